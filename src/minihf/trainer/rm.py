"""Reward-model training (Bradley-Terry on preference pairs): config, driver, ``run_rm``.

The SFT loop (``minihf.trainer.sft``) with pairs instead of examples: rank 0 owns a
``PairDataset`` and calls one ``RMTrainWorker`` group (FSDP2 over all ranks) -- a
``train_step`` per global batch of pairs, validation pair accuracy every
``trainer.test_freq`` steps and at the end, checkpoints with the data position (exact
resume), and an HF export to ``<run dir>/hf`` that transformers loads as
``AutoModelForSequenceClassification``. A causal-LM checkpoint starts with a fresh score
head. ``minihf rm`` and ``scripts/train_rm.py`` run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from minihf.controller.config import ControllerConfig, refuse_tp
from minihf.trainer.sft import SFTDriver, SFTTrainerConfig, check_data_sizes, check_paths, padded
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.optim import OptimConfig


@dataclass
class RMDataConfig:
    train_files: Union[str, list[str]] = ""  # parquet/jsonl preference file(s): prompt, chosen, rejected
    val_files: Union[str, list[str], None] = None  # validation pairs; null: none
    max_length: int = 512                # tokens per side (prompt + response)
    # a too-long side: error, keep its left/right part, or drop the pair (filter)
    truncation: Literal["error", "left", "right", "filter"] = "error"
    train_batch_size: int = 32           # pairs per optimizer step, global
    micro_batch_size_per_gpu: Optional[int] = 8  # pairs per forward/backward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget (both sides) per micro-batch
    val_batch_size: int = 64             # pairs per validation batch
    shuffle: bool = True                 # reshuffle every epoch
    seed: int = 0                        # seed of the pair order
    allow_unk: bool = False              # keep pairs with characters the tokenizer can only encode as its unknown token; false: refused naming the row

    def __post_init__(self):
        check_data_sizes(self)


@dataclass
class RMTrainerConfig(SFTTrainerConfig):
    experiment_name: str = "rm"          # run name


@dataclass
class RMConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_steps=0))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self):
        refuse_tp(self.controller.placement, "drop tp_size")


class RMDriver(SFTDriver):
    """The SFT loop over preference pairs (role ``rm``); validation reports ``val/loss``,
    ``val/accuracy`` (pairs ranked right), ``val/margin`` and, for sign-labeled pairs (a
    cost model), ``val/sign_accuracy`` (sides whose score has the labeled sign)."""
    role = "rm"

    @staticmethod
    def token_ids(ds) -> list[list[int]]:
        return ds.ids["chosen"] + ds.ids["rejected"]

    def dataset(self, files, tokenizer):
        from minihf.data import PairDataset

        d = self.cfg.data
        return PairDataset(files, tokenizer, max_length=d.max_length, truncation=d.truncation, allow_unk=d.allow_unk)

    def validate(self, step: int = 0) -> dict[str, float]:
        if self.val is None:
            return {}
        sums = {"loss_sum": 0.0, "correct": 0.0, "margin_sum": 0.0, "sign_correct": 0.0,
                "signed": 0.0, "pairs": 0.0}
        n, bs = len(self.val), self.cfg.data.val_batch_size
        for start in range(0, n, bs):
            batch = self.val.collate(list(range(start, min(n, start + bs))))
            r = self.sft.eval_step(padded(batch, self.sft.dp_size, "weight"))  # weight-0 fill rows
            sums = {k: sums[k] + r[k] for k in sums}
        pairs = max(sums["pairs"], 1.0)
        out = {"val/loss": sums["loss_sum"] / pairs, "val/accuracy": sums["correct"] / pairs,
               "val/margin": sums["margin_sum"] / pairs}
        if sums["signed"]:
            out["val/sign_accuracy"] = sums["sign_correct"] / sums["signed"]  # scores of the right sign
        return out


def rm_driver(cfg: RMConfig, stop_after: int | None = None):
    """The driver function for ``minihf.controller.run``/``launch``."""
    def drive(groups):
        return RMDriver(cfg, groups["rm"]).fit(stop_after)
    return drive


def rm_roles(cfg: RMConfig) -> dict:
    """The job's single role: ``rm`` on every rank."""
    from minihf.controller import Role
    from minihf.workers.rm_worker import RMTrainWorker

    d = cfg.data
    return {"rm": Role(RMTrainWorker, (cfg.model, cfg.optim, cfg.fsdp, d.micro_batch_size_per_gpu,
                                       d.max_tokens_per_micro_batch))}


def run_rm(cfg: RMConfig, in_process: bool = False) -> list[dict] | None:
    """Run reward-model training as a controller job (``python`` or ``torchrun``).
    ``in_process``: see ``launch_job`` (``minihf.train_rm``)."""
    from minihf.controller import run
    from minihf.controller.launch import launch_job

    check_paths(cfg)
    return launch_job(lambda device: run(rm_driver(cfg), rm_roles(cfg), cfg.controller, device=device),
                      cfg.controller, in_process=in_process)
