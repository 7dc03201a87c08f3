"""Per-step RL metrics with verl's names, computed on the driver from the step's Batch.

``critic/score/*`` (sequence scores from the reward function or model), ``critic/rewards/*``
(sequence sums of the token rewards the advantages used: scores minus an in-reward KL),
``critic/score/frac_equal_groups`` (prompts whose samples all scored the same),
``critic/advantages/*`` and ``critic/returns/*`` (over response tokens), ``critic/values/*``
(with a critic), ``response_length/*`` (incl. ``clip_ratio``: responses that hit the
length limit), ``prompt_length/*``, ``perf/*`` from token counts and the step time, and
``training/rollout_probs_diff_*`` (how far the rollout engine's token probabilities are from
the trainer's, when the old log-probs are recomputed) and, with ``rollout.check_log_probs``,
``training/rollout_log_prob_bound_ratio`` (the worst token's gap over what rounding explains);
``sample_rows``: the rows of samples.jsonl.
"""

from __future__ import annotations

import torch

from minihf.protocol import Batch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def data_metrics(batch: Batch) -> dict[str, float]:
    """What the step's data looked like (see the module docstring)."""
    mask = batch["response_mask"].bool()                                      # [B, R]
    out: dict[str, float] = {}
    out.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", batch["advantages"][mask]))
    out.update(_stats("critic/returns", batch["returns"][mask]))
    if "values" in batch.tensors:
        out.update(_stats("critic/values", batch["values"][mask]))
    # every response token, as verl counts them (a multi-turn response's observations too;
    # response_mask holds the model's tokens only, and rejection sampling drops some)
    response_len = batch["attention_mask"][:, -mask.shape[1]:].sum(-1)
    out.update(_stats("response_length", response_len))
    out["response_length/clip_ratio"] = (response_len == mask.shape[1]).float().mean().item()
    prompt_len = batch["attention_mask"][:, :-mask.shape[1]].sum(-1)
    out.update(_stats("prompt_length", prompt_len))
    return out


def throughput(batch: Batch, step_s: float, world_size: int) -> dict[str, float]:
    """``perf/total_num_tokens`` (prompt + response, no padding) and ``perf/throughput``
    (tokens per second per rank)."""
    tokens = int(batch["attention_mask"].sum())
    return {"perf/total_num_tokens": tokens,
            "perf/throughput": tokens / max(step_s, 1e-9) / world_size}


