"""Running the RL job: the roles from the config, the driver, the checks made before any
worker starts, and ``run_ppo`` (``scripts/train_ppo.py``, ``minihf train``): the job's
offline preparation (``minihf.trainer.prepare``), then the RL run, under one lock on the
run dir.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from minihf.config import ConfigError, section_of
from minihf.trainer.common import check_resume_path, check_run_dir, run_dir, run_dir_lock
from minihf.trainer.ppo_config import PPOConfig
from minihf.trainer.prepare import PrepareConfig, file_list, on_rank0, prepare_job
from minihf.utils.locks import acquire, release

DEFAULT_RECIPE = "grpo"  # what `scripts/train_ppo.py` and `minihf train` run without a recipe


@dataclass
class PPOJobConfig(PPOConfig):
    prepare: PrepareConfig = field(default_factory=PrepareConfig)

    def __post_init__(self):
        super().__post_init__()
        for role in self.prepare.role_recipes:
            if role not in self.roles:
                raise ValueError(f"prepare.role_recipes.{role}: the config has no roles.{role} section; "
                                 "add it (with model.path, where the recipe's policy is exported)")


def ppo_roles(cfg: PPOConfig) -> dict:
    """The role table's roles for ``cfg`` (``minihf.roles``: the actor, and the
    critic, reward model and plug-ins' roles when enabled), placed by ``controller``."""
    from minihf.trainer.plugins import plugin_classes
    from minihf.roles import role_table, worker_roles

    return worker_roles(role_table(cfg, plugin_classes(cfg)), cfg)


def ppo_driver(cfg: PPOConfig, stop_after: int | None = None, trainer=None):
    """The driver function for ``minihf.controller.run``: the metrics history. ``trainer``:
    a ``PPOTrainer`` subclass to run instead (an experiment that changes a phase)."""
    from minihf.trainer.ppo import PPOTrainer

    def drive(groups):
        return (trainer or PPOTrainer)(cfg, groups).fit(stop_after)
    return drive


def check_model_path(cfg: PPOConfig) -> None:
    """The actor's model dir: one the job's SFT warm start writes (``prepare.sft_recipe``),
    or one that exists. Checked before anything is prepared (a typo'd path built the data
    and a model, then failed)."""
    if cfg.prepare.sft_recipe:
        from minihf.trainer.prepare import sft_config

        sft_config(cfg)  # its export dir must be the actor's model dir
    else:
        _check_actor_dir(cfg)


