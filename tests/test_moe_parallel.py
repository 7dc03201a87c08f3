"""A mixture-of-experts model in the engine and under parallelism: greedy generation vs
transformers (Qwen3-MoE and Mixtral), TP=2 vs the unsharded model (each expert split as a
dense MLP is, the router replicated), FSDP on 2 ranks vs one process with the
load-balancing loss (plain and with activation checkpointing), and the hybrid engine's
reshard of expert weights (exact slices, hybrid and naive modes generating alike)."""

import pytest
import torch

from minihf.testing import spawn_ranks

from test_hybrid_reshard import _rank as reshard_rank
from test_rollout_engine import build_tiny, hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [5, 6, 7]]
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"qwen3_moe": (str(root / "qwen3_moe"), build_tiny("qwen3_moe", root / "qwen3_moe", heads=8,
                                                             kv_heads=4, **QWEN3_MOE)),
            "mixtral": (str(root / "mixtral"), build_tiny("mixtral", root / "mixtral", heads=8, kv_heads=4,
                                                         num_local_experts=4, num_experts_per_tok=2,
                                                         intermediate_size=48, sliding_window=None))}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engine_greedy_matches_transformers(moe_dirs, arch):
    from minihf.rollout import LLM, SamplingParams

    path, hf = moe_dirs[arch]
    for enforce_eager in (True, False):  # the eager and the static decode step
        llm = LLM(path, max_num_seqs=3, enforce_eager=enforce_eager)  # 5 prompts over 3 slots: refills
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10), (arch, enforce_eager, prompt)


def _tp_rank(rank, world, path):
    import torch.distributed as dist

    from minihf.models import load_hf
    from minihf.parallel.tp import ColumnParallelLinear, RowParallelLinear, apply_tp
    from minihf.rollout import LLM, SamplingParams

    ids = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    ref = load_hf(path)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with torch.no_grad():
        ref_logits = ref(ids, pos)
    ref_tokens = [o.outputs[0].token_ids for o in LLM(ref, max_num_seqs=3).generate(PROMPTS, greedy)]
    model = apply_tp(load_hf(path), dist.group.WORLD)
    moe = model.model.layers[0].ffn
    expert = moe.experts[3]
    up, down = (expert.up_proj, expert.down_proj) if hasattr(expert, "up_proj") else (expert.w3, expert.w2)
    kinds = (type(moe.gate).__name__, isinstance(up, ColumnParallelLinear), isinstance(down, RowParallelLinear),
             tuple(down.weight.shape))
    with torch.no_grad():
        logits = model(ids, pos)
    tokens = [o.outputs[0].token_ids for o in LLM(model, max_num_seqs=3).generate(PROMPTS, greedy)]
    return dict(kinds=kinds, logit_diff=(logits - ref_logits).abs().max().item(), same=tokens == ref_tokens)


@pytest.mark.parametrize("arch, down", [("qwen3_moe", (64, 16)), ("mixtral", (64, 24))])
def test_tp2_matches_tp1(moe_dirs, arch, down):
    """Logits within test_tp's bound (fp32, only the summation order of the split matmuls
    differs: 6e-5); greedy tokens identical."""
    for r in spawn_ranks(_tp_rank, 2, moe_dirs[arch][0], timeout_s=240):
        assert r["kinds"] == ("Linear", True, True, down), r["kinds"]  # router whole, experts split
        assert r["logit_diff"] < 6e-5, r["logit_diff"]
        assert r["same"]


ARGS = dict(arch="qwen3_moe", vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=64, qk_norm=True, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, initializer_range=0.1)


def _ce_sum(model, tokens, stats=None):
    from minihf.models.moe import MoEStep

    logits = model(tokens, moe=MoEStep(stats) if stats is not None else None).float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1), reduction="sum")