def rollout_probs_diff(rollout_log_probs: torch.Tensor, log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """``training/rollout_probs_diff_{max,mean,std}``: |p_rollout - p_trainer| over response
    tokens, the probabilities of the sampled tokens from the engine's log-probs and from the
    trainer's recomputed old log-probs (verl's names). fp32 on CPU: rounding only (the main
    job: max 6e-7 at step 1, 1e-5-4e-5 once the policy is sharp; mean <= 3e-7); bf16 and other
    kernels on GPU make it larger; a large value means the rollout is off-policy."""
    mask = response_mask.bool()
    if not mask.any():
        return {}
    diff = (rollout_log_probs.double().exp() - log_probs.double().exp()).abs()[mask]
    stats = torch.stack([diff.max(), diff.mean(), diff.std(unbiased=False)]).tolist()  # one sync
    return {f"training/rollout_probs_diff_{k}": v for k, v in zip(("max", "mean", "std"), stats)}


def check_rollout_log_probs(rollout_log_probs: torch.Tensor, log_probs: torch.Tensor,
                            bound: torch.Tensor, response_mask: torch.Tensor, step: int,
                            mode: str, uids=None) -> tuple[dict[str, float], str | None]:
    """``rollout.check_log_probs``: every response token's engine log-prob against the
    trainer's, in units of ``bound`` (the actor's ``log_prob_bound``: the gap rounding alone
    can make). Returns ``({"training/rollout_log_prob_bound_ratio": worst}, message)``; the
    message names the step, row (and uid) and token of the worst gap when it exceeds the
    bound, else None. ``mode="error"`` raises it as a RuntimeError instead. All ``[B, R]``."""
    mask = response_mask.bool()
    if not mask.any():
        return {}, None
    ratio = torch.where(mask, (rollout_log_probs.double() - log_probs.double()).abs()
                        / bound.double().clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    worst = ratio.max().item()
    metrics = {"training/rollout_log_prob_bound_ratio": worst}
    if worst <= 1.0:
        return metrics, None
    row, col = divmod(int(ratio.argmax()), ratio.shape[1])
    uid = f" (uid {uids[row]})" if uids is not None else ""
    message = (f"step {step}: the rollout engine's log-prob of row {row}{uid}, response token "
               f"{col} is {rollout_log_probs[row, col].item():.7g}, the trainer's "
               f"{log_probs[row, col].item():.7g}: they differ by "
               f"{abs(rollout_log_probs[row, col].item() - log_probs[row, col].item()):.3g}, "
               f"{worst:.1f}x what rounding alone explains ({bound[row, col].item():.3g}); "
               f"{int((ratio > 1).sum())} of {int(mask.sum())} tokens are past it. The samples "
               "were not drawn from the policy being trained (stale or different weights, "
               "another temperature, a kernel bug); rollout.check_log_probs=warn only logs "
               "this, off skips the check")
    if mode == "error":
        raise RuntimeError(message)
    return metrics, message


def group_metrics(scores: torch.Tensor, uids) -> dict[str, float]:
    """``critic/score/frac_equal_groups``: the fraction of prompts (uid groups of two or
    more samples) whose samples all scored the same: no signal for group estimators."""
    groups: dict = {}
    for s, u in zip(scores.tolist(), uids):
        groups.setdefault(u, []).append(s)
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return {}
    return {"critic/score/frac_equal_groups": sum(max(g) == min(g) for g in sized) / len(sized)}


def sample_rows(batch: Batch, step: int, kind: str, reward, tokenizer, n: int, stride: int = 1,
                scores: list[float] | None = None) -> list[dict]:
    """``n`` rows (every ``stride``-th: one sample per prompt) for samples.jsonl: the prompt
    as the model saw it (special tokens kept, padding dropped), the response as the reward
    function (``reward``, a ``RuleReward``) saw it."""
    rows = list(range(0, len(batch), stride))[:n]
    if scores is None:
        scores = batch["token_level_scores"].sum(-1).tolist()
    texts = reward.decode(batch[rows])
    out = []
    for text, i in zip(texts, rows):
        prompt = batch["prompts"][i][batch["attention_mask"][i, :batch["prompts"].shape[1]].bool()]
        out.append({"step": step, "kind": kind, "data_source": str(batch.non_tensors["data_source"][i]),
                    "prompt": tokenizer.decode(prompt.tolist(), skip_special_tokens=False),
                    "response": text, "score": float(scores[i]),
                    "ground_truth": batch.non_tensors["ground_truth"][i],
                    "response_length": int(batch["response_mask"][i].sum())})
        if "multi_turn_messages" in batch.non_tensors:  # the conversation, turn by turn
            out[-1].update(conversation(batch, i, tokenizer))
    return out


def conversation(batch: Batch, i: int, tokenizer) -> dict:
    """A multi-turn sample's turns (``messages``), its finish reason, and its response as
    spans of text marked ``trained`` (assistant tokens) or not (observations)."""
    r = batch["responses"].shape[1]
    attn = batch["attention_mask"][i, -r:].bool()
    ids, mask = batch["responses"][i][attn].tolist(), batch["response_mask"][i][attn].tolist()
    spans, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or mask[j] != mask[start]:
            spans.append({"trained": bool(mask[start]),
                          "text": tokenizer.decode(ids[start:j], skip_special_tokens=False)})
            start = j
    return {"messages": list(batch.non_tensors["multi_turn_messages"][i]),
            "finish_reason": str(batch.non_tensors["multi_turn_finish"][i]), "spans": spans}


def sent_bytes(groups: dict) -> dict[str, int]:
    """Bytes of the commands the driver has sent to the roles so far, per ``role.method``
    (``WorkerGroup.sent_bytes``; a stand-in group without it sends nothing)."""
    out = {}
    for name, group in groups.items():
        counts = getattr(group, "sent_bytes", None)
        for method, n in (counts() if callable(counts) else {}).items():
            out[f"{name}.{method}"] = n
    return out
