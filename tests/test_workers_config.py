"""Worker config sections through minihf.config: overrides, validation messages."""

import pytest

from minihf.config import ConfigError, load_config
from minihf.trainer.sft import SFTConfig
from minihf.workers.config import ActorRolloutRefConfig, CriticConfig


def test_overrides_reach_nested_sections():
    cfg = load_config(ActorRolloutRefConfig, None, [
        "actor.optim.lr=1e-5", "actor.optim.lr_scheduler=cosine", "actor.max_tokens_per_micro_batch=4096",
        "actor.loss_agg_mode=seq-mean-token-mean", "ref.fsdp.param_offload=true", "model.path=/m"])
    assert cfg.actor.optim.lr == 1e-5 and cfg.actor.optim.lr_scheduler == "cosine"
    assert cfg.actor.max_tokens_per_micro_batch == 4096 and cfg.ref.fsdp.param_offload
    assert load_config(CriticConfig).optim.lr == 1e-5
    sft = load_config(SFTConfig, None, ["data.train_files=[a.parquet, b.parquet]", "trainer.resume_mode=disable"])
    assert sft.data.train_files == ["a.parquet", "b.parquet"]


@pytest.mark.parametrize("override, match", [
    ("actor.loss_agg_mode=mean", "loss_agg_mode='mean'.*token-mean"),
    ("actor.ppo_micro_batch_size_per_gpu=null", "micro-batch size .* or max_tokens_per_micro_batch"),
    ("actor.optim.lr_scheduler=linear", "lr_scheduler"),
    ("actor.optim.min_lr_ratio=2", "min_lr_ratio=2"),
    ("actor.fsdp.mixed_precision=fp16", "mixed_precision"),
    ("rollout.check_log_probs=always", "check_log_probs"),
    ("actor.clip_ratio=0", "clip_ratio=0"),
    ("actor.clip_ratio_c=0.5", r"actor: clip_ratio_c=0.5 must be > 1"),
    ("actor.clip_ratio_low=-0.2", r"clip_ratio_low=-0.2 must be in \[0, 1\)"),
    ("actor.clip_ratio_low=1.0", r"clip_ratio_low=1.0 must be in \[0, 1\)"),
    ("actor.clip_ratio_high=-0.1", r"clip_ratio_high=-0.1 must be >= 0"),
    ("actor.kl_loss_coef=-1", r"kl_loss_coef=-1.0 must be >= 0"),
    ("actor.optim.weight_decay=-1", r"weight_decay=-1.0 >= 0"),
    ("actor.optim.eps=0", r"eps=0.0 must be > 0"),
    ("actor.kl_loss_type=lowvar", "kl_loss_type='lowvar'.*low_var_kl"),
    ("actor.ppo_epochs=0", "ppo_epochs=0 must be >= 1"),
    ("rollout.n=0", r"rollout.n=0 must be an int >= 1"),
    ("rollout.temperature=-1", r"rollout.temperature=-1.* must be >= 0"),
    ("rollout.top_p=0", r"rollout.top_p=0.* must be in \(0, 1\]"),
    ("rollout.top_k=-2", r"rollout.top_k=-2 must be an int; -1 or 0 disables it"),
    ("rollout.response_length=0", r"rollout.response_length=0 must be an int >= 1"),
    ("rollout.tensor_model_parallel_size=0", r"rollout.tensor_model_parallel_size=0 must be"),
    ("rollout.gpu_memory_utilization=1.5", r"rollout.gpu_memory_utilization=1.5 must be in"),
    ("rollout.max_num_batched_tokens=0", r"rollout.max_num_batched_tokens=0 must be >= 1"),
    ("rollout.reshard=fast", r"rollout.reshard.*'fast'.*hybrid.*naive"),
    ("rollout.val_kwargs.n=0", r"rollout.val_kwargs.n=0 must be an int >= 1"),
    ("rollout.val_kwargs.temperature=-0.5", r"val_kwargs.temperature=-0.5 must be >= 0"),
])
def test_bad_values_say_which_and_why(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ActorRolloutRefConfig, None, [override])


def test_critic_shares_the_update_checks():
    with pytest.raises(ConfigError, match="loss_agg_mode='mean'"):
        load_config(CriticConfig, None, ["loss_agg_mode=mean"])
    with pytest.raises(ConfigError, match=r"cliprange_value=-1.0 must be > 0"):
        load_config(CriticConfig, None, ["cliprange_value=-1"])
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=0"):
        load_config(CriticConfig, None, ["ppo_mini_batch_size=0"])


