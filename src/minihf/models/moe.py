"""The mixture-of-experts feed-forward: a softmax top-k router and SwiGLU experts, grouped.

Names mirror the checkpoints transformers writes, so state-dict keys are the files' keys:
Qwen3-MoE ``mlp.gate`` (the router, ``[E, H]``) and ``mlp.experts.{e}.{gate,up,down}_proj``;
Mixtral ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3``
(up), ``w2`` (down). Each expert is its own module (transformers 5 keeps them as 3-D
parameters in memory, converted from these keys when loading): tensor parallelism,
FSDP's shard dims, the reshard plan and LoRA then treat an expert's projections as they
treat a dense MLP's, by name (``minihf.parallel.placement``).

Routing (both families): ``p = softmax(x W_gate^T)`` in fp32, the top ``k`` experts by
``p``, their weights ``p_topk`` (divided by their sum when ``norm_topk_prob``; Mixtral
always), cast to the activations' dtype (Qwen3-MoE; Mixtral keeps them fp32 and casts each
weighted expert output, as transformers does). The output is ``sum_k p_k expert_k(x)``.

The experts run grouped: the (token, choice) pairs are sorted by expert, each expert
multiplies its rows in one matmul chain, and the weighted results are added back per
token in expert order, one after the other (the order transformers adds them in, on every
device); the backward adds each token's k row gradients the same way, so a gradient is
reproducible on CUDA too (no atomics). The split sizes cost one
host sync per layer. While a CUDA graph is being captured (a host sync is illegal there)
every expert runs over every row instead, weighted by a dense ``[N, E]`` matrix that is
zero off the chosen experts: the same sum, ``E/k`` times the FLOPs, no data-dependent
shape (written for the engine's captured decode step; not run on a GPU yet).

With gradients on, every expert runs, on zero rows when none chose it: FSDP reduces the
gradients of the parameters that have one, and a rank whose micro-batch skipped an
expert would otherwise reduce a different set than its peers.

``MoEStep`` carries what one forward asks of the MoE layers beyond their output, and the
model passes it to every block:

* ``stats``: the load-balancing statistics (transformers' ``load_balancing_loss_func``,
  with its gradient entered at each layer's output: see ``RouterStats``);
* ``record``: called with each MoE layer's index (among the MoE layers) and its chosen
  expert ids ``[N, k]``, device tensors, no host sync (the engine writes them beside the
  KV cache; the trainer keeps them for routing replay);
* ``replay``: expert ids ``[N, L, k]`` to route by instead of the router's own top-k
  (rows with any id < 0 route live). The routing weights are still the live router's
  probabilities at those ids (renormalised when the model does), so the router keeps its
  gradient: rollout routing replay (R3, arXiv 2510.11370);
* ``disagreement``: while replaying, per MoE layer, which rows' own top-k set differs
  from the replayed one and which rows were replayed (``[N]`` bool device tensors).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

from .linear import Linear


class MixtralExpert(nn.Module):
    """Mixtral's expert: ``w2(silu(w1 x) * w3 x)`` (the SwiGLU MLP under other names)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = Linear(hidden, inner, bias=False)
        self.w2 = Linear(inner, hidden, bias=False)
        self.w3 = Linear(hidden, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RouterStats:
    """The load-balancing loss of one forward (transformers' ``load_balancing_loss_func``):

    ``aux = E * sum_e f_e P_e``, ``f_e = sum_l count_le / R`` (chosen-expert counts over all
    MoE layers ``l``, ``R`` = rows x layers), ``P_e = sum_l sum_rows p_le / R``.

    ``f`` carries no gradient, so ``d aux / d (sum_rows p_le) = E f_e / R``: known only
    once every layer has routed. Each layer's prob sums therefore enter the graph through
    :class:`_AuxGrad`, an identity on the layer's output whose backward (after the whole
    forward) adds ``weight * E f / R`` as their gradient. The gradient reaches the router
    inside the block's own backward, where FSDP has gathered its weight and activation
    checkpointing recomputes it. ``weight`` is d(total loss)/d(aux) as ``backward`` sees it
    (the coefficient, the micro-batch's share, FSDP's DP scaling); set it before backward.
    A recomputed forward (activation checkpointing) overwrites a layer's entry with equal
    values.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts: dict[int, torch.Tensor] = {}     # layer -> [E] chosen-expert counts (float)
        self.prob_sums: dict[int, torch.Tensor] = {}  # layer -> [E] sum over rows of p (detached)
        self.rows: dict[int, torch.Tensor | int] = {}
        self.weight = 0.0
        # [N] how many tokens of the batch each routed row stands for, as the layers see the
        # rows: 0 for padding, the number of responses sharing it for a shared prompt's
        # token; None: 1 each. The loss is then transformers' over the batch's real tokens
        # (its attention_mask branch), whatever the packing (minihf.workers.forward sets it).
        self.row_weight: torch.Tensor | None = None

    def add(self, layer: int, probs: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Record layer ``layer``'s routing (``probs`` [N, E] fp32, ``ids`` [N, k]); returns
        ``out`` through :class:`_AuxGrad` when it needs a gradient."""
        E, (N, k) = self.num_experts, ids.shape
        w = self.row_weight
        if w is not None and w.shape[0] != N:
            raise ValueError(f"RouterStats.row_weight has {w.shape[0]} rows, the layer routed {N}")
        w32 = None if w is None else w.to(torch.float32)
        each = (torch.ones(N * k, dtype=torch.float32, device=ids.device) if w32 is None
                else w32[:, None].expand(N, k).reshape(-1))
        self.counts[layer] = torch.zeros(E, dtype=torch.float32, device=ids.device).index_add_(0, ids.reshape(-1), each)
        self.rows[layer] = N if w32 is None else w32.sum()
        sums = (probs if w is None else probs * w.to(probs.dtype)[:, None]).sum(0)   # [E]
        self.prob_sums[layer] = sums.detach()
        if torch.is_grad_enabled() and sums.requires_grad:
            return _AuxGrad.apply(out, sums, self, layer)
        return out

    def _total_rows(self):
        total = sum(self.rows.values())
        return total.clamp(min=1) if isinstance(total, torch.Tensor) else max(total, 1)

    def fractions(self) -> torch.Tensor:
        """``f`` [E]: chosen-expert counts per routed row, summed over layers (sums to k)."""
        return torch.stack(list(self.counts.values())).sum(0) / self._total_rows()

    def loss(self) -> torch.Tensor:
        """The loss's value (detached, fp32 scalar); 0 when no MoE layer ran."""
        if not self.counts:
            return torch.zeros(())
        probs = torch.stack(list(self.prob_sums.values())).sum(0) / self._total_rows()
        return self.num_experts * (self.fractions() * probs).sum()

    def grad_of_sums(self) -> torch.Tensor:
        """``weight * E f / R`` [E]: the gradient of every layer's prob sums."""
        return self.weight * self.num_experts * self.fractions() / self._total_rows()


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, :meth:`RouterStats.grad_of_sums` for ``sums``."""

    @staticmethod
    def forward(ctx, out, sums, stats, layer):
        ctx.stats = stats
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.stats.grad_of_sums()
        return grad, g, None, None


class MoEStep:
    """What one forward asks of the MoE layers (module docstring)."""

    def __init__(self, stats: RouterStats | None = None, record=None, replay: torch.Tensor | None = None,
                 disagreement: bool = False):
        self.stats = stats
        self.record = record
        self.replay = replay
        self.disagreement: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if disagreement else None

    def route(self, moe: "SparseMoE", probs: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weights, ids) layer ``moe`` uses: its own, or the replayed ids with the live
        probabilities at them."""
        if self.replay is not None:
            forced = self.replay[:, moe.moe_index].long()                      # [N, k]
            use = (forced >= 0).all(-1, keepdim=True)                          # [N, 1]
            chosen = torch.where(use, forced, ids)
            if self.disagreement is not None:
                differ = (chosen.sort(-1).values != ids.sort(-1).values).any(-1) & use[:, 0]
                self.disagreement[moe.moe_index] = (differ, use[:, 0])
            ids = chosen
            w = probs.gather(-1, ids)
            if moe.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            weights = w.to(weights.dtype)
        if self.record is not None:
            self.record(moe.moe_index, ids)
        return weights, ids


def _sum_slots(y: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[N*k, H]`` terms, term i of token ``token[i]`` at rank ``slot[i]`` (0..k-1) -> their
    sum per token ``[N, H]``, added one by one in rank order (no atomics, any device)."""
    terms = y.new_zeros(n, k, y.shape[-1]).index_put_((token, slot), y)  # [N, k, H]
    out = terms[:, 0]
    for j in range(1, k):
        out = out + terms[:, j]
    return out


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, token)`` whose backward adds each token's k row gradients in
    ``slot`` order (:func:`_sum_slots`), as the forward adds its outputs. index_select's own
    backward is an ``index_add_`` over repeated indices: on CUDA atomics, in any order, so a
    token's gradient was not reproducible for k >= 3. On CPU both add in the same order
    (``token`` runs in expert order): the same bits."""

    @staticmethod
    def forward(ctx, x, token, slot, k):
        ctx.save_for_backward(token, slot)
        ctx.n, ctx.k = x.shape[0], k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        token, slot = ctx.saved_tensors
        return _sum_slots(grad, token, slot, ctx.n, ctx.k), None, None, None


_DENSE = threading.local()  # set by dense_experts()


@contextlib.contextmanager
def dense_experts():
    """Run the dense experts' path inside, as a CUDA graph's capture does: the uncaptured
    first use of a decode bucket (``minihf.rollout.decode_step``) computes what its replays
    will, to the bit."""
    was = getattr(_DENSE, "on", False)
    _DENSE.on = True
    try:
        yield
    finally:
        _DENSE.on = was


def _capturing() -> bool:
    return getattr(_DENSE, "on", False) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class SparseMoE(nn.Module):
    """Router ``gate`` + ``experts`` (see the module docstring)."""

    def __init__(self, args, layer_idx: int, expert_names: str = "qwen"):
        super().__init__()
        from .layers import MLP  # layers imports this module

        self.layer_idx = layer_idx
        self.moe_index = sum(args.is_moe_layer(i) for i in range(layer_idx))  # among the MoE layers
        self.num_experts = E = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        H, inner = args.hidden_size, args.moe_intermediate_size
        self.gate = Linear(H, E, bias=False)
        # the routing weights' dtype, as transformers: Mixtral's stay fp32 (each expert's
        # output times its weight in fp32, then cast), Qwen3-MoE's are cast first
        self.fp32_weights = expert_names == "mixtral"
        if expert_names == "mixtral":
            self.experts = nn.ModuleList(MixtralExpert(H, inner) for _ in range(E))
        else:
            self.experts = nn.ModuleList(MLP(args, inner) for _ in range(E))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [N, H] -> (probs [N, E] fp32 (float64 stays), weights [N, k] in x's dtype
        (Mixtral: fp32), ids [N, k])."""
        logits = self.gate(x)                                                 # [N, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        weights, ids = torch.topk(probs, self.top_k, dim=-1)                  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights if self.fp32_weights else weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, moe: MoEStep | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                          # [N, H]
        probs, weights, ids = self.route(x)
        if moe is not None:
            weights, ids = moe.route(self, probs, weights, ids)
        if _capturing():
            out = self.dense(x, weights, ids)
        else:
            out = self.grouped(x, weights, ids)
        if moe is not None and moe.stats is not None:
            out = moe.stats.add(self.layer_idx, probs, ids, out)
        return out.view(shape)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert, one matmul chain per expert (module docstring)."""
        N, k = ids.shape
        flat = ids.reshape(-1)                                                # [N*k]
        order = torch.argsort(flat, stable=True)                              # by expert, then token
        token = order // k                                                    # [N*k]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()    # the host sync
        slot = ids.argsort(-1).argsort(-1).reshape(-1).index_select(0, order)  # rank by expert id
        rows = _GatherRows.apply(x, token, slot, k)                           # [N*k, H]
        outs, start = [], 0
        skip_empty = not torch.is_grad_enabled()
        for expert, count in zip(self.experts, counts):
            if count or not skip_empty:
                outs.append(expert(rows[start:start + count]))
            start += count
        y = (torch.cat(outs) * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)  # [N*k, H]
        # each token's k terms in expert order, added one by one: the order transformers
        # adds them in. (One index_add_ of every term adds a token's k in any order on
        # CUDA, where it uses atomics: not reproducible for k >= 3.)
        return _sum_slots(y, token, slot, N, k)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every row, weighted by the ``[N, E]`` matrix of ``weights`` at
        ``ids`` (zero elsewhere): no data-dependent shape, for CUDA-graph capture."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)                                       # [N, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (expert(x) * dense[:, e:e + 1]).to(x.dtype)
        return out
