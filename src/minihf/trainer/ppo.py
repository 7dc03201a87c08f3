"""The RL driver: one loop for PPO, GRPO, RLOO, REINFORCE++, ReMax, DAPO, Safe-RLHF
(docs/architecture.md, "One RL step"), run on rank 0 over the role worker groups.

One step is the phase list ``program`` builds (``minihf.trainer.phases`` runs it), each
timed as ``timing_s/<phase>``:

    rollout: one generation round over the loader's next prompts (with
        async_training.staleness k > 0, the batch generated k steps before:
        ``minihf.trainer.staleness``), whose phases are
        gen            prompts.repeat(n), a uid per prompt -> actor.generate_sequences
        reward         the reward model, else the rule function -> token_level_scores
    balance, samples   rows even over the actor's DP ranks; samples.jsonl rows
    old_log_prob       old log-probs (+ entropy), unless the update is one on-policy step
                       (see old_log_prob_source); checked against the engine's; then, on
                       the driver, algorithm.rollout_correction (IS weights, rejected tokens)
    ref | values       actor.compute_ref_log_prob (when a KL is used), critic.compute_values
    adv                in-reward KL, advantages (the registered estimator)
    update_critic | update_actor   (the actor after critic_warmup steps)

The loop has no algorithm's name in it: what an algorithm adds is a plug-in
(``minihf.trainer.plugins``: DAPO's dynamic sampling and overlong penalty, ReMax's
baseline rollout, Safe-RLHF), and which roles run is the role table
(``minihf.roles``).

``global_step`` travels in ``batch.meta``: it seeds the samples and the update shuffles,
so the workers keep no counters. The fit, checkpoints and resume are ``RunLoop``'s
(``minihf.trainer.loop``): each checkpointed role's shards and a driver state file (data
position, step, KL controller, skipped steps, plug-in states).
"""

from __future__ import annotations


import threading
import time
from contextlib import contextmanager
from dataclasses import replace as dc_replace

import numpy as np
import torch

