"""The RL driver: one loop for PPO, GRPO, RLOO, REINFORCE++, ReMax (docs/architecture.md, "One RL
step"), run on rank 0 over the role worker groups.

One step, as named phases (each timed as ``timing_s/<phase>``):

    prompts.repeat(n), a uid per prompt        -> gen            actor.generate_sequences
    rule function or reward model              -> reward
    old log-probs (+ entropy), unless the      -> old_log_prob   actor.compute_log_prob
      update is one on-policy step (then the update's own, see old_log_prob_source);
      with rollout.check_log_probs on, always, and checked against the engine's;
      then, on the driver, algorithm.rollout_correction (IS weights, rejected tokens)
    reference log-probs (when a KL is used)    -> ref            actor.compute_ref_log_prob
    values (with a critic)                     -> values         critic.compute_values
    in-reward KL, advantages (registry)        -> adv            on the driver
    critic update                              -> update_critic
    actor update (after critic_warmup steps)   -> update_actor

Safe-RLHF (``algorithm.safe``) adds costs, cost values, a cost critic update and the
Lagrange multiplier to these phases (``minihf.trainer.safe``).

``global_step`` travels in ``batch.meta``: it seeds the samples and the update shuffles,
so the workers keep no counters. Checkpoints hold each role's shards and a driver state
file (data position, step, KL controller); ``latest_checkpointed_iteration.txt`` moves
only after all of it is written.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from minihf.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty
from minihf.config import dump_yaml
from minihf.protocol import Batch
from minihf.trainer.common import (RESUME_FIX, Log, MetricsLog, config_json, every,
                                   find_resume_path, format_line, hold_run_dir, mark_latest, nothing_to_train,
                                   resume_config_changes, run_dir, save_config, write_atomic)
from minihf.trainer.loggers import Console, Trackers
from minihf.trainer.metrics import data_metrics, group_metrics, sample_rows, throughput
from minihf.trainer.old_log_prob import old_log_prob_phase
from minihf.trainer.ppo_config import PPOConfig
from minihf.trainer.reward import RuleReward, at_last_token, load_reward, overlong_penalty
from minihf.trainer.advantage import estimate_advantages
from minihf.trainer.balance import balance_batch
from minihf.trainer.safe import SafeRLHF
from minihf.trainer.sampling import dynamic_rollout
from minihf.trainer.watch import RunWatch, SkipCounter
from minihf.utils.files import read_json

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
LINE_KEYS = {"step": "step", "critic/score/mean": "score", "val-core/mean": "val",
             "actor/pg_loss": "pg_loss", "actor/ppo_kl": "ppo_kl", "actor/entropy": "entropy",
             "actor/grad_norm": "grad_norm", "critic/vf_loss": "vf_loss",
             "response_length/mean": "resp_len", "timing_s/step": "step_s"}  # key -> label


class PPOTrainer:
    """The loop on rank 0 (``groups``: the ``actor``, and ``critic``, ``reward_model``,
    ``cost_critic``, ``cost_model`` when on)."""

    def __init__(self, cfg: PPOConfig, groups: dict, log: Log = print):
        from minihf.data import PromptLoader, RLDataset, load_tokenizer

        self.cfg, self.log = cfg, log
        self.actor = groups["actor"]
        self.critic = groups.get("critic")
        self.rm = groups.get("reward_model")
        cfg.check_sizes(self.actor.dp_size, self.critic.dp_size if self.critic else 1)
        d = cfg.data
        tok = load_tokenizer(cfg.actor_rollout_ref.model.path, padding_side="left")
        kw = dict(max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                  apply_chat_template=d.apply_chat_template, prompt_key=d.prompt_key)
        self.train = RLDataset(d.train_files, tok, **kw)
        self.val = RLDataset(d.val_files, tok, **kw) if d.val_files else None
        if len(self.train) < d.train_batch_size:
            raise ValueError(f"data.train_batch_size={d.train_batch_size} exceeds the "
                             f"{len(self.train)} training prompts in {d.train_files}")
        per_round = (d.gen_batch_size or d.train_batch_size) if cfg.algorithm.filter_groups.enable \
            else d.train_batch_size  # dynamic sampling draws gen_batch_size prompts per round
        self.loader = PromptLoader(self.train, per_round, shuffle=d.shuffle, seed=d.seed)
        t = cfg.trainer
        self.total_steps = len(self.loader) * t.total_epochs
        if t.total_training_steps is not None:
            self.total_steps = min(self.total_steps, t.total_training_steps)
        r = cfg.custom_reward_function
        self.reward = RuleReward(load_reward(r.path, r.name), tok, r.skip_special_tokens,
                                 r.timeout_s, r.on_timeout)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
                        if k.type == "adaptive" else FixedKLController(k.kl_coef))
        self.out = run_dir(t)
        self.metrics_log = MetricsLog(self.out, "jsonl" in t.logger)
        self.samples = MetricsLog(self.out, t.log_samples_freq > 0, "samples.jsonl")
        self.trackers = None  # wandb / tensorboard, opened by fit
        self.console = Console(self.total_steps, log, LINE_KEYS)
        self.watch = RunWatch(d.max_response_length)
        self.skips = SkipCounter(t.max_skipped_steps)
        self.tokenizer = tok
        self.safe = SafeRLHF(cfg, groups, tok) if cfg.algorithm.safe.enable else None
        trained = [g for g in (self.actor, self.critic, groups.get("cost_critic")) if g is not None]
        ranks = [r for g in trained for r in g.ranks]
        self.overlap = len(trained) > 1 and len(ranks) == len(set(ranks))  # disjoint placement
        self.history: list[dict] = []
        self.phase_totals: dict[str, float] = {}

    # -- phases ---------------------------------------------------------------------------
    @contextmanager
    def _timed(self, metrics: dict, name: str):
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + dt  # rounds add up
        self.phase_totals[name] = self.phase_totals.get(name, 0.0) + dt

    def _generate(self, batch: Batch, meta: dict) -> tuple[Batch, dict]:
        """Prompts (+ uid, sample_index) through the actor; the result joined to ``batch``
        without its prompt tensors (``input_ids`` etc. now include the responses). When the
        actor repeats prompts itself (``meta["n"]``, validation's ``val_kwargs.n``), the rest
        of ``batch`` is repeated to match. Returns (batch, the generation's meta)."""
        gen_in = Batch({k: batch.tensors[k] for k in PROMPT_KEYS + ("sample_index",)
                        if k in batch.tensors}, {"uid": batch.non_tensors["uid"]}, meta)
        out = self.actor.generate_sequences(gen_in)
        rest = Batch({k: v for k, v in batch.tensors.items() if k not in PROMPT_KEYS},
                     batch.non_tensors)
        if len(out) != len(batch):
            rest = rest.repeat(len(out) // len(batch), interleave=True)
        keep = {k: v for k, v in out.meta.items() if k == "temperature"}
        joined = rest | Batch(out.tensors, {k: v for k, v in out.non_tensors.items()
                                            if k not in rest.non_tensors}, keep)
        return joined, out.meta

    def _score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """Training scores ``[B, R]`` (reward model or rule function, + DAPO's overlong
        penalty when enabled) and their metrics."""
        if self.rm is not None:
            scores, metrics = self.rm.compute_rm_score(batch)["rm_scores"], {}  # [B, R], at the last token
        else:
            scores, metrics, _ = self.reward(batch)
        o = self.cfg.reward_model.overlong_buffer
        if o.enable:
            lengths = batch["response_mask"].sum(-1)
            penalty = overlong_penalty(lengths, self.cfg.data.max_response_length, o.len, o.penalty_factor)
            scores = scores + at_last_token(penalty, batch["response_mask"])
            metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
            metrics["reward/overlong_frac"] = (penalty < 0).float().mean().item()
        return scores, metrics

    def _run_calls(self, m: dict, calls: list, batch: Batch) -> list:
        """The results of ``(phase, remote method)`` calls on ``batch``, each timed as
        ``timing_s/<phase>``. With the actor and critic on disjoint ranks every call is sent
        at once, so the roles run concurrently and a phase's time is the driver's wait for
        it; on shared ranks the calls run one after the other. Results are the same."""
        if not self.overlap:
            results = []
            for name, call in calls:
                with self._timed(m, name):
                    results.append(call(batch))
            return results
        futures = [(name, call.future(batch)) for name, call in calls]
        results = []
        for name, future in futures:
            with self._timed(m, name):
                results.append(future.result())
        return results

    def _rollout(self, step: int, m: dict, prompts: Batch, round_: int) -> tuple[Batch, dict]:
        """One generation round: ``rollout.n`` samples of each prompt, scored. Round ``k > 0`` of a step (dynamic sampling) gives its prompts the
        uids ``"<index>#k"``, so a prompt drawn twice in one step forms two groups with their
        own sampling streams."""
        cfg, n = self.cfg, self.cfg.actor_rollout_ref.rollout.n
        index = prompts.non_tensors["index"]
        prompts.non_tensors["uid"] = np.array([str(i) if round_ == 0 else f"{i}#{round_}" for i in index],
                                              dtype=object)
        baselines = None
        if cfg.algorithm.adv_estimator == "remax":  # ReMax: a greedy rollout's reward
            with self._timed(m, "gen_max"):
                greedy, _ = self._generate(prompts, {"global_step": step, "do_sample": False})
                baselines = self._score(greedy)[0].sum(-1).repeat_interleave(n)
        batch = prompts.repeat(n, interleave=True)
        batch.tensors["sample_index"] = torch.arange(n).repeat(len(batch) // n)
        with self._timed(m, "gen"):
            batch, gen_meta = self._generate(batch, {"global_step": step})
        m["timing_s/reshard"] = m.get("timing_s/reshard", 0.0) + gen_meta.get("timing_s/reshard", 0.0)
        batch.meta["global_step"] = step
        if baselines is not None:
            batch.tensors["reward_baselines"] = baselines
        with self._timed(m, "reward"):
            batch.tensors["token_level_scores"], metrics = self._score(batch)
        if self.safe is not None:
            with self._timed(m, "cost"):
                metrics.update(self.safe.score(batch))
        return batch, metrics

    def train_step(self, step: int) -> dict:
        cfg, m = self.cfg, {"step": step}
        n = cfg.actor_rollout_ref.rollout.n
        with self._timed(m, "step"):
            if cfg.algorithm.filter_groups.enable:
                batch, reward_metrics = dynamic_rollout(self, step, m)
            else:
                batch, reward_metrics = self._rollout(step, m, self.loader.next_batch(), 0)
                m.update(group_metrics(batch["token_level_scores"].sum(-1), batch.non_tensors["uid"]))
            m.update(reward_metrics)
            if cfg.trainer.balance_batch and self.actor.dp_size > 1:
                a = cfg.actor_rollout_ref.actor
                batch = balance_batch(batch, m, self.actor.dp_size, n, len(batch) if a.shuffle
                                      else a.ppo_mini_batch_size,  # shuffled: whole chunks
                                      cfg.actor_rollout_ref.model.shares_prompt)
            if every(cfg.trainer.log_samples_freq, step, self.total_steps):
                self.log_samples(step, sample_rows(batch, step, "train", self.reward, self.tokenizer,
                                                   self.cfg.trainer.log_samples_n, stride=n))
            old_log_prob_phase(cfg, self.actor, batch, m, step, self._timed, self.log)
            pending = []  # concurrent when actor and critic are placed apart (_run_calls)
            if cfg.use_ref:
                pending.append(("ref", self.actor.compute_ref_log_prob))
            if self.critic is not None:
                pending.append(("values", self.critic.compute_values))
            if self.safe is not None:
                pending.append(self.safe.values_call())
            for result in self._run_calls(m, pending, batch):
                batch |= result
            with self._timed(m, "adv"):
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
                if self.safe is not None:
                    m.update(self.safe.advantages(batch, step))
            pending = [("update_critic", self.critic.update_critic)] if self.critic is not None else []
            if self.safe is not None:
                pending.append(self.safe.update_call())
            if step > cfg.trainer.critic_warmup:
                pending.append(("update_actor", self.actor.update_actor))
            for result in self._run_calls(m, pending, batch):
                m.update(result)
        m.update(data_metrics(batch))
        m.update(throughput(batch, m["timing_s/step"], len(self.actor.ranks)))
        return m

    # -- validation -----------------------------------------------------------------------
    def validate(self, step: int) -> dict:
        if self.val is None:
            return {}
        t0 = time.perf_counter()
        k = self.cfg.actor_rollout_ref.rollout.val_kwargs.n
        size = self.cfg.data.val_batch_size or len(self.val)
        scores, costs, sources, lengths = [], [], [], []
        for start in range(0, len(self.val), size):
            batch = self.val.collate(list(range(start, min(len(self.val), start + size))))
            batch.non_tensors["uid"] = np.array([f"val{i}" for i in batch.non_tensors["index"]],
                                                dtype=object)
            out, _ = self._generate(batch, {"validate": True, "global_step": step})
            _, _, raw = self.reward(out)
            if start == 0 and self.cfg.trainer.log_samples_freq > 0:
                self.log_samples(step, sample_rows(out, step, "val", self.reward, self.tokenizer,
                                                   self.cfg.trainer.log_samples_n, scores=raw))
            scores += raw
            costs += self.safe.validate(out) if self.safe is not None else []
            sources += list(out.non_tensors["data_source"])
            lengths += out["response_mask"].sum(-1).tolist()
        m = {}
        for name, values in (("reward", scores), ("cost", costs)):
            for src in sorted(set(sources)) if values else []:
                vals = [v for v, d in zip(values, sources) if d == src]
                m[f"val-core/{src}/{name}/mean@{k}"] = sum(vals) / len(vals)
        m["val-core/mean"] = sum(scores) / len(scores)
        if costs:
            m["val-core/cost"] = sum(costs) / len(costs)
        m["val/response_length/mean"] = sum(lengths) / len(lengths)
        m["timing_s/testing"] = time.perf_counter() - t0
        self.phase_totals["testing"] = self.phase_totals.get("testing", 0.0) + m["timing_s/testing"]
        return m

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, step: int) -> Path:
        path = self.out / f"global_step_{step}"
        self.actor.save_checkpoint(str(path / "actor"))
        if self.critic is not None:
            self.critic.save_checkpoint(str(path / "critic"))
        state = {"step": step, "loader": self.loader.state_dict(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "skipped_steps": self.skips.total}
        if self.safe is not None:
            self.safe.save(path)
            state["lagrange"] = self.safe.lagrange.state_dict()
        write_atomic(path / "driver_state.json", json.dumps(state))
        save_config(path, self.cfg)
        mark_latest(self.out, step)
        return path

    def resume(self) -> int:
        t = self.cfg.trainer
        path = find_resume_path(str(self.out), t.resume_mode, t.resume_from_path)
        if path is None:  # an attempt interrupted before its first checkpoint wrote rows
            self.metrics_log.start_fresh()
            self.samples.start_fresh()
            return 0
        changed = resume_config_changes(path, self.cfg)  # refuses changes that cannot apply
        state = read_json(path / "driver_state.json", RESUME_FIX)
        self.actor.load_checkpoint(str(path / "actor"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(path / "critic"))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.skips.total = state.get("skipped_steps", 0)
        if self.safe is not None:
            self.safe.load(path)
            self.safe.lagrange.load_state_dict(state["lagrange"])
        self.metrics_log.resume_at(state["step"])
        self.samples.resume_at(state["step"])
        self.log(f"resumed from {path} at step {state['step']}"
                 + (f" (changed: {', '.join(changed)})" if changed else ""))
        return int(state["step"])

    def optimizer_steps(self, section) -> int:
        """Optimizer steps of a role over the run (for its LR schedule): steps x
        mini-batches per step x ppo_epochs."""
        rows = self.cfg.data.train_batch_size * self.cfg.actor_rollout_ref.rollout.n
        return self.total_steps * (rows // section.ppo_mini_batch_size) * section.ppo_epochs

    # -- the loop -------------------------------------------------------------------------
    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.samples.append(*rows)
        if self.trackers is not None:
            self.trackers.samples(rows, step)

    def record(self, metrics: dict) -> None:
        self.history.append(metrics)
        self.metrics_log.append(metrics)
        if self.trackers is not None:
            self.trackers.log(metrics, metrics["step"])
        for warning in self.watch.check(metrics):
            self.console.message(f"warning: {warning}")
        if "console" in self.cfg.trainer.logger:
            self.console.step(metrics, format_line(metrics, LINE_KEYS))

    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Train to ``total_steps`` (or ``stop_after`` more steps, as if preempted), holding
        the run dir."""
        with hold_run_dir(self.out):
            return self._fit(stop_after)

    def _fit(self, stop_after: int | None) -> list[dict]:
        t0 = time.perf_counter()
        self.actor.init_model(self.optimizer_steps(self.cfg.actor_rollout_ref.actor))
        if self.critic is not None:
            self.critic.init_model(self.optimizer_steps(self.cfg.critic))
        if self.rm is not None:
            self.rm.init_model()
        if self.safe is not None:
            self.safe.init_model(self.optimizer_steps(self.cfg.cost_critic))
        step = self.resume()
        done = nothing_to_train(self.out, step, self.total_steps)
        if done:
            self.log(done)
        dump_yaml(self.cfg, self.out / "config.yaml")  # the resolved config of this start
        t = self.cfg.trainer
        self.trackers = Trackers(t.logger, self.out, t.project_name, t.experiment_name, config_json(self.cfg))
        if self.cfg.trainer.val_before_train and step == 0 and self.val is not None:
            self.record({"step": 0, **self.validate(0)})
        end = self.total_steps if stop_after is None else min(self.total_steps, step + stop_after)
        while step < end:
            step += 1
            metrics = self.train_step(step)
            self.skips.check(metrics)  # training/skipped_steps; too many in a row: stop
            if every(self.cfg.trainer.test_freq, step, self.total_steps):
                metrics.update(self.validate(step))
            self.record(metrics)  # before the checkpoint: a kill after it must not lose the row
            if every(self.cfg.trainer.save_freq, step, self.total_steps) or step == self.total_steps:
                self.save(step)
        self.console.close()
        self.summary(time.perf_counter() - t0)
        self.trackers.close()
        return self.history

    def summary(self, wall_s: float) -> None:
        vals = [h["val-core/mean"] for h in self.history if "val-core/mean" in h]
        if len(vals) == 1:  # e.g. trainer.test_freq=-1: no "last" to compare with
            self.log(f"validation score: {vals[0]:.4f} (the only validation this run; "
                     "trainer.test_freq sets how often it runs)")
        elif vals:
            self.log(f"validation score: {vals[0]:.4f} (first) -> {vals[-1]:.4f} (last)")
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.phase_totals.items(),
                                                               key=lambda kv: -kv[1]))
        self.log(f"wall time {wall_s:.1f}s" + (f"; by phase: {phases}" if phases else ""))
