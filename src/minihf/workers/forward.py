"""One micro-batch through a model, with outputs aligned to the response tokens.

Batch layout (verl's): ``input_ids`` ``[B, T]`` = left-padded prompt + right-padded
response of length ``R``; ``attention_mask``/``position_ids`` ``[B, T]``; ``responses``
``[B, R]``. The output at response index ``j`` comes from sequence position
``T - R - 1 + j`` (the token *before* response token ``j``), i.e. columns ``[-R-1:-1]``.

Two equivalent paths: padded (``attention_mask`` passed to the model) and padding-free
(:mod:`minihf.workers.packing`: one packed row with ``cu_seqlens``), selected by
``use_remove_padding``. Packed, ``share_prompt`` runs a prompt shared by several rows
once (see :mod:`minihf.workers.packing`), and ``sp`` (a
``minihf.parallel.ulysses.SeqParallel``) splits the packed row over a sequence-parallel
group: each rank runs its piece and the outputs come back whole on every rank. The model is
called through ``__call__`` (never a sub-module directly) so FSDP's hooks gather its
parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minihf.algorithms import entropy_from_logits, last_index, logit_abs_scale, logprobs_from_logits
from minihf.algorithms.chunked_logits import chunked_log_probs
from minihf.models.linear import linear
from minihf.models.moe import MoEStep
from minihf.models.temperature import over_temperature
from minihf.workers.packing import next_token_labels, pack, unpack


def _pack(mb: dict, share_prompt: bool):
    prompt_length = mb["input_ids"].shape[1] - mb["responses"].shape[1] if share_prompt else None
    return pack(mb["input_ids"], mb["attention_mask"], mb["position_ids"], prompt_length)


def _check_sp(sp, use_remove_padding: bool) -> None:
    if sp is not None and not use_remove_padding:
        raise ValueError("sequence parallelism (ulysses_sequence_parallel_size > 1) splits the "
                         "packed row: set model.use_remove_padding=true")


def _check_prompts(mb: dict) -> None:
    """Every row has a prompt token: a response's first token is scored from the prompt's last
    (without one, a padded forward reads a pad's output and a packed one fails deep in torch)."""
    prompt = mb["attention_mask"][:, :mb["input_ids"].shape[1] - mb["responses"].shape[1]]
    empty = (~prompt.bool().any(1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row(s) {empty[:8]} of the micro-batch have no prompt token (attention_mask "
                         f"0 over all {prompt.shape[1]} prompt columns): a response's first token is "
                         f"scored from the prompt's last; give every row a prompt of at least one token")


def _run(model: nn.Module, mb: dict, use_remove_padding: bool, share_prompt: bool = False, sp=None):
    """Model outputs in the padded ``[B, T, ...]`` layout, or, if packed, on the packed
    row ``[N, ...]`` with the packing."""
    _check_sp(sp, use_remove_padding)
    if use_remove_padding:
        packed = _pack(mb, share_prompt)
        if sp is None:
            out = model(packed.tokens, packed.positions, cu_seqlens=packed.cu_seqlens,
                        shared_prefix=packed.shared_prefix)                     # [1, N, ...]
            return out[0], packed
        tokens = sp.pad(packed.tokens)
        out = model(tokens, sp.pad(packed.positions), cu_seqlens=packed.cu_seqlens,
                    shared_prefix=packed.shared_prefix, sp=sp)                  # [1, N/s, ...]
        return sp.whole(out[0], tokens.shape[1])[:packed.tokens.shape[1]], packed
    out = model(mb["input_ids"], mb["position_ids"], attention_mask=mb["attention_mask"])
    return out, None


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits.float() / temperature``; at temperature 1 no division (the same values, one
    vocabulary-sized pass and its backward fewer)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32; float64 (tests) stays
    return over_temperature(logits, temperature)


def forward_log_probs(model: nn.Module, mb: dict, *, use_remove_padding: bool = True,
                      share_prompt: bool = False, temperature: float = 1.0,
                      calc_entropy: bool = False, entropy_grad: bool = True,
                      calc_logit_scale: bool = False, logits_chunk: int | None = None,
                      moe: MoEStep | None = None, routes: str | None = None, sp=None,
                      ids: torch.Tensor | None = None, top_k: int = 0) -> dict:
    """Log-probs (and entropy) of the response tokens under ``model`` (an LM).

    Returns ``{"log_probs": [B, R]}`` (+ ``"entropy": [B, R]``), fp32, computed from
    ``logits / temperature`` (the distribution the rollout sampled from); zero at
    response padding (``attention_mask == 0``). ``entropy_grad=False``: the entropy is a
    metric only, computed off the autograd graph. ``calc_logit_scale`` adds
    ``"logit_scale": [B, R]``, ``minihf.algorithms.logit_abs_scale`` at each response
    token (what its log-prob's rounding scales with; an extra LM-head-sized matmul).
    ``logits_chunk``: the LM head's logits made that many tokens at a time, forward and
    backward (``minihf.algorithms.chunked_logits``), never ``[tokens, V]`` whole.
    ``moe``: a ``minihf.models.moe.MoEStep`` for a mixture-of-experts model's layers to
    record into (the load-balancing loss). ``routes`` (routing replay, MoE models):
    ``"replay"`` routes every token by ``mb["routed_experts"]`` [B, T, L, k] (-1: its own
    router's choice) and adds ``router_disagree`` / ``router_replayed`` [B, L] (per row and
    MoE layer: tokens whose own top-k differs from the replayed, tokens replayed);
    ``"record"`` adds ``routed_experts`` [B, T, L, k], this forward's choices (-1 at padding).
    ``sp``: a ``minihf.parallel.ulysses.SeqParallel`` (packed only): each rank of the group
    runs its piece of the packed row, the LM head at the kept positions in it, and the
    results come back whole on every rank (see that module for the gradient).
    ``ids`` ``[B, R, k]`` (long): adds ``"log_probs_at"`` ``[B, R, k]``, the log-probs of
    those ids at each response position, from the same logits (with their gradient; what an
    auxiliary loss reads, e.g. a teacher's top-k). ``top_k``: adds ``"top_k_ids"`` and
    ``"top_k_log_probs"`` ``[B, R, top_k]``, the most likely ids there (no gradient).

    The LM head runs as ``CausalLM.forward``'s ``head``: inside the model's forward (where
    FSDP has gathered its weight), at the kept positions only.
    """
    _check_sp(sp, use_remove_padding)
    if sp is not None and (routes is not None or moe is not None):
        raise ValueError("sequence parallelism runs dense models only (no moe statistics or "
                         "routing replay)")
    _check_prompts(mb)
    r = mb["responses"].shape[1]
    valid = mb["attention_mask"][:, -r:]                                     # [B, R]
    real = valid.bool()
    labels = mb["responses"][real] if use_remove_padding else mb["responses"].reshape(-1)
    if ids is not None:  # [M, k] or [B * R, k], as the labels
        ids = ids[real] if use_remove_padding else ids.reshape(-1, ids.shape[-1])

    def head_for(labels, ids):  # the LM head's replacement, scoring ``labels`` at the kept positions
        def head(hidden, weight):                          # [1, M, H] or [B, R, H] -> {key: [M] or [B * R]}
            h = hidden.reshape(-1, hidden.shape[-1])
            if logits_chunk is not None:
                out = chunked_log_probs(h, weight, labels, temperature=temperature, chunk=logits_chunk,
                                        calc_entropy=calc_entropy, entropy_grad=entropy_grad, ids=ids,
                                        top_k=top_k)
            else:
                logits = scaled(linear(h, weight), temperature)                # [M, V]
                out = {"log_probs": logprobs_from_logits(logits, labels)}
                if ids is not None or top_k:
                    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                    if ids is not None:
                        out["log_probs_at"] = logits.gather(-1, ids) - lse
                    if top_k:
                        top = logits.detach().topk(top_k, dim=-1)
                        out["top_k_ids"], out["top_k_log_probs"] = top.indices, top.values - lse.detach()
                if calc_entropy:
                    out["entropy"] = entropy_from_logits(logits if entropy_grad else logits.detach())
            if calc_logit_scale:
                out["logit_scale"] = logit_abs_scale(h.detach().float(), weight.detach().float(), temperature)
            return out
        return head

    b, t = mb["input_ids"].shape
    packed = _pack(mb, share_prompt) if use_remove_padding else None
    # the padded position of each token the model runs over: packed, or every [B, T] position
    where_run = packed.indices if packed is not None else torch.arange(b * t, device=valid.device)
    if routes is not None:
        moe, chosen = _routing(moe, routes, mb, where_run)
    if moe is not None and moe.stats is not None:  # the aux loss over the batch's real tokens
        moe.stats.row_weight = (torch.bincount(packed.slot[packed.slot >= 0], minlength=packed.tokens.shape[1])
                                if packed is not None else mb["attention_mask"].reshape(-1))
    if packed is not None:
        # logits only at the positions that predict a real response token (the token before
        # it, which for the first one may be a shared prompt's): the LM head skips the rest
        sel = packed.slot.view(b, t)[:, t - r - 1:t - 1][real]               # [M]
        if sp is None:
            out = model(packed.tokens, packed.positions, cu_seqlens=packed.cu_seqlens,
                        shared_prefix=packed.shared_prefix, logits_to_keep=sel, head=head_for(labels, ids),
                        moe=moe)
        else:  # the kept positions in this rank's piece; the values made whole after
            tokens = sp.pad(packed.tokens)
            lo, hi = sp.bounds(tokens.shape[1])
            mine = (sel >= lo) & (sel < hi)
            out = model(tokens, sp.pad(packed.positions), cu_seqlens=packed.cu_seqlens,
                        shared_prefix=packed.shared_prefix, logits_to_keep=sel[mine] - lo,
                        head=head_for(labels[mine], None if ids is None else ids[mine]), sp=sp)
            out = {k: sp.scatter(v, mine) for k, v in out.items()}
        where = real.nonzero(as_tuple=True)
        result = {k: v.new_zeros((b, r) + v.shape[1:]).index_put_(where, v) for k, v in out.items()}
    else:
        out = model(mb["input_ids"], mb["position_ids"], attention_mask=mb["attention_mask"],
                    logits_to_keep=torch.arange(t - r - 1, t - 1, device=valid.device), head=head_for(labels, ids),
                    moe=moe)
        result = {k: v.view(valid.shape + v.shape[1:]) * valid.view(valid.shape + (1,) * (v.dim() - 1)).to(v.dtype)
                  for k, v in out.items()}
    if routes is not None:
        result.update(_routing_outputs(moe, chosen, mb, where_run, packed, model.args.num_experts))
    return result


def _routing(moe: MoEStep | None, routes: str, mb: dict, where_run: torch.Tensor
             ) -> tuple[MoEStep, dict[int, torch.Tensor] | None]:
    """``moe`` (or a new ``MoEStep``) set to replay ``mb``'s routes, or to record this
    forward's into the returned dict (MoE layer -> ids [N, k])."""
    moe = moe if moe is not None else MoEStep()
    chosen = None
    if routes == "replay":
        table = mb["routed_experts"]                                          # [B, T, L, k]
        moe.replay = table.reshape(-1, *table.shape[2:]).index_select(0, where_run)  # [N, L, k]
        moe.disagreement = {}
    elif routes == "record":
        chosen = {}
        moe.record = chosen.__setitem__
    else:
        raise ValueError(f"routes={routes!r}: use 'replay', 'record' or None")
    return moe, chosen


def _routing_outputs(moe: MoEStep, chosen: dict | None, mb: dict, where_run: torch.Tensor, packed,
                     num_experts: int) -> dict:
    """The per-row outputs of replaying (``chosen`` None) or recording (see
    :func:`forward_log_probs`)."""
    b, t = mb["input_ids"].shape
    if chosen is None:
        rows = where_run // t                                                 # [N] row of each token
        layers = sorted(moe.disagreement)
        out = {"router_disagree": torch.zeros(b, len(layers), device=rows.device),
               "router_replayed": torch.zeros(b, len(layers), device=rows.device)}
        for j in layers:
            differ, used = moe.disagreement[j]
            out["router_disagree"][:, j].index_add_(0, rows, differ.float())
            out["router_replayed"][:, j].index_add_(0, rows, used.float())
        return out
    chosen = torch.stack([chosen[j] for j in sorted(chosen)], 1)             # [N, L, k]
    dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32  # as the engine's
    if packed is not None:  # every padded position takes its packed token's (shared prompts too)
        slot = packed.slot                                                    # [B*T], -1 at padding
        table = chosen.index_select(0, slot.clamp(min=0)).to(dtype)
        table[slot < 0] = -1
    else:
        table = chosen.to(dtype)
        table[~mb["attention_mask"].reshape(-1).bool()] = -1
    return {"routed_experts": table.view(b, t, *chosen.shape[1:])}


def forward_values(model: nn.Module, mb: dict, *, use_remove_padding: bool = True,
                   share_prompt: bool = False, sp=None) -> torch.Tensor:
    """Critic values for the response tokens ``[B, R]`` (fp32): the value at the token
    before each response token, as in verl; zero at response padding. ``sp``: as in
    :func:`forward_log_probs`."""
    _check_prompts(mb)
    r = mb["responses"].shape[1]
    out, packed = _run(model, mb, use_remove_padding, share_prompt, sp)
    if packed is not None:
        out = unpack(out, packed)                                            # [B, T]
    return out[:, -r - 1:-1].float() * mb["attention_mask"][:, -r:]


def last_token_scores(model: nn.Module, mb: dict, *, use_remove_padding: bool = True,
                      share_prompt: bool = False) -> torch.Tensor:
    """A score model's output at the last real token of each row ``[B]`` (fp32; left- or
    right-padded rows), as transformers' ``*ForSequenceClassification`` pools.
    ``share_prompt`` needs ``responses`` in ``mb`` (the prompt is what precedes them)."""
    out, packed = _run(model, mb, use_remove_padding, share_prompt)
    if packed is not None:
        out = unpack(out, packed)                                            # [B, T]
    mask = mb["attention_mask"].bool()
    t = mask.shape[1]
    last = torch.where(mask, torch.arange(t, device=mask.device), -1).max(-1).values  # [B]
    return out.float().gather(1, last.clamp(min=0)[:, None]).squeeze(1)      # [B]


def forward_scores(model: nn.Module, mb: dict, *, use_remove_padding: bool = True,
                   share_prompt: bool = False) -> torch.Tensor:
    """Reward-model token-level scores ``[B, R]``: the score head's output at the last
    real token, placed at the last response token (zeros elsewhere and for rows with an
    empty response)."""
    score = last_token_scores(model, mb, use_remove_padding=use_remove_padding,
                              share_prompt=share_prompt)                       # [B]
    last = last_index(mb["response_mask"])                                    # [B]
    scores = torch.zeros(mb["responses"].shape, dtype=torch.float32, device=score.device)
    rows = (last >= 0).nonzero().squeeze(-1)
    scores[rows, last[rows]] = score[rows]
    return scores


def forward_token_log_probs(model: nn.Module, mb: dict, *, use_remove_padding: bool = True) -> torch.Tensor:
    """Next-token log-probs of a (right- or left-padded) batch, for SFT.

    Returns ``[B, T-1]`` fp32: entry ``t`` is ``log p(input_ids[t+1] | input_ids[:t+1])``,
    zero where ``input_ids[t+1]`` is padding.
    """
    out, packed = _run(model, mb, use_remove_padding)
    if packed is not None:
        log_probs = unpack(logprobs_from_logits(out, next_token_labels(packed)[0]), packed)
        log_probs = log_probs[:, :-1]                                          # [B, T-1]
    else:
        log_probs = logprobs_from_logits(out[:, :-1], mb["input_ids"][:, 1:])  # [B, T-1]
    return log_probs * mb["attention_mask"][:, 1:]