from minihf.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty
from minihf.config import section_of
from minihf.multi_turn.loop import ENV_ROW_KEYS, multi_turn_metrics, tool_renderer
from minihf.protocol import Batch
from minihf.trainer.common import Log, check_token_ids, every, run_dir
from minihf.trainer.loop import RunLoop
from minihf.trainer.metrics import data_metrics, group_metrics, sample_rows, sent_bytes, throughput
from minihf.trainer.old_log_prob import apply_rejection, old_log_prob_phase
from minihf.trainer.phases import Call, Phase, StepContext, Together, apply_hooks, run_phases
from minihf.trainer.plugin_states import PluginStates
from minihf.trainer.plugins import plugin_classes
from minihf.trainer.ppo_config import PPOConfig
from minihf.trainer.reward import RuleReward, load_reward
from minihf.trainer.advantage import estimate_advantages
from minihf.trainer.balance import balance_batch, layout_differences
from minihf.roles import known_roles, role_groups, role_table
from minihf.trainer.staleness import RolloutQueue, WeightSync, busy_metrics
from minihf.trainer.record import RunRecord
from minihf.trainer.validation import validate

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
class PPOTrainer(RunLoop):
    """The RL loop on rank 0 over ``groups`` (role name -> worker group: the role table's);
    ``RunLoop`` runs the fit, checkpoints and resume."""

    def __init__(self, cfg: PPOConfig, groups: dict, log: Log = print):
        from minihf.data import PromptLoader, RLDataset, load_tokenizer

        self.cfg = cfg
        classes = plugin_classes(cfg)
        self.roles = [r for r in role_table(cfg, classes) if r.name in groups]
        self.groups = role_groups(self.roles, groups)
        cfg.check_sizes({r.trains: self.groups[r.name].dp_size for r in self.roles if r.trains})
        d = cfg.data
        tok = load_tokenizer(cfg.actor_rollout_ref.model.path, padding_side="left")
        mt = cfg.actor_rollout_ref.rollout.multi_turn  # with tools: prompts carry their schemas
        kw = dict(max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                  apply_chat_template=d.apply_chat_template, prompt_key=d.prompt_key, allow_unk=d.allow_unk,
                  renderer=tool_renderer(tok, mt.tools) if mt.enable and mt.tools else None)
        train = RLDataset(d.train_files, tok, **kw)
        self.val = RLDataset(d.val_files, tok, **kw) if d.val_files else None
        for files, ds in ((d.train_files, train), (d.val_files, self.val)):
            if ds is not None:
                check_token_ids(ds.input_ids, files, cfg.actor_rollout_ref.model.path, tok)
        if len(train) < d.train_batch_size:
            raise ValueError(f"data.train_batch_size={d.train_batch_size} exceeds the "
                             f"{len(train)} training prompts in {d.train_files}")
        loader = PromptLoader(train, d.gen_batch_size or d.train_batch_size, shuffle=d.shuffle, seed=d.seed)
        t = cfg.trainer
        self.total_steps = len(loader) * t.total_epochs
        if t.total_training_steps is not None:
            self.total_steps = min(self.total_steps, t.total_training_steps)
        r = cfg.custom_reward_function
        reward = RuleReward(load_reward(r.path, r.name), tok, r.skip_special_tokens,
                            r.timeout_s, r.on_timeout)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
                        if k.type == "adaptive" else FixedKLController(k.kl_coef))
        self.out = run_dir(t)
        self.records = RunRecord(cfg, self.out, self.total_steps, log)  # logs, console, watch, history
        trained = [self.groups[r.name] for r in self.roles if r.trains]
        ranks = [rank for g in trained for rank in g.ranks]
        self.ctx = StepContext(cfg, self.groups, loader, tok, reward, log, self._rollout,
                               self._generate, self._score, self._timed,
                               overlap=len(trained) > 1 and len(ranks) == len(set(ranks)))
        self.plugins = [cls(self.ctx) for cls in classes]
        PluginStates(self.plugins).state_dict()  # state a checkpoint cannot hold: before any model loads
        self.program = apply_hooks(self.phases(), self.plugins, known_roles(cfg, classes))
        # a standalone rollout (controller.placement.rollout) generates; it gets the
        # actor's weights when they changed since its last sync
        self.sync = WeightSync(self.actor, self.rollout, self.records.phase_totals, cfg.actor_rollout_ref.model.lora)
        self._tls = threading.local()  # the context of a batch being made (RolloutQueue)
        # async_training.staleness: the rollout phase (plug-ins' included) runs ahead
        k = cfg.async_training.staleness
        rollout = next(p for p in self.program["step"] if getattr(p, "name", None) == "rollout")
        self.queue = RolloutQueue(k, self.total_steps, lambda target: self._produce(rollout, target),
                                  self.sync, overlap=self.rollout is not None)
        if k:
            self.program["step"] = [self.queue.staged(p) if p is rollout else p
                                    for p in self.program["step"]]

    @property
    def actor(self):
        return self.groups["actor"]

    @property
    def loader(self):
        return self.ctx.loader

    @property
    def log(self) -> Log:
        return self.ctx.log

    @property
    def env_only(self) -> bool:
        """Multi-turn with an environment and no reward function or model: its rewards are the score."""
        mt = self.cfg.actor_rollout_ref.rollout.multi_turn
        return bool(mt.enable and mt.environment and not self.cfg.custom_reward_function.path
                    and "reward_model" not in self.groups)

    @property
    def rollout(self):
        """A standalone rollout's group (controller.placement.rollout), else None."""
        return self.groups.get("rollout")

    # -- phases ---------------------------------------------------------------------------
    def phases(self) -> dict[str, list]:
        """The core phase lists: ``round`` (one generation round) and ``step``."""
        cfg = self.cfg
        return {"round": [Phase("gen", self._gen_phase), Phase("reward", self._reward_phase)],
                "step": [Phase("rollout", self._rollout_phase, timed=False),
                         Phase("balance", self._balance_phase, timed=False),
                         Phase("samples", self._samples_phase, timed=False),
                         Phase("old_log_prob", self._old_log_prob_phase, timed=False),  # times itself
                         Together((Call("ref", "actor", "compute_ref_log_prob", lambda ctx: cfg.use_ref),
                                   Call("values", "critic", "compute_values"))),
                         Phase("adv", self._adv_phase),
                         Phase("rejection", lambda ctx, batch, m: apply_rejection(batch), timed=False),
                         Together((Call("update_critic", "critic", "update_critic"),
                                   Call("update_actor", "actor", "update_actor",
                                        lambda ctx: ctx.step > cfg.trainer.critic_warmup)))]}

    @property
    def cur(self) -> StepContext:
        """The step's context, or on the thread making a batch ahead, that batch's."""
        return getattr(self._tls, "ctx", None) or self.ctx

    def _produce(self, rollout: Phase, target: int) -> tuple[Batch, dict, dict]:
        """The batch of step ``target`` from the rollout phase: ``(batch, its data metrics,
        the time metrics of making it)``, run as step ``target`` (RolloutQueue)."""
        made, timing = {}, {}
        ctx = dc_replace(self.ctx, step=target, metrics=timing)
        self._tls.ctx = ctx
        try:
            out = Batch()
            result = rollout.run(ctx, out, made)
        finally:
            self._tls.ctx = None
        return (out if result is None else result), made, timing

    @contextmanager
    def _timed(self, name: str):
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        m = self.cur.metrics
        m[f"timing_s/{name}"] = m.get(f"timing_s/{name}", 0.0) + dt  # rounds add up
        self.records.add_time(name, dt)

    def _generate(self, batch: Batch, meta: dict) -> tuple[Batch, dict]:
        """Prompts (+ uid, sample_index) through the actor; the result joined to ``batch``
        without its prompt tensors (``input_ids`` etc. now include the responses). When the
        actor repeats prompts itself (``meta["n"]``, validation's ``val_kwargs.n``), the rest
        of ``batch`` is repeated to match. Returns (batch, the generation's meta)."""
        rows = ENV_ROW_KEYS if self.cfg.actor_rollout_ref.rollout.multi_turn.enable else ()
        gen_in = Batch({k: batch.tensors[k] for k in PROMPT_KEYS + ("sample_index",)
                        if k in batch.tensors},
                       {k: v for k, v in batch.non_tensors.items() if k == "uid" or k in rows}, meta)
        if getattr(self._tls, "ctx", None) is None:  # a batch made ahead uses the weights synced for it
            self.sync(self.ctx.metrics)
        out = (self.rollout or self.actor).generate_sequences(gen_in)
        rest = Batch({k: v for k, v in batch.tensors.items() if k not in PROMPT_KEYS},
                     batch.non_tensors)
        if len(out) != len(batch):
            rest = rest.repeat(len(out) // len(batch), interleave=True)
        keep = {k: v for k, v in out.meta.items() if k == "temperature"}
        joined = rest | Batch(out.tensors, {k: v for k, v in out.non_tensors.items()
                                            if k not in rest.non_tensors}, keep)
        return joined, out.meta

    def _score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """The ``reward`` phase (with its plug-ins' wrappers) on ``batch``: ``(scores [B, R],
        metrics)``."""
        m = {}
        reward = next(p for p in self.program["round"] if getattr(p, "name", None) == "reward")
        reward.run(self.cur, batch, m)
        return batch["token_level_scores"], m

    def _rollout(self, prompts: Batch, round_: int) -> tuple[Batch, dict]:
        """One generation round over ``prompts``: the ``round`` phases; (batch, the round's
        metrics). Round ``k > 0`` of a step (dynamic sampling) gives its prompts the uids
        ``"<index>#k"``, so a prompt drawn twice in one step forms two groups with their own
        sampling streams."""
        index = prompts.non_tensors["index"]
        prompts.non_tensors["uid"] = np.array([str(i) if round_ == 0 else f"{i}#{round_}" for i in index],
                                              dtype=object)
        m = {}
        return run_phases(self.cur, self.program["round"], prompts, m, rows_needed=False), m

    def _gen_phase(self, ctx: StepContext, prompts: Batch, m: dict) -> Batch:
        n = self.cfg.actor_rollout_ref.rollout.n
        batch = prompts.repeat(n, interleave=True)
        batch.tensors["sample_index"] = torch.arange(n).repeat(len(batch) // n)
        batch, gen_meta = self._generate(batch, {"global_step": ctx.step})
        reshard = gen_meta.get("timing_s/reshard", 0.0)  # inside gen's time, reported apart
        ctx.metrics["timing_s/reshard"] = ctx.metrics.get("timing_s/reshard", 0.0) + reshard
        moved = gen_meta.get("perf/reshard_bytes", 0)  # one rank's, received (LoRA: the adapters)
        ctx.metrics["perf/reshard_bytes"] = ctx.metrics.get("perf/reshard_bytes", 0) + moved
        for key in ("timing_s/gen_prefill", "timing_s/gen_decode", "timing_s/gen_capture", "timing_s/gen_pack",
                    "timing_s/gen_extend", "timing_s/env", "multi_turn/evictions"):
            if key in gen_meta:  # inside gen's time: the engine's forwards (+ sampling, CUDA graph captures,
                # the CPU weights' repacking), environments
                ctx.metrics[key] = ctx.metrics.get(key, 0.0) + gen_meta[key]
        if "multi_turn_turns" in batch.tensors:
            m.update(multi_turn_metrics(batch))
        batch.meta["global_step"] = ctx.step
        batch.meta["scheduled_rows"] = self.cfg.data.train_batch_size * n  # what the LR schedule counts on
        return batch

    def _reward_phase(self, ctx: StepContext, batch: Batch, m: dict) -> None:
        rm = ctx.groups.get("reward_model")
        if self.env_only:  # multi-turn: the environment's step rewards are the score
            batch.tensors["token_level_scores"] = batch["env_rewards"]
            return
        if rm is not None:
            batch.tensors["token_level_scores"] = rm.compute_rm_score(batch)["rm_scores"]  # [B, R], at the last token
        else:
            batch.tensors["token_level_scores"], metrics, _ = ctx.reward(batch)
            m.update(metrics)
        if "env_rewards" in batch.tensors:  # multi-turn: the environment's step rewards add
            batch.tensors["token_level_scores"] = batch["token_level_scores"] + batch["env_rewards"]

    def _rollout_phase(self, ctx: StepContext, _: Batch, m: dict) -> Batch:
        batch, metrics = ctx.rollout(self.loader.next_batch(), 0)
        m.update(group_metrics(batch["token_level_scores"].sum(-1), batch.non_tensors["uid"]))
        m.update(metrics)
        return batch

    def _balance_phase(self, ctx: StepContext, batch: Batch, m: dict) -> Batch | None:
        cfg, n = self.cfg, self.cfg.actor_rollout_ref.rollout.n
        if not (cfg.trainer.balance_batch and self.actor.dp_size > 1 and self.balance_keeps_mini_batches()):
            return None
        a = cfg.actor_rollout_ref.actor
        return balance_batch(batch, m, self.actor.dp_size, n, len(batch) if a.shuffle
                             else a.ppo_mini_batch_size,  # shuffled: whole chunks
                             cfg.actor_rollout_ref.model.shares_prompt)

    def balance_keeps_mini_batches(self) -> bool:
        """``minihf.trainer.balance.layout_differences`` is empty; otherwise balancing is
        skipped, said once."""
        if getattr(self, "_balance_ok", None) is None:
            why = layout_differences(self.cfg, self.roles, self.groups)
            self._balance_ok = not why
            if why:
                self.log(f"trainer.balance_batch: skipped ({'; '.join(why)}: balancing would move rows "
                         "between its mini-batches)")
        return self._balance_ok

    def _samples_phase(self, ctx: StepContext, batch: Batch, m: dict) -> None:
        t = self.cfg.trainer
        if every(t.log_samples_freq, ctx.step, self.total_steps):
            self.log_samples(ctx.step, sample_rows(batch, ctx.step, "train", ctx.reward, ctx.tokenizer,
                                                   t.log_samples_n, stride=self.cfg.actor_rollout_ref.rollout.n))

    def _old_log_prob_phase(self, ctx: StepContext, batch: Batch, m: dict) -> None:
        old_log_prob_phase(self.cfg, self.actor, batch, m, ctx.step, lambda _m, name: self._timed(name),
                           self.log)

    def _adv_phase(self, ctx: StepContext, batch: Batch, m: dict) -> None:
        cfg = self.cfg
        if cfg.algorithm.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                batch["response_mask"], self.kl_ctrl, cfg.algorithm.kl_penalty)
            m.update(kl_metrics)
        else:
            rewards = batch["token_level_scores"]
        batch.tensors["token_level_rewards"] = rewards
        adv, ret = estimate_advantages(batch, cfg.algorithm, cfg.algorithm.adv_estimator)
        batch.tensors["advantages"], batch.tensors["returns"] = adv, ret

    def train_step(self, step: int) -> dict:
        m = {"step": step}
        self.ctx.step, self.ctx.metrics = step, m
        sent = sum(sent_bytes(self.groups).values())
        with self._timed("step"):
            batch = run_phases(self.ctx, self.program["step"], Batch(), m)
            self.queue.join(m)  # the batch made ahead while this step trained
        if step > self.cfg.trainer.critic_warmup:
            self.sync.stale = True  # the actor's weights changed
        if self.rollout is not None:
            m.update(busy_metrics(m))
        m.update(data_metrics(batch))
        m.update(throughput(batch, m["timing_s/step"], len(self.actor.ranks)))
        m["perf/driver_sent_bytes"] = sum(sent_bytes(self.groups).values()) - sent  # commands to other ranks
        self.records.skips.check(m)  # training/skipped_steps; too many in a row: stop
        return m

    # -- validation -----------------------------------------------------------------------
    def validate(self, step: int) -> dict:
        m = validate(self, step)
        if m:
            self.records.add_time("testing", m["timing_s/testing"])
        return m

    # -- the loop (minihf.trainer.loop) ---------------------------------------------------
    def checkpointed(self) -> dict:
        return {r.name: self.groups[r.name] for r in self.roles if r.checkpointed}

    def driver_state(self) -> dict:
        return {"loader": self.loader, "kl_ctrl": self.kl_ctrl, "skipped_steps": self.records.skips,
                "plugins": PluginStates(self.plugins)}

    def driver_files(self) -> dict:
        return {"pending.pt": self.queue} if self.cfg.async_training.staleness else {}

    def load_driver_state(self, state: dict) -> None:
        if "plugins" not in state:  # checkpoints before plug-ins kept their state at the top level
            state = {**state, "plugins": {p.key(): state for p in self.plugins}}
        super().load_driver_state(state)

    def resumed_at(self, step: int) -> None:
        super().resumed_at(step)
        self.records.resumed_at(step)

    def validate_at(self, step: int) -> bool:
        return every(self.cfg.trainer.test_freq, step, self.total_steps)

    def save_at(self, step: int) -> bool:
        return every(self.cfg.trainer.save_freq, step, self.total_steps) or step == self.total_steps

    def init_models(self) -> None:
        for r in self.roles:
            group = self.groups[r.name]
            if r.trains:
                group.init_model(self.optimizer_steps(section_of(self.cfg, r.trains)))
            else:
                group.init_model()

    def optimizer_steps(self, section) -> int:
        """Optimizer steps of a role over the run (for its LR schedule): steps x
        mini-batches per step x ppo_epochs."""
        rows = self.cfg.data.train_batch_size * self.cfg.actor_rollout_ref.rollout.n
        return self.total_steps * (rows // section.ppo_mini_batch_size) * section.ppo_epochs

    # -- the loop: what the run writes and says (RunRecord) -----------------------------
    @property
    def history(self) -> list[dict]:
        return self.records.history

    @property
    def metrics_log(self):
        return self.records.metrics_log

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.records.log_samples(step, rows)

    def record(self, metrics: dict) -> None:
        self.records.record(metrics)

    def started(self, step: int) -> None:
        self.records.open()
        if self.cfg.trainer.val_before_train and step == 0 and self.val is not None:
            self.record({"step": 0, **self.validate(0)})

    def finished(self, wall_s: float) -> None:
        self.records.close(wall_s, sent_bytes(self.groups))
