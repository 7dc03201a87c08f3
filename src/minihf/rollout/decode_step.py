"""The static decode step: fixed shapes per bucket, inputs written in place, replayable.

The eager decode (``ModelRunner.decode`` with ``static=None``) runs over exactly the rows
and the cache prefix at hand, so its shapes change every step: nothing can be captured.
This step runs over a **bucket**: the batch padded up to the next capture size
(``rollout.cudagraph_capture_sizes``, vLLM's name) and the cache read up to the next power
of two (at least 256 positions, at most the cache's length). Per bucket it is one
function of device buffers only:

* inputs: ``tokens``, ``positions``, ``steps`` (the sampler's counters) and the rows'
  sampling parameters are device tensors, written in place before each step (one
  host->device copy for the three per-step vectors, one per composition change for the
  parameters);
* the cache mask (``key position <= row position``) and the write offsets are built on
  the device from ``positions``;
* sampling runs on the device (counter-based: no generator state), into an output buffer
  the host reads once per step, as the eager path does.

Padding rows are cache slots past the last occupied one (free: the scheduler keeps the
running sequences in a dense prefix), so they sample greedily from token 0 at position 0,
which the slot's next prefill overwrites; their outputs are dropped. Cache positions past a
row's own are masked (stale entries included), so the bucket's extra length changes no
value.

What runs the function per bucket is the only device-specific part: on CUDA it is captured
as a CUDA graph (a shared memory pool; no Python, no kernel launches but the graph's) unless
``rollout.enforce_eager``. A bucket's first use runs the function as is, on the path a
capture takes (MoE's dense experts), which is also the capture's warm-up (kernels chosen,
lazy allocations made on the device); its second use captures it, then replays it, as every
later use does. So a bucket used once (the tail of a batch whose rows finish at different
lengths) is never captured, no step is computed twice (a warm-up apart from the step's own
run would be), and the first use computes what the replays do. Elsewhere the function is
always called as is, which is how the CPU tests cover the same logic (and check that no op
of it reads a device value on the host, which would fail the capture). Captured graphs hold
the addresses of the weights, the KV cache and these
buffers: :meth:`StaticDecode.clear` drops them whenever one of those is reallocated
(sleep, wake-up, a new cache, a parameter replaced instead of written in place: each
generate compares the weights' addresses with those captured), and the next use
recaptures (at its second use again), timed in ``capture_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .sampling import RowParams, SamplingParams, sample


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself: at most twice the
    rows of a step are computed, with few graphs to capture (vLLM captures 1, 2, 4 and every
    multiple of 8, cheaper per step but ~70 graphs)."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


def bucket(value: int, sizes: list[int]) -> int:
    """The smallest of ``sizes`` (ascending) that is >= ``value``."""
    for s in sizes:
        if s >= value:
            return s
    raise ValueError(f"{value} rows exceed the largest capture size {sizes[-1]}")


def length_bucket(kv_len: int, max_len: int, floor: int = 256) -> int:
    """The cache prefix a decode step reads: the next power of two >= ``kv_len`` (at least
    ``floor``), capped at the cache's ``max_len``: log2(max_len / floor) + 1 lengths at most."""
    return min(max_len, max(floor, 1 << (kv_len - 1).bit_length()))


def _as_captured(body: Callable[[], None]) -> Callable[[], None]:
    """``body`` run uncaptured on the path a capture takes (MoE's dense experts), so that a
    bucket's first use computes what its replays will."""
    from minihf.models.moe import dense_experts

    def run() -> None:
        with dense_experts():
            body()
    return run


