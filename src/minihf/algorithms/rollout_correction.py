"""Rollout correction: importance weights and rejection masks for samples the trainer's
policy did not draw (verl's ``rollout_corr_helper``, its names and argument order).

The rollout engine samples from ``pi_rollout``; the PPO ratio's denominator is the trainer's
recomputed ``pi_old``. Where the two differ (a bf16 engine, stale weights in asynchronous
training, another kernel), the samples are off-policy for ``pi_old`` and the gradient is
biased. With ``log_ratio = old_log_prob - rollout_log_prob`` (``[B, T]``, log pi_old/pi_rollout):

* **Importance sampling** (``rollout_is``): ``token``: ``w_t = exp(log_ratio_t)``;
  ``sequence``: ``w = exp(sum_t m_t log_ratio_t)`` on every token of the sequence. Log-ratios
  are clamped to [-20, 20] before ``exp``. ``rollout_is_threshold`` C truncates (TIS:
  ``min(w, C)``, no lower cap); ``"lower_upper"`` masks instead (IcePop: ``w`` outside
  [lower, upper] becomes 0). The weights are detached, optionally divided by their batch
  mean (``rollout_is_batch_normalize``), and multiply the per-token policy loss.
* **Rejection sampling** (``rollout_rs``), masked (MIS): per option a statistic of
  ``lr = clamp(log_ratio, -20, 20)``: ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = exp(lr) - 1 - lr``,
  taken per token (``token_*``) or per sequence as the masked sum, mean (the geometric mean
  of the ratio, for k1) or max (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``). k2 and k3 keep
  a token (sequence) when the statistic is <= the threshold; k1 takes ``"lower_upper"`` (a
  single X means ``1/X_X``) and keeps it when ``lower <= exp(k1) <= upper``, i.e. bounds
  ``pi_rollout / pi_old``. All options must keep a token; rejected tokens leave the
  ``response_mask`` the updates read (the driver applies it after the advantages, which
  see every token: ``minihf.trainer.old_log_prob.apply_rejection``). Weights are never
  changed by rejection.

Metrics carry the ``rollout_corr/`` prefix and verl's names. Deliberate deviation: batch
normalisation and the metrics run on the driver over the whole batch, so no distributed
mean is needed. Pure tensor functions, no distributed code.
"""

from __future__ import annotations

import math

import torch

SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / (mask.sum() + 1e-8)
    return (x * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def parse_rs_options(rollout_rs: str | None, rollout_rs_threshold) -> list[tuple[str, float | None, float]]:
    """``[(option, lower or None, upper)]`` from verl's comma-separated ``rollout_rs`` and
    ``rollout_rs_threshold`` (one value per option, or one shared by all). Raises ValueError
    naming the key and the valid forms."""
    if rollout_rs is None:
        return []
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    bad = [o for o in options if o not in RS_OPTIONS]
    if bad or not options:
        raise ValueError(f"rollout_rs={rollout_rs!r}: unknown option(s) {bad}; choose from "
                         f"{list(RS_OPTIONS)} (comma-separated to combine)")
    if rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold (e.g. 2.0 or "
                         "'0.5_2.0' for k1 options, 0.01 for k2/k3)")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",")]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold={rollout_rs_threshold!r} gives {len(specs)} values "
                         f"for {len(options)} options {options}: give one, or one per option")
    parsed = []
    for option, spec in zip(options, specs):
        try:
            if option.endswith("k1"):
                low, _, up = spec.partition("_")
                upper = float(up) if up else float(low)
                lower = float(low) if up else 1.0 / upper
                ok = 0 < lower < upper
            else:
                if "_" in spec:
                    raise ValueError
                lower, upper = None, float(spec)
                ok = upper > 0
        except ValueError:
            ok = False
        if not ok:
            form = "'lower_upper' with 0 < lower < upper, or X > 1 for 1/X_X" if option.endswith("k1") \
                else "one positive upper bound"
            raise ValueError(f"rollout_rs_threshold={spec!r} for {option}: needs {form}")
        parsed.append((option, lower, upper))
    return parsed