def _check_actor_dir(cfg: PPOConfig) -> None:
    model = Path(cfg.actor_rollout_ref.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(f"actor_rollout_ref.model.path={str(model)!r} has no config.json (relative "
                          f"paths are from {Path.cwd()}); pass an HF checkpoint dir (offline: "
                          "`minihf init-model DIR --task digits`, then `minihf sft`)")


def check_paths(cfg: PPOConfig) -> None:
    """Fail before any model loads if the model dir or a data file is missing."""
    _check_actor_dir(cfg)
    check_rollout_tp(cfg)
    cfg.check_token_budgets()
    check_lora(cfg)
    check_run_dir(run_dir(cfg.trainer), "trainer.default_local_dir")
    check_resume_path(cfg.trainer)
    from minihf.roles import planned_roles

    for row in planned_roles(cfg):  # the score models (reward, cost): the role table's "scores" rows
        section = section_of(cfg, row.section)
        if row.forward == "scores" and not Path(section.model.path or "", "config.json").is_file():
            raise ConfigError(f"{row.section}.model.path={section.model.path!r} has no config.json (relative "
                              f"paths are from {Path.cwd()}); pass a score-head model dir (train one "
                              "with `minihf rm`)")
    for name, section in cfg.roles.items():
        if not Path(section.model.path, "config.json").is_file():
            raise ConfigError(f"roles.{name}.model.path={section.model.path!r} has no config.json "
                              f"(relative paths are from {Path.cwd()}); pass an HF checkpoint dir, or "
                              f"train one first with prepare.role_recipes.{name}")
    for key in ("train_files", "val_files"):
        for f in file_list(getattr(cfg.data, key)):
            if not Path(f).is_file():
                raise ConfigError(f"data.{key}: {f!r} does not exist (relative paths are from "
                                  f"{Path.cwd()}); write task data with `minihf make-data`")
    check_role_vocabularies(cfg)


def check_role_vocabularies(cfg: PPOConfig) -> None:
    """Every role reads the actor's token ids: a role's model must embed each of them (a
    smaller vocabulary failed inside ``F.embedding``) and, where both dirs hold a tokenizer,
    have the actor's (another tokenizer's ids scored, or distilled, meaningless tokens in
    silence). Embedding sizes may differ (Qwen2.5's 0.5B and 7B pad the same tokenizer
    differently)."""
    from minihf.data import load_tokenizer
    from minihf.data.tokenizer import _TOKENIZER_FILES
    from minihf.models import load_args
    from minihf.roles import planned_roles

    def vocab(path: Path) -> dict | None:
        if not any((path / f).exists() for f in _TOKENIZER_FILES):
            return None
        try:
            with warnings.catch_warnings():  # (its pad token is the actor's business, not this check's)
                warnings.simplefilter("ignore")
                return load_tokenizer(path).get_vocab()
        except Exception as e:  # a tokenizer this process cannot load: the roles read ids, not text
            warnings.warn(f"{path}: its tokenizer could not be loaded to compare with the actor's "
                          f"({type(e).__name__}: {str(e)[:120]}); not compared")
            return None
    actor = Path(cfg.actor_rollout_ref.model.path)
    mine = vocab(actor)
    needed = max(mine.values()) + 1 if mine else load_args(actor).vocab_size
    seen = {actor.resolve()}
    for row in planned_roles(cfg):
        path = getattr(getattr(section_of(cfg, row.section), "model", None), "path", None)
        if not path or Path(path).resolve() in seen or not Path(path, "config.json").is_file():
            continue
        seen.add(Path(path).resolve())
        key = f"{row.section}.model.path={path!r}"
        size = load_args(path).vocab_size
        if size < needed:
            raise ConfigError(f"{key} embeds {size} token ids, but the actor's tokenizer makes ids up to "
                              f"{needed - 1}: the roles read the actor's token ids; give it a model of the "
                              f"actor's tokenizer ({actor})")
        theirs = vocab(Path(path))  # the actor's and maybe more (a pad token added): the same ids
        if mine is not None and theirs is not None and not mine.items() <= theirs.items():
            differ = sorted(set(mine.items()) - set(theirs.items()))[:3]
            raise ConfigError(f"{key} has another tokenizer than the actor's ({actor}; e.g. the actor's "
                              f"{differ} are not its): the roles read the actor's token ids; give it a model of "
                              "the actor's tokenizer")


def check_rollout_tp(cfg: PPOConfig) -> None:
    """The rollout TP size must split the model's query and KV heads (e.g. SmolLM2's 9 / 3
    allow 1 or 3), and prompt + response must fit the model's context: config errors before
    any worker starts (a response length past the context failed at the first validation,
    allocating a KV cache for it)."""
    from minihf.models import load_args
    from minihf.models.config_checks import context_error
    from minihf.parallel.tp import tp_head_counts

    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    args = load_args(cfg.actor_rollout_ref.model.path)
    r = cfg.actor_rollout_ref.rollout
    keys = cfg.length_keys()  # the rollout's lengths default to the data's: the keys that set them
    message = context_error(f"{keys[0]} + {keys[1]} = {r.prompt_length} + "
                            f"{r.response_length}", r.prompt_length + r.response_length, args.max_position_embeddings,
                            f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r}", "lower them to fit")
    if message:
        raise ConfigError(message)
    try:
        tp_head_counts(args.num_attention_heads, args.num_key_value_heads, tp,
                       where=f"the model at {cfg.actor_rollout_ref.model.path}")
    except ValueError as exc:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: {exc}") from None


def check_sequence_parallel(cfg: PPOConfig, world: int) -> None:
    """Each ``ulysses_sequence_parallel_size`` against its role's ranks and its model (one
    line naming the key and the values that work), before any worker starts."""
    from minihf.controller.config import resolve_placement
    from minihf.models import load_args
    from minihf.parallel.ulysses import check_sp_model, check_sp_ranks
    from minihf.workers import CriticWorker
    from minihf.workers.actor_checks import sp_sizes

    roles = ppo_roles(cfg)
    a, ref = sp_sizes(cfg.actor_rollout_ref)
    sizes = [("actor", "actor_rollout_ref.actor", a, cfg.actor_rollout_ref.model),
             ("actor", "actor_rollout_ref.ref", ref, cfg.actor_rollout_ref.model)]
    sizes += [(name, name, role.args[0].ulysses_sequence_parallel_size, role.args[0].model)
              for name, role in roles.items() if role.worker_cls is CriticWorker]  # critic, cost_critic
    if all(size == 1 for *_, size, _ in sizes):
        return
    layouts = resolve_placement(cfg.controller.placement, world, list(roles))
    for role, section, size, model in sizes:
        key = f"{section}.ulysses_sequence_parallel_size"
        try:
            check_sp_ranks(size, layouts[role].size, key, role)
            check_sp_model(size, load_args(model.path), key, model.use_remove_padding)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_lora(cfg: PPOConfig) -> None:
    """The LoRA keys of the trained roles against their models, before any worker starts:
    module names that match nothing, a ``lora_adapter_path`` that is no PEFT dir, is broken
    (``minihf.hub.peft``: bad config values, an unreadable file, non-finite values) or does
    not fit (its rank, alpha, modules, shapes, its base model dir)."""
    from minihf.hub.peft import is_adapter_dir
    from minihf.models import build_model, load_args
    from minihf.models.lora import apply_lora, module_names
    from minihf.workers.engine import adapter_state

    from minihf.roles import planned_roles

    for row in (r for r in planned_roles(cfg) if r.trains):  # the trained roles of the role table
        section, head = row.section, row.head
        m = section_of(cfg, section).model
        if not getattr(m, "lora", False):  # a recipe role's model has no LoRA keys
            continue
        key = f"{section}.model"
        path = m.lora_adapter_path
        if path is not None and not is_adapter_dir(path):
            raise ConfigError(f"{key}.lora_adapter_path={path!r} is not a PEFT adapter dir (no "
                              f"adapter_config.json; relative paths are from {Path.cwd()})")
        model = build_model(load_args(m.path), head, device="meta")
        try:
            apply_lora(model, m.lora_rank, m.lora_alpha, module_names(
                model, m.target_modules, m.exclude_modules, f"{key}.target_modules"))
            adapter_state(m, model, key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def rl_job(cfg: PPOJobConfig, device, trainer=None):
    """Every rank's part of one RL job inside a launched job: the run dir taken (held to the
    end), the preparation, the checks, the run. ``trainer``: as in :func:`ppo_driver`."""
    from minihf.controller import run
    from minihf.controller.config import resolve_placement

    rl_dir = run_dir(cfg.trainer)

    def take_run_dir():  # held to the end of the job (released there, or at exit)
        check_run_dir(rl_dir, "trainer.default_local_dir")
        check_model_path(cfg)  # before the preparation builds anything
        acquire(rl_dir, *run_dir_lock(rl_dir))

    on_rank0(take_run_dir, "taking the run dir")  # before anything is prepared or written
    try:
        # the placement against the world size, before the preparation (which may train the SFT
        # warm start): run() resolves it again
        resolve_placement(cfg.controller.placement, dist.get_world_size(), list(ppo_roles(cfg)))
        prepare_job(cfg, device)
        check_paths(cfg)
        check_sequence_parallel(cfg, dist.get_world_size())
        if device.type == "cuda" and cfg.trainer.memory_check:  # before any role loads a model
            from minihf.planner.startup import check_memory, device_profile

            check_memory(cfg, dist.get_world_size(), device_profile(device))
        return run(ppo_driver(cfg, trainer=trainer), ppo_roles(cfg), cfg.controller, device=device)
    finally:
        if dist.get_rank() == 0:
            release(rl_dir)


def run_ppo(cfg: PPOJobConfig, trainer=None, in_process: bool = False):
    """The whole job (prepare, warm start, RL) as one ``torchrun`` job; history on rank 0.
    ``trainer``: as in :func:`ppo_driver`; ``in_process``: see ``launch_job`` (``minihf.train``)."""
    from minihf.controller import launch_job

    return launch_job(lambda device: rl_job(cfg, device, trainer), cfg.controller,
                      in_process=in_process)
