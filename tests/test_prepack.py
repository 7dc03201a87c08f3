"""The decode's prepacked weights (``minihf.models.linear.PackedWeights``), the engine's CPU
fast path: which calls take them, that they never go stale, and the engine's outputs with
them against the eager path's.

The thresholds (``PACK_MIN_NUMEL``, ``MKL_PACK_MIN_NUMEL``) keep the tiny test models'
weights unpacked, and which kind a weight gets goes by the CPU's vendor (``pack_kind``), so
these tests make ``pack_kind`` give every weight one kind, each test once per kind: the same
code then runs every decode linear of >= 2 rows through oneDNN's packed weights (the path
SmolLM2-sized models take on AMD CPUs, and their LM head on Intel's) or MKL's (their layer
weights on Intel CPUs).
"""

import pytest
import torch
import torch.nn.functional as F

from minihf.models import linear as lin
from minihf.models import load_hf
from minihf.rollout import LLM

from test_decode_step import SAMPLERS, _worst
from test_rollout_engine import PROMPTS, build_tiny

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(params=[lin.ONEDNN, lin.MKL])
def pack_all(request, monkeypatch):
    """Every fp32 CPU linear weight packed, in the layout of the kind under test."""
    if request.param == lin.MKL and not lin._backends()[2]:
        pytest.skip("torch built without MKL's packed sgemm")
    monkeypatch.setattr(lin, "pack_kind", lambda *args, **kwargs: request.param)
    return request.param


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prepack") / "qwen2"  # a tied LM head (qwen2's default here)
    build_tiny("qwen2", path)
    return path


def _close(got, x, w, b=None):
    """``got`` against ``F.linear(x, w, b)`` within the two computations' rounding: each
    sums the in-features' products in some order, off the exact value by at most
    n * u * sum_i |x_i w_i| (+ u |b| for the bias add; n products, u = 2^-24), so their gap
    is within twice that. Derived per output, so it holds for any kernel on any CPU."""
    n, u = x.shape[-1], torch.finfo(torch.float32).eps / 2
    scale = x.abs() @ w.abs().T + (0 if b is None else b.abs())
    gap = (got - F.linear(x, w, b)).abs()
    assert (gap <= 2 * (n + 1) * u * scale).all(), gap.max()


def _counting(monkeypatch) -> list:
    """The packed copies the packed ops are called with, either kind's."""
    calls = []
    for name in ("_onednn_mm_t", "_mkl_mm_t"):
        real = getattr(lin, name)
        monkeypatch.setattr(lin, name, lambda *a, real=real: calls.append(a[1]) or real(*a))
    return calls


def test_which_calls_take_the_packed_weight(monkeypatch, pack_all):
    """Inside the context, without autograd, at >= PACK_MIN_ROWS rows (or one row through a
    oneDNN-packed weight of >= PACK_ONE_ROW_NUMEL), for a packed weight: the packed op;
    otherwise F.linear's.
    Values agree with F.linear within the rounding of both (``_close``)."""
    model = torch.nn.Sequential(lin.Linear(16, 8), torch.nn.Embedding(5, 16))
    packed = lin.PackedWeights(model)
    packed.refresh()
    w, b = model[0].weight, model[0].bias
    assert list(packed.table) == [id(w)] and packed.packs == 1  # the embedding is not packed
    assert packed.table[id(w)][3] == pack_all
    calls = _counting(monkeypatch)
    x = torch.randn(2, 3, 16)  # 6 rows, 3-D as the model's activations are
    with torch.no_grad():
        with packed:
            y = lin.linear(x, w, b)
            assert len(calls) == 1 and calls[0] is packed.table[id(w)][4]
            _close(y, x, w, b)
            assert y.shape == (2, 3, 8)
            lin.linear(x[0, :1], w, b)                       # 1 row: below PACK_MIN_ROWS
            lin.linear(x, torch.randn(8, 16), b)             # a weight not in the table
        lin.linear(x, w, b)                                  # outside the context
    with packed:
        lin.linear(x.requires_grad_(), w, b)                 # autograd: the training path
    assert len(calls) == 1
    monkeypatch.setattr(lin, "PACK_ONE_ROW_NUMEL", w.numel())  # one row through a weight this large:
    with torch.no_grad(), packed:                              # oneDNN's copy (MKL's only from 2 rows)
        _close(lin.linear(x[0, :1], w, b), x[0, :1], w, b)
    assert len(calls) == (2 if pack_all == lin.ONEDNN else 1)


