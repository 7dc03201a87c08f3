"""Supervised fine-tuning: the driver loop, its config, and ``run_sft`` (script and CLI).

Rank 0 owns the data (``SFTDataset`` + ``ResumableSampler``) and calls one ``SFTWorker``
group (FSDP2 over all ranks): ``train_step`` per global batch, ``eval_step`` over the
validation set every ``trainer.test_freq`` steps and at the end, checkpoints every
``trainer.save_freq`` steps and at the end (``RunLoop``'s format: the worker's shards
under ``global_step_N/sft`` and the sampler position in its driver state, so a resumed run
continues the exact data order), then an HF export to ``<default_local_dir>/hf``.
Metrics go to stdout and ``<default_local_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from minihf.controller.config import ControllerConfig, refuse_tp
from minihf.trainer.common import (MetricsLog, check_keep, check_resume_path, check_run_dir, check_run_length,
                                   check_token_ids, run_dir)
from minihf.trainer.loop import RunLoop
from minihf.workers.optim import OptimConfig
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.section_checks import check_micro

@dataclass
class SFTDataConfig:
    train_files: Union[str, list[str]] = ""  # parquet/jsonl prompt/response file(s)
    val_files: Union[str, list[str], None] = None  # validation file(s); null: none
    response_key: str = "response"       # e.g. extra_info.answer for `minihf make-data` files
    max_length: int = 512                # tokens per example (prompt + response)
    # a too-long example: error, keep its left/right part, or drop it (filter)
    truncation: Literal["error", "left", "right", "filter"] = "error"
    train_batch_size: int = 32           # sequences per optimizer step, global
    micro_batch_size_per_gpu: Optional[int] = 8  # rows per forward/backward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget per micro-batch (wins when set)
    val_batch_size: int = 64             # examples per validation batch
    shuffle: bool = True                 # reshuffle every epoch
    seed: int = 0                        # seed of the example order
    allow_unk: bool = False              # keep rows with characters the tokenizer can only encode as its unknown token; false: refused naming the row
    tools: list[str] = field(default_factory=list)  # tools the prompts offer (file.py:name or a built-in), as rollout.multi_turn.tools renders them

    def __post_init__(self):
        check_data_sizes(self)


def check_data_sizes(data) -> None:
    """The sizes an SFT or RM ``data`` section shares: batches, the length, the micro-batches
    (as the RL sections check theirs), so a bad one fails at load, not in the first step."""
    if data.train_batch_size < 1 or data.val_batch_size < 1:
        raise ValueError(f"train_batch_size={data.train_batch_size} and val_batch_size="
                         f"{data.val_batch_size} must be >= 1")
    if data.max_length < 1:
        raise ValueError(f"max_length={data.max_length} must be >= 1 (tokens per example)")
    if data.seed < 0:  # numpy's generator refused it at the first batch
        raise ValueError(f"seed={data.seed} must be >= 0")
    check_micro(data.micro_batch_size_per_gpu, data.max_tokens_per_micro_batch)


@dataclass
class SFTTrainerConfig:
    total_epochs: int = 1                # passes over the training data
    total_training_steps: Optional[int] = None  # stop early after this many steps
    test_freq: int = 0                   # validate every N steps and at the end (0 or -1: only at the end)
    save_freq: int = 0                   # checkpoint every N steps and at the end (0 or -1: only at the end)
    max_ckpt_to_keep: Optional[int] = None  # keep the newest N global_step_* dirs, delete older ones; null: keep all
    project_name: str = "minihf"         # run grouping name
    experiment_name: str = "sft"         # run name
    # run dir (checkpoints, config.yaml, metrics.jsonl, hf/ export); null:
    # outputs/<project_name>/<experiment_name>
    default_local_dir: Optional[str] = None
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"  # auto: from the latest checkpoint
    resume_from_path: Optional[str] = None  # a global_step_N dir (resume_mode=resume_path)
    export_hf: bool = True               # write an HF model dir (hf/) at the end
    log_freq: int = 1                    # print a line every N steps

    def __post_init__(self):
        check_run_length(self.total_epochs, self.total_training_steps)
        check_keep(self.max_ckpt_to_keep)
        if self.log_freq < 1:
            raise ValueError(f"trainer.log_freq={self.log_freq} must be >= 1 (a line every N steps)")


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=0))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self):
        refuse_tp(self.controller.placement, "drop tp_size")


def padded(batch, dp: int, mask_key: str = "loss_mask"):
    """Pad to a multiple of ``dp`` with rows whose ``mask_key`` is 0 (so no row counts twice)."""
    batch, pad = batch.pad_to_multiple(dp)
    if pad:
        batch.tensors[mask_key] = batch.tensors[mask_key].clone()
        batch.tensors[mask_key][-pad:] = 0
    return batch


class SFTDriver(RunLoop):
    """The SFT loop on rank 0 over the ``sft`` worker group (``role``); ``RunLoop`` runs
    the fit, checkpoints and resume."""
    role = "sft"

    def __init__(self, cfg: SFTConfig, sft, log=print):
        from minihf.data import ResumableSampler, load_tokenizer

        self.cfg, self.sft, self.log = cfg, sft, log
        d = cfg.data
        if d.train_batch_size % sft.dp_size:
            raise ValueError(f"data.train_batch_size={d.train_batch_size} must be a multiple of "
                             f"the {sft.dp_size} data-parallel ranks")
        tok = load_tokenizer(cfg.model.path, padding_side="right")
        self.train = self.dataset(d.train_files, tok)
        self.val = self.dataset(d.val_files, tok) if d.val_files else None
        for files, ds in ((d.train_files, self.train), (d.val_files, self.val)):
            if ds is not None:
                check_token_ids(self.token_ids(ds), files, cfg.model.path, tok)
        if d.train_batch_size > len(self.train):  # (the RM's pairs as well: RMDriver is this class's)
            raise ValueError(f"data.train_batch_size={d.train_batch_size} exceeds the {len(self.train)} "
                             f"training rows in {d.train_files} (after the filters); lower it or add rows")
        self.sampler = ResumableSampler(len(self.train), d.train_batch_size, shuffle=d.shuffle,
                                        seed=d.seed, drop_last=True)
        t = cfg.trainer
        self.total_steps = len(self.sampler) * t.total_epochs
        if t.total_training_steps is not None:
            self.total_steps = min(self.total_steps, t.total_training_steps)
        self.out = run_dir(t)
        self.metrics_log = MetricsLog(self.out)
        self.history: list[dict] = []
        self.export_from: Path | None = None  # the checkpoint to export at the end of this fit

    @staticmethod
    def token_ids(ds) -> list[list[int]]:
        return ds.input_ids

    def dataset(self, files, tokenizer):
        from minihf.data import SFTDataset

        d = self.cfg.data
        renderer = None
        if d.tools:  # the prompts offer tools, rendered as the multi-turn rollout renders them
            from minihf.multi_turn.loop import tool_renderer
            renderer = tool_renderer(tokenizer, d.tools)
        return SFTDataset(files, tokenizer, max_length=d.max_length, truncation=d.truncation,
                          response_key=d.response_key, renderer=renderer, allow_unk=d.allow_unk)

    def validate(self, step: int = 0) -> dict[str, float]:
        if self.val is None:
            return {}
        nll = tokens = 0.0
        n, bs = len(self.val), self.cfg.data.val_batch_size
        for start in range(0, n, bs):
            batch = self.val.collate(list(range(start, min(n, start + bs))))
            r = self.sft.eval_step(padded(batch, self.sft.dp_size))
            nll, tokens = nll + r["nll_sum"], tokens + r["tokens"]
        return {"val/loss": nll / max(tokens, 1.0)}

    # -- the loop (minihf.trainer.loop) ---------------------------------------------------
    def init_models(self) -> None:
        self.sft.init_model(self.total_steps)

    def checkpointed(self) -> dict:
        return {self.role: self.sft}

    def driver_state(self) -> dict:
        return {"sampler": self.sampler}

    def load_legacy(self, path: Path) -> dict:
        """A checkpoint from before the common format: the worker's shards at
        ``global_step_N`` itself, the step and data position in its ``extra``."""
        if not (path / "meta.json").is_file():
            return super().load_legacy(path)
        extra = self.sft.load_checkpoint(str(path))
        return {"step": extra["step"], "sampler": extra["sampler"]}

    def validate_at(self, step: int) -> bool:
        t = self.cfg.trainer
        return (t.test_freq > 0 and step % t.test_freq == 0) or step == self.total_steps

    def save_at(self, step: int) -> bool:
        t = self.cfg.trainer
        return (t.save_freq > 0 and step % t.save_freq == 0) or step == self.total_steps

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        batch = self.train.collate(self.sampler.next_batch())
        metrics = self.sft.train_step(batch)
        return {"step": step, "epoch": self.sampler.epoch, **metrics, "timing_s/step": time.perf_counter() - t0}

    def record(self, metrics: dict) -> None:
        super().record(metrics)
        if metrics["step"] % self.cfg.trainer.log_freq == 0 or any(k.startswith("val/") for k in metrics):
            self.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in metrics.items()))

    def on_nothing_to_train(self, message: str) -> None:
        t = self.cfg.trainer
        if t.export_hf and not (self.out / "hf" / "config.json").is_file():
            self.export_from = self.last_checkpoint  # its export was interrupted (or deleted)
            self.log(f"the run in {self.out} has trained all {self.total_steps} steps but has no HF "
                     f"export (interrupted while exporting?): exporting {self.last_checkpoint.name}")
        else:
            self.log(message)

    def save(self, step: int) -> Path:
        self.export_from = super().save(step)
        return self.export_from

    def finished(self, wall_s: float) -> None:
        if self.cfg.trainer.export_hf and self.export_from is not None:
            from minihf.hub import export_hf
            self.log(f"exported {export_hf(self.export_from, self.out / 'hf')}")


def sft_driver(cfg: SFTConfig):
    """The driver function for ``minihf.controller.run``/``launch``."""
    def drive(groups):
        return SFTDriver(cfg, groups["sft"]).fit()
    return drive


def sft_roles(cfg: SFTConfig) -> dict:
    """The job's single role: ``sft`` on every rank."""
    from minihf.controller import Role
    from minihf.workers.sft_worker import SFTWorker

    d = cfg.data
    return {"sft": Role(SFTWorker, (cfg.model, cfg.optim, cfg.fsdp, d.micro_batch_size_per_gpu,
                                    d.max_tokens_per_micro_batch))}