def _fsdp_rank(rank, world):
    import torch.distributed as dist

    from minihf.models import ModelArgs, build_model, init_weights
    from minihf.models.moe import RouterStats
    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh

    coef = 0.5
    tokens = torch.randint(0, 48, (4, 7), generator=torch.Generator().manual_seed(3))
    count = tokens[:, 1:].numel()

    def fresh():
        return init_weights(build_model(ModelArgs(**ARGS)), seed=1)

    ref = fresh()  # one process: each rank's rows with their own load-balancing loss, weight 1/2
    for r in range(world):
        stats = RouterStats(8)
        loss = _ce_sum(ref, tokens[2 * r:2 * r + 2], stats) / count
        stats.weight = coef / world
        loss.backward()
    errs = {}
    for name, kw in (("plain", {}), ("ckpt", dict(activation_checkpointing=True))):
        model = apply_fsdp(fresh(), fsdp_mesh(dist.group.WORLD, "cpu"), **kw)
        stats = RouterStats(8)
        loss = _ce_sum(model, tokens[2 * rank:2 * rank + 2], stats) / count
        stats.weight = coef / world * world  # the share, times FSDP's DP averaging (as the actor sets it)
        (loss * world).backward()
        errs[name] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                         for p, q in zip(model.parameters(), ref.parameters()))
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    return dict(errs=errs, scale=scale)


def test_fsdp_with_load_balancing_loss_matches_one_process():
    """Gradients of FSDP on 2 ranks (each expert's weights sharded like any parameter, the
    aux gradient entered inside each block's backward) equal one process's; sums in
    another order: 32 ulp of the largest gradient (test_fsdp's bound)."""
    for r in spawn_ranks(_fsdp_rank, 2, timeout_s=240):
        for name, err in r["errs"].items():
            assert err <= 32 * 2**-24 * max(1.0, r["scale"]), (name, err, r["scale"])


def test_reshard_moves_exact_expert_slices(moe_dirs):
    results = spawn_ranks(reshard_rank, 2, [("qwen3_moe", moe_dirs["qwen3_moe"][0], 2)], timeout_s=300)
    for res in results:
        for key, r in res.items():
            if key[2] == "same_tokens":
                assert r, key
                continue
            assert r["worst"] == 0.0 and r["asleep"] and r["as_planned"], (key, r)


def _grpo_moe(rank, world, model, data, tmp, modes):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    from test_recipes import overrides

    out = {}
    for mode in modes:
        extra = {"actor_rollout_ref.actor.router_replay": mode, "actor_rollout_ref.rollout.check_log_probs": "error",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "actor_rollout_ref.actor.ppo_epochs": 2}
        cfg = load_config(PPOJobConfig, "grpo_moe", overrides(model, data, f"{tmp}/{mode}", **extra))
        out[mode] = run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)
    return out


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("grpo_moe")
    init_model(root / "model", arch="qwen3_moe", size="tiny", task="sort")
    make_task_data("sort", root / "data", 32, 4, seed=0)
    return str(root / "model"), str(root / "data")


def test_grpo_moe_recipe_on_two_ranks_with_each_replay_mode(tiny_moe, tmp_path):
    """recipes/grpo_moe, 2 steps on 2 ranks (FSDP over both, the rollout at TP 2), with
    router_replay disabled, R2 and R3; ``check_log_probs=error`` holds in every mode (the
    rollout's log-probs within the rounding bound of the trainer's)."""
    model, data = tiny_moe
    res = spawn_ranks(_grpo_moe, 2, model, data, str(tmp_path), ["disabled", "R2", "R3"], timeout_s=600)[0]
    for mode, hist in res.items():
        steps = [h for h in hist if h["step"] > 0]
        assert [h["step"] for h in steps] == [1, 2], mode
        for h in steps:
            assert h["actor/moe_aux_loss"] > 0, (mode, h)
            assert h["training/rollout_log_prob_bound_ratio"] <= 1, (mode, h)
            # R3 compares the trainer's own choices with the rollout's: fp32 on one host,
            # so they agree but for near-ties (a few in a thousand at most)
            assert ("actor/router_disagreement" in h) == (mode == "R3"), (mode, h)
            if mode == "R3":
                assert 0 <= h["actor/router_disagreement"] <= 0.01, h


