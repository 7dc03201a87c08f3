"""The Llama-family decoder and its three heads (LM, value, score).

One forward serves training and generation:
``forward(tokens, positions, kv_cache=None, cu_seqlens=None, attention_mask=None,
shared_prefix=None, moe=None)``; ``shared_prefix`` [S] (packed input only) says which packed
sequence each one continues (-1: none), so a prompt shared by several responses is packed
once; ``moe`` (``minihf.models.moe.MoEStep``) what a mixture-of-experts model's layers
record in this forward (the load-balancing loss's statistics); ``sp``
(``minihf.parallel.ulysses.SeqParallel``, packed input only) runs this rank's piece of the
packed row (the row's length a multiple of the group's size), attention over all of it, and
returns that piece's outputs.
The model never touches torch.distributed; tensor parallelism and FSDP are applied after
construction by ``minihf.parallel``. Build order (CONTRIBUTING.md, rule 2): construct on the meta
device (``build_model(args, device="meta")``), parallelize, then ``materialize`` and load
(``hf_io.load_hf``) or ``init_weights``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .args import ModelArgs
from .layers import Block, RMSNorm
from .linear import Linear
from .masks import build_attn_meta
from .moe import SparseMoE
from .rope import RopeTable

HEADS = ("lm", "value", "score")


class DecoderModel(nn.Module):
    """Embedding -> blocks -> final norm (HF's ``model.`` prefix)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rope = RopeTable(args)  # not a module or buffer: invisible to state dicts / FSDP

    def forward(self, tokens, positions=None, kv_cache=None, cu_seqlens=None,
                attention_mask=None, shared_prefix=None, moe=None, sp=None) -> torch.Tensor:
        if positions is None:
            if kv_cache is not None:
                raise ValueError("positions are required with a kv_cache (they say where "
                                 "each new token goes in the cache)")
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if kv_cache is not None and (cu_seqlens is not None or attention_mask is not None):
            raise ValueError("with a kv_cache the cache decides the mask: pass positions only "
                             "(not cu_seqlens or attention_mask)")
        full = tokens
        if sp is not None:  # Ulysses: this rank's tokens; attention gathers the rest
            if cu_seqlens is None or moe is not None:
                raise ValueError("sequence parallelism runs packed input (cu_seqlens) of a dense "
                                 "model only")
            lo, hi = sp.bounds(tokens.shape[1])
            tokens, positions = tokens[:, lo:hi], positions[:, lo:hi]
        h = self.embed_tokens(tokens)
        meta = None if kv_cache is not None else build_attn_meta(
            full, attention_mask, cu_seqlens, h.dtype, shared_prefix)
        if sp is not None:
            meta.sp = sp
        # a cache's positions are below its length: the table covers it without reading them
        cos, sin = self.rope(positions, h.dtype, getattr(kv_cache, "max_len", None))
        for layer in self.layers:
            h = layer(h, cos, sin, positions, meta, kv_cache, moe)
        return self.norm(h)


class _Base(nn.Module):
    head = "lm"

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)

    def forward_hidden(self, tokens, positions=None, kv_cache=None, cu_seqlens=None,
                       attention_mask=None, shared_prefix=None, moe=None, sp=None) -> torch.Tensor:
        """Final normed hidden states [B, T, H] (with ``sp``, this rank's piece of T)."""
        return self.model(tokens, positions, kv_cache, cu_seqlens, attention_mask, shared_prefix, moe, sp)

    def tie_weights(self) -> None:
        """Re-establish weight sharing (``to_empty`` breaks it); no-op when untied."""


