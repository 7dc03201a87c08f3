"""Log-probs and entropy of chosen tokens from the LM head, never holding all logits.

A response of ``M`` tokens has ``[M, V]`` logits: at 4k tokens and Qwen's 152k vocabulary
that is 2.5 GB in fp32, plus as much again for the softmax the backward keeps. Here the
final hidden states ``[M, H]`` go through the LM head ``chunk`` rows at a time: each chunk's
logits are made, reduced to a log-prob (and an entropy) per row, and dropped. The backward
makes each chunk's logits again from the saved hidden states and the per-row log-sum-exp
(one more LM-head matmul per chunk, the price of the memory) and sends their gradient on
to the hidden states and the head's weight.

Same arithmetic as the whole-logits path (``minihf.workers.forward``): logits are the LM
head's matmul in the parameter dtype (``minihf.models.linear.linear``), then fp32, then
``/ temperature``; so the log-probs agree with it to rounding (the matmul's blocking may
differ with the number of rows), tested against it and against float64.

Gradients, with ``p = softmax(z)`` and ``log p = z - lse`` per row:

* ``d log p[y] / dz = onehot(y) - p`` (for several ids per row, ``y_1..y_k`` with gradients
  ``g_1..g_k``: ``sum_j g_j onehot(y_j) - p sum_j g_j``);
* ``d H / dz = -p * (log p + H)`` (``H = lse - sum p z``);

then ``dz/dlogits = 1 / temperature``, ``d hidden = g @ W`` and ``d W = g^T @ hidden``,
accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch

from minihf.models.linear import linear
from minihf.models.temperature import over_temperature


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk's logits in fp32 (float64 for float64 inputs: the reference), over the temperature."""
    z = linear(hidden, weight)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return over_temperature(z, temperature)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk, with_entropy):
        """``labels`` ``[M, 1 + k]``: the label and ``k`` more ids per row; their log-probs as
        ``[M]`` and ``[M, k]`` (two outputs: no view of one is returned)."""
        m = hidden.shape[0]
        lse = torch.empty(m, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        log_probs = lse.new_empty(labels.shape)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_zeros(0)
        for s in range(0, m, chunk):
            # two [c, V] buffers at a time, z and e (logsumexp then softmax held three: at
            # chunks of 1024 and a 49k vocabulary 192 MB each, the peak of an SP rank's update)
            z = _logits(hidden[s:s + chunk], weight, temperature)          # [c, V] fp32
            top = z.amax(-1, keepdim=True)                                 # [c, 1]
            e = torch.sub(z, top).exp_()                                   # exp(z - max)
            total = e.sum(-1)
            row_lse = top[:, 0] + total.log()
            lse[s:s + chunk] = row_lse
            log_probs[s:s + chunk] = z.gather(-1, labels[s:s + chunk]) - row_lse[:, None]
            if with_entropy:  # H = lse - sum(softmax * z), softmax = e / total
                entropy[s:s + chunk] = row_lse - e.mul_(z).sum(-1) / total
            del z, e
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.set_materialize_grads(False)
        return log_probs[:, 0].clone(), log_probs[:, 1:].clone(), entropy

    @staticmethod
    def backward(ctx, grad_label, grad_at, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        grad_log_probs = None  # [M, 1 + k]: the label's and the ids' gradients together
        if grad_label is not None or (grad_at is not None and grad_at.numel()):
            grad_log_probs = lse.new_zeros(labels.shape)
            if grad_label is not None:
                grad_log_probs[:, 0] = grad_label
            if grad_at is not None and grad_at.numel():
                grad_log_probs[:, 1:] = grad_at
        t, chunk = ctx.temperature, ctx.chunk
        if not ctx.with_entropy:
            grad_entropy = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            # in place from here on: one [c, V] buffer at a time, two with the entropy's gradient
            # (the backward of the LM head runs while the whole body's activations are still
            # held, so they add to its peak)
            log_p = _logits(h, weight, t).sub_(lse[s:s + chunk, None])     # [c, V] fp32
            p = log_p.exp() if grad_entropy is not None else log_p.exp_()  # log_p only for d H
            d_entropy = None  # d entropy / d z, times its gradient, in log_p's buffer
            if grad_entropy is not None:
                d_entropy = log_p.add_(entropy[s:s + chunk, None]).mul_(p).mul_(grad_entropy[s:s + chunk, None])
            if grad_log_probs is not None:  # d log_p[label] / d z = onehot - p, summed over the ids
                gl = grad_log_probs[s:s + chunk]                               # [c, j]
                g = p.mul_(gl.sum(-1, keepdim=True)).neg_()
                g.scatter_add_(-1, labels[s:s + chunk], gl)
                if d_entropy is not None:
                    g.sub_(d_entropy)
            else:
                g = d_entropy.neg_() if d_entropy is not None else p.zero_()
            if t != 1.0:
                g /= t
            g = g.to(weight.dtype)
            if need_h:
                grad_hidden[s:s + chunk] = (g @ weight).to(hidden.dtype)
            if need_w:  # in place where the dtypes allow: no [V, H] temporary
                if g.dtype == h.dtype == grad_weight.dtype:
                    grad_weight.addmm_(g.T, h)
                else:
                    grad_weight += (g.T @ h).to(lse.dtype)
            del log_p, p, g, d_entropy  # before the next chunk's logits are made
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None)


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                      temperature: float = 1.0, chunk: int = 1024, calc_entropy: bool = False,
                      entropy_grad: bool = True, ids: torch.Tensor | None = None,
                      top_k: int = 0) -> dict[str, torch.Tensor]:
    """``{"log_probs": [...]}`` (+ ``"entropy"``) of ``labels`` under ``softmax(hidden @
    weight.T / temperature)``, ``chunk`` rows of logits at a time (forward and backward).

    hidden: ``[..., H]`` final normed hidden states; weight: ``[V, H]`` the LM head;
    labels: ``[...]`` long. Results fp32 (float64 for float64 inputs), shaped like ``labels``. ``entropy_grad=False``:
    the entropy is a metric, off the graph. ``ids`` ``[..., k]`` (long): also
    ``"log_probs_at"`` ``[..., k]``, the log-probs of those ids, from the same chunks and with
    their gradient. ``top_k``: also ``"top_k_ids"`` / ``"top_k_log_probs"`` ``[..., top_k]``, the
    most likely ids of each row and their log-probs (no gradient: a frozen model's answer).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: the rows of logits made at a time must be >= 1")
    shape = labels.shape
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1, 1)
    k = 0 if ids is None else ids.shape[-1]
    if k:
        flat_y = torch.cat([flat_y, ids.reshape(-1, k)], 1)
    log_probs, at, entropy = _ChunkedHead.apply(flat_h, weight, flat_y, float(temperature), int(chunk),
                                                calc_entropy)
    def shaped(x, tail=()):  # no view where none is needed: FSDP warns of a module returning one
        return x if x.shape == shape + tail else x.reshape(shape + tail)
    out = {"log_probs": shaped(log_probs)}
    if k:
        out["log_probs_at"] = shaped(at, (k,))
    if calc_entropy:
        out["entropy"] = shaped(entropy if entropy_grad else entropy.detach())
    if top_k:
        top_ids, top_lp = chunked_top_k(flat_h.detach(), weight.detach(), top_k, temperature=temperature,
                                        chunk=chunk)
        out["top_k_ids"], out["top_k_log_probs"] = shaped(top_ids, (top_k,)), shaped(top_lp, (top_k,))
    return out


@torch.no_grad()
def chunked_top_k(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, temperature: float = 1.0,
                  chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely ids of each row of ``hidden`` ``[M, H]`` and their log-probs
    ``[M, k]`` (most likely first), ``chunk`` rows of logits at a time; no gradient."""
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"top_k={k}: use 1 to the vocabulary size {weight.shape[0]}")
    ids = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    log_probs = torch.empty(hidden.shape[0], k, dtype=torch.promote_types(hidden.dtype, torch.float32),
                            device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        z = _logits(hidden[s:s + chunk], weight, temperature)
        top = z.topk(k, dim=-1)
        ids[s:s + chunk] = top.indices
        log_probs[s:s + chunk] = top.values - torch.logsumexp(z, dim=-1, keepdim=True)
    return ids, log_probs
