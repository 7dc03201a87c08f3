"""A float64 reference for log-prob tests: how far each fp32 computation sits from exact.

Two fp32 computations of one log-prob (the rollout engine's decode, the trainer's packed
forward, another TP size or CPU) round differently, so their gap is not a constant to
assert. Each is compared instead with a float64 forward of the same weights and tokens,
within ``minihf.algorithms.logprob_rounding_bound`` (a multiple of fp32's unit roundoff
times the logits' magnitude at that position, ``logit_abs_scale``, derived in its docstring); the pairwise gap
then follows, within twice the bound.
"""

import copy

import torch

from minihf.algorithms import logit_abs_scale, logprob_rounding_bound


def float64_log_probs(model: torch.nn.Module, mb: dict, temperature: float):
    """``(log_probs, logit_scale)``, both ``[B, R]`` float64: the log-probs of
    ``mb["responses"]`` under a float64 copy of ``model`` (an LM; the padded forward, no
    packing), and ``logit_abs_scale`` at each response position."""
    ref = copy.deepcopy(model).double().eval()
    ids, r = mb["input_ids"], mb["responses"].shape[1]
    t = ids.shape[1]
    with torch.no_grad():
        h = ref.forward_hidden(ids, mb["position_ids"], attention_mask=mb["attention_mask"])
        h = h[:, t - r - 1:t - 1]                                             # [B, R, H]
        z = ref.lm_head(h) / temperature                                      # [B, R, V]
        scale = logit_abs_scale(h, ref.lm_head.weight, temperature)          # [B, R]
    log_probs = torch.log_softmax(z, -1).gather(-1, mb["responses"][..., None])[..., 0]
    return log_probs, scale


def rounding_ratio(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor,
                   mask: torch.Tensor, pairwise: bool = False,
                   dtype: torch.dtype = torch.float32) -> float:
    """The worst ``|got - ref|`` over ``mask``, in units of the rounding bound of ``dtype``
    (twice it when ``pairwise``: ``got`` and ``ref`` are then two computations in ``dtype``).
    <= 1 passes."""
    bound = logprob_rounding_bound(scale, dtype) * (2 if pairwise else 1)
    return ((got.double() - ref.double()).abs() / bound)[mask.bool()].max().item()
