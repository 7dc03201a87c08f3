"""The generation engine: a short loop over the scheduler and the model runner.

One engine step reads like nano-vllm's: **schedule** (the torch-free
``minihf.rollout.scheduler`` admits waiting sequences into free cache slots, or compacts
the slots when nothing waits), **run** (``minihf.rollout.model_runner``: the slot moves,
the prefill of the admitted contexts, the chunks of chunked prefills, the extend of resumed
multi-turn sequences, then one decode step over the dense slot prefix ``[0, num_rows)``,
new sequences included),
**postprocess** (the scheduler records the sampled tokens: stop checks, finishing, freeing
slots; a multi-turn sequence that ended a turn is handed to the caller's environment). The
host sees the sampled tokens once per forward (one device->host copy), nothing else.

The decode step: with ``enforce_eager=False`` (the default, vLLM's key) on CUDA it is the
static step of ``minihf.rollout.decode_step``, one CUDA graph per bucket of rows and cache
length, captured at its second use and replayed; ``enforce_eager=True``, and on CPU, it is the
eager step over exactly the rows and cache prefix at hand (on CPU the static step computes
the bucket's padding for nothing, with no launches to save: docs/models.md#generation).
On CPU ``enforce_eager=False`` runs that eager step with the large weights prepacked
(``minihf.models.linear.PackedWeights``): for oneDNN on AMD CPUs (SmolLM2's decode ~1.7x
faster at 16 rows on a Zen 2 EPYC), for MKL's packed sgemm on Intel CPUs, the LM head for
oneDNN (~1.15x at 4-16 rows on an Intel Xeon).
Not done yet: flash-attn's KV-cache kernel (the decode runs SDPA with a mask).

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

import numbers
import time
from collections.abc import Iterable
from typing import Protocol

import torch

from minihf.models.config_checks import context_error

from .model_runner import ModelRunner
from .sampling import SamplingParams, sequence_key
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


def check_sizes(**sizes: int | None) -> None:
    """Each size an int >= 1; ``max_num_seqs`` required, the others None for the default
    (the model's context, no cap). A 0 read as "unset" and a negative hung or failed inside
    torch; ``RolloutConfig`` checks the same keys for the trainer's engine."""
    for name, value in sizes.items():
        if value is None and name != "max_num_seqs":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            unset = "" if name == "max_num_seqs" else ", or None for the default"
            raise ValueError(f"{name}={value!r} must be an int >= 1{unset}")


def as_prompts(prompts) -> list:
    """``generate``'s prompts, a list (each prompt is checked by ``Engine``); refuses what would
    be read wrong: a tokenizer's output, one 2-D tensor (its padding would be read as tokens),
    an iterator (read once)."""
    if hasattr(prompts, "keys"):
        raise TypeError("prompts is a dict (a tokenizer's output?): pass its input_ids as a list of "
                        "token-id lists, one per prompt, without padding")
    if hasattr(prompts, "ndim"):
        fix = ("wrap one prompt as [ids]" if prompts.ndim == 1 else
               "one list per prompt, without padding (a row's padding would be read as tokens)")
        raise TypeError(f"prompts is a {prompts.ndim}-D {type(prompts).__name__}: pass a list of token-id "
                        f"lists; {fix}")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    return prompts


def check_settings(seed, eos_token_ids, kv_cache_memory, gpu_memory_utilization, vocab: int) -> list[int]:
    """The engine's other settings, each named with the fix where it is wrong (a wrong type
    failed at the first generate, deep in the sampler or the cache sizing; an eos id past the
    vocabulary never matched); returns the eos ids as a list of ints."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r} must be an int")
    listed = isinstance(eos_token_ids, Iterable) and not isinstance(eos_token_ids, (str, bytes, dict))
    ids = list(eos_token_ids) if listed else None
    if ids is None or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab
                          for t in ids):
        raise ValueError(f"eos_token_ids={eos_token_ids!r} must be a list of token ids in [0, {vocab}) "
                         f"(the model's vocabulary); [] for none")
    if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, int)
                                        or kv_cache_memory < 1):
        raise ValueError(f"kv_cache_memory={kv_cache_memory!r} must be a number of bytes (an int >= 1), or "
                         "None for no cap")
    g = gpu_memory_utilization
    if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1):
        raise ValueError(f"gpu_memory_utilization={g!r} must be a fraction of the free memory in (0, 1], "
                         "or None")
    return [int(t) for t in ids]


class Engine:
    """Runs generation for one model (possibly TP-sharded) with a slot KV cache.

    ``max_num_seqs`` caps concurrent sequences (cache slots), ``max_model_len`` caps prompt +
    completion, ``max_num_batched_tokens`` caps prompt tokens per prefill step (with
    ``enable_chunked_prefill``, a longer context is prefilled in pieces over several steps
    while the others decode: ``minihf.rollout.scheduler``), and
    ``kv_cache_memory`` (bytes) / ``gpu_memory_utilization`` cap the cache size;
    ``enforce_eager`` / ``cudagraph_capture_sizes``: the decode step (module docstring);
    ``record_routes`` (a mixture-of-experts model): each finished sequence's ``routes``, its
    tokens' expert ids per MoE layer [cached positions, layers, k] (rollout routing replay).
    """

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str | None = None,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None, eos_token_ids: tuple[int, ...] = (), seed: int = 0,
                 cpu_column_major: bool = True, enforce_eager: bool = False,
                 cudagraph_capture_sizes: list[int] | None = None, decode: str | None = None,
                 enable_chunked_prefill: bool = False, record_routes: bool = False):
        check_sizes(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens)
        if decode is None:  # tests and benchmarks name the decode mode; users say enforce_eager
            target = torch.device(device) if device is not None else next(model.parameters()).device
            decode = "graph" if target.type == "cuda" and not enforce_eager else "eager"
        self.runner = ModelRunner(model, device=device, max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory,
                                  gpu_memory_utilization=gpu_memory_utilization, cpu_column_major=cpu_column_major,
                                  decode=decode, capture_sizes=cudagraph_capture_sizes, prepack=not enforce_eager,
                                  record_routes=record_routes)
        args = model.args
        eos_ids = check_settings(seed, eos_token_ids, kv_cache_memory, gpu_memory_utilization, args.vocab_size)
        limit = args.max_position_embeddings
        message = context_error(f"max_model_len={max_model_len}", max_model_len or limit, limit, "the model's config",
                                f"pass at most {limit}, or None for the model's context")
        if message:  # past it: no trained rotary angles
            raise ValueError(message)
        self.max_model_len = max_model_len or args.max_position_embeddings
        rope = getattr(model.model, "rope", None)
        if rope is not None:  # accelerators build the RoPE table once, at this length
            rope.reserve(self.max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        if enable_chunked_prefill and max_num_batched_tokens is None:
            raise ValueError("enable_chunked_prefill cuts prefills at max_num_batched_tokens tokens a "
                             "step, which is not set; set it too (e.g. max_num_batched_tokens=2048)")
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_ids = frozenset(eos_ids)
        self.seed = int(seed)
        self._calls = 0
        # the last generate call's seconds in prefill and decode forwards (sampling included;
        # each step ends in a host sync, so the times hold on CUDA too) and its decode steps
        self.last_stats: dict[str, float] = {}

    # -- what the runner owns, seen from the engine ----------------------------------------
    device = property(lambda self: self.runner.device)
    model = property(lambda self: self.runner.model)
    awake = property(lambda self: self.runner.awake)
    cache = property(lambda self: self.runner.cache, lambda self, c: setattr(self.runner, "cache", c))
    kv_cache_memory = property(lambda self: self.runner.kv_cache_memory,
                               lambda self, b: setattr(self.runner, "kv_cache_memory", b))

    def sleep(self) -> None:
        """Free the KV cache and the weights' storage; the module and its shapes stay."""
        self.runner.sleep()

    def wake_up(self) -> None:
        """Allocate the weights on the engine's device (uninitialised: load them next)."""
        self.runner.wake_up()

    def free(self, weights: bool = True) -> None:
        """Drop the KV cache and (unless ``weights=False``) the engine's reference to the model;
        after dropping the weights the engine cannot generate any more. The cache is
        reallocated by the next ``generate``."""
        self.runner.free(weights)

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
        prompts = self._checked_prompts(as_prompts(prompts))
        plist = params if isinstance(params, list) else [params] * len(prompts)
        bad = next((i for i, sp in enumerate(plist) if not isinstance(sp, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling params {bad} is a {type(plist[bad]).__name__}: pass SamplingParams(...), "
                            "one for every prompt or one list entry per prompt")
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        if turns is not None and any(sp.n != 1 for sp in plist):
            raise ValueError("a multi-turn generation takes n=1 per prompt (one environment per "
                             "sample): repeat the prompts instead")
        self._calls += 1
        groups = self._sequences(prompts, plist, multi_turn=turns is not None)
        seqs = [s for g in groups for s in g]
        if not seqs:
            return groups
        max_len = min(self.max_model_len, max(len(s.prompt) + s.max_tokens for s in seqs))
        sched = Scheduler(self.runner.ensure_cache(len(seqs), max_len), max_len, self.max_num_batched_tokens,
                          self.enable_chunked_prefill)
        for s in seqs:
            sched.add(s)
        self.last_stats = {"prefill_s": 0.0, "prefill_chunks": 0, "decode_s": 0.0, "decode_steps": 0,
                           "extend_s": 0.0, "extend_tokens": 0, "evictions": 0}
        self.runner.stats.update(captures=0, capture_s=0.0)
        with torch.inference_mode():
            while sched.has_work():
                if turns is not None and sched.num_paused():
                    idle = (not sched.decodable() and not sched.extend_rows() and not sched.can_admit()
                            and not sched.chunking)
                    for seq, obs, reason in turns.poll(wait=idle):
                        sched.resume(seq, obs, reason)
                    if not sched.has_work():
                        break
                self._step(sched, turns)
            self.runner.keep_routes(sched.take_vacated())  # finished by a last resume()
        self.last_stats["evictions"] = sched.evictions
        self.last_stats.update(self.runner.stats)  # static buckets captured (decode_s includes them)
        return groups

    def _sequences(self, prompts: list[list[int]], plist: list[SamplingParams], multi_turn: bool
                   ) -> list[list[Sequence]]:
        """``n`` sequences per prompt, each with its own sampling key (counter-based: the same
        on every TP rank, and from ``SamplingParams.seed`` when set)."""
        call_key = sequence_key(self.seed, self._calls)
        groups = []
        for r, (prompt, sp) in enumerate(zip(prompts, plist)):
            group = []
            for j in range(sp.n):
                key = sequence_key(sp.seed, j) if sp.seed is not None else sequence_key(call_key, r * SEQ_STRIDE + j)
                group.append(Sequence(
                    seq_id=r * SEQ_STRIDE + j, prompt=list(prompt), max_tokens=sp.max_tokens,
                    stop_ids=frozenset(sp.stop_token_ids), eos_ids=self.eos_token_ids,
                    ignore_eos=sp.ignore_eos, params=(sp, key), multi_turn=multi_turn,
                    max_turn_tokens=sp.max_turn_tokens if multi_turn else None,
                ))
            groups.append(group)
        return groups

    def _checked_prompts(self, prompts: list) -> list[list[int]]:
        """Each prompt as a list of Python ints (a tensor's or numpy's made so), checked: shorter
        than ``max_model_len``, token ids of the vocabulary. One pass over the tokens when they
        are such ints already (the hybrid engine's, every step)."""
        vocab = self.model.args.vocab_size
        out = []
        for i, prompt in enumerate(prompts):
            prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                                 "shorten it or raise max_model_len")
            odd = [t for t in prompt if type(t) is not int or not 0 <= t < vocab]
            if odd and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in odd):
                prompt = [int(t) for t in prompt]  # e.g. numpy's ints
                odd = [t for t in prompt if not 0 <= t < vocab]
            elif odd:  # e.g. text, a tokenizer's dict (its keys), float ids (they were truncated)
                kinds = {type(t).__name__ for t in odd if isinstance(t, bool) or not isinstance(t, numbers.Integral)}
                raise ValueError(f"prompt {i} is not a list of token ids (ints): it holds {sorted(kinds)}; "
                                 "tokenize it first (the tokenizer's input_ids)")
            if odd:
                raise ValueError(f"prompt {i} has token ids {odd[:5]} outside the vocabulary [0, {vocab})")
            out.append(prompt)
        return out

    def _step(self, sched: Scheduler, turns: TurnHandler | None) -> None:
        """One engine step: schedule, run (moves, prefill, extend, decode), postprocess."""
        step = sched.schedule()
        runner, stats = self.runner, self.last_stats
        # a sequence's routes are copied out as soon as it leaves its slot: before this step's
        # moves and prefills reuse the slot, and before a decode writes its hole row there
        runner.keep_routes(sched.take_vacated())
        for src, dst in step.moves:
            runner.move(src, dst, sched.running[dst].num_tokens)
        t0 = time.perf_counter()
        if step.prefill:
            sched.record_prefill(step.prefill, *runner.prefill(step.prefill))
        if step.chunks:
            sched.record_chunks(step.chunks, *runner.prefill_chunks(step.chunks))
            stats["prefill_chunks"] += len(step.chunks)
        runner.keep_routes(sched.take_vacated())  # finished on their first token
        t1 = time.perf_counter()
        extend = sched.extend_rows() if turns is not None else []
        if extend:
            stats["extend_tokens"] += sum(s.pending + 1 for s in extend)
            sched.record_extend(extend, *runner.extend(extend))
            runner.keep_routes(sched.take_vacated())
        t2 = time.perf_counter()
        if sched.decodable():
            sched.record_decode(*runner.decode(*sched.decode_rows()))
            stats["decode_steps"] += 1
        stats["prefill_s"] += t1 - t0
        stats["extend_s"] += t2 - t1
        stats["decode_s"] += time.perf_counter() - t2
        runner.keep_routes(sched.take_vacated())
        if turns is not None:
            for seq in sched.take_paused():
                turns.end_turn(seq)