def test_grpo_moe_with_r3_stopped_and_resumed_equals_the_uninterrupted_run(tiny_moe, tmp_path):
    """Routing replay carries no state across steps (the routes travel with each step's
    batch), so a resumed run repeats the uninterrupted one exactly: every metric but the
    timings, the load-balancing loss and the disagreement included."""
    from test_ppo import _runs

    model, data = tiny_moe
    extra = {"trainer.total_training_steps": 4, "trainer.save_freq": 2,
             "actor_rollout_ref.actor.router_replay": "R3"}
    cases = [("full", "grpo_moe", None, "full", extra), ("first", "grpo_moe", 2, "resumed", extra),
             ("rest", "grpo_moe", None, "resumed", extra)]
    res = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=600)[0]

    def strip(h):  # (a resumed engine syncs every weight once more: perf/reshard_bytes differs)
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))}
    assert [strip(h) for h in res["full"]] == [strip(h) for h in res["first"] + res["rest"]]
    assert all("actor/router_disagreement" in h and "actor/moe_aux_loss" in h for h in res["full"] if h["step"])


@pytest.mark.slow
def test_standalone_rollout_with_r3_equals_colocated(tiny_moe, tmp_path):
    """A MoE actor on ranks 0-1 and a TP-2 standalone rollout on ranks 2-3 (weights sent
    point to point, each rank its slice of every expert; the rollout's routes travel with
    the batch) train exactly as the colocated hybrid engine does, with R3 on."""
    from test_standalone import COLOCATED, RUN, STANDALONE, _run, slice_bytes, strip

    model, data = tiny_moe
    r3 = {**RUN, "actor_rollout_ref.actor.router_replay": "R3", "async_training.staleness": 0}
    cases = [("colocated", None, "colocated", {**COLOCATED, **r3}),
             ("standalone", None, "standalone", {**STANDALONE, **r3})]
    res = spawn_ranks(_run, 4, model, data, str(tmp_path), cases, timeout_s=900)
    hist = {name: res[0][name][0] for name, *_ in cases}
    assert strip(hist["standalone"]) == strip(hist["colocated"])
    steps = [h for h in hist["standalone"] if h["step"] > 0]
    assert [h.get("perf/weight_sync_bytes") for h in steps] == [None] + [slice_bytes(model, 2)] * 2
    assert all("actor/router_disagreement" in h for h in steps)


@pytest.mark.slow
def test_grpo_moe_learns_with_r3(tmp_path):
    """recipes/grpo_moe from an empty dir (data, the random-init MoE model, its SFT warm
    start built first) with routing replay R3 and ``check_log_probs=error``: the validation
    score rises by >= 0.3 and every step's rollout log-probs are within rounding of the
    trainer's (its rows are the run's). Wall time is printed (the issue asks for 10 minutes
    on 2 CPU cores; docs/models.md has the measured figure)."""
    import json

    from test_controller_launch import run_main_job

    before, after, elapsed, log = run_main_job(
        tmp_path, "recipe=grpo_moe", "actor_rollout_ref.actor.router_replay=R3",
        "actor_rollout_ref.rollout.check_log_probs=error")
    print(f"grpo_moe with R3: validation {before:.3f} -> {after:.3f} in {elapsed:.0f}s")
    assert after - before >= 0.3, log
    rows = [json.loads(line) for line in
            (tmp_path / "outputs" / "grpo_moe" / "metrics.jsonl").read_text().splitlines()]
    assert sum("actor/router_disagreement" in r for r in rows) == 150
    assert max(r["training/rollout_log_prob_bound_ratio"] for r in rows if r["step"]) <= 1.0