def parse_is_threshold(rollout_is_threshold) -> tuple[float, float | None]:
    """``(upper, lower or None)`` from ``rollout_is_threshold``: a number C (truncation,
    ``min(w, C)``) or ``"lower_upper"`` (IcePop: weights outside [lower, upper] become 0).
    Raises ValueError naming the value."""
    spec = str(rollout_is_threshold).strip()
    try:
        if isinstance(rollout_is_threshold, bool):
            raise ValueError
        low, sep, up = spec.partition("_")
        upper, lower = (float(up), float(low)) if sep else (float(low), None)
    except ValueError:
        upper, lower = 0.0, None
    if not upper > 0 or (lower is not None and not 0 <= lower < upper):
        raise ValueError(f"rollout_is_threshold={rollout_is_threshold!r}: give a cap C > 0 (e.g. "
                         "2.0) or 'lower_upper' with 0 <= lower < upper (e.g. '0.5_2.0', IcePop)")
    return upper, lower


def compute_rollout_correction_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                                       rollout_is: str = "token", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize: bool = False):
    """Importance weights ``[B, T]`` (detached, 0 on padding) and their metrics (unprefixed).
    ``log_ratio`` = old - rollout log-probs ``[B, T]``; ``rollout_is_threshold`` as
    :func:`parse_is_threshold`; formulas in the module docstring."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r}; choose one of {list(IS_LEVELS)} or null")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask.to(log_ratio.dtype)                             # [B, T]
    if rollout_is == "token":
        log_w = log_ratio                                                    # [B, T]
    else:
        log_w = (log_ratio * mask).sum(-1, keepdim=True)                     # [B, 1]
    raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask
    if lower is None:
        weights = raw.clamp(max=upper)                                       # truncated (TIS)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = is_metrics(weights, raw, log_w, mask, rollout_is, upper, lower)
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _masked_mean(weights, mask)
        else:
            valid = mask.sum(-1) > 0                                        # [B]
            mean = _masked_mean(weights, mask, -1)[valid].mean() if valid.any() else weights.new_zeros(())
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
    return weights, metrics


def is_metrics(weights: torch.Tensor, raw: torch.Tensor, log_w: torch.Tensor, mask: torch.Tensor,
               rollout_is: str, upper: float, lower: float | None) -> dict[str, float]:
    """verl's ``rollout_is_*`` figures: of the applied weights ``[B, T]`` (mean, spread,
    effective sample size, per-sequence means), and of the raw ratios (how often they fall
    outside the bounds); ``log_w`` is the token or sequence log-ratio ``[B, T]`` / ``[B, 1]``."""
    low = 1.0 / upper if lower is None else lower
    m = mask.bool()
    out = {"rollout_is_mean": _masked_mean(weights, mask).item()}
    if rollout_is == "token":
        out["rollout_is_max"] = weights[m].max().item()
        out["rollout_is_min"] = weights[m].min().item()
        out["rollout_is_ratio_fraction_high"] = _masked_mean((raw > upper).float(), mask).item()
        out["rollout_is_ratio_fraction_low"] = _masked_mean((raw < low).float(), mask).item()
    else:
        out["rollout_is_max"] = math.exp(min(log_w.max().item(), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(log_w.min().item())
        out["rollout_is_ratio_fraction_high"] = (log_w > math.log(upper)).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (log_w < math.log(low)).float().mean().item()
    v = weights.clamp(0.0, upper)
    mean_v = _masked_mean(v, mask)
    var = _masked_mean(v.square(), mask) - mean_v.square()
    out["rollout_is_std"] = var.clamp(min=0).sqrt().item() if mask.sum() > 1 else 0.0
    out["rollout_is_eff_sample_size"] = (1.0 / _masked_mean((v / (mean_v + 1e-8)).square(), mask)).item()
    valid = m.any(-1)
    seq = _masked_mean(weights, mask, -1)[valid]                             # [B']
    raw_seq = _masked_mean(raw, mask, -1)[valid]
    out.update({"rollout_is_seq_mean": seq.mean().item(),
                "rollout_is_seq_std": seq.std().item() if len(seq) > 1 else 0.0,
                "rollout_is_seq_max": seq.max().item(), "rollout_is_seq_min": seq.min().item(),
                "rollout_is_seq_max_deviation": (seq - 1).abs().max().item(),
                "rollout_is_seq_fraction_high": (raw_seq > upper).float().mean().item(),
                "rollout_is_seq_fraction_low": (raw_seq < low).float().mean().item()})
    if lower is not None:
        out["rollout_is_oob_ratio"] = _masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    return out


def _rs_statistic(option: str, lr: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's statistic ``[B, T]`` (per sequence options: the same on every token)."""
    kind = option.rsplit("_", 1)[1]
    stat = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1 - lr}[kind]   # [B, T]
    if option.startswith("token"):
        return stat
    if option.startswith("seq_sum"):
        agg = (stat * mask).sum(-1)
    elif option.startswith("seq_mean"):
        agg = _masked_mean(stat, mask, -1)
    else:
        agg = torch.where(mask.bool(), stat, torch.full_like(stat, -math.inf)).amax(-1)
        agg = torch.where(mask.bool().any(-1), agg, torch.zeros_like(agg))
    return agg[:, None].expand_as(lr)


