"""Host (CPU) memory allocation set for training steps: fresh pages cost more than the work.

A training step on CPU allocates and frees the same large buffers every step: FSDP's
gradient buffers (copy-in and output, 14 MB per SmolLM2-135M block), the logits
``[tokens, vocab]`` (75 MB for 384 tokens of a 49k vocabulary), the embedding's gradient
(113 MB). glibc's malloc maps a block over its mmap threshold freshly and unmaps it on
free, and trims freed memory at the top of a heap, so the next step touches those bytes
as new pages: a page fault per 4 KB page. Measured on the 2-core AMD EPYC (Zen 4) VM: one
block's FSDP copy-in took 21-29 ms into a fresh buffer and 1.2-1.3 ms into the same buffer
again (~7 us a page), and in a SmolLM2 GRPO step (``scripts/bench_step.py --model``)
these copies and fills were a quarter of ``update_actor``. Both settings together took the
step from 10.6 to 9.0 s and the update from 6.5 to 4.95 s (2 alternating rounds).

Two settings remove most of it:

* ``THP_MEM_ALLOC_ENABLE=1``, torch's own switch: CPU allocations of 2 MB or more are
  page-aligned and advised ``MADV_HUGEPAGE`` (one fault per 2 MB). torch reads it once, at
  its first CPU allocation, so ``import minihf`` sets it (unless set already) before any
  tensor exists; an opt-out is ``THP_MEM_ALLOC_ENABLE=0`` in the environment.
* glibc ``mallopt``: ``M_MMAP_MAX = 0`` (every block comes from a heap, which keeps a freed
  block for a later request that fits it, instead of unmapping it) and ``M_TRIM_THRESHOLD``
  = 1 GiB (freed memory stays mapped; more than that free at a heap's top is returned).
  glibc does not reuse every freed block (a page-aligned request often does not fit the
  block it freed), so this is the smaller part: 9.9 -> 9.2 s a step over huge pages alone
  (2 alternating rounds). Applied by :func:`tune_malloc` when a CPU job starts
  (``minihf.controller.launch``); ``MINIHF_MALLOC_TUNING=0`` skips it.
* ``M_ARENA_MAX = 1`` with them: one heap for every thread. Rank 0's worker runs its
  commands in a thread of the driver's pool (``minihf.controller.driver``), and glibc gives
  other threads their own arenas, whose heaps are at most 64 MB and are shrunk on free: with
  no mmap allowed there, each step's large blocks were mapped and faulted again. Measured
  (30 x 14 MB copies and a 113 MB zero fill, FSDP's pattern for SmolLM2, in a pool thread,
  huge pages on): 290-900 ms a step tuned without it, 60-75 untuned, 34 with it; in the
  SmolLM2 GRPO step ``update_actor`` spent 0.95 s in FSDP's gradient copies (5.35 s in
  all, ``scripts/bench_step.py --model``). The main arena's lock is uncontended here (the
  worker's ops run in one thread; torch's intra-op threads rarely allocate).

Neither changes a value: only where the bytes live. The cost is memory: a process keeps
its peak heap (less up to 1 GiB of free space) instead of returning it between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

THP_ENV = "THP_MEM_ALLOC_ENABLE"
MALLOC_ENV = "MINIHF_MALLOC_TUNING"
TRIM_THRESHOLD = 1 << 30  # bytes free at a heap's top before glibc returns them

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def enable_huge_pages() -> None:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless the environment says otherwise (see above);
    it takes effect only if torch has not yet allocated a CPU tensor in this process."""
    os.environ.setdefault(THP_ENV, "1")


def tune_malloc() -> bool:
    """glibc's malloc keeps and reuses freed blocks (see above). Returns whether it was
    applied: False off Linux/glibc, or with ``MINIHF_MALLOC_TUNING=0``."""
    if os.environ.get(MALLOC_ENV, "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return (bool(libc.mallopt(M_ARENA_MAX, 1)) and bool(libc.mallopt(M_MMAP_MAX, 0))
            and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
