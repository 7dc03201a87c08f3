"""The planner (``minihf plan``): candidate counts, each formula against a hand-computed
value, the memory model against a real FSDP run's shards, and a written plan that
``train_ppo.py`` runs."""

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from minihf.cli import app
from minihf.planner import DeviceProfile, Group, Plan, estimate, model_shape, plan_overrides, search
from minihf.planner.cost import (forward_seconds, generation_seconds, micro_batch_bytes, resident_bytes, sp_bytes,
                                 update_seconds)
from minihf.planner.job import Role, Workload
from minihf.planner.search import compositions, describe, groupings, set_partitions, tp_options

ROOT = Path(__file__).resolve().parents[1]
BELL = [1, 1, 2, 5, 15, 52]
# round numbers, so every formula's value can be worked out by hand
PROFILE = DeviceProfile("test", memory_bytes=100e9, flops=1e12, memory_bandwidth=1e11, intra_node_bandwidth=1e10,
                        inter_node_bandwidth=1e9, devices_per_node=4, bytes_per_param=2, collective_latency=1e-8)


def test_candidate_counts():
    for k in range(6):
        parts = list(set_partitions(list(range(k))))
        assert len(parts) == BELL[k]
        assert len({tuple(sorted(tuple(sorted(b)) for b in p)) for p in parts}) == BELL[k]  # all distinct
    for n, k in [(4, 1), (4, 2), (8, 3), (6, 6)]:
        got = list(compositions(n, k))
        assert len(got) == math.comb(n - 1, k - 1) and all(sum(c) == n and min(c) >= 1 for c in got)
    assert list(compositions(2, 3)) == []
    assert tp_options(8, 9, 3) == [1]           # SmolLM2: 9 query / 3 KV heads
    assert tp_options(6, 9, 3) == [1, 3]
    assert tp_options(8, 32, 8) == [1, 2, 4, 8]


