"""The RL job's config tree, with verl's section and key names.

``PPOConfig`` = ``data`` + ``actor_rollout_ref`` + ``critic`` + ``reward_model`` +
``custom_reward_function`` + (Safe-RLHF) ``cost_model`` + ``cost_critic`` +
``custom_cost_function`` + ``algorithm`` + ``trainer`` + ``controller`` + ``roles`` (a
recipe's own). One loop serves
every estimator; which roles run follows from the settings (a critic only for an estimator
whose spec reads values, as ``gae``'s; a reference only when a KL is used, a reward model
only when ``reward_model.enable``, a cost critic and model only with ``algorithm.safe``).
Deliberate deviation from verl: ``ppo_mini_batch_size`` counts sequences (prompts x n),
as every batch size of the workers does. ``check_sizes`` (called with the world size before
any model loads) refuses batch sizes that do not fit the ranks, naming the key.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from minihf.config import ConfigError, section_of
from minihf.trainer.algorithm_config import AlgorithmConfig
from minihf.controller.config import ControllerConfig, RoleSpec, refuse_tp
from minihf.trainer.common import check_keep, check_run_length
from minihf.utils.profiling import check_steps
from minihf.trainer.role_section import RoleSection
from minihf.workers.config import ActorRolloutRefConfig, CriticConfig, RewardModelConfig


@dataclass
class DataConfig:
    train_files: Union[str, list[str]] = ""  # parquet/jsonl prompt file(s), verl's format
    val_files: Union[str, list[str], None] = None  # validation prompt file(s); null: no validation
    prompt_key: str = "prompt"           # column holding the prompt (chat messages or a string)
    max_prompt_length: int = 512         # tokens; longer prompts follow `truncation`
    max_response_length: int = 512       # new tokens per response at most
    train_batch_size: int = 32           # prompts per step (x rollout.n sequences)
    gen_batch_size: Optional[int] = None  # prompts per generation round of algorithm.filter_groups (only there); None: train_batch_size
    val_batch_size: Optional[int] = None  # prompts per validation generate call; None: all
    # a too-long prompt: error, keep its left/right part, or drop it (filter)
    truncation: Literal["error", "left", "right", "filter"] = "error"
    apply_chat_template: bool = True     # format chat-message prompts with the tokenizer's template
    allow_unk: bool = False              # keep prompts with characters the tokenizer can only encode as its unknown token (a character tokenizer's); false: refused naming the row
    shuffle: bool = True                 # reshuffle the prompts every epoch
    seed: int = 0                        # seed of the prompt order

    def __post_init__(self):
        for key in ("max_prompt_length", "max_response_length", "train_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")
        for key in ("val_batch_size", "gen_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1 or null")
        if self.seed < 0:  # numpy's generator refused it at the first batch
            raise ValueError(f"data.seed={self.seed} must be >= 0")


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None           # a .py file: from the recipe folder in a recipe's YAML,
    name: str = "compute_score"          # from the working directory on the command line
    skip_special_tokens: bool = True     # decode responses without special tokens (verl); false: the function sees e.g. the final <|im_end|>
    timeout_s: Optional[float] = None    # per sample; a call past it stops the run naming the sample (null: no limit)
    on_timeout: Literal["error", "zero"] = "error"  # zero: such a sample scores 0 (reward_extra/timed_out/mean)

    def __post_init__(self):
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (seconds per sample) or null")
        if self.on_timeout not in ("error", "zero"):
            raise ValueError(f"on_timeout={self.on_timeout!r}; choose error or zero")
        if self.path and not Path(self.path).is_file():
            raise ValueError(f"path={self.path!r} does not exist (relative to {Path.cwd()}); "
                             "name a .py file with the reward function")
        if self.path:  # its syntax and the name, before any model loads (nothing runs)
            from minihf.utils.imports import check_ref

            try:
                check_ref(f"{self.path}:{self.name}", "function")
            except AttributeError as e:
                raise ValueError(f"name={self.name!r}: {e}; set name to the function to call") from None


@dataclass
class CustomCostConfig(CustomRewardConfig):
    """The rule cost (Safe-RLHF), a reward-style function: the built-ins by data_source
    (e.g. ``safe_sort``) or one from a file. Scores training costs when no cost model is
    enabled, and validation costs always."""
    name: str = "compute_cost"           # function name in `path`


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a response longer than ``max_response_length - len``
    loses up to ``penalty_factor``, linearly in its excess length (training scores only;
    validation reports the task's score)."""
    enable: bool = False                 # add the length penalty to each training score
    len: int = 0                         # buffer: the penalty grows over the last `len` tokens before max_response_length
    penalty_factor: float = 1.0          # penalty of a response of max_response_length tokens

    def __post_init__(self):
        if self.enable and self.len < 1:
            raise ValueError(f"reward_model.overlong_buffer.len={self.len} must be >= 1 when enabled")
        if self.penalty_factor < 0:
            raise ValueError(f"reward_model.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")


