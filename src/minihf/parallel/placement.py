"""Where every parameter lives: its TP slicing dim and its FSDP shard dim, in one table.

Pure functions of a parameter's HF name and shape (no torch). ``apply_tp`` slices by
:func:`tp_dim`, ``apply_fsdp``'s ``shard_placement_fn`` shards by :func:`fsdp_dim`, and the
reshard planner (``minihf.reshard``) reads both, so the three can never disagree.

* Column-parallel (q/k/v, gate/up, Mixtral's w1/w3; weight and bias): TP dim 0, FSDP dim 0.
* Row-parallel (o/down, Mixtral's w2): weight TP dim 1, FSDP dim 1 when dim 1 divides by the FSDP size
  (FSDP2 shards unevenly only on dim 0, so otherwise dim 0: such a weight is gathered whole
  and sliced when resharding); bias replicated.
* ``lm_head.weight``: vocab-parallel (TP dim 0) when the vocabulary divides by the TP size,
  else replicated; FSDP dim 0.
* LoRA adapters (``<module>.lora_A`` [r, in], ``<module>.lora_B`` [out, r]) follow the
  layer they adapt: a column-parallel layer's ``lora_B`` is split on dim 0 with its weight
  and its ``lora_A`` replicated; a row-parallel layer's ``lora_A`` is split on dim 1 (its
  input features) and its ``lora_B`` replicated, so each TP rank's partial sum includes its
  adapter term before the one all-reduce.
* A mixture-of-experts layer's experts are split as a dense MLP is, each expert over
  every TP rank (its projections carry the names above); the router (``gate``) is
  replicated, so every rank routes alike.
* Everything else (embedding, norms, routers, value/score heads): replicated under TP, FSDP dim 0.
  The embedding stays replicated because a vocab-parallel lookup would need an all-reduce
  per forward for a table the engine reads only B rows of.
"""

from __future__ import annotations

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW_PARALLEL = ("o_proj", "down_proj", "w2")
VOCAB_PARALLEL = ("lm_head",)


def _module_leaf(name: str) -> tuple[str, str]:
    parts = name.split(".")
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)


def tp_role(name: str) -> int | None:
    """The dim TP would slice ``name`` on if sizes allow (0 column/vocab, 1 row), else None."""
    module, leaf = _module_leaf(name)
    if module in COLUMN_PARALLEL:
        return None if leaf == "lora_A" else 0
    if module in ROW_PARALLEL:  # its bias is added once, after the sum; its lora_B is replicated
        return 1 if leaf in ("weight", "lora_A") else None
    if module in VOCAB_PARALLEL and leaf == "weight":
        return 0
    return None


def vocab_parallel(vocab_size: int, tp_size: int) -> bool:
    """Whether the LM head is split over the vocabulary at this TP size."""
    return vocab_size % tp_size == 0


def tp_dim(name: str, shape: tuple[int, ...], tp_size: int) -> int | None:
    """Dim along which TP of size ``tp_size`` slices parameter ``name``, None if replicated.

    >>> tp_dim("model.layers.0.mlp.down_proj.weight", (32, 64), 2), tp_dim("lm_head.weight", (65, 32), 2)
    (1, None)
    """
    dim = tp_role(name)
    if dim is None or tp_size == 1:
        return dim
    if _module_leaf(name)[0] in VOCAB_PARALLEL and not vocab_parallel(shape[0], tp_size):
        return None
    return dim


def fsdp_dim(name: str, shape: tuple[int, ...], fsdp_size: int) -> int:
    """Dim FSDP shards parameter ``name`` on over ``fsdp_size`` ranks: the TP dim where FSDP2
    can shard it (dim 1 only when it divides evenly), else 0."""
    if tp_role(name) == 1 and len(shape) == 2 and shape[1] % fsdp_size == 0:
        return 1
    return 0


def chunk_rows(size: int, world: int) -> int:
    """Rows per FSDP shard along the shard dim (FSDP2 chunks like ``torch.chunk``: the last
    ranks may hold fewer, or none)."""
    return -(-size // world)
