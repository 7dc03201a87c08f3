"""The static decode step (``minihf.rollout.decode_step``) against the eager one, on CPU.

On CUDA the static step is captured as a CUDA graph; here the same function runs as is
(``decode="static"``), so these tests cover the fast path's logic: the buckets, the device
buffers written in place, the on-device mask over a padded cache length, the padding rows,
sampling on the device, and when buckets are prepared (captured) again. Tokens must equal
the eager path's and log-probs stay within the rounding bound of a float64 forward: the two
paths differ only in GEMM shapes (padded rows) and the mask (the eager step at one shared
length has none), which change the summation order, not the result beyond rounding.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from logprob_reference import float64_log_probs, rounding_ratio
from minihf.models import load_hf
from minihf.rollout import LLM, SamplingParams
from minihf.rollout.decode_step import StaticDecode, bucket, default_capture_sizes, length_bucket

from test_multi_turn_engine import STOP, FixedObservations, check_against_forward
from test_rollout_engine import PROMPTS, build_tiny, one_row

SAMPLERS = {"greedy": SamplingParams(temperature=0, max_tokens=12),
            "sampled": SamplingParams(temperature=0.8, max_tokens=12, seed=7),
            "top-k/top-p": SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, seed=3)}


def test_buckets_by_hand():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(16) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="9 rows exceed the largest capture size 8"):
        bucket(9, [1, 2, 4, 8])
    assert [length_bucket(n, 4096) for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert length_bucket(300, 300) == 300 and length_bucket(20, 23) == 23  # capped at the cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("static") / "llama"
    build_tiny("llama", path)
    return path


def _worst(model, prompts, got, want, temperature) -> float:
    """The largest log-prob gap, over every token, as a fraction of its rounding bound."""
    worst = 0.0
    for prompt, g, w in zip(prompts, got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, prompt
        _, scale = float64_log_probs(model, one_row(prompt, w.token_ids), temperature or 1.0)
        worst = max(worst, rounding_ratio(torch.tensor([g.logprobs]), torch.tensor([w.logprobs]), scale,
                                          torch.ones(1, len(w.logprobs)), pairwise=True))
    return worst


@pytest.mark.parametrize("name", SAMPLERS)
def test_static_step_equals_eager_and_prepares_each_bucket_once(tiny, name):
    """6 prompts over 4 slots (refills, a shrinking batch): the same tokens as the eager step,
    log-probs within rounding; each bucket is prepared once, and a second generate over a
    cache that still fits prepares none (a captured graph would be replayed)."""
    sp = SAMPLERS[name]
    eager = LLM(str(tiny), max_num_seqs=4).generate(PROMPTS, sp)
    llm = LLM(str(tiny), max_num_seqs=4, decode="static", cudagraph_capture_sizes=[1, 2])
    got = llm.generate(PROMPTS, sp)
    stats = llm.engine.last_stats
    used = set(llm.engine.runner.static.steps)
    assert stats["captures"] == len(used) >= 2, (stats, used)  # no bucket prepared twice
    assert {rows for rows, *_ in used} <= {1, 2, 4}             # capture sizes, then the cache's 4 slots
    assert _worst(load_hf(tiny), PROMPTS, got, eager, sp.temperature) <= 1
    again = llm.generate(PROMPTS, sp)
    assert llm.engine.last_stats["captures"] == 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]


def test_static_step_is_batch_invariant_with_bucket_padding(tiny):
    """A request alone (bucket 1) and among 2, 4 and 10 others (buckets padded with rows
    that sample from token 0): the same tokens, log-probs within rounding."""
    sp = SAMPLERS["sampled"]
    model = load_hf(tiny)
    llm = LLM(load_hf(tiny), decode="static", cudagraph_capture_sizes=[1, 4, 8])
    prompt = PROMPTS[0]
    alone = llm.generate([prompt], sp)[0]
    g = torch.Generator().manual_seed(0)
    for others in (2, 4, 10):
        batch = [torch.randint(1, 100, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (others,), generator=g)]
        params = [SamplingParams(temperature=1.0, max_tokens=int(m), seed=100 + i)
                  for i, m in enumerate(torch.randint(1, 16, (others,), generator=g))]
        at = others // 2
        outs = llm.generate(batch[:at] + [prompt] + batch[at:], params[:at] + [sp] + params[at:])
        assert _worst(model, [prompt], [outs[at]], [alone], sp.temperature) <= 1, others


def test_static_step_with_multi_turn_extends_and_a_long_cache(tmp_path):
    """Multi-turn (paused rows are holes, extends between decodes) and a cache longer than
    the first length bucket (256), so a generation crosses into the next bucket (512)."""
    path = tmp_path / "qwen3"
    build_tiny("qwen3", path, max_position_embeddings=1024)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(STOP), max_turn_tokens=6)
    runs = {}
    for mode in ("eager", "static"):
        llm = LLM(str(path), max_num_seqs=2, decode=mode)
        runs[mode] = [g[0] for g in llm.engine.generate(prompts, sp, turns=FixedObservations(turns=3, delay=True))]
    model = load_hf(path)
    for prompt, e, s in zip(prompts, runs["eager"], runs["static"]):
        assert s.tokens == e.tokens and s.finish_reason == e.finish_reason and len(s.observations) >= 1
        assert check_against_forward(model, prompt, s)[0] <= 1
    long = LLM(str(path), max_num_seqs=2, decode="static")
    out = long.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0].outputs[0]
    eager = LLM(str(path), max_num_seqs=2).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=300,
                                                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == eager.token_ids
    assert {length for _, length, *_ in long.engine.runner.static.steps} == {256, 303}  # cache max_len 303


def test_decode_modes_and_their_errors(tiny):
    llm = LLM(str(tiny))
    assert llm.engine.runner.decode_mode == "eager"  # CPU: the eager step, whatever enforce_eager says
    with pytest.raises(ValueError, match="decode='fast'; choose one of"):
        LLM(str(tiny), decode="fast")
    with pytest.raises(ValueError, match="captures CUDA graphs, but the device is cpu"):
        LLM(str(tiny), decode="graph")


def test_rollout_keys_reach_the_engine_and_bad_values_are_refused(tiny):
    """``rollout.enforce_eager`` / ``cudagraph_capture_sizes`` as the hybrid engine builds its
    engine (CPU: the eager step whatever enforce_eager says; the sizes are kept for CUDA)."""
    from minihf.hybrid.engine import build_engine
    from minihf.models import load_args
    from minihf.workers.config import RolloutConfig

    for eager in (False, True):
        cfg = RolloutConfig(prompt_length=8, response_length=8, enforce_eager=eager, cudagraph_capture_sizes=[4, 1])
        engine = build_engine(load_args(tiny), cfg, torch.float32, None, torch.device("cpu"), ())
        assert engine.runner.decode_mode == "eager" and engine.runner.capture_sizes == [1, 4]
        assert (engine.runner.packed is None) == eager  # CPU's fast path: the prepacked weights
    for bad in ([], [0], [2.5], "8"):
        with pytest.raises(ValueError, match=r"rollout.cudagraph_capture_sizes=.* must be a non-empty list of ints >= 1"):
            RolloutConfig(cudagraph_capture_sizes=bad)


def test_each_generate_writes_its_own_sampling_parameters(tiny):
    """Calls in a row on one engine with other sampling parameters: a new call's sequences
    may reuse the ids of the last call's dead ones, so the static step's parameter buffers
    are written afresh each call (the eager path rebuilds them likewise)."""
    static = LLM(str(tiny), max_num_seqs=4, decode="static")
    eager = LLM(str(tiny), max_num_seqs=4)
    for sp in (SAMPLERS["greedy"], SAMPLERS["top-k/top-p"], SAMPLERS["greedy"], SAMPLERS["sampled"]):
        got, want = static.generate(PROMPTS, sp), eager.generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], sp
    # whether CPython reuses the ids is up to its allocator: the reset itself, deterministically
    runner = static.engine.runner
    assert runner.static._composition is not None
    runner.ensure_cache(len(PROMPTS), 8)  # the first thing each generate does
    assert runner.static._composition is None


class HostReads(TorchDispatchMode):
    """Records the ops that a CUDA graph cannot capture because the host waits for the
    device's data: a value read on the host (``.item()``, ``int(t)``, ``if t:``: ``item``
    or ``_local_scalar_dense``, whichever the mode sees), an output whose shape depends on
    the data (``nonzero``, a boolean index, ``unique``, ``masked_select``,
    ``repeat_interleave`` without its size, ``bincount``; ``equal`` answers on the host), and
    a tensor made from Python data inside the step (a constant frozen at capture).
    ``tolist``/``numpy``/``cpu`` are not seen as a device read on the CPU: the caller
    patches them. What it does not list it does not see.

    ``reads`` collects the storages the step reads that it did not make (weights, the KV
    cache, the static buffers, RoPE's table): a replayed graph reads them at the addresses
    they had at capture."""

    DATA_SHAPED = {"nonzero", "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive",
                   "bincount", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []
        self.reads: set[int] = set()
        self._made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        kwargs = kwargs or {}
        index = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        if (name in ("item", "_local_scalar_dense", "lift_fresh") or name in self.DATA_SHAPED
                or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
                or (name == "repeat_interleave" and kwargs.get("output_size") is None)):
            self.hits.append(str(func))
        for t in _tensors((args, kwargs)):
            if t.untyped_storage().data_ptr() not in self._made:
                self.reads.add(t.untyped_storage().data_ptr())
        out = func(*args, **kwargs)
        self._made.update(p for t in _tensors(out) if (p := t.untyped_storage().data_ptr()) not in self.reads)
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _watch_host_reads(monkeypatch) -> dict:
    """Runs every static step's body under :class:`HostReads`, as if a CUDA graph were being
    captured (what checks for that, MoE's choice of its dense path, says yes); returns the
    tally: steps run, host reads, and the buckets whose later runs (replays) read storages
    other than their first run read (on CUDA the first run is the uncaptured warm-up
    and the second the capture: every run must read the same storages)."""
    from minihf.models import moe

    seen = {"steps": 0, "hits": [], "moved": []}
    make = StaticDecode._body

    def refuse(*_, **__):
        raise AssertionError("tolist()/numpy()/cpu() inside the static decode step")

    def watched_body(self, key, forward, cache):
        body = make(self, key, forward, cache)
        captured: set[int] = set()

        def run():
            with HostReads() as probe, monkeypatch.context() as m:
                m.setattr(torch.Tensor, "tolist", refuse)
                m.setattr(torch.Tensor, "numpy", refuse)
                m.setattr(torch.Tensor, "cpu", refuse)
                m.setattr(moe, "_capturing", lambda: True)
                body()
            seen["steps"] += 1
            seen["hits"] += probe.hits
            if not captured:  # the first run: what every later one, the capture too, must read
                captured.update(probe.reads)
            elif probe.reads != captured:
                seen["moved"].append(key)
        return run

    monkeypatch.setattr(StaticDecode, "_body", watched_body)
    return seen


def test_the_probe_sees_what_a_graph_cannot_capture():
    t = torch.arange(6)
    for read in (lambda: int(t.max()), lambda: bool(t.any()), lambda: t[t > 2], lambda: t.nonzero(),
                 lambda: torch.tensor([1, 2]), lambda: t.repeat_interleave(t), lambda: t.unique(),
                 lambda: t.bincount(), lambda: torch.equal(t, t)):
        with HostReads() as probe:
            read()
        assert probe.hits, read
    with HostReads() as probe:
        t[t.clamp(max=3)] + t.masked_fill(t > 2, 0)  # data-independent shapes: captureable
    assert probe.hits == []


@pytest.mark.parametrize("case", ["greedy", "top-k/top-p", "moe-routes", "lora"])
def test_the_static_step_never_waits_on_the_device(tiny, tmp_path, monkeypatch, case):
    """What CUDA graphs capture, checked on CPU: every op the static step runs (the model,
    the cache's mask and writes, the sampler, MoE routing, its dense experts and the
    routes' recording, unmerged LoRA adapters) leaves the host free. One such op would fail the capture on CUDA, or freeze
    a value read at capture time into every replay."""
    from minihf.models.lora import apply_lora, module_names
    from minihf.rollout.engine import Engine

    seen = _watch_host_reads(monkeypatch)
    sp = SAMPLERS["top-k/top-p" if case == "top-k/top-p" else "greedy"]
    if case == "moe-routes":
        build_tiny("qwen3_moe", tmp_path / "moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        engine = Engine(load_hf(tmp_path / "moe"), max_num_seqs=4, decode="static", record_routes=True)
        engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    else:
        model = load_hf(tiny)
        if case == "lora":
            apply_lora(model, 4, 8.0, module_names(model, "all-linear"))
        LLM(model, max_num_seqs=4, decode="static", cudagraph_capture_sizes=[1, 2]).generate(PROMPTS, sp)
    assert seen["steps"] >= 10 and seen["hits"] == [] and seen["moved"] == [], seen


def test_replays_read_what_was_captured_or_the_graphs_are_dropped(tiny, monkeypatch):
    """Generates after the weights were written in place (as a weight sync writes them:
    the graphs are replayed), after sleep and wake-up (new storage: recaptured), after a
    parameter was replaced (``load_state_dict(assign=True)``, new storage without sleep:
    recaptured) and after RoPE's table was rebuilt by a longer forward (recaptured). In
    every case each replay reads the storages its capture read."""
    seen = _watch_host_reads(monkeypatch)
    model = load_hf(tiny)
    llm = LLM(model, max_num_seqs=4, decode="static", cudagraph_capture_sizes=[1, 2])
    sp = SAMPLERS["greedy"]
    first = llm.generate(PROMPTS, sp)
    saved = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    llm.generate(PROMPTS, sp)
    assert llm.engine.last_stats["captures"] == 0  # written in place: replayed
    llm.engine.sleep()
    llm.engine.wake_up()
    llm.engine.runner.model.load_state_dict(saved)
    again = llm.generate(PROMPTS, sp)
    assert llm.engine.last_stats["captures"] > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    model = llm.engine.runner.model
    model.load_state_dict({n: t * 0.5 for n, t in saved.items()}, assign=True)
    llm.generate(PROMPTS, sp)
    assert llm.engine.last_stats["captures"] > 0  # the weights moved: the old graphs are gone
    with torch.no_grad():
        model(torch.zeros(1, 600, dtype=torch.long))  # another forward grows (rebuilds) RoPE's table
    llm.generate(PROMPTS, sp)
    assert llm.engine.last_stats["captures"] > 0
    assert seen["steps"] >= 20 and seen["moved"] == [], seen


def test_a_bucket_is_captured_at_its_second_use_and_no_step_runs_twice(tiny, monkeypatch):
    """On CUDA a bucket's first use runs its step as is (which warms the capture up), its
    second use captures it, later ones replay: a bucket used once is never captured, and no
    step is computed twice. The capture is faked here (it records the call and returns the
    body as the replay), over the static step with ``capture`` on: the CUDA path's bookkeeping
    on the CPU. Replacing a parameter drops the graphs, and with them the uses counted."""
    from collections import Counter

    uses, runs, captured = [], [0], []
    make, run, init = StaticDecode._body, StaticDecode.run, StaticDecode.__init__

    def counted_body(self, key, forward, cache):
        body = make(self, key, forward, cache)

        def counted():
            runs[0] += 1
            body()
        return counted

    def recorded_run(self, rows, length, *args):
        out = run(self, rows, length, *args)
        uses.append((rows, length, *self._flags))
        return out

    monkeypatch.setattr(StaticDecode, "__init__", lambda self, rows, device, capture: init(self, rows, device, True))
    monkeypatch.setattr(StaticDecode, "_body", counted_body)
    monkeypatch.setattr(StaticDecode, "run", recorded_run)
    monkeypatch.setattr(StaticDecode, "_capture", lambda self, body: captured.append(body) or body)
    # 6 prompts over 4 slots: buckets of 4 and 2 rows used several times, of 1 row once
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 4, 4, 4, 6, 7)]
    eager = LLM(str(tiny), max_num_seqs=4).generate(PROMPTS, params)
    llm = LLM(str(tiny), max_num_seqs=4, decode="static", cudagraph_capture_sizes=[1, 2])
    static = lambda: llm.engine.runner.static  # noqa: E731
    got = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]
    counts = Counter(uses)
    assert runs[0] == len(uses)  # every step computed once: no warm-up run beside it
    assert set(static().steps) == {k for k, c in counts.items() if c >= 2} != set()
    assert set(static()._first) == {k for k, c in counts.items() if c == 1} != set(), counts
    assert llm.engine.last_stats["captures"] == len(captured) == len(static().steps)
    once = set(static()._first)
    uses.clear()
    llm.generate(PROMPTS, params)  # the buckets used once are used again: captured now
    assert llm.engine.last_stats["captures"] == len(once) and static()._first == {}
    assert runs[0] == len(uses) + sum(counts.values())
    llm.generate(PROMPTS, params)
    assert llm.engine.last_stats["captures"] == 0  # every bucket replayed
    model = llm.engine.runner.model
    model.load_state_dict({n: t.clone() for n, t in model.state_dict().items()}, assign=True)
    uses.clear()
    llm.generate(PROMPTS, params)  # the weights moved: counted from scratch
    assert llm.engine.last_stats["captures"] == len(static().steps) == len({k for k, c in Counter(uses).items() if c >= 2})


def test_a_buckets_first_use_takes_the_path_its_capture_takes():
    """On CUDA a bucket's first use runs uncaptured; MoE takes its dense experts there as in
    the capture (not the grouped path, whose sums are ordered otherwise), so the first use
    computes what the replays do, and the dense path's kernels are warmed up before the capture."""
    from minihf.models import moe
    from minihf.rollout.decode_step import _as_captured

    seen = []
    _as_captured(lambda: seen.append(moe._capturing()))()
    assert seen == [True] and not moe._capturing()