def check_paths(cfg: SFTConfig) -> None:
    """Fail before any process group exists if the model dir or a data file is missing, or
    if ``data.max_length`` is past the model's context."""
    from minihf.config import ConfigError

    model = Path(cfg.model.path)
    if not cfg.model.path or not (model / "config.json").is_file():
        what = "is empty" if not cfg.model.path else (
            "does not exist" if not model.exists() else "has no config.json")
        raise ConfigError(f"model.path={cfg.model.path!r} {what} (relative paths are from {Path.cwd()}); "
                          "pass an HF checkpoint dir (make one offline with `minihf init-model DIR --task digits`)")
    from minihf.models import load_args
    from minihf.models.config_checks import context_error

    limit = load_args(model).max_position_embeddings
    message = context_error(f"data.max_length={cfg.data.max_length}", cfg.data.max_length, limit,
                            f"model.path={cfg.model.path}", f"set data.max_length to at most {limit}")
    if message:  # past it the positions have no trained rotary angles
        raise ConfigError(message)
    for key in ("train_files", "val_files"):
        files = getattr(cfg.data, key)
        for f in [files] if isinstance(files, str) else (files or []):
            if not Path(f).is_file():
                raise ConfigError(f"data.{key}: {f!r} does not exist (relative paths are from "
                                  f"{Path.cwd()}); write task data with `minihf make-data`")
    check_run_dir(run_dir(cfg.trainer), "trainer.default_local_dir")
    check_resume_path(cfg.trainer)


def run_sft(cfg: SFTConfig, in_process: bool = False) -> list[dict] | None:
    """Run SFT as a controller job (``python`` or ``torchrun``); the metrics on rank 0.
    ``in_process``: see ``launch_job`` (``minihf.train_sft``)."""
    from minihf.controller import run
    from minihf.controller.launch import launch_job

    check_paths(cfg)
    return launch_job(lambda device: run(sft_driver(cfg), sft_roles(cfg), cfg.controller, device=device),
                      cfg.controller, in_process=in_process)
