"""The model runner: the one place that runs the engine's model (nano-vllm's split).

It owns the model's weights (sleep, wake-up, free), the slot KV cache and the per-row
sampling parameters, and runs the three kinds of forward the engine asks for:

* ``prefill(seqs)``: newly admitted sequences' contexts, written from position 0. A context
  shared by several sequences (the n samples of a request) is run once and its cache rows
  are copied to the others' slots; each sequence draws its own first token.
* ``extend(seqs)``: resumed multi-turn sequences append their new tokens (the turn's last
  sampled token and the observation) after their cached history.
* ``prefill_chunks(chunks)``: a chunked prefill's pieces of contexts, each written after the
  pieces before it; a sequence's first token is drawn after its last piece.
* ``decode(tokens, positions, seqs)``: one token for each row ``[0, len(tokens))``, eager
  over exactly those rows and the cache prefix they use (``decode="eager"``), or the static
  step of ``minihf.rollout.decode_step`` over a bucket of rows and cache length, run as is
  (``"static"``) or replayed as a CUDA graph (``"graph"``). With ``prepack`` on CPU, the
  decode step runs the large weights' packed copies, oneDNN's or MKL's by the CPU
  (``minihf.models.linear.PackedWeights``, which says at how many rows: SmolLM2's step
  ~1.7x faster at 16 rows on a Zen 2 EPYC, ~1.15x on an Intel Xeon),
  packed at the start of a ``generate`` whose weights changed since the last (each linear
  call decides by its rows and weight whether to use them: ``PackedWeights.get``).

Prefill, chunks and extend are one code path (:meth:`ModelRunner._forward_new`): contexts
right-padded in length buckets, written at ``start .. start + T - 1`` of their slots, only
the last real position of each going through the LM head. A prefill is the case ``start =
0``, where attention needs only the new keys (the cache's prefill mode never reads its
buffer). Each forward ends in :meth:`_sample`: tokens and log-probs drawn on the device,
then one device->host copy, the step's only host sync.

With ``record_routes`` (a mixture-of-experts model, rollout routing replay) every forward
also writes each token's expert ids per MoE layer beside its cached keys
(``SlotKVCache.enable_routes``), and :meth:`keep_routes` copies a sequence's out of its slot
when it leaves it; device ops only, no extra host sync.

The runner decides nothing: which sequences run, in which slots, is the scheduler's
(``minihf.rollout.scheduler``); the engine (``minihf.rollout.engine``) loops over the two.
"""

from __future__ import annotations

import contextlib
import time

import torch

from minihf.models.linear import PackedWeights, mkl_packed
from minihf.parallel.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead

from .decode_step import StaticDecode, bucket, default_capture_sizes, length_bucket
from .kv_cache import SlotKVCache
from .sampling import RowParams, sample
from .scheduler import Sequence

_LINEARS = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead)


def column_major_linears(model: torch.nn.Module, row_major=None) -> None:
    """Store every Linear weight [out, in] column-major (same shape, values and names).

    On CPU the decode step is a chain of matrix-vector products over weights that do not stay
    in cache; MKL streams a column-major weight (``x @ W_t`` with ``W_t`` [in, out]
    contiguous) about 2x faster than the row-major ``nn.Linear`` layout when the weight comes
    from DRAM (measured: 8192x256 fp32, cold, 1.13 ms -> 0.44 ms), which made the batch-1 step
    of the 5M benchmark model ~1.4x faster. ``F.linear`` accepts the transposed-view weight
    as is; loads into it (``copy_``) keep working. Not done on CUDA, where it does not help.
    Modules for which ``row_major(module)`` is true keep their weights as they are.
    """
    # a weight shared with an embedding (tied LM head) stays row-major: a batch of row lookups
    # into a column-major table is a strided gather (measured 0.34 ms per step at batch 64)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for module in model.modules():
            w = getattr(module, "weight", None)
            if (isinstance(module, _LINEARS) and w.dim() == 2 and w.is_contiguous() and id(w) not in embeddings
                    and not (row_major is not None and row_major(module))):
                w.data = w.data.t().contiguous().t()


