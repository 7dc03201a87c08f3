"""Split placement: the same 2 ``ppo`` steps on 4 processes with the actor and the critic
both on ranks 0-1 (colocated) and with the actor on ranks 0-1 and the critic on 2-3
(``controller.placement``) give the same metrics within float tolerance, and in the split
run the critic's values overlap the reference log-probs and its update overlaps the
actor's (wall-clock intervals recorded on the ranks that ran them). Each role keeps 2
data-parallel ranks in both runs: a role's mini-batches are formed from its ranks' local
rows, so a different DP size would change their composition (as in verl)."""

import time

import pytest

from minihf.testing import spawn_ranks

from test_ppo import job_config

COLOCATED = {"controller.placement": "{actor: {ranks: [0, 1]}, critic: {ranks: [0, 1]}}"}
SPLIT = {"controller.placement": "{actor: {ranks: [0, 1]}, critic: {ranks: [2, 3]}}"}


def _timed(cls, name, log, rank):
    method = cls.__dict__[name]                                 # a RemoteMethod
    inner = method.fn

    def fn(self, *args, **kwargs):
        t0 = time.time()
        out = inner(self, *args, **kwargs)
        log.append((rank, name, t0, time.time()))
        return out
    method.fn = fn


def _run(rank, world, model, data, tmp):
    from minihf.controller import run
    from minihf.trainer.ppo_job import ppo_driver, ppo_roles
    from minihf.workers import ActorRolloutRefWorker, CriticWorker

    log = []
    for cls, name in ((ActorRolloutRefWorker, "update_actor"), (ActorRolloutRefWorker, "compute_ref_log_prob"),
                      (CriticWorker, "update_critic"), (CriticWorker, "compute_values")):
        _timed(cls, name, log, rank)
    out = {}
    for case, extra in (("colocated", COLOCATED), ("split", SPLIT)):
        cfg = job_config(model, data, f"{tmp}/{case}", "ppo", **{"trainer.total_training_steps": 2}, **extra)
        log.clear()
        out[case] = (run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller), list(log))
    return out


def overlaps(log, a, b):
    """Pairs of intervals of methods a and b (on different ranks) that overlap in time."""
    xs = [x for x in log if x[1] == a]
    ys = [y for y in log if y[1] == b]
    return [(x, y) for x in xs for y in ys if x[0] != y[0] and x[2] < y[3] and y[2] < x[3]]


def test_split_placement_matches_colocated_and_overlaps(tmp_path):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    init_model(tmp_path / "model", size="tiny", task="digits")
    make_task_data("digits", tmp_path / "data", 32, 8, seed=0)
    res = spawn_ranks(_run, 4, str(tmp_path / "model"), str(tmp_path / "data"), str(tmp_path),
                      timeout_s=600)
    hist = {case: res[0][case][0] for case in ("colocated", "split")}
    for a, b in zip(hist["colocated"], hist["split"]):
        assert a["step"] == b["step"]
        for key, value in a.items():
            if key.startswith(("timing_s/", "perf/")):
                continue
            # each role keeps its ranks and DP size (docstring): the same ops, so at most rounding
            # differs; rel 1e-4 is ~800 fp32 ulp, abs 1e-6 for figures near 0
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
    split = [entry for r in res for entry in r["split"][1]]
    assert {r for r, name, *_ in split if name == "update_critic"} == {2, 3}
    assert {r for r, name, *_ in split if name == "update_actor"} == {0, 1}
    assert overlaps(split, "update_actor", "update_critic")
    assert overlaps(split, "compute_ref_log_prob", "compute_values")
    colocated = [entry for r in res for entry in r["colocated"][1]]
    assert not overlaps(colocated, "update_actor", "update_critic")  # one after the other