class StaticDecode:
    """Device buffers for up to ``max_rows`` rows and, per ``(rows, length, sampler mode)``
    bucket, a step that reads them: a CUDA graph (``capture=True``) or the function itself."""

    def __init__(self, max_rows: int, device: torch.device, capture: bool):
        self.max_rows, self.device, self.capture = max_rows, device, capture
        self.inputs = torch.zeros(3, max_rows, dtype=torch.long, device=device)  # tokens, positions, steps
        self.out = torch.zeros(2, max_rows, dtype=torch.float64, device=device)  # tokens, log-probs
        self.temperature = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_k = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.keys = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.steps: dict[tuple, Callable[[], None]] = {}
        self._first: dict[tuple, Callable[[], None]] = {}  # capture: buckets used once, uncaptured
        self.captures = 0       # buckets captured (or prepared, uncaptured) since this object was made
        self.capture_s = 0.0    # seconds spent capturing them
        self._pool = None
        self._composition: tuple | None = None
        self._flags = (True, False)
        self._weights: list[int] | None = None  # the parameters' addresses the steps read

    def follow_weights(self, model: torch.nn.Module, length: int) -> None:
        """Drop the prepared steps if a weight's storage moved since they were prepared (a
        parameter replaced, e.g. by ``load_state_dict(assign=True)``, or RoPE's table rebuilt
        by another user of the model): a graph replayed would read the old memory. Weights
        written in place (a weight sync) keep them. RoPE's table is first built to cover the
        cache's ``length``, so no forward of the generate rebuilds it."""
        where = [p.data_ptr() for p in model.parameters()]
        rope = getattr(getattr(model, "model", None), "rope", None)
        if rope is not None:  # built for the embeddings' dtype, the forward's activations'
            weight = model.model.embed_tokens.weight
            rope.prepare(weight.device, weight.dtype, length)
            where += [rope.cos.data_ptr(), rope.sin.data_ptr()]
        if where != self._weights:
            self.clear()
            self._weights = where

    def clear(self) -> None:
        """Forget every captured step (their addresses are about to become invalid)."""
        self.steps.clear()
        self._first.clear()
        self._pool = None

    def forget_rows(self) -> None:
        """The next ``set_rows`` writes the parameters whatever its composition (a new
        generate call: ids of its sequences may be those of the last call's dead ones)."""
        self._composition = None

    def set_rows(self, params: list[SamplingParams | None], keys: list[int], composition: tuple) -> None:
        """Write the rows' sampling parameters (padding rows: None, greedy) when they changed."""
        if composition == self._composition:
            return
        rows = RowParams.build(params, keys, "cpu")
        n = len(params)
        for buf, new in ((self.temperature, rows.temperature), (self.top_k, rows.top_k),
                         (self.top_p, rows.top_p), (self.keys, rows.keys)):
            buf[:n].copy_(new, non_blocking=True)
        self._flags = (rows.all_greedy, rows.truncate)
        self._composition = composition

    def run(self, rows: int, length: int, forward: Callable, cache, tokens: list[int], positions: list[int],
            steps: list[int]) -> torch.Tensor:
        """One step over the bucket of ``rows`` rows and ``length`` cache positions; the first
        ``len(tokens)`` rows are real. Returns the output buffer [2, rows] (tokens, log-probs)."""
        n = len(tokens)
        staged = torch.tensor([tokens, positions, steps], dtype=torch.long)
        if n < rows:  # padding rows: token 0 at position 0, counter 0
            staged = torch.nn.functional.pad(staged, (0, rows - n))
        self.inputs[:, :rows].copy_(staged, non_blocking=True)
        key = (rows, length, *self._flags)
        step = self.steps.get(key)
        if step is None and self.capture and key not in self._first:  # first use: as is
            step = self._first[key] = _as_captured(self._body(key, forward, cache))
        elif step is None:
            t0 = time.perf_counter()
            step = self.steps[key] = self._prepare(key, forward, cache)
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
        step()
        return self.out[:, :rows]

    def _body(self, key: tuple, forward: Callable, cache) -> Callable[[], None]:
        rows, length, all_greedy, truncate = key
        tokens, positions, counters = self.inputs[0, :rows], self.inputs[1, :rows], self.inputs[2, :rows]
        params = RowParams(self.temperature[:rows], self.top_k[:rows], self.top_p[:rows], self.keys[:rows],
                           all_greedy=all_greedy, truncate=truncate, uniform_temperature=None)
        out = self.out[:, :rows]

        def body() -> None:
            cache.begin_decode(positions, length)  # mask and write offsets from the device buffer
            logits = forward(tokens[:, None], positions[:, None], kv_cache=cache,
                             moe=cache.recorder)[:, -1]                                  # [rows, V]
            tok, logp = sample(logits, params, counters)
            out.copy_(torch.stack([tok.double(), logp.double()]))
        return body

    def _prepare(self, key: tuple, forward: Callable, cache) -> Callable[[], None]:
        """The step kept for bucket ``key``: its function captured (``capture``), else as is."""
        body = self._first.pop(key, None) or self._body(key, forward, cache)
        return self._capture(body) if self.capture else body

    def _capture(self, body: Callable[[], None]) -> Callable[[], None]:
        """``body`` captured as a CUDA graph (it ran once before, uncaptured: its warm-up);
        returns the graph's replay. Capturing launches nothing: the caller replays it."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the controller's receive threads may allocate or launch meanwhile
        # (on their own streams); "global" would fail the capture for that
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            body()
        return graph.replay
