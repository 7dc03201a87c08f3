"""Per-token log-probabilities and entropies from logits.

Both upcast to fp32 first: bf16 log-softmax loses the small differences PPO ratios are
made of. Pure tensor functions, no distributed code.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(label)`` under ``softmax(logits)``.

    logits: ``[..., V]``; labels: ``[...]`` long. Returns ``[...]`` fp32:
    ``logits[label] - logsumexp(logits)``.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32; float64 stays
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim.

    logits: ``[..., V]``. Returns ``[...]`` fp32:
    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32; float64 stays
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)



# The multiple of the unit roundoff in :func:`logprob_rounding_bound`; see its docstring for
# where 256 comes from.
LOGPROB_ROUNDING_MULTIPLE = 256


def logit_abs_scale(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``max_v sum_k |h_k| |W_vk| / T``: the magnitude the rounding of logit ``z = W h / T``
    scales with (the absolute-value product of textbook error analysis; it bounds
    ``max_v |z_v / T|`` from above).

    hidden: ``[..., H]`` final normed hidden states; weight: ``[V, H]`` the LM head.
    Returns ``[...]`` in the wider of the two dtypes. Computed 256 rows at a time, so the
    ``[rows, V]`` product stays small for a large vocabulary.
    """
    rows = hidden.abs().reshape(-1, hidden.shape[-1])                   # [N, H]
    w = weight.abs().T                                                   # [H, V]
    scale = torch.cat([(chunk @ w).amax(-1) for chunk in rows.split(256)]) if len(rows) \
        else rows.new_zeros(0)                                           # [N]
    return scale.reshape(hidden.shape[:-1]) / temperature               # [...]


def logprob_rounding_bound(logit_scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                           multiple: float = LOGPROB_ROUNDING_MULTIPLE) -> torch.Tensor:
    """How far a log-prob computed in ``dtype`` may sit from the exact one by rounding alone.

    ``logit_scale`` ``[...]``: :func:`logit_abs_scale` at each position. Returns ``[...]``:
    ``multiple * u * logit_scale``, ``u`` the unit roundoff of ``dtype`` (2^-24 for fp32,
    2^-8 for bf16).

    Why this form: ``log p_t = z_t/T - logsumexp(z/T)``, so logit errors ``d`` move it by
    ``d_t - sum_v p_v d_v``, at most ``2 max|d|``. A logit is a dot product of the final
    hidden state with an LM-head row; if the forward leaves the hidden state with relative
    errors ``rho`` per element, and the dot product rounds, the logit's error is at most
    ``(rho + K u) sum_k |h_k| |W_vk|`` (Higham, *Accuracy and Stability of Numerical
    Algorithms*, ch. 3). So the error in units of ``u * logit_abs_scale`` is the forward's
    relative accuracy, which depends on its arithmetic, not on the CPU: another host, TP
    size or batch composition changes the summation order (which errors occur), not their
    scale. ``max_v |z_v/T|`` is a worse unit: it shrinks where terms cancel, which deeper
    models do more (in its units SmolLM2's worst token was twice the 2-layer model's).

    Why 256: that ratio, measured per response token against a float64 forward of the same
    weights and tokens, for the rollout engine (TP 1 and 2) and the trainer's packed forward,
    is small and steady on random-init models and grows with RL training, with a heavy tail:

    * a 2-layer random Llama (init std 0.2, ~1,200 tokens, under three summation orders of
      one AMD Zen 4 host: MKL's default kernels; ``MKL_CBWR=COMPATIBLE``, which reproduced
      the 1.0e-5 engine-vs-trainer gap first seen on an Intel Xeon; 2 threads): RMS 2,
      worst 10; SmolLM2-135M (30 layers, ``|z/T|`` up to 85): RMS 0.9, worst 6;
    * the main job's 4-layer policy (4,475 tokens): RMS 1.4, worst 12 after its SFT warm
      start; RMS 2.4, worst 38 after 50 GRPO steps. Its relative error grows through the
      layers where a matmul's output is small next to its inputs (cancellation);
    * the gap between engine and trainer over the main job's 150 steps (~360,000 tokens):
      median of the per-step worst 29, worst 245.

    So 256 per computation, and twice that (512) between two of them, leaves 2x above the
    worst gap seen. A bug sits far outside it: a wrong temperature, position or weight
    version moves log-probs by 1e-2 or more (the bound is ~1e-4 at ``logit_abs_scale`` 7).
    """
    return multiple * (torch.finfo(dtype).eps / 2) * logit_scale