@dataclass
class RewardModelSection(RewardModelConfig):
    enable: bool = False                 # score with a learned reward model instead of the rule function
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO length shaping


@dataclass
class CostModelSection(RewardModelConfig):
    enable: bool = False                 # score training costs with a learned cost model (algorithm.safe)


@dataclass
class CriticSection(CriticConfig):
    enable: Optional[bool] = None        # None: only with adv_estimator=gae


@dataclass
class CostCriticSection(CriticConfig):
    enable: Optional[bool] = None        # None: with algorithm.safe.enable


@dataclass
class PPOTrainerConfig:
    total_epochs: int = 1                # passes over the training prompts
    total_training_steps: Optional[int] = None  # stop after this many steps; null: total_epochs
    critic_warmup: int = 0               # steps that train only the critic
    test_freq: int = -1                  # validate every N steps (and at the end); -1: never
    save_freq: int = -1                  # checkpoint every N steps (and at the end); -1: end only
    max_ckpt_to_keep: Optional[int] = None  # keep the newest N global_step_* dirs, delete older ones; null: keep all (verl's max_actor_ckpt_to_keep)
    val_before_train: bool = True        # validate once before the first step
    # run dir (checkpoints, config.yaml, metrics.jsonl, samples.jsonl); null:
    # outputs/<project_name>/<experiment_name>
    default_local_dir: Optional[str] = None
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"  # auto: from the latest checkpoint
    resume_from_path: Optional[str] = None  # a global_step_N dir (resume_mode=resume_path)
    project_name: str = "minihf"         # run grouping name (loggers)
    experiment_name: str = "run"         # run name (loggers)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # console, jsonl, wandb, tensorboard
    log_samples_freq: int = 10           # samples.jsonl rows every N steps (and validations); <= 0: off
    log_samples_n: int = 4               # rows per logged step (one sample of each of the first prompts)
    balance_batch: bool = True           # even out each mini-batch's tokens over the actor's DP ranks (rows move between ranks, not mini-batches)
    max_skipped_steps: int = 3           # steps in a row with a NaN/Inf gradient (update skipped) before the run stops; 0: never
    memory_check: bool = True            # on CUDA, refuse at start-up a placement whose predicted peak memory exceeds a device's (minihf.planner's model)
    profile_steps: list[int] = field(default_factory=list)  # steps to profile with torch.profiler, every process: run_dir/profile/step_N/rankR.json (Chrome trace) and .txt (ops by time)

    def __post_init__(self):
        check_run_length(self.total_epochs, self.total_training_steps)
        check_keep(self.max_ckpt_to_keep)
        if self.max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps={self.max_skipped_steps} must be >= 0 (0: never stop)")
        if self.log_samples_n < 1:
            raise ValueError(f"log_samples_n={self.log_samples_n} must be >= 1 (turn samples off "
                             "with log_samples_freq=0)")
        from minihf.trainer.loggers import check_loggers

        check_loggers(self.logger)
        self.profile_steps = check_steps(self.profile_steps)