class _Shape:
    """A ModelShape stand-in with round numbers."""
    def __init__(self, params, layers, hidden, kv_dim, vocab, ffn, active=None):
        self.params, self.layers, self.hidden, self.kv_dim, self.vocab, self.ffn = params, layers, hidden, kv_dim, vocab, ffn
        self.active = params if active is None else active  # a MoE model's routed parameters
        self.heads, self.kv_heads, self.largest_block, self.tied = 4, 2, params // 4, False
        self.shapes = (("model.layers.0.mlp.gate_proj.weight", (params // 50, 50)),)  # for the reshard plan

    def kv_bytes_per_token(self, itemsize):
        return 2 * self.layers * self.kv_dim * itemsize


def work(roles, **kw):
    base = dict(prompts=4, n=2, prompt_len=10, response_len=6, share_prompt=False, recompute_old_log_prob=True,
                use_ref=True)
    base.update(kw)
    return Workload(roles=tuple(roles), **base)


def test_groupings_are_the_partitions_of_all_roles():
    m = _Shape(1, 1, 1, 1, 1, 1)
    for names in (["actor"], ["actor", "critic"], ["actor", "critic", "reward_model"],
                  ["actor", "critic", "reward_model", "cost_model"]):
        w = work([Role(r, m, r in ("actor", "critic")) for r in names])
        got = list(groupings(w))
        assert len(got) == BELL[len(names)] and all(g[0][0] == "actor" for g in got)


def test_forward_update_and_generation_formulas_by_hand():
    m = _Shape(params=1000, layers=2, hidden=10, kv_dim=4, vocab=50, ffn=20)
    # forward of K = 8 x 16 = 128 tokens on g = 2: compute 2*1000*128/(2*1e12) = 1.28e-7 s; FSDP:
    # ceil(8/2/1) = 4 micro-batches x (1000*2*(1/2) bytes / 1e10 + 1 unit x 1e-8 s) = 4.4e-7 s -> the larger
    assert forward_seconds(m, 128, 8, 1, 2, 1e10, PROFILE) == pytest.approx(4.4e-7)
    assert forward_seconds(m, 128, 8, 1, 1, 1e10, PROFILE) == pytest.approx(2.56e-7)  # one device: compute only
    cpu = replace(PROFILE, comm_overlaps_compute=False)  # gloo: the collectives take the cores' time too
    assert forward_seconds(m, 128, 8, 1, 2, 1e10, cpu) == pytest.approx(1.28e-7 + 4.4e-7)
    role = Role("actor", m, True, epochs=2, mini_batch=4)
    w = work([role])
    assert w.sequences == 8 and w.forward_tokens == 128
    # per epoch: max(6*1000*128/(2e12) = 3.84e-7, 4 micro-batches x (1000*(2*2+4)/2/1e10 = 4e-7 + 3
    # collectives x 3 units (2 blocks + root) x 1e-8 = 9e-8)) = 1.96e-6, + 2 AdamW steps x 32*1000/2/1e11
    # = 1.6e-7 each; two epochs
    assert update_seconds(role, 1, w, 2, 1e10, PROFILE) == pytest.approx(2 * (1.96e-6 + 2 * 1.6e-7))
    assert work([role], share_prompt=True).forward_tokens == 4 * 10 + 8 * 6
    # generation on 2 devices at TP 1: 2 replicas of q = 4 sequences; prefill 2*1000*4*10/1e12 = 8e-8;
    # KV: 2 (K, V) x 2 layers x 4 x 2 bytes = 32 bytes a token; each of 6 decode steps reads the weights
    # and the KV of 4 sequences at the mean context 10 + 6/2: (1000*2 + 4*13*32) / 1e11 = 3.664e-8 s,
    # more than its compute 2*1000*4/1e12 = 8e-9
    plan = Plan((Group(("actor",), 0, 2),), 1, (("actor", 1),))
    seconds, peak = generation_seconds(w, plan, PROFILE)
    assert seconds == pytest.approx(8e-8 + 6 * 3.664e-8)
    assert peak == pytest.approx(1000 * 2 + 4 * 16 * 32)  # engine weights + KV of 4 full sequences
    # a mixture-of-experts model of 1000 parameters, 250 active per token: FLOPs from 250, bytes
    # (FSDP's gathers, the engine's weights) from 1000
    moe = _Shape(params=1000, layers=2, hidden=10, kv_dim=4, vocab=50, ffn=20, active=250)
    assert forward_seconds(moe, 128, 8, 1, 1, 1e10, PROFILE) == pytest.approx(2.56e-7 / 4)
    assert forward_seconds(moe, 128, 8, 1, 2, 1e10, PROFILE) == pytest.approx(4.4e-7)  # the gathers: all
    seconds, peak = generation_seconds(work([Role("actor", moe, True, epochs=2, mini_batch=4)]), plan, PROFILE)
    assert seconds == pytest.approx(8e-8 / 4 + 6 * 3.664e-8) and peak == pytest.approx(1000 * 2 + 4 * 16 * 32)


def test_sequence_parallel_memory_and_time_by_hand():
    m = _Shape(params=1000, layers=2, hidden=10, kv_dim=4, vocab=50, ffn=20)
    # Ulysses over the 2 ranks: one SP group runs all 8 micro-batches (8 rows / (2 / 2) / 1), each
    # gathering 1000*2/2 bytes / 1e10 + 1e-8 s and sending all-to-alls: 4 query heads of 2 dims over
    # 2 KV heads; rank 0 holds query heads 0-1 (KV head 0), rank 1 heads 2-3 (KV head 1); each
    # sends the other its tokens' 2 query heads and 1 KV head's k and v, then gets back its 2
    # heads' output for the other's tokens: (2 + 2 x 1 + 2) heads x 2 dims x 16/2 tokens x 2 layers
    # x 2 bytes = 384 bytes / 1e10: 8 x (1e-7 + 1e-8 + 3.84e-8) = 1.1872e-6 s
    assert forward_seconds(m, 128, 8, 1, 2, 1e10, PROFILE, sp=2) == pytest.approx(1.1872e-6)
    # the update: 8 micro-batches x (4e-7 + 9e-8 + 2 x 3.84e-8 forward and backward) = 4.5344e-6
    # per epoch (more than the compute 3.84e-7), + 2 AdamW steps of 1.6e-7
    role = Role("actor", m, True, epochs=2, mini_batch=4, sp=2)
    assert update_seconds(role, 1, work([role]), 2, 1e10, PROFILE) == pytest.approx(2 * (4.5344e-6 + 2 * 1.6e-7))
    # SmolLM2's 9 query heads over 3 KV heads at SP=2: ranks of 5 (KV 0-1) and 4 (KV 1-2) query
    # heads; either sends 13 heads a token per layer (5 + 2 x 2 + 4), not the 18 = 4 x 9 / 2 that
    # KV heads as many as the query heads would cost
    smol = _Shape(params=1000, layers=1, hidden=576, kv_dim=3 * 64, vocab=50, ffn=20)
    smol.heads, smol.kv_heads = 9, 3
    assert sp_bytes(smol, 10, 1, 1, 2, 4) == pytest.approx(13 * 64 * 5 * 4)
    # memory: a rank holds half a micro-batch's 16 tokens: activations 8 x 2 layers x 2 x (8*10 + 3*20)
    # bytes and the logits 8 x 50 x 12, beside two gathered units (the largest block) and fp32 grads
    one, two = (micro_batch_bytes(Role("actor", m, True, sp=s), 1, work([role]), 2, True) for s in (1, 2))
    units = 2 * m.largest_block * 2 + 4 * m.largest_block
    assert two - units == pytest.approx(8 * 2 * 2 * (80 + 60) + 8 * 50 * 12)
    assert one - units == pytest.approx(2 * (two - units))


def test_model_shape_counts_total_and_active_parameters(tmp_path):
    from minihf.hub import init_model
    from minihf.planner.job import model_shape

    shape = model_shape(str(init_model(tmp_path / "moe", arch="qwen3_moe", size="tiny", task="sort")))
    # tiny: 2 layers, each 8 experts of 3 x 64 x 64 (half the dense 128), 2 routed: 6 unrouted per layer
    assert shape.params - shape.active == 2 * 6 * 3 * 64 * 64
    assert shape.ffn == 2 * 64
    dense = model_shape(str(init_model(tmp_path / "dense", arch="qwen3", size="tiny", task="sort")))
    assert dense.active == dense.params and dense.active_params is None


def test_resident_memory_and_overlap_by_hand():
    m = _Shape(params=1000, layers=2, hidden=10, kv_dim=4, vocab=50, ffn=20)
    w = work([Role("actor", m, True, 1, 8), Role("critic", m, True, 1, 8)])
    together = Plan((Group(("actor", "critic"), 0, 2),), 1, (("actor", 1), ("critic", 1)))
    # actor 16 P/g + its reference 4 P/g + critic 16 P/g on g = 2
    assert resident_bytes(w, together.groups[0]) == (16 + 4 + 16) * 1000 / 2
    apart = Plan((Group(("actor",), 0, 1), Group(("critic",), 1, 1)), 1, (("actor", 1), ("critic", 1)))
    e_apart = estimate(w, apart, PROFILE)
    p = e_apart.phases
    sequential = sum(p[k] for k in ("gen", "reshard", "reward", "old_log_prob"))
    assert e_apart.step_seconds == pytest.approx(sequential + max(p["ref"], p["values"])
                                                 + max(p["update_actor"], p["update_critic"]))
    e_together = estimate(w, together, PROFILE)
    assert e_together.step_seconds == pytest.approx(sum(e_together.phases.values()))


def test_llama_7b_shape_and_a_paper_scale_plan():
    s = model_shape("llama-7b")
    assert s.params == 6_738_415_616          # Llama-2-7B's published parameter count
    assert model_shape("llama-70b", "value").params == 68_976_648_192 - 32000 * 8192 + 8192 + 1
    w_cfg = _paper_cfg()
    from minihf.planner import workload

    w = workload(w_cfg, {"all": "llama-7b"})
    result = search(w, 16, replace(_a100(), devices_per_node=8))
    assert result.considered == result.refused + result.infeasible + len(result.ranked)
    assert result.ranked and result.ranked[0].fits
    assert all(a.step_seconds <= b.step_seconds for a, b in zip(result.ranked, result.ranked[1:]))
    # whole nodes only (--unit 8): per grouping, the compositions of 2 nodes (1 way for one
    # group, 1 for two, none for three), each with the actor's TP options (1, 2, 4, 8 that
    # divide its devices and heads): the unit's candidates are a subset of the plain search's
    nodes = search(w, 16, replace(_a100(), devices_per_node=8), unit=8)
    shapes = [len(g) for g in groupings(w)]
    want = sum(len(tp_options(16 if k == 1 else 8, 32, 32)) for k in shapes if k <= 2)
    assert nodes.considered == want
    assert {describe(e.plan) for e in nodes.ranked} <= {describe(e.plan) for e in result.ranked}
    with pytest.raises(ValueError, match="--unit 3 must be >= 1 and divide --devices 16"):
        search(w, 16, _a100(), unit=3)


def _a100():
    from minihf.planner import load_profile

    return load_profile("A100-80GB")


def _paper_cfg():
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    blocks = [f"{k}.fsdp.wrap_blocks=true" for k in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic",
                                                     "reward_model")]
    return load_config(PPOJobConfig, "ppo_rm", ["data.train_batch_size=256", "data.max_prompt_length=512",
                                                "data.max_response_length=512", "reward_model.model.path=x",
                                                "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                                                "critic.ppo_mini_batch_size=256", *blocks])


def _fsdp_bytes(rank, world, model_dir):
    import torch
    import torch.distributed as dist

    from minihf.models import load_hf
    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh

    model = apply_fsdp(load_hf(model_dir), fsdp_mesh(dist.group.WORLD, "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 16, (2, 6))
    model(tokens, torch.arange(6).expand(2, 6)).float().sum().backward()
    opt.step()

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    params = sum(local(p) for p in model.parameters())
    grads = sum(local(p.grad) for p in model.parameters())
    moments = sum(local(v) for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    return params + grads + moments


def test_resident_memory_model_matches_an_fsdp_run(tmp_path):
    """16 P / g bytes per rank: measured on 2 ranks' FSDP shards after an AdamW step (the
    shards are padded to a multiple of the ranks, hence the small slack)."""
    from minihf.hub import init_model
    from minihf.testing import spawn_ranks

    model = init_model(tmp_path / "m", size="tiny", task="digits")
    params = model_shape(str(model)).params
    measured = spawn_ranks(_fsdp_bytes, 2, str(model), timeout_s=240)
    predicted = 16 * params / 2
    for got in measured:
        assert predicted <= got <= predicted * 1.01, (got, predicted)


def test_cli_ranks_plans_and_refuses_bad_input(tmp_path):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    model = init_model(tmp_path / "m", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "d", 16, 4)
    over = [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
            f"data.train_files={tmp_path}/d/train.parquet", f"data.val_files={tmp_path}/d/test.parquet"]
    run = CliRunner().invoke
    res = run(app, ["plan", "ppo", *over, "--devices", "4", "--profile", "H100", "--top", "3"])
    assert res.exit_code == 0, res.output
    assert "candidates: 6 considered, 2 refused by the batch sizes, 0 over memory, 4 feasible" in res.output
    ranked = [line.split(" | ") for line in res.output.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r[0] for r in ranked] == ["| 1", "| 2", "| 3"]
    assert [float(r[2]) for r in ranked] == sorted(float(r[2]) for r in ranked)  # fastest first
    for args, want in [(["--devices", "2", "--profile", "B200"], "neither a built-in profile"),
                       (["--devices", "2", "--profile", "H100", "--model", "coach=llama-7b"], "roles are"),
                       (["--devices", "2", "--profile", "H100", "--model", "all=nope"], "not a named shape"),
                       (["--profile", "H100"], "--devices"),
                       (["--devices", "3", "--nodes", "2", "--profile", "H100"], "split evenly"),
                       (["--devices", "0", "--profile", "H100"], "must be >= 1"),
                       (["--devices", "2", "--profile", "H100", "--model", "llama-7b"], "give ROLE=DIR|NAME")]:
        res = run(app, ["plan", "ppo", *over, *args])
        assert res.exit_code != 0 and want in res.output, (args, res.output)
    # grpo's one group on 3 devices splits 64 sequences unevenly: the advice was "use more devices"
    res = run(app, ["plan", "grpo", *over[:1], *over[2:], "--devices", "3", "--profile", "H100"])
    assert res.exit_code != 0 and ("ppo_mini_batch_size (64 sequences) splits evenly over no group these 3 devices "
                                   "allow; use --devices 2 or 4, or a ppo_mini_batch_size that is a multiple of 3"
                                   in " ".join(res.output.split())), res.output


def test_a_written_plan_runs_a_step(tmp_path):
    """``--out`` writes a recipe that builds on the planned one; train_ppo.py runs it on 2
    processes as it is (the tiny job of test_docs, with the plan's placement, TP and micro-batches)."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    model = init_model(tmp_path / "m", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "d", 16, 4)
    over = [f"actor_rollout_ref.model.path={model}", f"data.train_files={tmp_path}/d/train.parquet",
            f"data.val_files={tmp_path}/d/test.parquet", "data.max_prompt_length=16", "data.max_response_length=8",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.total_training_steps=1", "trainer.test_freq=-1", "prepare.task=null", "prepare.sft_recipe=null",
            f"trainer.default_local_dir={tmp_path}/run"]
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(app, ["plan", "grpo", *over, "--devices", "2", "--profile", "H100", "--out", str(out)])
    assert res.exit_code == 0, res.output
    written = yaml.safe_load(out.read_text())
    assert written["base"] == "grpo" and written["controller"]["placement"]["actor"]["ranks"] == "all"
    assert written["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] in (1, 2)
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "scripts" / "train_ppo.py"), f"recipe={out}"], cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "step=1 " in job.stdout


def test_plan_overrides_name_every_role():
    plan = Plan((Group(("actor", "reward_model"), 0, 2), Group(("critic",), 2, 2)), 2,
                (("actor", 4), ("critic", 2), ("reward_model", 8)))
    keys = plan_overrides(plan, 4)
    assert keys["controller.placement.actor.ranks"] == [0, 1] == keys["controller.placement.reward_model.ranks"]
    assert keys["controller.placement.critic.ranks"] == [2, 3]
    assert keys["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 2
    assert keys["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 4 == \
        keys["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"]
    assert keys["critic.ppo_micro_batch_size_per_gpu"] == 2 and keys["reward_model.micro_batch_size_per_gpu"] == 8


def test_measured_profile_is_written_and_read(tmp_path):
    """``--measure`` writes this machine's profile (matmul, copy and gloo all-gather figures,
    each > 0) and ``--profile FILE`` plans with it; a broken profile file is one clear error."""
    out = tmp_path / "profile.yaml"
    res = CliRunner().invoke(app, ["plan", "--measure", "--devices", "2", "--profile-out", str(out)])
    assert res.exit_code == 0, res.output
    prof = yaml.safe_load(out.read_text())
    assert prof["devices_per_node"] == 2 and prof["bytes_per_param"] == 4
    assert all(prof[k] > 0 for k in ("flops", "memory_bandwidth", "intra_node_bandwidth", "memory_bytes"))
    from minihf.planner import load_profile

    assert load_profile(str(out)).flops == prof["flops"]
    (tmp_path / "bad.yaml").write_text("name: x\nflops: 1\nspeed: 3\n")
    with pytest.raises(ValueError, match=r"profile .*bad.yaml: unknown key 'speed'"):
        load_profile(str(tmp_path / "bad.yaml"))
    (tmp_path / "neg.yaml").write_text(out.read_text().replace(f"flops: {prof['flops']}", "flops: -1"))
    with pytest.raises(ValueError, match="flops must be > 0"):
        load_profile(str(tmp_path / "neg.yaml"))


def test_ranks_sharing_a_host_take_turns():
    from minihf.planner.cost import contended

    host = replace(PROFILE, host_cores=2, threads_per_rank=1)
    assert contended(host, 2) == host                               # one core each: as measured
    assert contended(host, 4).flops == PROFILE.flops / 2            # 4 busy ranks on 2 cores
    assert contended(host, 4).memory_bandwidth == PROFILE.memory_bandwidth / 2
    assert contended(PROFILE, 64) == PROFILE                        # devices of their own
