"""The generation engine: executes the scheduler's decisions with a slot KV cache.

Each engine step runs (1) slot moves chosen by the scheduler (compaction), (2) the prefill
of the newly admitted prompts (right-padded in length buckets; a prompt shared by n samples
is run once; only the last position of each prompt goes through the LM head), sampling each
one's first token, and (3) one decode step over the dense slot prefix ``[0, num_rows)``, new
sequences included. The host sees the sampled tokens once per step (one device->host copy:
stop checks are Python), nothing else.

Not done yet (GPU): CUDA graphs / torch.compile for the decode step and flash-attn's KV-cache
kernel; the decode runs eager SDPA over the used prefix of the cache. On CPU torch.compile
recompiled on every new cache length and did not pay off.

The KV cache is allocated lazily, sized to the work at hand (``min(max_num_seqs, #sequences)``
slots of ``min(max_model_len, longest prompt + max_tokens)`` positions) and capped by
``kv_cache_memory`` bytes (or ``gpu_memory_utilization`` of free CUDA memory); it is reused
while big enough. :meth:`Engine.free` drops the weights and the cache so a colocated trainer
gets the memory back.

A long-lived engine (the hybrid actor's) uses vLLM's names instead: :meth:`Engine.sleep`
frees the weights' storage and the KV cache but keeps the module (its parameters move to
the meta device with their shapes and strides), :meth:`Engine.wake_up` allocates the
weights again on the engine's device, uninitialised, and the resharder
(``minihf.hybrid``) writes into ``named_parameters``. The device is passed in, so an
engine can be built on the meta device and never holds weights it was not given.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from minihf.parallel.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead

from .kv_cache import SlotKVCache
from .sampling import RowParams, SamplingParams, sample, sequence_key
from .scheduler import Scheduler, Sequence


class TurnHandler(Protocol):
    """The caller's side of a multi-turn generation (``minihf.rollout.multi_turn``).

    ``end_turn(seq)``: ``seq`` paused at a turn end; start its environment step (off the
    decode loop). ``poll(wait)``: the steps done since the last poll, as ``(seq, tokens,
    reason)``: observation ``tokens`` to append, or ``None`` to finish it with ``reason``;
    ``wait``: block until at least one is done (the engine has nothing else to run). Under
    TP every rank of a replica must get the same answers in the same engine step.
    """

    def end_turn(self, seq: Sequence) -> None: ...

    def poll(self, wait: bool) -> list[tuple[Sequence, list[int] | None, str]]: ...


SEQ_STRIDE = 1_000_003  # seq_id = prompt index * SEQ_STRIDE + sample index
_LINEARS = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead)


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every Linear weight [out, in] column-major (same shape, values and names).

    On CPU the decode step is a chain of matrix-vector products over weights that do not stay
    in cache; MKL streams a column-major weight (``x @ W_t`` with ``W_t`` [in, out]
    contiguous) about 2x faster than the row-major ``nn.Linear`` layout when the weight comes
    from DRAM (measured: 8192x256 fp32, cold, 1.13 ms -> 0.44 ms), which made the batch-1 step
    of the 5M benchmark model ~1.4x faster. ``F.linear`` accepts the transposed-view weight
    as is; loads into it (``copy_``) keep working. Not done on CUDA, where it does not help.
    """
    # a weight shared with an embedding (tied LM head) stays row-major: a batch of row lookups
    # into a column-major table is a strided gather (measured 0.34 ms per step at batch 64)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for module in model.modules():
            w = getattr(module, "weight", None)
            if isinstance(module, _LINEARS) and w.dim() == 2 and w.is_contiguous() and id(w) not in embeddings:
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