@dataclass
class AsyncTrainingConfig:
    """Asynchronous RL on a fixed schedule (docs/async.md): the samples trained at step n
    were generated with the weights of step n - k."""
    staleness: int = 0                   # k: policy versions between a sample's weights and the ones it trains; 0: synchronous

    def __post_init__(self):
        if self.staleness < 0:
            raise ValueError(f"staleness={self.staleness} must be an integer >= 0 (0: synchronous; "
                             "k: train on samples of the weights k steps old)")


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticSection = field(default_factory=CriticSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    cost_model: CostModelSection = field(default_factory=CostModelSection)
    cost_critic: CostCriticSection = field(default_factory=CostCriticSection)
    custom_cost_function: CustomCostConfig = field(default_factory=CustomCostConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    roles: dict[str, RoleSection] = field(default_factory=dict)  # roles a recipe adds, by name (e.g. a teacher)

    def __post_init__(self):
        r, d = self.actor_rollout_ref.rollout, self.data
        if r.prompt_length is None:
            r.prompt_length = d.max_prompt_length
        if r.response_length is None:
            r.response_length = d.max_response_length
        if r.prompt_length < d.max_prompt_length:
            raise ValueError(f"actor_rollout_ref.rollout.prompt_length={r.prompt_length} is below "
                             f"data.max_prompt_length={d.max_prompt_length}; drop it (it follows "
                             "the data) or raise it")
        reads_values = "values" in self.adv_needs
        if self.critic.enable is None:
            self.critic.enable = reads_values
        if reads_values and not self.critic.enable:
            raise ValueError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} reads values, "
                             "which need a critic; set critic.enable=true")
        if self.critic.enable and not self.critic.model.path:
            self.critic.model.path = self.actor_rollout_ref.model.path
        if (self.algorithm.rollout_correction.enabled
                and self.actor_rollout_ref.actor.recompute_log_prob is False):
            raise ValueError("algorithm.rollout_correction weighs the engine's samples by the "
                             "trainer's recomputed old log-probs, but actor.recompute_log_prob="
                             "false uses the engine's as the old ones (verl's bypass mode, "
                             "nothing to correct); set recompute_log_prob to null or true")
        if r.free_base_weights and not self.actor_rollout_ref.model.lora:
            raise ValueError("actor_rollout_ref.rollout.free_base_weights frees a LoRA actor's base "
                             "weights (actor_rollout_ref.model.lora_rank > 0); without LoRA every "
                             "weight is freed anyway: drop it")
        if self.async_training.staleness and r.check_log_probs != "off":
            raise ValueError(f"actor_rollout_ref.rollout.check_log_probs={r.check_log_probs} compares the "
                             "engine's log-probs with the trainer's for the same weights, but "
                             f"async_training.staleness={self.async_training.staleness} trains on samples of "
                             "older weights; set check_log_probs=off (training/rollout_probs_diff_* "
                             "still reports the gap)")
        self._check_standalone_rollout()
        refuse_tp(self.controller.placement, "generation's tensor parallelism is actor_rollout_"
                  "ref.rollout.tensor_model_parallel_size; drop tp_size")
        from minihf.trainer.plugins import BUILTIN_PLUGINS

        for plugin in BUILTIN_PLUGINS:  # DAPO's and Safe-RLHF's keys are checked by their plug-ins
            plugin.check_config(self)

    def length_keys(self) -> tuple[str, str]:
        """The keys that set the rollout's prompt and response lengths: the data's, which they
        follow by default, or the rollout's own where those were set apart."""
        r, d = self.actor_rollout_ref.rollout, self.data
        return ("data.max_prompt_length" if r.prompt_length == d.max_prompt_length
                else "actor_rollout_ref.rollout.prompt_length",
                "data.max_response_length" if r.response_length == d.max_response_length
                else "actor_rollout_ref.rollout.response_length")

    def check_token_budgets(self) -> None:
        """Warn where a ``max_tokens_per_micro_batch`` is below the longest sequence the rollout
        may make: micro-batches are cut by the rows' real lengths, so it runs until a row is
        longer, then stops the run mid-way on a worker. Checked at start-up after the lengths
        are checked against the model's context (a length past it is the thing to fix)."""
        r = self.actor_rollout_ref.rollout
        longest = r.prompt_length + r.response_length

        def walk(obj, key):
            if dataclasses.is_dataclass(obj):
                for f in dataclasses.fields(obj):
                    yield from walk(getattr(obj, f.name), f"{key}.{f.name}" if key else f.name)
            elif isinstance(obj, dict):
                for name, value in obj.items():
                    yield from walk(value, f"{key}.{name}")
            elif key.endswith(".max_tokens_per_micro_batch") and obj is not None:
                yield key, obj
        for key, budget in walk(self, ""):
            if budget < longest:
                warnings.warn(f"{key}={budget} is below the longest sequence the rollout may make ({r.prompt_length} "
                              f"prompt + {r.response_length} response tokens): a longer row will stop the run; "
                              f"raise it to {longest} to be safe", stacklevel=2)

    def _check_standalone_rollout(self) -> None:
        """``controller.placement.rollout``: the engine on ranks of its own, disjoint from the
        actor's, split by the rollout TP size; one line naming the key otherwise."""
        placement = self.controller.placement
        if "rollout" not in placement:
            return

        def ranks(role: str):
            spec = placement.get(role, RoleSpec())
            return (spec if isinstance(spec, RoleSpec) else RoleSpec(**spec)).ranks
        rollout, actor = ranks("rollout"), ranks("actor")
        if rollout == "all" or actor == "all":
            which = "controller.placement.rollout.ranks" if rollout == "all" else "controller.placement.actor"
            raise ValueError(f"{which}: a standalone rollout needs ranks of its own, but "
                             f"{'it runs on all ranks' if rollout == 'all' else 'the actor is not placed (it runs on all ranks)'}; "
                             "name both, disjoint, e.g. controller.placement={actor: {ranks: [0, 1]}, "
                             "rollout: {ranks: [2]}}")
        shared = sorted(set(rollout) & set(actor))
        if shared:
            raise ValueError(f"controller.placement.rollout.ranks={rollout} overlaps controller.placement."
                             f"actor.ranks={actor} on {shared}: a standalone rollout runs on ranks of its "
                             "own (drop controller.placement.rollout to generate on the actor's ranks, "
                             "the colocated hybrid engine)")
        tp = self.actor_rollout_ref.rollout.tensor_model_parallel_size
        if len(rollout) % tp:
            ok = [d for d in range(1, len(rollout) + 1) if len(rollout) % d == 0]
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide "
                             f"the {len(rollout)} rollout ranks {rollout} (controller.placement.rollout."
                             f"ranks); use one of {ok}")

    @property
    def adv_needs(self) -> frozenset[str]:
        """What the advantage estimator reads beyond every step's batch (its spec,
        ``minihf.algorithms.adv_estimator_needs``): ``values``, ``reward_baselines``."""
        from minihf.algorithms import adv_estimator_needs

        return adv_estimator_needs(self.algorithm.adv_estimator)

    @property
    def use_ref(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def old_log_prob_source(self) -> str:
        """Where the PPO ratio's old log-probs come from: ``recompute`` (the actor's forward
        pass before the update), ``update`` (the update is one on-policy optimizer step: its
        own log-probs, detached, are exactly the old ones; as TRL does) or ``rollout`` (the
        engine's ``rollout_log_probs``: ``recompute_log_prob=false`` with several optimizer
        steps; equal to ~1e-6 in fp32, further apart with a bf16 rollout). Rollout correction
        needs them recomputed; so does ``async_training.staleness`` > 0 unless
        ``recompute_log_prob=false`` asks for the ratio against the behaviour policy itself
        (the update's own log-probs would be the current policy's, ignoring that the samples
        are stale)."""
        a = self.actor_rollout_ref.actor
        rows = self.data.train_batch_size * self.actor_rollout_ref.rollout.n
        one_step = (a.ppo_epochs == 1 and a.ppo_mini_batch_size >= rows
                    and not self.algorithm.use_kl_in_reward)  # the in-reward KL needs them first
        if a.recompute_log_prob or self.algorithm.rollout_correction.enabled:
            return "recompute"
        if one_step and not self.async_training.staleness:
            return "update"
        return "recompute" if a.recompute_log_prob is None else "rollout"

    def _no_mini_batch_fits(self, rows: int, ranks: int) -> str:
        """What to change when no mini-batch size splits ``rows`` over ``ranks``."""
        counts = [d for d in range(1, min(rows, 16) + 1) if rows % d == 0]
        n, batch = self.actor_rollout_ref.rollout.n, self.data.train_batch_size
        fit = next(b for b in range(batch, batch + ranks + 1) if b * n % ranks == 0)
        return (f"no value works, as {rows} sequences do not split evenly over {ranks} ranks: run "
                f"on a process count that divides {rows} ({', '.join(map(str, counts))}), or make "
                f"data.train_batch_size x rollout.n a multiple of {ranks} (e.g. "
                f"data.train_batch_size={fit})")

    def check_sizes(self, ranks: dict[str, int]) -> None:
        """Batch sizes that do not fit the ranks fail here, naming the key and what works.
        ``ranks``: each trained role's section (``"critic"``, ``"actor_rollout_ref.actor"``)
        -> the DP ranks that train it (the role table's ``trains``)."""
        rows = self.data.train_batch_size * self.actor_rollout_ref.rollout.n
        for section, n_ranks in ranks.items():
            key, mini = f"{section}.ppo_mini_batch_size", section_of(self, section).ppo_mini_batch_size
            if rows % mini or mini % n_ranks:
                ok = [m for m in range(n_ranks, rows + 1, n_ranks) if rows % m == 0]
                raise ConfigError(
                    f"{key}={mini} must divide the {rows} sequences of a step "
                    f"(data.train_batch_size={self.data.train_batch_size} x rollout.n="
                    f"{self.actor_rollout_ref.rollout.n}) and be a multiple of the {n_ranks} "
                    f"ranks that train it; " + (f"values that work: {ok}" if ok
                                                else self._no_mini_batch_fits(rows, n_ranks)))
