"""The engine's multi-turn path (pause at a turn end, append an observation, prefill only
the observation, resume) against a from-scratch forward over the whole trajectory."""

import pytest
import torch

from logprob_reference import float64_log_probs, rounding_ratio
from minihf.models import load_hf
from minihf.rollout import Engine, SamplingParams
from minihf.rollout.scheduler import FINISH_ABORT, Scheduler, Sequence
from test_rollout_engine import PROMPTS, build_tiny, one_row

STOP = tuple(range(0, 128, 5))  # ~20% of the vocabulary ends a turn: several turns per sequence


class FixedObservations:
    """Answers every turn end with observation tokens that depend on the sequence and its
    turn; ends the episode after ``turns`` turns. ``delay`` polls answer one turn per poll
    (so the other sequences keep decoding meanwhile); an answer comes ``lag`` polls after
    the turn ended (sooner when the engine waits with nothing else to do)."""

    def __init__(self, turns=3, delay=False, lag=0):
        self.turns, self.delay, self.lag = turns, delay, lag
        self.queue, self.count, self.polls = [], {}, 0

    def end_turn(self, seq):
        self.queue.append((seq, self.polls))

    def poll(self, wait):
        self.polls += 1
        ripe = [q for q, at in self.queue if self.polls - at > self.lag or wait]  # ``lag`` polls late
        take = ripe[:1] if self.delay else ripe
        self.queue = [(q, at) for q, at in self.queue if q not in take]
        out = []
        for seq in take:
            k = self.count[seq.seq_id] = self.count.get(seq.seq_id, 0) + 1
            if k >= self.turns:
                out.append((seq, None, "stop"))
            else:
                out.append((seq, [(seq.seq_id + 3 * k + j) % 120 + 1 for j in range(2 + k)], ""))
        return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mt") / "qwen3"
    build_tiny("qwen3", path)
    return path


def check_against_forward(model, prompt, seq, temperature=1.0):
    """Sampled tokens' log-probs vs a float64 forward over the whole trajectory; greedy
    tokens equal its argmax (the tiny model's peaky logits leave no near-ties)."""
    mask = torch.tensor([seq.token_mask()], dtype=torch.float32)
    exact, scale = float64_log_probs(model, one_row(prompt, seq.tokens), temperature)
    got = torch.tensor([seq.logprobs], dtype=torch.float64)
    return rounding_ratio(got, exact, scale, mask), exact


@pytest.mark.parametrize("delay", [False, True], ids=["together", "staggered"])
def test_continuation_equals_whole_trajectory_forward(tiny, delay):
    model = load_hf(tiny)
    engine = Engine(load_hf(tiny), max_num_seqs=4)  # 6 prompts over 4 slots: refill while paused
    handler = FixedObservations(turns=3, delay=delay)
    sp = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=list(STOP))
    groups = engine.generate(PROMPTS, sp, turns=handler)
    worst, turns = 0.0, 0
    for prompt, (seq,) in zip(PROMPTS, groups):
        mask = seq.token_mask()
        assert len(mask) == len(seq.tokens) == len(seq.logprobs)
        assert sum(1 for m in mask if m == 0) == sum(e - s for s, e in seq.observations)
        turns += len(seq.observations)
        ratio, exact = check_against_forward(model, prompt, seq)
        worst = max(worst, ratio)
        # greedy: each sampled token is the whole-trajectory forward's argmax
        ids = torch.tensor([prompt + seq.tokens])
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1])[None])[0, len(prompt) - 1:-1]
        argmax = logits.argmax(-1).tolist()
        for t, (tok, m) in enumerate(zip(seq.tokens, mask)):
            if m:
                assert tok == argmax[t], (seq.seq_id, t)
        assert seq.finish_reason in ("stop", "length")
        for s, e in seq.observations:  # each observation follows a turn-ending token
            assert seq.tokens[s - 1] in STOP
    assert turns >= 6, "the test should exercise several resumes"
    assert worst <= 1, worst
    assert engine.last_stats["extend_tokens"] > 0


def test_sampled_continuation_log_probs(tiny):
    model = load_hf(tiny)
    engine = Engine(load_hf(tiny), max_num_seqs=3)
    sp = SamplingParams(temperature=0.8, max_tokens=40, stop_token_ids=list(STOP), seed=7)
    groups = engine.generate(PROMPTS[:3], sp, turns=FixedObservations(turns=4, delay=True))
    worst = max(check_against_forward(model, p, g[0], 0.8)[0] for p, g in zip(PROMPTS, groups))
    assert worst <= 1, worst


