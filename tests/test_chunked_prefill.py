"""Chunked prefill in the engine (``enable_chunked_prefill``): contexts longer than the
step's token budget are written in pieces while the other sequences decode. The outputs
must be those of the unchunked engine: the same tokens (the tiny models' peaky logits leave
no greedy near-ties) and every log-prob within the rounding bound of a float64 forward over
the whole trajectory (a chunk attends to the cached keys of the chunks before it, so only
the summation order differs from one prefill)."""

from types import SimpleNamespace

import pytest
from minihf.models import load_hf
from minihf.rollout import LLM, SamplingParams
from minihf.rollout.engine import Engine

from test_multi_turn_engine import STOP, FixedObservations, check_against_forward
from test_rollout_engine import build_tiny

# long prompts beside short ones, so chunks and decodes share steps
PROMPTS = [list(range(1, 31)), [7, 8], list(range(40, 85)), [3, 4, 5], list(range(2, 22))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunked") / "qwen3"
    build_tiny("qwen3", path, max_position_embeddings=256)
    return path


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=0, max_tokens=10),
                                SamplingParams(temperature=0.9, max_tokens=10, seed=5, n=2)],
                         ids=["greedy", "sampled-n2"])
def test_chunked_equals_unchunked(tiny, decode, sp):
    model = load_hf(tiny)
    whole = LLM(str(tiny), max_num_seqs=3).generate(PROMPTS, sp)
    llm = LLM(str(tiny), max_num_seqs=3, max_num_batched_tokens=8, enable_chunked_prefill=True, decode=decode)
    got = llm.generate(PROMPTS, sp)
    assert llm.engine.last_stats["prefill_chunks"] >= sum(-(-len(p) // 8) for p in PROMPTS if len(p) > 8)
    for prompt, w, g in zip(PROMPTS, whole, got):
        for a, b in zip(w.outputs, g.outputs):
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason, prompt
            ratio, _ = check_against_forward(model, prompt, _as_seq(b), sp.temperature or 1.0)
            assert ratio <= 1, (prompt, ratio)


def _as_seq(out):
    """What ``check_against_forward`` reads of a Sequence, from a CompletionOutput."""
    return SimpleNamespace(tokens=out.token_ids, logprobs=out.logprobs, token_mask=lambda: [1] * len(out.token_ids))


def test_evicted_multi_turn_contexts_come_back_in_chunks(tiny):
    """2 slots for 5 multi-turn sequences with slow environments: evicted sequences return
    with contexts longer than the budget, prefilled in chunks; trajectories equal those with
    a slot each and no chunking."""
    model = load_hf(tiny)
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(STOP))
    roomy = Engine(load_hf(tiny), max_num_seqs=8).generate(PROMPTS, sp, turns=FixedObservations(turns=3))
    tight = Engine(load_hf(tiny), max_num_seqs=2, max_num_batched_tokens=8, enable_chunked_prefill=True)
    groups = tight.generate(PROMPTS, sp, turns=FixedObservations(turns=3, lag=3))
    assert tight.last_stats["evictions"] > 0 and tight.last_stats["prefill_chunks"] > 0
    for prompt, (a,), (b,) in zip(PROMPTS, roomy, groups):
        assert b.tokens == a.tokens and b.observations == a.observations and b.finish_reason == a.finish_reason
        assert check_against_forward(model, prompt, b)[0] <= 1


def test_chunked_prefill_needs_a_budget_and_reaches_the_hybrid_engine(tiny):
    import torch

    from minihf.hybrid.engine import build_engine
    from minihf.models import load_args
    from minihf.workers.config import RolloutConfig

    with pytest.raises(ValueError, match="enable_chunked_prefill cuts prefills at max_num_batched_tokens"):
        LLM(str(tiny), enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"rollout.enable_chunked_prefill=true .* set it too "
                                         r"\(e.g. rollout.max_num_batched_tokens=2048\)"):
        RolloutConfig(enable_chunked_prefill=True)
    assert RolloutConfig(enable_chunked_prefill=True, max_num_batched_tokens=64).enable_chunked_prefill
    cfg = RolloutConfig(prompt_length=8, response_length=8, enable_chunked_prefill=True, max_num_batched_tokens=4)
    engine = build_engine(load_args(tiny), cfg, torch.float32, None, torch.device("cpu"), ())
    assert engine.enable_chunked_prefill and engine.max_num_batched_tokens == 4


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_long_observations_are_written_in_chunks(tiny, decode):
    """A budget of 3 tokens: observations of 3-4 tokens (plus the turn's last sampled token)
    go in pieces instead of one extend forward; trajectories equal the unchunked engine's,
    log-probs within rounding of the whole-trajectory forward."""
    model = load_hf(tiny)
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(STOP))
    unchunked = Engine(load_hf(tiny), max_num_seqs=8)
    whole = unchunked.generate(PROMPTS, sp, turns=FixedObservations(turns=3, delay=True))
    chunked = Engine(load_hf(tiny), max_num_seqs=8, max_num_batched_tokens=3, enable_chunked_prefill=True,
                     decode=decode)
    groups = chunked.generate(PROMPTS, sp, turns=FixedObservations(turns=3, delay=True))
    # every observation (3-4 tokens, + the turn's last token) exceeds the budget: no extend runs
    assert unchunked.last_stats["extend_tokens"] > 0 and chunked.last_stats["extend_tokens"] == 0
    for prompt, (a,), (b,) in zip(PROMPTS, whole, groups):
        assert b.tokens == a.tokens and b.observations == a.observations and b.finish_reason == a.finish_reason
        assert len(b.observations) >= 1
        assert check_against_forward(model, prompt, b)[0] <= 1
