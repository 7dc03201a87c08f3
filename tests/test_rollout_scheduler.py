"""Scheduler: slot bookkeeping and continuous-batching decisions, without torch."""

import sys

import pytest

from minihf.rollout.scheduler import FINISH_LENGTH, FINISH_STOP, Scheduler, Sequence


def seq(i, prompt_len=3, max_tokens=4, **kw):
    return Sequence(seq_id=i, prompt=list(range(1, prompt_len + 1)), max_tokens=max_tokens, **kw)


def drive(sched, next_token):
    """Run the scheduler with a fake model: ``next_token(seq)`` gives each sampled token."""
    trace = []
    while sched.has_work():
        step = sched.schedule()
        trace.append(("step", [s.seq_id for s in step.prefill], list(step.moves)))
        if not sched.waiting:  # compaction keeps running slots dense once nothing waits
            assert set(sched.running) == set(range(len(sched.running)))
        sched.record_prefill(step.prefill, [next_token(s) for s in step.prefill])
        if sched.num_rows:
            toks, pos, seqs = sched.decode_rows()
            for s, p in zip(seqs, pos):
                if s is not None:
                    assert p == s.num_tokens - 1
            sched.record_decode([next_token(s) if s is not None else 0 for s in seqs])
    return trace


def test_scheduler_does_not_import_torch():
    import subprocess

    import minihf.rollout.scheduler as m

    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('sched', {m.__file__!r}); "
        "mod = importlib.util.module_from_spec(spec); sys.modules['sched'] = mod; spec.loader.exec_module(mod); "
        "assert 'torch' not in sys.modules, 'scheduler imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_length_and_stop_reasons():
    sched = Scheduler(max_num_seqs=4, max_model_len=100)
    a, b, c = seq(0, max_tokens=5), seq(1, max_tokens=5, stop_ids=frozenset({7})), seq(2, eos_ids=frozenset({9}), ignore_eos=True, max_tokens=3)
    for s in (a, b, c):
        sched.add(s)
    drive(sched, lambda s: 7 if s.seq_id == 1 and len(s.tokens) == 1 else 9)
    assert a.finish_reason == FINISH_LENGTH and len(a.tokens) == 5
    assert b.finish_reason == FINISH_STOP and b.tokens == [9, 7]  # stop token included
    assert c.finish_reason == FINISH_LENGTH and c.tokens == [9, 9, 9]  # EOS ignored
    d = seq(3, eos_ids=frozenset({9}))
    sched.add(d)
    drive(sched, lambda s: 9)
    assert d.finish_reason == FINISH_STOP and d.tokens == [9]


def test_max_model_len_finishes_with_length():
    sched = Scheduler(max_num_seqs=2, max_model_len=10)
    s = seq(0, prompt_len=7, max_tokens=100)
    sched.add(s)
    drive(sched, lambda s: 1)
    assert s.finish_reason == FINISH_LENGTH and s.num_tokens == 10


def test_refill_and_compaction():
    sched = Scheduler(max_num_seqs=2, max_model_len=100)
    lens = {0: 1, 1: 6, 2: 2, 3: 5}
    seqs = [seq(i, max_tokens=lens[i]) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s.slot for s in step.prefill] == [0, 1] and step.moves == []
    sched.record_prefill(step.prefill, [5, 5])  # seq 0 finishes (max_tokens=1), slot 0 free
    assert seqs[0].finish_reason == FINISH_LENGTH and seqs[0].slot is None
    step = sched.schedule()  # seq 2 refills slot 0
    assert [s.seq_id for s in step.prefill] == [2] and seqs[2].slot == 0
    sched.record_prefill(step.prefill, [5])
    trace = drive(sched, lambda s: 5)
    assert all(s.finish_reason == FINISH_LENGTH for s in seqs)
    assert [len(s.tokens) for s in seqs] == [1, 6, 2, 5]
    # seq 3 refills slot 0 after seq 2; seq 1 (slot 1) finishes first, so no move is needed.
    assert [t[1] for t in trace if t[1]] == [[3]]
    assert sched.running == {} and sorted(sched._free) == [0, 1]