def test_the_kind_goes_by_vendor_and_size(monkeypatch):
    """AMD CPUs pack large weights for oneDNN (MKL's generic kernels there); Intel CPUs pack
    the LM head for oneDNN and every other weight for MKL's packed sgemm, by role, not size (a
    1B model's MLP weights are as large as a small model's head); other CPUs, and torches
    without the backend, pack nothing. Decided by the CPU's vendor and the weight, the same in
    every process of a job and its resume. Where nothing pays no weight is packed, however
    large."""
    kind, big = lin.pack_kind, lin.PACK_ONE_ROW_NUMEL
    assert kind("AuthenticAMD", lin.PACK_MIN_NUMEL, True, True) == lin.ONEDNN
    assert kind("AuthenticAMD", lin.PACK_MIN_NUMEL, True, True, head=True) == lin.ONEDNN
    assert kind("AuthenticAMD", lin.PACK_MIN_NUMEL - 1, True, True) is None
    assert kind("AuthenticAMD", big, False, True) is None
    assert kind("GenuineIntel", big, True, True, head=True) == lin.ONEDNN
    assert kind("GenuineIntel", lin.PACK_MIN_NUMEL, True, True, head=True) == lin.ONEDNN
    assert kind("GenuineIntel", lin.PACK_MIN_NUMEL - 1, True, True, head=True) is None
    assert kind("GenuineIntel", big, True, True) == lin.MKL   # an MLP weight of a 1B model
    assert kind("GenuineIntel", lin.MKL_PACK_MIN_NUMEL, True, True) == lin.MKL
    assert kind("GenuineIntel", lin.MKL_PACK_MIN_NUMEL - 1, True, True) is None
    assert kind("GenuineIntel", lin.MKL_PACK_MIN_NUMEL, True, False) is None
    assert kind("GenuineIntel", big, False, True, head=True) is None
    assert kind("", big, True, True) is None and kind("", big, True, True, head=True) is None
    model = torch.nn.Sequential(lin.Linear(16, 8), lin.Linear(8, 8).double())
    for pays in (None, lin.ONEDNN):
        monkeypatch.setattr(lin, "pack_kind", lambda *args, **kwargs: pays)
        packed = lin.PackedWeights(model)
        packed.refresh()
        assert packed.packs == len(packed.table) == (pays is not None)  # never the float64 weight


