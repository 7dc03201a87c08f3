"""minihf.data: tokenizers, prompt/SFT datasets, synthetic tasks, rewards.

* ``load_tokenizer(model_dir)`` -- every tokenizer is loaded through it (see tokenizer.py).
* ``RLDataset`` + ``PromptLoader`` -- verl-format prompt files -> left-padded ``Batch``es
  in a resumable order; ``SFTDataset`` -- prompt/response pairs with a response-only mask.
* ``make_task_data`` / ``TASKS`` -- the ``digits``, ``arith`` and ``countdown`` tasks.
* ``default_reward_fn``, ``default_cost_fn``, ``load_reward_fn``, ``compute_score`` -- rule
  rewards and costs.
"""

from minihf.data.rewards import (RewardError, compute_score, default_cost_fn, default_reward_fn,
                                 load_reward_fn)
from minihf.data.rl_dataset import PromptLoader, RLDataset
from minihf.data.sampler import ResumableSampler
from minihf.data.sft_dataset import PairDataset, SFTDataset
from minihf.data.tasks import TASKS, make_task_data
from minihf.data.tokenizer import build_char_tokenizer, load_tokenizer, save_tokenizer

__all__ = [
    "RewardError", "compute_score", "default_cost_fn", "default_reward_fn", "load_reward_fn", "PromptLoader",
    "RLDataset", "ResumableSampler", "PairDataset", "SFTDataset", "TASKS", "make_task_data", "build_char_tokenizer",
    "load_tokenizer", "save_tokenizer",
]