def test_compaction_moves_highest_into_lowest_hole():
    sched = Scheduler(max_num_seqs=4, max_model_len=100)
    seqs = [seq(i, max_tokens=10) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    sched.record_prefill(step.prefill, [1, 1, 1, 1])
    # finish slots 0 and 2 by hand
    seqs[0].max_tokens = seqs[2].max_tokens = 2
    sched.record_decode([1, 1, 1, 1])
    assert sched.num_rows == 4 and set(sched.running) == {1, 3}
    step = sched.schedule()
    assert step.moves == [(3, 0)] and seqs[3].slot == 0 and sched.num_rows == 2
    toks, pos, rows = sched.decode_rows()
    assert rows == [seqs[3], seqs[1]] and pos == [seqs[3].num_tokens - 1, seqs[1].num_tokens - 1]


def test_batched_token_budget_and_fifo():
    sched = Scheduler(max_num_seqs=8, max_model_len=100, max_num_batched_tokens=10)
    for i in range(4):
        sched.add(seq(i, prompt_len=4))
    step = sched.schedule()
    assert [s.seq_id for s in step.prefill] == [0, 1]  # 8 tokens; the third would exceed 10
    step = sched.schedule()
    assert [s.seq_id for s in step.prefill] == [2, 3]
    # the budget is inclusive: prompts filling it exactly are admitted together
    exact = Scheduler(max_num_seqs=8, max_model_len=100, max_num_batched_tokens=10)
    for i, n in enumerate((4, 6, 1)):
        exact.add(seq(i, prompt_len=n))
    assert [s.seq_id for s in exact.schedule().prefill] == [0, 1]
    big = Scheduler(max_num_seqs=2, max_model_len=100, max_num_batched_tokens=4)
    big.add(seq(0, prompt_len=50))
    assert len(big.schedule().prefill) == 1  # a long prompt is never starved


def test_every_sequence_finishes_with_random_lengths():
    import random

    rng = random.Random(0)
    sched = Scheduler(max_num_seqs=3, max_model_len=40)
    seqs = [seq(i, prompt_len=rng.randint(1, 10), max_tokens=rng.randint(1, 40), stop_ids=frozenset({3})) for i in range(30)]
    for s in seqs:
        sched.add(s)
    drive(sched, lambda s: rng.randint(0, 20))
    assert len(sched.finished) == 30
    for s in seqs:
        assert s.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        if s.finish_reason == FINISH_STOP:
            assert s.tokens[-1] == 3 and 3 not in s.tokens[:-1]
        else:
            assert 3 not in s.tokens and (len(s.tokens) == s.max_tokens or s.num_tokens == 40)


def test_bad_inputs_raise_clearly():
    sched = Scheduler(max_num_seqs=1, max_model_len=5)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq(0, prompt_len=5))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Sequence(seq_id=1, prompt=[], max_tokens=2))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(max_num_seqs=0, max_model_len=5)


def test_chunked_prefill_cuts_long_contexts_and_the_others_keep_decoding():
    """Budget 8 tokens a step: a running sequence decodes every step while a 20-token prompt
    is written 5 + 8 + 7 (its row a hole until then, at the position its next chunk writes);
    chunks under way go before admissions, and a prompt that does not fit what is left is
    admitted with a chunk that fills it. Each sequence's first token comes after its last
    chunk."""
    sched = Scheduler(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8, enable_chunked_prefill=True)
    a, long, b = seq(0, prompt_len=3, max_tokens=10), seq(1, prompt_len=20, max_tokens=2), seq(2, prompt_len=5)
    for s in (a, long, b):
        sched.add(s)
    trace = []
    for _ in range(4):
        step = sched.schedule()
        trace.append(([s.seq_id for s in step.prefill], [(s.seq_id, i, j) for s, i, j in step.chunks]))
        sched.record_prefill(step.prefill, [5] * len(step.prefill))
        done = [s for s, _, j in step.chunks if j == len(s.context)]
        sched.record_chunks(step.chunks, [6] * len(done), [0.0] * len(done))
        tokens, positions, seqs = sched.decode_rows()
        for s in (long, b):
            if s.prefilled is not None:  # a hole, writing where its next chunk starts
                assert seqs[s.slot] is None and positions[s.slot] == s.prefilled == s.cached
        sched.record_decode([7 if s else 0 for s in seqs])
    assert trace == [([0], [(1, 0, 5)]),              # a whole (3), long's first chunk fills the 5 left
                     ([], [(1, 5, 13)]),              # long's chunk first: nothing left for b
                     ([], [(1, 13, 20), (2, 0, 1)]),  # long's last chunk (7), b's first (the 1 left)
                     ([], [(2, 1, 5)])]
    assert a.tokens == [5, 7, 7, 7, 7]                # a decoded in every step
    assert long.tokens == [6, 7] and long.finish_reason == FINISH_LENGTH
    assert b.tokens == [6, 7] and b.prefilled is None and not sched.chunking


def test_chunked_prefill_off_admits_a_long_prompt_whole():
    """Off, the same budget admits a long prompt whole when nothing else is admitted."""
    sched = Scheduler(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=8)
    sched.add(seq(0, prompt_len=20))
    step = sched.schedule()
    assert [s.seq_id for s in step.prefill] == [0] and step.chunks == []
