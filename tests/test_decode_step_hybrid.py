"""The static decode step inside the hybrid engine at TP 2, on 2 gloo ranks: the step CUDA
captures, run uncaptured here (the CPU's engine decodes eagerly by default, so its jobs do
not run TP's all-reduce inside this step). Over two rounds of weight sync -> generate -> sleep, with
the weights changed between them: the same tokens as the eager step, log-probs within their
rounding bound of a float64 forward of the full model, each round prepares its buckets
again (the engine slept: on CUDA they would be captured again), no op of the step reads a
device value on the host, and each replay reads the storages its capture read. On NCCL the all-reduce is a kernel on the step's stream, which
the capture records; on gloo it runs on the host, which is why the CPU runs the step as is.
"""

import pytest
import torch

from logprob_reference import float64_log_probs, rounding_ratio
from minihf.testing import spawn_ranks

from test_rollout_engine import build_tiny, one_row

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
SCALES = (1.0, 0.8)  # the weights of round 2: every parameter of round 1 times 0.8


def _rank(rank, world, path):
    import torch.distributed as dist

    from minihf.hybrid.engine import HybridEngine
    from minihf.hybrid.reshard import rollout_groups
    from minihf.models import load_hf
    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh
    from minihf.rollout import SamplingParams
    from minihf.workers.config import RolloutConfig
    from test_decode_step import _watch_host_reads

    seen = _watch_host_reads(pytest.MonkeyPatch())  # this process only: never undone

    gather, tp_group, tp_rank = rollout_groups(2)
    out = {}
    for mode in ("eager", "static"):
        fsdp = apply_fsdp(load_hf(path), fsdp_mesh(dist.group.WORLD, "cpu"))
        cfg = RolloutConfig(tensor_model_parallel_size=2, prompt_length=8, response_length=10)
        eng = HybridEngine(fsdp, cfg, all_group=dist.group.WORLD, gather_group=gather, tp_group=tp_group,
                           tp_rank=tp_rank, device=torch.device("cpu"), eos_token_ids=(), pad_token_id=0)
        eng.engine.runner.decode_mode = mode  # the CPU's default is eager
        for i, scale in enumerate(SCALES):
            with torch.no_grad():
                for p in fsdp.parameters():
                    p.mul_(scale)
            eng.sync_weights()
            groups = eng.engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=10, seed=5,
                                                                 ignore_eos=True))
            out[mode, i] = ([g[0].tokens for g in groups], [g[0].logprobs for g in groups],
                            eng.engine.last_stats["captures"])
            eng.sleep()
    out["seen"] = seen
    return out


def test_static_step_in_the_hybrid_engine_at_tp2(tmp_path):
    path = tmp_path / "llama"
    build_tiny("llama", path, heads=8, kv_heads=4)
    results = spawn_ranks(_rank, 2, str(path), timeout_s=300)
    from minihf.models import load_hf

    model = load_hf(path)
    for i, scale in enumerate(SCALES):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        for res in results:
            (eager, eager_lp, _), (static, static_lp, captures) = res["eager", i], res["static", i]
            assert static == eager, (i, static, eager)
            assert captures >= 1, captures  # prepared again after the sleep, every round
            for prompt, tokens, a, b in zip(PROMPTS, static, static_lp, eager_lp):
                _, bound = float64_log_probs(model, one_row(prompt, tokens), 0.8)
                worst = rounding_ratio(torch.tensor([a]), torch.tensor([b]), bound, torch.ones(1, len(a)),
                                       pairwise=True)
                assert worst <= 1, (i, prompt, worst)
    for res in results:
        seen = res["seen"]
        assert seen["steps"] >= 2 * 9 and seen["hits"] == [] and seen["moved"] == [], seen
        assert res["static", 0][0] != res["static", 1][0]  # round 2's weights reached the engine