def test_single_turn_path_unchanged(tiny):
    """Without a handler a stop token finishes the sequence, as before."""
    engine = Engine(load_hf(tiny), max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(STOP))
    for (seq,) in engine.generate(PROMPTS, sp):
        assert not seq.observations
        assert seq.finish_reason == "length" or seq.tokens[-1] in STOP


def test_scheduler_pause_resume_and_budget():
    sched = Scheduler(2, 32)
    a = Sequence(0, [1, 2, 3], max_tokens=8, stop_ids=frozenset({9}), multi_turn=True)
    sched.add(a)
    sched.schedule()
    sched.record_prefill([a], [9])
    assert a.paused and sched.take_paused() == [a] and a.slot is not None
    tokens, positions, seqs = sched.decode_rows()
    assert seqs == [None] and positions == [a.cached] == [3]  # a hole writing where the extend will
    assert not sched.decodable()
    sched.resume(a, [4, 5])
    assert a.pending == 2 and sched.extend_rows() == [a] and a.cached == 3
    sched.record_extend([a], [6], [0.0])
    assert a.tokens == [9, 4, 5, 6] and a.token_mask() == [1, 0, 0, 1] and a.cached == 6
    sched.record_decode([9])
    assert a.paused
    sched.resume(a, [1, 2, 3])  # 5 tokens so far, 3 more would leave no room: length
    assert a.finish_reason == "length" and a.tokens == [9, 4, 5, 6, 9]
    b = Sequence(1, [1], max_tokens=8, stop_ids=frozenset({9}), multi_turn=True)
    sched.add(b)
    sched.schedule()
    sched.record_prefill([b], [9])
    sched.resume(b, None, FINISH_ABORT)
    assert b.finish_reason == FINISH_ABORT and not sched.has_work()
    with pytest.raises(RuntimeError, match="not paused"):
        sched.resume(b, [1])


def test_turn_token_cap(tiny):
    """``max_turn_tokens``: a turn also pauses after that many sampled tokens (no stop ids)."""
    model = load_hf(tiny)
    engine = Engine(load_hf(tiny), max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=30, max_turn_tokens=4)
    groups = engine.generate(PROMPTS[:3], sp, turns=FixedObservations(turns=3))
    for prompt, (seq,) in zip(PROMPTS, groups):
        assert seq.finish_reason == "stop" and len(seq.observations) == 2
        starts = [0] + [e for _, e in seq.observations]
        ends = [s for s, _ in seq.observations] + [len(seq.tokens)]
        assert [e - s for s, e in zip(starts, ends)] == [4, 4, 4]
        assert check_against_forward(model, prompt, seq)[0] <= 1
    with pytest.raises(ValueError, match="max_turn_tokens must be an int >= 1"):
        SamplingParams(max_turn_tokens=0)


def test_eviction_when_slots_run_out(tiny):
    """2 slots for 6 multi-turn sequences whose environments answer slowly: paused
    sequences give their slots to waiting ones and come back with their whole context
    prefilled again. The trajectories equal those of a run with a slot each, and the
    log-probs stay within the rounding bound of the whole-trajectory forward."""
    model = load_hf(tiny)
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(STOP))
    roomy = Engine(load_hf(tiny), max_num_seqs=8).generate(PROMPTS, sp, turns=FixedObservations(turns=3))
    tight = Engine(load_hf(tiny), max_num_seqs=2)
    groups = tight.generate(PROMPTS, sp, turns=FixedObservations(turns=3, lag=3))
    assert tight.last_stats["evictions"] > 0
    for prompt, (a,), (b,) in zip(PROMPTS, roomy, groups):
        assert b.tokens == a.tokens and b.observations == a.observations and b.finish_reason == a.finish_reason
        assert check_against_forward(model, prompt, b)[0] <= 1


def test_scheduler_evicts_the_shortest_paused_sequence():
    sched = Scheduler(1, 32)
    a = Sequence(0, [1, 2, 3], max_tokens=8, stop_ids=frozenset({9}), multi_turn=True)
    b = Sequence(1, [4], max_tokens=8, stop_ids=frozenset({9}), multi_turn=True)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().prefill == [a]
    sched.record_prefill([a], [9])           # a pauses; b waits for the only slot
    step = sched.schedule()
    assert step.prefill == [b] and a.evicted and a.slot is None and sched.evictions == 1
    assert sched.num_paused() == 1 and sched.has_work()
    sched.resume(a, [5, 6])                  # back in line, first, with everything to prefill
    assert sched.waiting[0] is a and a.context == [1, 2, 3, 9, 5, 6] and a.pending == 0
    sched.record_prefill([b], [7])
    sched.record_decode([9])                 # b pauses: the waiting a takes its slot
    assert sched.schedule().prefill == [a] and b.evicted and not a.evicted
    sched.resume(b, None)
    assert b.finish_reason == "stop" and sched.num_paused() == 0