def test_the_mkl_self_check_refuses_a_pack_that_serves_one_row_count():
    """Once per process, MKL's packed path is checked at several row counts from one pack; a
    kernel whose results drift at other counts (simulated: one rounding-sized error too many
    at 33 rows) is refused, so the decode would not use it."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        pytest.skip("torch built without MKL's packed sgemm")
    assert lin.mkl_pack_serves_any_rows(lin._mkl_raw)

    def drifts(x, pack, w, rows):
        y = lin._mkl_raw(x, pack, w, rows)
        return y + 1e-3 * y.abs().max() if rows == 33 else y
    assert not lin.mkl_pack_serves_any_rows(drifts)


def test_weights_the_engine_packs_by_role(monkeypatch, tiny):
    """The engine tells the LM head apart from the other weights (Intel packs it for oneDNN,
    the rest for MKL): every linear weight gets the kind ``pack_kind`` gives its role."""
    monkeypatch.setattr(lin, "pack_kind", lambda *args, head=False: lin.ONEDNN if head else lin.MKL)
    model = load_hf(tiny)
    packed = lin.PackedWeights(model)
    packed.refresh()
    kinds = {entry[3] for i, entry in packed.table.items() if i != id(model.lm_head.weight)}
    assert packed.table[id(model.lm_head.weight)][3] == lin.ONEDNN and kinds == {lin.MKL}


@pytest.mark.skipif(not lin._backends()[2], reason="torch built without MKL's packed sgemm")
@pytest.mark.parametrize("shape", [(8, 16), (37, 100), (1536, 576)])
def test_an_mkl_pack_serves_every_row_count(shape):
    """MKL documents a packed matrix for the row count it was packed with; the engine packs at
    PACK_ROWS and calls with each step's rows. Every count 1-40, and a few up to past the
    default 256 slots, against F.linear within the rounding of both (``_close``); the weight
    column-major as the engine stores other weights, with and without a bias."""
    torch.manual_seed(0)
    out_f, in_f = shape
    w = torch.randn(out_f, in_f).t().contiguous().t()
    b = torch.randn(out_f)
    pack = lin._pack(lin.MKL, w)
    for rows in [*range(1, 41), 64, 100, 257]:
        x = torch.randn(rows, in_f)
        _close(lin._mkl_mm_t(x, pack, w, b), x, w, b)
        _close(lin._mkl_mm_t(x, pack, w, None), x, w)


def test_refresh_repacks_only_what_changed(pack_all):
    """A weight written in place (a load), a parameter replaced (a wake-up): repacked with
    its new values; the others kept; clear() drops them."""
    model = torch.nn.Sequential(lin.Linear(16, 8, bias=False), lin.Linear(8, 4, bias=False))
    packed = lin.PackedWeights(model)
    packed.refresh()
    first = dict(packed.table)
    packed.refresh()
    assert packed.packs == 2 and packed.table == first
    x = torch.randn(4, 16)
    with torch.no_grad():
        model[0].weight.mul_(2)
        model[1].weight = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)
    packed.refresh()
    assert packed.packs == 4
    with torch.no_grad(), packed:
        h = model[0](x)
        _close(h, x, model[0].weight)  # the doubled values: repacked
        _close(model[1](h), h, model[1].weight)  # the new parameter's
    packed.clear()
    assert packed.table == {}


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("name", SAMPLERS)
def test_engine_with_packed_weights_matches_enforce_eager(tiny, pack_all, decode, name):
    """6 prompts over 4 slots (refills, a shrinking batch: steps of 1-4 rows, so both
    kernels run: MKL at 1 row): the same tokens as ``enforce_eager=True``, every log-prob within the
    rounding bound of a float64 forward. The tiny model's init makes logits peaky, so no
    greedy choice here is a near-tie that summation order could flip."""
    sp = SAMPLERS[name]
    want = LLM(str(tiny), max_num_seqs=4, enforce_eager=True).generate(PROMPTS, sp)
    llm = LLM(str(tiny), max_num_seqs=4, decode=decode)
    got = llm.generate(PROMPTS, sp)
    assert llm.engine.runner.packed.packs == len(llm.engine.runner.packed.table) > 0
    assert _worst(load_hf(tiny), PROMPTS, got, want, sp.temperature) <= 1


def test_packed_weights_follow_loads_and_sleep(tiny, pack_all):
    """New weights loaded into a live engine (as the hybrid engine does each step) are
    packed afresh: its outputs are a fresh engine's on those weights; sleep drops the copies
    and the next generate after wake-up and a load packs again."""
    sp = SAMPLERS["greedy"]
    llm = LLM(str(tiny), max_num_seqs=4)
    before = llm.generate(PROMPTS, sp)
    other = load_hf(tiny)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.5)
    fresh = LLM(other, max_num_seqs=4, cpu_column_major=True).generate(PROMPTS, sp)
    runner = llm.engine.runner
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            p.copy_(dict(other.named_parameters())[name])
    packs = runner.packed.packs
    after = llm.generate(PROMPTS, sp)
    assert runner.packed.packs > packs and llm.engine.last_stats["pack_s"] > 0  # repacked, timed
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in fresh]
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    llm.engine.sleep()
    assert runner.packed.table == {}
    llm.engine.wake_up()
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            p.copy_(dict(other.named_parameters())[name])
    again = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]
    assert runner.packed.table


def test_enforce_eager_and_the_default_thresholds(tiny):
    """``enforce_eager=True`` packs nothing; by default the tiny model's weights are below
    both kinds' thresholds, so a generate packs none of them (the main job's model likewise)."""
    assert LLM(str(tiny), enforce_eager=True).engine.runner.packed is None
    llm = LLM(str(tiny), max_num_seqs=4)
    llm.generate(PROMPTS, SAMPLERS["greedy"])
    assert llm.engine.runner.packed.table == {}


def test_lora_adapters_beside_packed_base_weights(tiny, pack_all):
    """The engine's LoRA layers (unmerged adapters): the base weights packed, the adapters
    on MKL beside them; same tokens as enforce_eager, log-probs within rounding."""
    import copy

    from minihf.models.lora import apply_lora, module_names

    model = load_hf(tiny)
    apply_lora(model, 4, 8.0, module_names(model, "all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)  # adapters that change the outputs
    sp = SAMPLERS["sampled"]
    want = LLM(copy.deepcopy(model), max_num_seqs=4, enforce_eager=True).generate(PROMPTS, sp)
    llm = LLM(copy.deepcopy(model), max_num_seqs=4, cpu_column_major=True)
    got = llm.generate(PROMPTS, sp)
    packed = llm.engine.runner.packed.table
    engine_model = llm.engine.model
    adapters = {id(p) for n, p in engine_model.named_parameters() if "lora_" in n}
    bases = {id(m.weight) for m in engine_model.modules() if hasattr(m, "lora_A")}
    assert bases and bases <= set(packed) and not adapters & set(packed)
    assert _worst(model, PROMPTS, got, want, sp.temperature) <= 1


def test_weights_packed_for_mkl_stay_row_major(tiny, pack_all):
    """The engine lays CPU weights out column-major, except those its decode packs for MKL:
    packing copies a row-major weight as fast as a clone, a column-major one is transposed
    first. ``enforce_eager=True`` packs nothing, so there every weight is column-major (but
    the tied LM head, an embedding's: row lookups)."""
    def layouts(llm):
        model = llm.engine.model
        tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        return {m.weight.is_contiguous() for m in model.modules()
                if isinstance(m, torch.nn.Linear) and id(m.weight) not in tied}
    row_major = pack_all == lin.MKL
    assert layouts(LLM(str(tiny), max_num_seqs=4)) == {row_major}
    assert layouts(LLM(str(tiny), max_num_seqs=4, enforce_eager=True)) == {False}