def length_buckets(lens: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Group indices of prompts (by ascending length) so each group's right-padding adds at
    most ``max_waste`` of its real tokens. Measured on 64 prompts of 8..64 tokens (5M model,
    1 thread): one padded batch 424 ms, one forward per prompt 383 ms, buckets 250 ms."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and lens[i] * (len(g) + 1) <= (1 + max_waste) * (total + lens[i]):
            g.append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups


class ModelRunner:
    """Runs one model (possibly TP-sharded) over a slot KV cache on ``device``.

    ``max_num_seqs`` caps the cache's slots, ``kv_cache_memory`` (bytes) or
    ``gpu_memory_utilization`` (of free CUDA memory) its size. ``decode``: ``eager``,
    ``static`` or ``graph`` (see the module docstring), the static step's batch buckets
    ``capture_sizes`` (default: :func:`default_capture_sizes`); ``prepack``: the decode's
    packed weights on CPU; ``record_routes``: each token's experts kept (module docstring).
    """

    DECODE_MODES = ("eager", "static", "graph")

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str | None = None,
                 max_num_seqs: int = 256, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None, cpu_column_major: bool = True,
                 decode: str = "eager", capture_sizes: list[int] | None = None, prepack: bool = False,
                 record_routes: bool = False):
        self.model = model.eval()
        args = getattr(model, "args", None)
        if record_routes and not (args is not None and args.is_moe):
            raise ValueError("record_routes keeps a mixture-of-experts model's expert choices, but this "
                             "model is dense; leave it off (router_replay: disabled)")
        self.record_routes = record_routes
        param_device = next(model.parameters()).device
        if device is None and param_device.type == "meta":
            raise ValueError("the engine's model is on the meta device: pass device= (where "
                             "wake_up allocates the weights)")
        self.device = torch.device(device) if device is not None else param_device
        self.awake = param_device.type != "meta"
        if cpu_column_major and self.device.type == "cpu":
            # on meta too: wake_up keeps the strides. The weights the decode packs for MKL stay
            # row-major: a generate packs them as fast as it would copy them, where a column-
            # major weight is transposed first (SmolLM2 on an Intel Xeon: ~320 -> ~140 ms)
            head = getattr(model, "lm_head", None)
            column_major_linears(model, row_major=(lambda m: mkl_packed(m.weight, m is head)) if prepack else None)
        self.max_num_seqs = max_num_seqs
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        if decode not in self.DECODE_MODES:
            raise ValueError(f"decode={decode!r}; choose one of {self.DECODE_MODES}")
        if decode == "graph" and self.device.type != "cuda":
            raise ValueError(f"decode='graph' captures CUDA graphs, but the device is {self.device}")
        self.decode_mode = decode
        self.capture_sizes = sorted(set(capture_sizes or default_capture_sizes(max_num_seqs)))
        self.static: StaticDecode | None = None  # the static step's buffers and graphs, per cache
        # static buckets prepared (the engine resets them) and the last repack's seconds
        self.stats = {"captures": 0, "capture_s": 0.0, "pack_s": 0.0}
        self.cache: SlotKVCache | None = None
        self.packed = PackedWeights(model) if prepack and self.device.type == "cpu" else None
        self._rows_key: tuple | None = None
        self._rows: RowParams | None = None
        attn = model.model.layers[0].self_attn
        self._cache_geometry = (len(model.model.layers), attn.num_kv_heads, attn.head_dim)

    # -- weights ------------------------------------------------------------------------
    def _move_params(self, device: torch.device | str) -> None:
        """Give every parameter new storage on ``device`` (same shape, strides and dtype;
        uninitialised). Parameters are replaced, not ``.data``-swapped (torch refuses to
        swap meta for real storage); a shared (tied) parameter stays shared."""
        new: dict[int, torch.nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in new:
                    t = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
                    new[id(p)] = torch.nn.Parameter(t, requires_grad=False)
                module._parameters[name] = new[id(p)]

    def sleep(self) -> None:
        """Free the KV cache and the weights' storage; the module and its shapes stay."""
        self.reset()
        self._move_params("meta")
        self.awake = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Allocate the weights on the runner's device (uninitialised: load them next)."""
        if not self.awake:
            self._move_params(self.device)
            self.awake = True

    def free(self, weights: bool = True) -> None:
        """Drop the KV cache and (unless ``weights=False``) the reference to the model."""
        self.reset()
        if weights:
            self.model = self.packed = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset(self) -> None:
        """Drop the KV cache, the static step's buffers and graphs (they hold the cache's and
        the weights' addresses) and the cached per-row sampling parameters."""
        self.cache = None
        self.static = None
        self._rows = self._rows_key = None
        if self.packed is not None:
            self.packed.clear()

    # -- the KV cache -------------------------------------------------------------------
    def _slot_budget(self, max_len: int, dtype: torch.dtype) -> int | None:
        layers, kv, hd = self._cache_geometry
        per_slot = SlotKVCache.bytes_per_slot(layers, kv, max_len, hd, dtype)
        budget = self.kv_cache_memory
        if budget is None and self.gpu_memory_utilization is not None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # and the segments torch caches with nothing in them (not the gaps between live
            # blocks of a segment: a cache's tensors do not fit there)
            idle = torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.current", 0)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device) - idle
            budget = int(free * self.gpu_memory_utilization)
        if budget is None:
            return None
        slots = budget // per_slot
        if slots < 1:
            raise ValueError(
                f"KV cache budget {budget} bytes holds no sequence of {max_len} positions "
                f"({per_slot} bytes each); raise kv_cache_memory / gpu_memory_utilization or lower max_model_len"
            )
        return slots

    def ensure_cache(self, num_seqs: int, max_len: int) -> int:
        """A cache of at least ``min(max_num_seqs, num_seqs)`` slots (within the memory budget)
        of ``max_len`` positions, reused while big enough; returns its number of slots."""
        p = next(self.model.parameters())
        slots = min(self.max_num_seqs, num_seqs)
        cap = self._slot_budget(max_len, p.dtype)
        if cap is not None:
            slots = min(slots, cap)
        if self.cache is None or not self.cache.fits(slots, max_len, p.dtype, p.device):
            self.reset()  # release the old buffers (and graphs over them) before allocating new ones
            layers, kv, hd = self._cache_geometry
            self.cache = SlotKVCache(layers, slots, kv, max_len, hd, p.dtype, p.device)
            if self.record_routes:
                a = self.model.args
                moe_layers = sum(a.is_moe_layer(i) for i in range(a.num_hidden_layers))
                self.cache.enable_routes(moe_layers, a.num_experts_per_tok, a.num_experts)
            if self.decode_mode != "eager":
                self.static = StaticDecode(self.cache.num_slots, p.device, capture=self.decode_mode == "graph")
        self._rows_key = None  # ids of dead sequences may be reused by the next call's
        if self.packed is not None:  # weights may have been loaded since the last call
            t0 = time.perf_counter()
            self.packed.refresh()   # repacks only the weights written since they were packed
            self.stats["pack_s"] = time.perf_counter() - t0
        if self.static is not None:
            self.static.forget_rows()
            self.static.follow_weights(self.model, self.cache.max_len)
        return self.cache.num_slots

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's first ``length`` cached positions from slot ``src`` to ``dst``."""
        self.cache.move(src, dst, length)

    def keep_routes(self, left: list[tuple[Sequence, int]]) -> None:
        """Copy the routes of the sequences that left their slots (``(seq, slot)``) into
        ``seq.routes`` [cached positions, MoE layers, k] (on the device) before the slots are
        reused; a sequence that comes back (evicted, then readmitted) is copied again."""
        if self.cache is None or self.cache.routes is None:
            return
        for seq, slot in left:
            seq.routes = self.cache.routes_of(slot, seq.cached)

    # -- forwards -----------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """First tokens of newly admitted ``seqs`` (each context run once, see module docstring)."""
        ctx = [s.context for s in seqs]  # the prompt (or a returning evicted sequence's all)
        first: dict[tuple[int, ...], int] = {}
        uniq: list[int] = []  # index into seqs of each distinct context
        src: list[int] = []  # index into uniq of each seq's context
        for i, c in enumerate(ctx):
            if tuple(c) not in first:
                first[tuple(c)] = len(uniq)
                uniq.append(i)
            src.append(first[tuple(c)])
        owners = [seqs[i] for i in uniq]
        logits = self._forward_new(owners, [ctx[i] for i in uniq], [0] * len(uniq))  # [u, V]
        for s, c, u in zip(seqs, ctx, src):
            if s is not owners[u]:
                self.cache.move(owners[u].slot, s.slot, len(c))
        return self._sample(logits[torch.tensor(src, device=self.device)], seqs)

    def prefill_chunks(self, chunks: list[tuple[Sequence, int, int]]) -> tuple[list[int], list[float]]:
        """Write each chunk ``(seq, start, end)``, context positions ``[start, end)``, into its
        sequence's slot; the first tokens of the sequences whose context this completes."""
        seqs = [s for s, _, _ in chunks]
        logits = self._forward_new(seqs, [s.context[a:b] for s, a, b in chunks], [a for _, a, _ in chunks])
        last = [i for i, (s, _, b) in enumerate(chunks) if b == len(s.context)]
        if not last:
            return [], []
        return self._sample(logits[torch.tensor(last, device=self.device)], [seqs[i] for i in last])

    def extend(self, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """First tokens of the next turn of resumed ``seqs``, after their new tokens are written."""
        feeds = [s.tokens[-(s.pending + 1):] for s in seqs]
        logits = self._forward_new(seqs, feeds, [s.cached for s in seqs])  # [k, V]
        return self._sample(logits, seqs)

    def _forward_new(self, seqs: list[Sequence], feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Write ``feeds[i]`` into ``seqs[i]``'s slot from position ``starts[i]``; the LM head's
        logits [k, V] at each feed's last token. Feeds are right-padded in length buckets; a
        bucket whose padding would run past the cache goes one sequence at a time (padding
        writes land past a row's real tokens, where later tokens overwrite them unread)."""
        dev = self.device
        groups = []
        for group in length_buckets([len(f) for f in feeds]):
            T = max(len(feeds[i]) for i in group)
            if max(starts[i] for i in group) + T > self.cache.max_len:
                groups.extend([i] for i in group)
            else:
                groups.append(group)
        last_hidden: list[torch.Tensor | None] = [None] * len(seqs)
        for group in groups:
            lens = [len(feeds[i]) for i in group]
            T = max(lens)
            tokens = torch.tensor([feeds[i] + [0] * (T - len(feeds[i])) for i in group], dtype=torch.long, device=dev)
            slots = torch.tensor([seqs[i].slot for i in group], device=dev)
            top = max(starts[i] for i in group)
            if top == 0:  # prompts: attention needs only the new keys
                positions = torch.arange(T, device=dev).expand(len(group), T)
                self.cache.begin_prefill(slots, T)
            else:
                begin = torch.tensor([starts[i] for i in group], dtype=torch.long, device=dev)
                positions = begin[:, None] + torch.arange(T, device=dev)
                self.cache.begin_extend(slots, begin, T, top + T)
            hidden = self.model.forward_hidden(tokens, positions, kv_cache=self.cache,
                                               moe=self.cache.recorder)                # [g, T, H]
            last = hidden[torch.arange(len(group), device=dev), torch.tensor(lens, device=dev) - 1]
            for i, h in zip(group, last):
                last_hidden[i] = h
        return self.model.lm_head(torch.stack(last_hidden))

    def decode(self, tokens: list[int], positions: list[int], seqs: list[Sequence | None]
               ) -> tuple[list[int], list[float]]:
        """One decode step over rows ``[0, len(tokens))``: row b appends ``tokens[b]`` at
        ``positions[b]``; ``seqs[b]`` is None for a hole (its output is ignored)."""
        with self.packed if self.packed is not None else contextlib.nullcontext():
            if self.static is not None:
                return self._decode_static(tokens, positions, seqs)
            return self._decode_eager(tokens, positions, seqs)

    def _decode_eager(self, tokens: list[int], positions: list[int], seqs: list[Sequence | None]
                      ) -> tuple[list[int], list[float]]:
        dev = self.cache.k.device  # the model's; cheaper than walking parameters every step
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)[:, None]  # [B, 1]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)[:, None]
        self.cache.begin_decode(pos[:, 0], max(positions) + 1, same_length=min(positions) == max(positions))
        logits = self.model(tok, pos, kv_cache=self.cache, moe=self.cache.recorder)[:, -1]  # [B, V]
        return self._sample(logits, seqs)

    def _decode_static(self, tokens: list[int], positions: list[int], seqs: list[Sequence | None]
                       ) -> tuple[list[int], list[float]]:
        """:meth:`decode` through the static step: the rows padded to the next capture size
        (at most the cache's slots), the cache read up to the next length bucket."""
        n, slots = len(tokens), self.cache.num_slots
        rows = bucket(n, [s for s in self.capture_sizes if s < slots] + [slots])
        padded = seqs + [None] * (rows - n)
        self.static.set_rows([s.params[0] if s else None for s in padded], [s.params[1] if s else 0 for s in padded],
                             tuple(id(s) for s in padded))
        before = self.static.captures, self.static.capture_s
        out = self.static.run(rows, length_bucket(max(positions) + 1, self.cache.max_len), self.model, self.cache,
                              tokens, positions, [len(s.tokens) if s else 0 for s in seqs])
        self.stats["captures"] += self.static.captures - before[0]
        self.stats["capture_s"] += self.static.capture_s - before[1]
        both = out[:, :n].cpu()  # the one host sync per step
        return [int(t) for t in both[0].tolist()], both[1].tolist()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence | None]) -> tuple[list[int], list[float]]:
        # per-row parameters change only when the row composition does (admission, finish, move)
        composition = tuple(id(s) for s in seqs)
        if self._rows_key != composition:
            self._rows = RowParams.build([s.params[0] if s else None for s in seqs],
                                         [s.params[1] if s else 0 for s in seqs], logits.device)
            self._rows_key = composition
        steps = torch.tensor([len(s.tokens) if s else 0 for s in seqs], dtype=torch.int64, device=logits.device)
        tok, logp = sample(logits, self._rows, steps)
        both = torch.stack([tok.double(), logp.double()]).cpu()  # the one host sync per step
        return [int(t) for t in both[0].tolist()], both[1].tolist()
