"""The ``old_log_prob`` phase of an RL step: the trainer's log-probs of the sampled tokens,
checked against the rollout engine's and, with rollout correction on, used to weigh or
reject the samples.

Where the PPO ratio's old log-probs come from is ``PPOConfig.old_log_prob_source``:
``recompute`` (this phase's forward), ``update`` (the one-step update's own) or ``rollout``
(the engine's). ``rollout.check_log_probs`` adds the forward when the source would skip it.
Rollout correction (``algorithm.rollout_correction``) runs on the driver, before the
advantages, whenever the old log-probs are recomputed.
"""

from __future__ import annotations

from minihf.algorithms import masked_mean
from minihf.algorithms.rollout_correction import compute_rollout_correction_and_rejection_mask
from minihf.protocol import Batch
from minihf.trainer.metrics import check_rollout_log_probs, rollout_probs_diff


def old_log_prob_phase(cfg, actor, batch: Batch, m: dict, step: int, timed, log) -> None:
    """Fill ``batch["old_log_probs"]`` (or mark the update's own) and ``m`` with the phase's
    metrics. ``timed(m, name)`` times a call as ``timing_s/<name>``; ``log`` prints."""
    source = cfg.old_log_prob_source
    check = cfg.actor_rollout_ref.rollout.check_log_probs
    if source == "recompute" or check != "off":  # the check adds the pass otherwise
        with timed(m, "old_log_prob"):
            old = actor.compute_log_prob(batch, calc_entropy=True, calc_bound=check != "off")
        m["actor/entropy"] = masked_mean(old["entropys"], batch["response_mask"]).item()
        if "routed_experts" in old.tensors:  # router_replay R2: the update routes by these
            batch.tensors["routed_experts"] = old["routed_experts"]
        if "router_disagree" in old.tensors:  # R3: how often this forward's own choice differs
            m.update(router_disagreement(old["router_disagree"], old["router_replayed"]))
        if source == "recompute":
            batch.tensors["old_log_probs"] = old["old_log_probs"]
        if "rollout_log_probs" in batch.tensors:
            m.update(rollout_probs_diff(batch["rollout_log_probs"], old["old_log_probs"],
                                        batch["response_mask"]))
            if check != "off":
                checked, message = check_rollout_log_probs(
                    batch["rollout_log_probs"], old["old_log_probs"], old["log_prob_bound"],
                    batch["response_mask"], step, check, batch.non_tensors.get("uid"))
                m.update(checked)
                if message:
                    log(f"warning: {message}")
    if source == "rollout":
        batch.tensors["old_log_probs"] = batch["rollout_log_probs"]
    if source == "recompute" and "rollout_log_probs" in batch.tensors:
        correct_rollout(cfg.algorithm.rollout_correction, batch, m)
    batch.meta["old_log_probs"] = source  # "update": the actor's own, detached


def router_disagreement(disagree, replayed) -> dict[str, float]:
    """``actor/router_disagreement``: the fraction of (token, MoE layer) pairs whose trainer
    top-k expert set differs from the rollout's (replayed) one; ``..._max``: the worst
    layer's fraction. From per-row counts [B, L]."""
    per_layer = disagree.sum(0) / replayed.sum(0).clamp(min=1)               # [L]
    return {"actor/router_disagreement": float(disagree.sum() / replayed.sum().clamp(min=1)),
            "actor/router_disagreement_max": float(per_layer.max())}


def correct_rollout(rc, batch: Batch, m: dict) -> None:
    """``algorithm.rollout_correction`` (decoupled): importance weights for the policy loss
    and the mask of the tokens rejection keeps (``rollout_rs_mask``, applied after the
    advantages: :func:`apply_rejection`); the ``rollout_corr/*`` off-policy figures always."""
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
        rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
        rc.rollout_rs, rc.rollout_rs_threshold)
    m.update(metrics)
    if rc.rollout_rs is not None:
        batch.tensors[REJECTION_MASK] = mask
    if weights is not None:
        batch.tensors["rollout_is_weights"] = weights


REJECTION_MASK = "rollout_rs_mask"


def apply_rejection(batch: Batch) -> None:
    """The tokens rollout correction rejected leave the response mask, after the rewards
    and advantages were computed over every token (a sequence's score sits on its last
    token: rejecting that one dropped the score from the returns, and ReMax pushed a right
    answer down); the losses of the updates skip them."""
    keep = batch.tensors.pop(REJECTION_MASK, None)
    if keep is not None:
        batch.tensors["response_mask"] = keep