def compute_rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                                   rollout_rs: str = "token_k1", rollout_rs_threshold=None):
    """The response mask with rejected tokens zeroed ``[B, T]`` (the dtype of
    ``response_mask``) and the metrics (unprefixed); options and thresholds as verl's
    (:func:`parse_rs_options`, module docstring)."""
    options = parse_rs_options(rollout_rs, rollout_rs_threshold)
    mask = response_mask.to(log_ratio.dtype)                               # [B, T]
    m = mask.bool()
    valid_seq = m.any(-1)                                                   # [B]
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    keep_all = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    for option, lower, upper in options:
        stat = _rs_statistic(option, lr, mask)                             # [B, T]
        if lower is None:
            keep = stat <= upper
        else:
            keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
        keep = keep.to(mask.dtype)
        values = stat[m]
        rejected = (1 - keep) * mask
        metrics[f"rollout_rs_{option}_mean"] = values.mean().item()
        metrics[f"rollout_rs_{option}_max"] = values.max().item()
        metrics[f"rollout_rs_{option}_min"] = values.min().item()
        metrics[f"rollout_rs_{option}_masked_fraction"] = _masked_mean(rejected, mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (rejected.sum(-1) > 0)[valid_seq].float().mean().item())
        keep_all = keep_all * keep
    new_mask = (mask * keep_all)                                            # [B, T]
    metrics["rollout_rs_masked_fraction"] = _masked_mean(mask - new_mask, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = ((mask - new_mask).sum(-1) > 0).float().mean().item()
    return new_mask.to(response_mask.dtype), metrics


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None,
                              response_mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout is from the trainer (verl's names, unprefixed): perplexities of
    both, ``kl`` (mean of rollout - old log-probs), ``k3_kl``, per-sequence log-perplexity
    differences and chi-square divergences (token and sequence)."""
    mask = response_mask.to(old_log_prob.dtype)
    valid = mask.bool().any(-1)
    old_seq = _masked_mean(old_log_prob, mask, -1)[valid]                   # [B']
    out = {"training_ppl": torch.exp(-old_seq).mean().item(),
           "training_log_ppl": (-old_seq).mean().item()}
    if rollout_log_prob is None:
        return out
    lr = old_log_prob - rollout_log_prob                                    # [B, T]
    roll_seq = _masked_mean(rollout_log_prob, mask, -1)[valid]
    diff = roll_seq - old_seq                                               # [B']
    clamped = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out.update({
        "kl": _masked_mean(rollout_log_prob - old_log_prob, mask).item(),
        "k3_kl": _masked_mean(torch.exp(lr) - lr - 1, mask).item(),
        "rollout_ppl": torch.exp(-roll_seq).mean().item(),
        "rollout_log_ppl": (-roll_seq).mean().item(),
        "log_ppl_diff": diff.mean().item(), "log_ppl_abs_diff": diff.abs().mean().item(),
        "log_ppl_diff_max": diff.max().item(), "log_ppl_diff_min": diff.min().item(),
        "ppl_ratio": torch.exp(diff).mean().item(),
        "chi2_token": (_masked_mean(torch.exp(clamped).square(), mask) - 1).item(),
        "chi2_seq": (torch.exp(2 * (lr * mask).sum(-1)[valid].clamp(-SAFETY_BOUND, SAFETY_BOUND))
                     .mean() - 1).item(),
    })
    return out


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
        rollout_is: str | None = None, rollout_is_threshold=2.0,
        rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
        rollout_rs_threshold=None):
    """``(weights or None, response_mask after rejection, metrics)``, all ``[B, T]``, the
    metrics with the ``rollout_corr/`` prefix. IS runs when ``rollout_is`` and its threshold
    are set, rejection when ``rollout_rs`` is; both use the original mask."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must have one shape [B, T]")
    if not response_mask.bool().any():
        raise ValueError("rollout correction: the response mask is empty (no response tokens)")
    log_ratio = old_log_prob.float() - rollout_log_prob.float()             # [B, T]
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, m = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(m)
    mask = response_mask
    if rollout_rs is not None:
        mask, m = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs,
                                                 rollout_rs_threshold)
        metrics.update(m)
    metrics.update(compute_offpolicy_metrics(old_log_prob.float(), rollout_log_prob.float(),
                                             response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