class CausalLM(_Base):
    head = "lm"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens, positions=None, kv_cache=None, cu_seqlens=None,
                attention_mask=None, shared_prefix=None, logits_to_keep=None, head=None, moe=None,
                sp=None):
        """Logits [B, T, V] in the parameter dtype; with ``logits_to_keep`` (long [K], positions
        along T, repeats allowed; transformers' argument) only those, [B, K, V]: the LM head
        is the largest matmul of a real vocabulary, and a trainer needs it at response
        positions only. ``head(hidden, lm_head_weight)``, when given, replaces the LM head's
        matmul and its result is returned (``minihf.algorithms.chunked_logits``: log-probs
        without whole logits); it runs inside this forward, where FSDP has gathered the
        weight. With ``sp``, ``logits_to_keep`` indexes this rank's piece."""
        h = self.forward_hidden(tokens, positions, kv_cache, cu_seqlens, attention_mask,
                                shared_prefix, moe, sp)
        if logits_to_keep is not None:
            h = h.index_select(1, logits_to_keep)
        return self.lm_head(h) if head is None else head(h, self.lm_head.weight)


class ValueModel(_Base):
    """Critic: one value per token (head ``value_head``)."""
    head = "value"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.value_head = Linear(args.hidden_size, 1)

    def forward(self, tokens, positions=None, kv_cache=None, cu_seqlens=None,
                attention_mask=None, shared_prefix=None, moe=None, sp=None) -> torch.Tensor:
        """Values [B, T]."""
        h = self.forward_hidden(tokens, positions, kv_cache, cu_seqlens, attention_mask,
                                shared_prefix, moe, sp)
        # not a view: FSDP2 hooks a root module's output for its backward, and an in-place
        # edit of a view would skip that hook (it warns about every view it returns)
        return self.value_head(h).squeeze(-1).clone()


class ScoreModel(_Base):
    """Reward model: a score per token (HF's ``score``, no bias); the reward worker reads
    the score at the last response token."""
    head = "score"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.score = Linear(args.hidden_size, 1, bias=False)

    def forward(self, tokens, positions=None, kv_cache=None, cu_seqlens=None,
                attention_mask=None, shared_prefix=None, moe=None, sp=None) -> torch.Tensor:
        """Scores [B, T]."""
        h = self.forward_hidden(tokens, positions, kv_cache, cu_seqlens, attention_mask,
                                shared_prefix, moe, sp)
        return self.score(h).squeeze(-1).clone()  # not a view (see ValueModel.forward)


_CLASSES = {"lm": CausalLM, "value": ValueModel, "score": ScoreModel}


def build_model(args: ModelArgs, head: str = "lm", device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """Construct the model for ``head`` (lm|value|score). ``device="meta"`` allocates
    nothing; call ``materialize`` and then load or ``init_weights``."""
    if head not in _CLASSES:
        raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")
    with torch.device(device or "cpu"):
        model = _CLASSES[head](args)
    if dtype is not None:
        model.to(dtype)
    return model


def compile_blocks(model: nn.Module) -> nn.Module:
    """``torch.compile`` (dynamic shapes: one graph for every token count) each block's two
    norms and its MLP, in place (names and state-dict keys unchanged): the trainer's
    ``use_torch_compile``. Their elementwise ops fuse into the matmuls' neighbours, forward
    and backward. Attention stays eager: the packed attention's buckets are Python ints, so
    a compiled region would be compiled again for each new set of lengths. So does a MoE
    layer's routing (its split sizes are Python ints): there each expert is compiled alone.
    Measured on CPU (2 cores, SmolLM2, docs/training.md), and the first forward of each
    process compiles."""
    for block in model.model.layers:
        ffn = block.ffn
        parts = list(ffn.experts) if isinstance(ffn, SparseMoE) else [ffn]
        for part in (block.input_layernorm, block.post_attention_layernorm, *parts):
            part.compile(dynamic=True)
    return model


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate (uninitialised) storage for a meta-device model on ``device`` and restore
    tied weights. Follow with a state-dict load or ``init_weights``."""
    model.to_empty(device=device)
    model.tie_weights()
    return model


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random init as transformers does: Linear/Embedding weights ~ N(0, initializer_range),
    biases 0, norm weights 1. Drawn on CPU from ``seed`` so every device gets the same
    numbers."""
    std = model.args.initializer_range
    gen = torch.Generator().manual_seed(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():  # named_parameters dedups tied weights
        if id(p) in norms:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    return model