class Engine:
    """Runs generation for one model (possibly TP-sharded) with a slot KV cache.

    ``max_num_seqs`` caps concurrent sequences (cache slots), ``max_model_len`` caps prompt +
    completion, ``max_num_batched_tokens`` caps prompt tokens per prefill step, and
    ``kv_cache_memory`` (bytes) / ``gpu_memory_utilization`` cap the cache size.
    """

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str | None = None,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None, eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                 cpu_column_major: bool = True):
        self.model = model.eval()
        param_device = next(model.parameters()).device
        if device is None and param_device.type == "meta":
            raise ValueError("the engine's model is on the meta device: pass device= (where "
                             "wake_up allocates the weights)")
        self._device = torch.device(device) if device is not None else param_device
        self.awake = param_device.type != "meta"
        if cpu_column_major and self._device.type == "cpu":
            column_major_linears(model)  # on meta too: wake_up keeps the strides
        args = model.args
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or args.max_position_embeddings
        rope = getattr(model.model, "rope", None)
        if rope is not None:  # accelerators build the RoPE table once, at this length
            rope.reserve(self.max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_memory = kv_cache_memory
        self.gpu_memory_utilization = gpu_memory_utilization
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._calls = 0
        # the last generate call's seconds in prefill and decode forwards (sampling included;
        # each step ends in a host sync, so the times hold on CUDA too) and its decode steps
        self.last_stats: dict[str, float] = {}
        self.cache: SlotKVCache | None = None
        self._rows_key: tuple | None = None
        self._rows: RowParams | None = None
        attn = model.model.layers[0].self_attn
        self._cache_geometry = (len(model.model.layers), attn.num_kv_heads, attn.head_dim)

    @property
    def device(self) -> torch.device:
        return self._device

    # -- weights (long-lived engines) -------------------------------------------------------
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
        self.cache = None
        self._rows = self._rows_key = None
        self._move_params("meta")
        self.awake = False
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Allocate the weights on the engine's device (uninitialised: load them next)."""
        if not self.awake:
            self._move_params(self._device)
            self.awake = True

    # -- memory -----------------------------------------------------------------------
    def _slot_budget(self, max_len: int, dtype: torch.dtype) -> int | None:
        layers, kv, hd = self._cache_geometry
        per_slot = SlotKVCache.bytes_per_slot(layers, kv, max_len, hd, dtype)
        budget = self.kv_cache_memory
        if budget is None and self.gpu_memory_utilization is not None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
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

    def _ensure_cache(self, num_seqs: int, max_len: int) -> int:
        p = next(self.model.parameters())
        slots = min(self.max_num_seqs, num_seqs)
        cap = self._slot_budget(max_len, p.dtype)
        if cap is not None:
            slots = min(slots, cap)
        if self.cache is None or not self.cache.fits(slots, max_len, p.dtype, p.device):
            self.cache = None  # release the old buffers before allocating new ones
            layers, kv, hd = self._cache_geometry
            self.cache = SlotKVCache(layers, slots, kv, max_len, hd, p.dtype, p.device)
        return self.cache.num_slots

    def free(self, weights: bool = True) -> None:
        """Drop the KV cache and (unless ``weights=False``) the engine's reference to the model;
        after dropping the weights the engine cannot generate any more. The cache is
        reallocated by the next ``generate``."""
        self.cache = None
        self._rows = self._rows_key = None
        if weights:
            self.model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 turns: TurnHandler | None = None) -> list[list[Sequence]]:
        """Sequences for each prompt (``n`` each), finished, with tokens, log-probs and reasons.

        With ``turns``, a stop/EOS token ends a turn: the sequence keeps its slot and KV
        cache while ``turns`` runs the environment, then the observation's tokens alone are
        prefilled (an extend forward) and decoding resumes; the others keep decoding."""
        if self.model is None:
            raise RuntimeError("this engine was freed; build a new one (LLM(...)) to generate again")
        if not self.awake:
            raise RuntimeError("this engine is asleep (weights freed); call wake_up() and load "
                               "the weights before generating")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        if turns is not None and any(sp.n != 1 for sp in plist):
            raise ValueError("a multi-turn generation takes n=1 per prompt (one environment per "
                             "sample): repeat the prompts instead")
        self._calls += 1
        self._rows_key = None  # ids of dead sequences may be reused by this call's
        call_key = sequence_key(self.seed, self._calls)
        groups: list[list[Sequence]] = []
        longest = 0
        for r, (prompt, sp) in enumerate(zip(prompts, plist)):
            group = []
            for j in range(sp.n):
                key = sequence_key(sp.seed, j) if sp.seed is not None else sequence_key(call_key, r * SEQ_STRIDE + j)
                group.append(Sequence(
                    seq_id=r * SEQ_STRIDE + j, prompt=list(prompt), max_tokens=sp.max_tokens,
                    stop_ids=frozenset(sp.stop_token_ids), eos_ids=self.eos_token_ids,
                    ignore_eos=sp.ignore_eos, params=(sp, key), multi_turn=turns is not None,
                    max_turn_tokens=sp.max_turn_tokens if turns is not None else None,
                ))
            groups.append(group)
            longest = max(longest, len(prompt) + sp.max_tokens)
        seqs = [s for g in groups for s in g]
        if not seqs:
            return groups
        max_len = min(self.max_model_len, longest)
        slots = self._ensure_cache(len(seqs), max_len)
        sched = Scheduler(slots, max_len, self.max_num_batched_tokens)
        vocab = self.model.args.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                                 "shorten it or raise max_model_len")
            try:
                bad = [t for t in prompt if not 0 <= t < vocab]
            except TypeError:  # e.g. text, or a tokenizer's dict (its keys)
                raise ValueError(f"prompt {i} is not a list of token ids (ints): its items are "
                                 f"{type(next(iter(prompt))).__name__}; tokenize it first (the "
                                 "tokenizer's input_ids)") from None
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        for s in seqs:
            sched.add(s)
        stats = self.last_stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0,
                                   "extend_s": 0.0, "extend_tokens": 0, "evictions": 0}
        with torch.inference_mode():
            while sched.has_work():
                if turns is not None and sched.num_paused():
                    idle = not sched.decodable() and not sched.extend_rows() and not sched.can_admit()
                    for seq, obs, reason in turns.poll(wait=idle):
                        sched.resume(seq, obs, reason)
                    if not sched.has_work():
                        break
                step = sched.schedule()
                for src, dst in step.moves:
                    seq = sched.running[dst]
                    self.cache.move(src, dst, seq.num_tokens)
                t0 = time.perf_counter()
                if step.prefill:
                    self._prefill(sched, step.prefill)
                t1 = time.perf_counter()
                extend = sched.extend_rows() if turns is not None else []
                if extend:
                    stats["extend_tokens"] += sum(s.pending + 1 for s in extend)
                    self._extend(sched, extend)
                t2 = time.perf_counter()
                if sched.decodable():
                    self._decode(sched)
                    stats["decode_steps"] += 1
                stats["prefill_s"] += t1 - t0
                stats["extend_s"] += t2 - t1
                stats["decode_s"] += time.perf_counter() - t2
                if turns is not None:
                    for seq in sched.take_paused():
                        turns.end_turn(seq)
        stats["evictions"] = sched.evictions
        return groups

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence | None]) -> tuple[list[int], list[float]]:
        # per-row parameters change only when the row composition does (admission, finish, move)
        composition = tuple(id(s) for s in seqs)
        if self._rows_key != composition:
            self._rows = RowParams.build([s.params[0] if s else None for s in seqs],
                                         [s.params[1] if s else 0 for s in seqs], logits.device)
            self._rows_key = composition
        rows = self._rows
        steps = torch.tensor([len(s.tokens) if s else 0 for s in seqs], dtype=torch.int64, device=logits.device)
        tok, logp = sample(logits, rows, steps)
        both = torch.stack([tok.double(), logp.double()]).cpu()  # the one host sync per step
        return [int(t) for t in both[0].tolist()], both[1].tolist()

    def _prefill(self, sched: Scheduler, seqs: list[Sequence]) -> None:
        """Prefill the distinct prompts (the n samples of a request share one forward; their
        cache rows are then copied to the other samples' slots, and each sample draws its own
        first token from the shared logits). Prompts are right-padded in length buckets."""
        dev = self.device
        ctx = [s.context for s in seqs]  # the prompt (or a returning evicted sequence's all)
        first: dict[tuple[int, ...], int] = {}
        uniq: list[int] = []  # index into seqs of each distinct context
        src: list[int] = []  # index into uniq of each seq's context
        for i, c in enumerate(ctx):
            if tuple(c) not in first:
                first[tuple(c)] = len(uniq)
                uniq.append(i)
            src.append(first[tuple(c)])
        last_hidden: list[torch.Tensor | None] = [None] * len(uniq)
        for group in length_buckets([len(ctx[i]) for i in uniq]):
            part = [seqs[uniq[i]] for i in group]
            rows = [ctx[uniq[i]] for i in group]
            lens = [len(r) for r in rows]
            T = max(lens)
            tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long, device=dev)
            positions = torch.arange(T, device=dev).expand(len(part), T)
            self.cache.begin_prefill(torch.tensor([s.slot for s in part], device=dev), T)
            hidden = self.model.forward_hidden(tokens, positions, kv_cache=self.cache)  # [g, T, H]
            last = hidden[torch.arange(len(part), device=dev), torch.tensor(lens, device=dev) - 1]
            for i, h in zip(group, last):
                last_hidden[i] = h
        logits = self.model.lm_head(torch.stack(last_hidden))  # [u, V]
        for s, c, u in zip(seqs, ctx, src):
            if s is not seqs[uniq[u]]:
                self.cache.move(seqs[uniq[u]].slot, s.slot, len(c))
        toks, logps = self._sample(logits[torch.tensor(src, device=dev)], seqs)
        sched.record_prefill(seqs, toks, logps)

    def _extend(self, sched: Scheduler, seqs: list[Sequence]) -> None:
        """Write resumed sequences' new tokens (the turn's last sampled token and the
        observation) to the cache in their own slots, attending to their cached history,
        and sample each one's first token of the next turn. Right-padded in length buckets;
        a bucket whose padding would run past the cache goes one sequence at a time."""
        dev = self.device
        feeds = [s.tokens[-(s.pending + 1):] for s in seqs]
        groups = []
        for group in length_buckets([len(f) for f in feeds]):
            T = max(len(feeds[i]) for i in group)
            if max(seqs[i].cached for i in group) + T > self.cache.max_len:
                groups.extend([i] for i in group)
            else:
                groups.append(group)
        last_hidden: list[torch.Tensor | None] = [None] * len(seqs)
        for group in groups:
            part = [seqs[i] for i in group]
            lens = [len(feeds[i]) for i in group]
            T = max(lens)
            tokens = torch.tensor([feeds[i] + [0] * (T - len(feeds[i])) for i in group], dtype=torch.long, device=dev)
            starts = torch.tensor([s.cached for s in part], dtype=torch.long, device=dev)
            positions = starts[:, None] + torch.arange(T, device=dev)
            self.cache.begin_extend(torch.tensor([s.slot for s in part], device=dev), starts,
                                    T, max(s.cached for s in part) + T)
            hidden = self.model.forward_hidden(tokens, positions, kv_cache=self.cache)  # [g, T, H]
            last = hidden[torch.arange(len(part), device=dev), torch.tensor(lens, device=dev) - 1]
            for i, h in zip(group, last):
                last_hidden[i] = h
        logits = self.model.lm_head(torch.stack(last_hidden))  # [k, V]
        toks, logps = self._sample(logits, seqs)
        sched.record_extend(seqs, toks, logps)

    def _decode(self, sched: Scheduler) -> None:
        dev = self.cache.k.device  # the model's; cheaper than walking parameters every step
        tok_list, pos_list, seqs = sched.decode_rows()
        tokens = torch.tensor(tok_list, dtype=torch.long, device=dev)[:, None]  # [B, 1]
        positions = torch.tensor(pos_list, dtype=torch.long, device=dev)[:, None]
        self.cache.begin_decode(positions[:, 0], max(pos_list) + 1, same_length=min(pos_list) == max(pos_list))
        logits = self.model(tokens, positions, kv_cache=self.cache)[:, -1]  # [B, V]
        toks, logps = self._sample(logits, seqs)
        sched.record_decode(toks, logps)
