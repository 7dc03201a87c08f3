"""minihf.trainer: driver programs and their optimisation pieces (optimizer, LR schedule,
SFT loop). The PPO-family driver loop lands here with the trainer issue."""