def test_shipped_sft_recipe_loads():
    cfg = load_config(SFTConfig, "sft_digits")
    assert cfg.data.response_key == "extra_info.answer" and cfg.data.max_tokens_per_micro_batch == 1024
    assert cfg.model.path == "outputs/models/digits-tiny"


def test_shipped_rl_recipes_load():
    from minihf.trainer.ppo_job import PPOJobConfig

    grpo = load_config(PPOJobConfig, "grpo")
    assert grpo.algorithm.adv_estimator == "grpo" and not grpo.critic.enable and grpo.use_ref
    assert grpo.actor_rollout_ref.rollout.response_length == grpo.data.max_response_length
    ppo = load_config(PPOJobConfig, "ppo")
    assert ppo.critic.enable and ppo.critic.model.path == ppo.actor_rollout_ref.model.path
    assert ppo.algorithm.kl_ctrl.type == "adaptive" and ppo.use_ref


def test_rl_config_errors():
    from minihf.trainer.ppo_job import PPOJobConfig

    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'grp'; did you mean 'grpo'"):
        load_config(PPOJobConfig, None, ["algorithm.adv_estimator=grp"])
    # the policy loss's name too, at load (it failed on every actor rank after start-up)
    with pytest.raises(ConfigError, match=r"policy_loss: unknown policy loss 'foo'; choose one of \['gspo', 'vanilla'\]"):
        load_config(PPOJobConfig, None, ["actor_rollout_ref.actor.policy_loss.loss_mode=foo"])
    with pytest.raises(ConfigError, match=r"policy_loss: /nope/algo.py does not exist"):
        load_config(PPOJobConfig, None, ["actor_rollout_ref.actor.policy_loss.loss_mode=/nope/algo.py:fn"])
    # a token budget that cannot hold the longest sequence failed at its first long row, on a worker:
    # said at start-up (check_paths, after the lengths against the model's context); runs do run
    # while every row fits (micro-batches are cut by real lengths)
    for key in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        with pytest.warns(UserWarning, match=rf"{key}.max_tokens_per_micro_batch=3 is below the longest sequence "
                                             r"the rollout may make \(\d+ prompt \+ \d+ response tokens\): a "
                                             r"longer row will stop the run; raise it to \d+"):
            load_config(PPOJobConfig, "ppo", [f"{key}.max_tokens_per_micro_batch=3"]).check_token_budgets()
    with pytest.raises(ConfigError, match="adv_estimator=gae reads values, which need a critic"):
        load_config(PPOJobConfig, None, ["critic.enable=false"])
    with pytest.raises(ConfigError, match=r"rollout.prompt_length=8 is below data.max_prompt_length=16"):
        load_config(PPOJobConfig, None, ["data.max_prompt_length=16",
                                         "actor_rollout_ref.rollout.prompt_length=8"])
    with pytest.raises(ConfigError, match=r"trainer.logger: unknown \['wandb2'\]"):
        load_config(PPOJobConfig, None, ["trainer.logger=[console, wandb2]"])
    for override, match in (("algorithm.gamma=2", r"algorithm.gamma=2.0 must be in \[0, 1\]"),
                            ("algorithm.lam=-0.1", r"algorithm.lam=-0.1 must be in \[0, 1\]"),
                            ("algorithm.kl_ctrl.kl_coef=-0.5", "kl_ctrl.kl_coef=-0.5 must be >= 0"),
                            ("algorithm.kl_ctrl.type=adaptive,algorithm.kl_ctrl.kl_coef=0",
                             "type=adaptive with kl_coef=0 never moves"),
                            ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                             "loss_mode=gspo aggregates per sequence .* loss_agg_mode='token-mean'"),
                            ("data.seed=-1", "data.seed=-1 must be >= 0"),
                            ("algorithm.kl_ctrl.horizon=0", "horizon=0 >= 1")):
        with pytest.raises(ConfigError, match=match):
            load_config(PPOJobConfig, None, override.split(","))


@pytest.mark.parametrize("kind, recipe, role", [("rl", "ppo", "critic"), ("rl", "grpo", "actor"),
                                                ("sft", "sft_sort", "sft")])
def test_a_tp_size_in_a_training_role_placement_is_refused_at_load(kind, recipe, role):
    """The jobs' roles train data-parallel only: a placement tp_size would be silently
    ignored (the critic ran unsharded by TP, its update twice as long), so it is refused."""
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.sft import SFTConfig

    cls = PPOJobConfig if kind == "rl" else SFTConfig
    with pytest.raises(ConfigError, match=rf"controller.placement.{role}.tp_size=2: .*data-parallel"):
        load_config(cls, recipe, [f"controller.placement={{{role}: {{ranks: [0, 1], tp_size: 2}}}}"])
