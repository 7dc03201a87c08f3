"""Continuous-batching decisions for the rollout engine, in plain Python (no torch).

The engine owns a fixed number of KV-cache *slots* (rows of a preallocated cache). This
module decides which sequence occupies which slot, when waiting sequences are admitted,
when a sequence is finished ("stop": an EOS / stop token was produced; "length":
``max_tokens`` or the model length was reached) and how the running slots are kept
compact. The engine only executes what a :class:`Step` says, so every scheduling rule is
testable without tensors (nano-vllm's scheduler / model-runner split).

Rules:
* A finished slot is refilled with the next waiting sequence (FIFO), lowest slot first.
* Admissions per step are bounded by ``max_num_batched_tokens`` prompt tokens (at least one
  sequence is always admitted so a long prompt cannot starve).
* Chunked prefill (``enable_chunked_prefill``, vLLM's key): a context longer than what is
  left of the step's token budget is admitted with a first chunk that fills the budget; its
  next chunks come first in the following steps' budgets, and its first token is sampled
  after the last chunk. Meanwhile its slot is a hole in the decode rows and the other
  sequences keep decoding, so one long prompt no longer stalls a step for its whole length.
  A multi-turn sequence resumed with more new tokens than the budget writes them the same
  way (instead of one extend forward).
* When nothing waits and the running slots have holes, the highest running slot is moved
  into the lowest free one, so decode steps run over a dense prefix ``[0, num_rows)`` of
  the cache instead of paying for idle rows during a long tail.
* Multi-turn (``Sequence.multi_turn``): a stop or EOS token ends the *turn*, not the
  sequence. The sequence pauses and keeps its slot (and KV cache) while the caller runs the
  environment; :meth:`Scheduler.resume` then appends the observation tokens (``pending``
  until the engine's extend forward writes them to the cache) or finishes it. A paused
  slot is a hole in the decode rows. ``max_tokens`` caps everything after the prompt,
  observations included. When sequences wait for a slot and none is free, the paused
  sequence with the shortest context is *evicted* (its slot given away, counted in
  ``evictions``); on resume it waits again, first in line, and its whole context is
  prefilled anew.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"  # the turn handler ended it (e.g. an environment error)


@dataclass
class Sequence:
    """One completion being generated. ``seq_id`` is the caller's index for the result."""

    seq_id: int
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()  # always stop (vLLM's stop_token_ids)
    eos_ids: frozenset[int] = frozenset()  # stop unless ignore_eos
    ignore_eos: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    params: object = None  # the engine's sampling parameters for this sequence (opaque here)
    slot: int | None = None
    finish_reason: str | None = None
    multi_turn: bool = False  # a stop/EOS token pauses it for the environment instead of finishing
    paused: bool = False  # waiting for the caller's resume()
    pending: int = 0  # trailing tokens appended by resume() and not in the KV cache yet
    observations: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of appended tokens
    max_turn_tokens: int | None = None  # a turn also ends after this many sampled tokens
    turn_start: int = 0  # index in ``tokens`` where the current turn began
    evicted: bool = False  # paused without a slot: its whole context is prefilled again on return
    prefilled: int | None = None  # chunked prefill: context positions written so far (None: not in one)
    routes: object = None  # a MoE model's expert ids per cached position, when the engine records them

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the position the next token is written at."""
        return len(self.prompt) + len(self.tokens)

    @property
    def context(self) -> list[int]:
        """What the next prefill of this sequence runs over: its prompt, or for a sequence
        coming back after eviction, its prompt and every token so far."""
        return self.prompt + self.tokens if self.tokens else self.prompt

    @property
    def cached(self) -> int:
        """Positions whose keys/values are in the KV cache (all but the last token, and all
        but the observation tokens waiting for the extend forward; during a chunked prefill,
        the chunks written so far)."""
        if self.prefilled is not None:
            return self.prefilled
        return self.num_tokens - 1 - self.pending

    def token_mask(self) -> list[int]:
        """1 on sampled tokens, 0 on appended observation tokens."""
        mask = [1] * len(self.tokens)
        for start, end in self.observations:
            mask[start:end] = [0] * (end - start)
        return mask


@dataclass
class Step:
    """What the engine runs next.

    ``moves``: ``(src, dst)`` slot copies to run first (compaction); ``prefill``: newly
    admitted sequences, already assigned to slots. After the prefill (whose sampled
    tokens are recorded with :meth:`Scheduler.record_prefill`) the engine decodes rows
    ``[0, Scheduler.num_rows)``: new sequences join the decode in the same step.
    ``chunks``: ``(seq, start, end)``, context positions ``[start, end)`` of sequences in a
    chunked prefill to write this step (recorded with :meth:`Scheduler.record_chunks`).
    """

    moves: list[tuple[int, int]]
    prefill: list[Sequence]
    chunks: list[tuple[Sequence, int, int]] = field(default_factory=list)


class Scheduler:
    """Slot bookkeeping for ``max_num_seqs`` cache rows of ``max_model_len`` positions."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None = None,
                 enable_chunked_prefill: bool = False):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens or max(max_model_len, 8192)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.chunking: list[Sequence] = []  # in a chunked prefill, oldest first
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free: list[int] = list(range(max_num_seqs))  # heap of free slots
        self.finished: list[Sequence] = []
        self.paused: list[Sequence] = []  # paused since the caller last took them (take_paused)
        self.evicted: set[int] = set()  # ids of paused sequences that gave their slot away
        self.evictions = 0
        # (sequence, slot) of every sequence that gave its slot up (finished or evicted) since
        # the engine last took them: what it left there is intact until the next schedule()
        self.vacated: list[tuple[Sequence, int]] = []

    # -- intake ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if not seq.prompt:
            raise ValueError(f"sequence {seq.seq_id}: empty prompt; pass at least one token (e.g. BOS)")
        if len(seq.prompt) >= self.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id}: prompt has {len(seq.prompt)} tokens but max_model_len is "
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if seq.max_tokens < 1:
            raise ValueError(f"sequence {seq.seq_id}: max_tokens must be >= 1, got {seq.max_tokens}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.evicted)

    def num_paused(self) -> int:
        return sum(s.paused for s in self.running.values()) + len(self.evicted)

    def decodable(self) -> bool:
        """Whether some running sequence takes part in the next decode."""
        return any(self._decodes(s) for s in self.running.values())

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        return not seq.paused and not seq.pending and seq.prefilled is None

    def can_admit(self) -> bool:
        """Whether the next ``schedule`` admits someone (a free slot, or a paused one to evict)."""
        return bool(self.waiting) and (bool(self._free) or any(s.paused for s in self.running.values()))

    @property
    def num_rows(self) -> int:
        """Decode rows: one past the highest occupied slot."""
        return max(self.running) + 1 if self.running else 0

    # -- deciding ----------------------------------------------------------------------
    def schedule(self) -> Step:
        """Admit waiting sequences into free slots, or compact when nothing waits."""
        prefill: list[Sequence] = []
        chunks: list[tuple[Sequence, int, int]] = []
        budget = self.max_num_batched_tokens
        for seq in self.chunking:  # prefills under way go first
            if budget <= 0:
                break
            end = min(len(seq.context), seq.prefilled + budget)
            chunks.append((seq, seq.prefilled, end))
            budget -= end - seq.prefilled
        if self.waiting and not self._free:
            self._evict()
        while self.waiting and self._free:
            nxt = self.waiting[0]
            chunk = self.enable_chunked_prefill and len(nxt.context) > budget
            if chunk and budget <= 0 or not chunk and (prefill or chunks) and len(nxt.context) > budget:
                break
            self.waiting.popleft()
            nxt.slot = heapq.heappop(self._free)
            nxt.evicted = False
            self.running[nxt.slot] = nxt
            if chunk:
                nxt.prefilled = 0
                self.chunking.append(nxt)
                chunks.append((nxt, 0, budget))
                budget = 0
            else:
                prefill.append(nxt)
                budget -= len(nxt.context)
        moves = self._compact() if not self.waiting else []
        return Step(moves=moves, prefill=prefill, chunks=chunks)

    def _evict(self) -> None:
        """Give the slot of the paused sequence with the shortest context (the cheapest to
        prefill again) to the waiting ones."""
        paused = [q for q in self.running.values() if q.paused]
        if not paused:
            return
        seq = min(paused, key=lambda q: (q.num_tokens, q.seq_id))
        del self.running[seq.slot]
        heapq.heappush(self._free, seq.slot)
        self.vacated.append((seq, seq.slot))
        seq.slot, seq.evicted = None, True
        self.evicted.add(seq.seq_id)
        self.evictions += 1

    def _compact(self) -> list[tuple[int, int]]:
        moves = []
        while self._free and self.running and self._free[0] < max(self.running):
            dst = heapq.heappop(self._free)
            src = max(self.running)
            seq = self.running.pop(src)
            seq.slot = dst
            self.running[dst] = seq
            heapq.heappush(self._free, src)
            moves.append((src, dst))
        return moves

    # -- recording results ---------------------------------------------------------------
    def append(self, seq: Sequence, token: int, logprob: float = 0.0) -> bool:
        """Record ``token`` for ``seq``; finish and free its slot when done. True if finished."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        if token in seq.stop_ids or (not seq.ignore_eos and token in seq.eos_ids):
            if seq.multi_turn:  # the turn ends; the caller resumes or finishes the sequence
                seq.paused = True
                self.paused.append(seq)
                return False
            return self.finish(seq, FINISH_STOP)
        if len(seq.tokens) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return self.finish(seq, FINISH_LENGTH)
        if seq.max_turn_tokens is not None and len(seq.tokens) - seq.turn_start >= seq.max_turn_tokens:
            seq.paused = True
            self.paused.append(seq)
        return False

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End ``seq`` with ``reason`` and free its slot."""
        seq.finish_reason = reason
        seq.paused = False
        if seq.evicted:  # it holds no slot
            self.evicted.discard(seq.seq_id)
            seq.evicted = False
        else:
            del self.running[seq.slot]
            heapq.heappush(self._free, seq.slot)
            self.vacated.append((seq, seq.slot))
        seq.slot = None
        self.finished.append(seq)
        return True

    def take_vacated(self) -> list[tuple[Sequence, int]]:
        """``(sequence, slot)`` of the sequences that left a slot since the last call."""
        out, self.vacated = self.vacated, []
        return out

    def take_paused(self) -> list[Sequence]:
        """The sequences paused at a turn end since the last call."""
        out, self.paused = self.paused, []
        return out

    def resume(self, seq: Sequence, tokens: list[int] | None, reason: str = FINISH_STOP) -> None:
        """Continue paused ``seq`` after appending observation ``tokens``; ``None`` finishes
        it (``reason``). Observations that leave no room for one more sampled token finish it
        as ``length`` (nothing is appended)."""
        if not seq.paused:
            raise RuntimeError(f"sequence {seq.seq_id} is not paused")
        if tokens is None:
            self.finish(seq, reason)
            return
        room = min(seq.max_tokens - len(seq.tokens), self.max_model_len - seq.num_tokens)
        if not tokens or len(tokens) >= room:
            self.finish(seq, FINISH_LENGTH)
            return
        start = len(seq.tokens)
        cached = seq.cached
        seq.tokens.extend(tokens)
        seq.logprobs.extend([0.0] * len(tokens))
        seq.observations.append((start, len(seq.tokens)))
        seq.turn_start = len(seq.tokens)
        seq.paused = False
        if seq.evicted:  # back in line, first: its whole context is prefilled on admission
            self.evicted.discard(seq.seq_id)
            self.waiting.appendleft(seq)
        elif self.enable_chunked_prefill and len(tokens) + 1 > self.max_num_batched_tokens:
            seq.prefilled = cached  # the new tokens go in chunks, as a prefill's do
            self.chunking.append(seq)
        else:
            seq.pending = len(tokens)

    def extend_rows(self) -> list[Sequence]:
        """Resumed sequences whose observation tokens the engine must write to the cache
        (an extend forward over ``tokens[-(pending + 1):]`` from position ``cached``)."""
        return [s for s in self.running.values() if s.pending]

    def record_extend(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> None:
        """First sampled token of each extended sequence's new turn."""
        for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            seq.pending = 0
            self.append(seq, tok, lp)

    def record_chunks(self, chunks: list[tuple[Sequence, int, int]], tokens: list[int],
                      logprobs: list[float]) -> None:
        """Chunks written; ``tokens``/``logprobs``: the first sampled token of each sequence
        whose last chunk this was (in ``chunks``' order)."""
        done = []
        for seq, _, end in chunks:
            seq.prefilled = end
            if end == len(seq.context):
                seq.prefilled = None
                self.chunking.remove(seq)
                done.append(seq)
        self.record_prefill(done, tokens, logprobs)

    def record_prefill(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float] | None = None) -> None:
        """First sampled token of each newly admitted sequence (same order as ``seqs``)."""
        logprobs = logprobs if logprobs is not None else [0.0] * len(seqs)
        for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            self.append(seq, tok, lp)

    def decode_rows(self) -> tuple[list[int], list[int], list[Sequence | None]]:
        """Inputs of the next decode over rows ``[0, num_rows)``: last token, its position, sequence.

        Holes (free slots below ``num_rows``) get token 0 at position 0; their outputs are
        ignored and their cache rows are rewritten by the next prefill into that slot. A
        paused or pending sequence's row is a hole too, writing at its first uncached
        position (rewritten by its extend forward), as is one in a chunked prefill (its next
        chunk rewrites it).
        """
        n = self.num_rows
        tokens, positions, seqs = [0] * n, [0] * n, [None] * n
        for slot, seq in self.running.items():
            if not self._decodes(seq):
                positions[slot] = seq.cached
                continue
            tokens[slot] = seq.tokens[-1]
            positions[slot] = seq.num_tokens - 1
            seqs[slot] = seq
        return tokens, positions, seqs

    def record_decode(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Sampled tokens (and log-probs) of decode rows ``[0, len(tokens))``; holes are ignored."""
        logprobs = logprobs if logprobs is not None else [0.0] * len(tokens)
        for slot in range(len(tokens)):
            seq = self.running.get(slot)
            if seq is not None and self._decodes(seq):
                self.append(seq, tokens[slot], logprobs[slot])
