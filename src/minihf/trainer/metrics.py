"""Per-step RL metrics with verl's names, computed on the driver from the step's Batch.

``critic/score/*`` (sequence scores from the reward function or model), ``critic/rewards/*``
(sequence sums of the token rewards the advantages used: scores minus an in-reward KL),
``critic/score/frac_equal_groups`` (prompts whose samples all scored the same),
``critic/advantages/*`` and ``critic/returns/*`` (over response tokens), ``critic/values/*``
(with a critic), ``response_length/*`` (incl. ``clip_ratio``: responses that hit the
length limit), ``prompt_length/*``, ``perf/*`` from token counts and the step time, and
``training/rollout_probs_diff_*`` (how far the rollout engine's token probabilities are from
the trainer's, when the old log-probs are recomputed); ``sample_rows``: the rows of
samples.jsonl.
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
    response_len = mask.sum(-1)
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
    return out
