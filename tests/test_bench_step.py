"""scripts/bench_step.py's own arithmetic and set-up, without running a benchmark: the MFU
formula against hand-computed values, the device settings each framework gets, and the
argument checks."""

import argparse
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_step  # noqa: E402
import bench_step_bounds  # noqa: E402
import bench_step_tables  # noqa: E402
import bench_step_workers  # noqa: E402


def args(**kw):
    base = dict(rounds=2, steps=3, warmup=1, threads=2, samples=8, prompts=16, max_new=64, device="cpu",
                docs=None, model=None, worker=None, recipe="grpo", prompt_limit=32)
    return argparse.Namespace(**{**base, **kw})


def test_phase_mfu_by_hand():
    # 2 prompts x 4 samples: 40 prompt tokens over the 8 rows, so 10 distinct prompt tokens
    # (one per prompt group) + 90 response tokens = 100 tokens of model work
    m = {"prompt_tokens": 40, "tokens": 90, "step_s": 4.0, "s_per_token": 4.0 / 90,
         "phases": {"gen": 1.0, "ref": 0.5, "update_actor": 2.0, "old_log_prob": 0.0}}
    # plain float64 arithmetic: approx's default rel=1e-6 is ~5e9 ulp, room for decimal rounding
    out = bench_step_tables.phase_mfu(m, params=1000, peak_gflops=1e-3, samples=4)
    assert out["gen"] == pytest.approx((1.0, 2e-4, 0.2))            # 2 * 1000 * 100 FLOPs in 1 s
    assert out["ref"] == pytest.approx((0.5, 4e-4, 0.4))
    assert out["update_actor"] == pytest.approx((2.0, 3e-4, 0.3))   # 6 * 1000 * 100 in 2 s
    assert "old_log_prob" not in out                                # a phase that did not run
    # the step: (2 + 2 + 6) * 1000 * 100 FLOPs in 4 s
    assert out["step"] == pytest.approx((4.0, 2.5e-4, 0.25))
    # TRL took 10 s, minihf 4 s; minihf's 1 MFLOP would take 1 s at the peak: a 10x ceiling
    r = {"minihf": m, "trl": {"step_s": 10.0, "tokens": 80, "s_per_token": 0.125},
         "ratio": 2.5, "token_ratio": 0.125 / (4.0 / 90), "round_ratios": [2.0, 3.125],
         "peaks": [150.6, 120.4, 149.0]}
    row = bench_step_tables.compare_row("tiny", False, r, params=1000, peak=1e-3, samples=4)
    assert r["ceiling"] == pytest.approx(10.0) and r["mfu"] == out
    assert row == ("| tiny | eos | 4.00 | 10.00 | **2.50x** | 10.0x | 90 / 80 | 44.44 | 125.00 | "
                   "2.81x | 2.00x, 3.12x | 120-151 |")


def test_compare_pools_the_rounds_and_pairs_them(tmp_path):
    # two rounds read back from the cache: the medians pool every step of both rounds, the
    # per-round ratios pair each round's TRL run with the minihf run just before it
    def run(steps, tokens):
        return {"step_s": steps, "response_tokens": tokens, "prompt_tokens": [10] * len(steps),
                "phases": {"gen": [s / 2 for s in steps]}}
    runs = {"minihf": [run([2.0, 4.0, 3.0], [100] * 3), run([5.0, 6.0, 7.0], [100] * 3)],
            "trl": [run([9.0, 8.0, 10.0], [50] * 3), run([12.0, 18.0, 15.0], [50] * 3)],
            "peaks": [150.0, 140.0, 90.0, 145.0]}
    a = args(workdir=str(tmp_path), fresh=False)
    key = json.dumps(["compare", "m", False, "grpo", [], a.rounds, a.steps, a.threads, a.samples, a.device])
    (tmp_path / "results.json").write_text(json.dumps({key: runs}))
    out = bench_step.compare("m", "d", a, forced=False)
    assert out["minihf"]["step_s"] == 4.5 and out["trl"]["step_s"] == 11.0    # medians of 6 steps
    # float64 medians and ratios: approx's default rel=1e-6 only absorbs decimal rounding
    assert out["ratio"] == pytest.approx(11.0 / 4.5)
    assert out["round_ratios"] == pytest.approx([9.0 / 3.0, 15.0 / 6.0])
    assert out["minihf"]["phases"]["gen"] == 2.25
    assert out["token_ratio"] == pytest.approx((11.0 / 50) / (4.5 / 100))
    assert bench_step_tables.probes(out) == "90-150"


def test_scaling_row_shows_its_probe():
    r = {"step_s": 4.861, "phases": {"gen": 1.482, "update_actor": 2.544}, "peak": 178.6}
    assert bench_step_tables.scaling_row("2 processes", r) == "| 2 processes | 4.86 | 1.48 | 2.54 | 179 |"


def test_device_settings_of_each_framework():
    assert bench_step_workers.trl_device_kwargs("cpu") == {"use_cpu": True, "bf16": False, "fp16": False}
    cuda = bench_step_workers.trl_device_kwargs("cuda")
    assert cuda["use_cpu"] is False and cuda["bf16"] is True and cuda["fp16"] is False
    flash = importlib.util.find_spec("flash_attn") is not None
    assert cuda["model_init_kwargs"] == {
        "attn_implementation": "flash_attention_2" if flash else "sdpa"}
    assert bench_step.process_counts("cpu") == (1, 2, 4)
    cmd = bench_step.worker_cmd("trl", "m", "d", "/t", args(device="cuda"), forced=False)
    assert cmd[cmd.index("--device") + 1] == "cuda"


def test_cpu_workers_do_not_see_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    code = ("import json, os, sys; open(sys.argv[-1] + '/minihf.json', 'w').write(json.dumps("
            "{'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), 'omp': os.environ['OMP_NUM_THREADS']}))")
    for device, seen in (("cpu", ""), ("cuda", "0")):
        cmd = [sys.executable, "-c", code, "--threads", "3", "--device", device, str(tmp_path)]
        assert bench_step.run_worker(cmd, str(tmp_path), "minihf") == {"cuda": seen, "omp": "3"}
    bad = [sys.executable, "-c", "raise SystemExit(3)", "--threads", "1", "--device", "cpu"]
    with pytest.raises(SystemExit, match="minihf worker failed"):
        bench_step.run_worker(bad, str(tmp_path), "minihf")


def test_argument_checks():
    a = args()
    bench_step.check_args(a)
    assert a.docs == str(ROOT / "docs" / "performance.md")
    a = args(docs="")
    bench_step.check_args(a)
    assert a.docs == ""  # '' keeps meaning: write no report
    with pytest.raises(SystemExit, match="--max-new=0 must be >= 1"):
        bench_step.check_args(args(max_new=0))
    with pytest.raises(SystemExit, match="--warmup=0 must be >= 1"):
        bench_step.check_args(args(warmup=0))
    if torch.cuda.is_available():
        a = args(device="cuda")
        bench_step.check_args(a)
        assert a.docs.endswith("performance-gpu.md")
    else:
        with pytest.raises(SystemExit, match="--device cuda needs a CUDA GPU"):
            bench_step.check_args(args(device="cuda"))


def test_cache_keeps_devices_apart(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return {"n": len(calls)}

    for device in ("cpu", "cuda", "cpu"):
        a = args(device=device, workdir=str(tmp_path), fresh=False)
        bench_step.cached(a, ["compare", "m", False], measure)
    assert len(calls) == 2  # the second cpu call reads the first one's result
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2


def test_fresh_report_measures_again_and_keeps_all_it_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_step, "_MEASURED", set())
    calls = []

    def measure():
        calls.append(1)
        return {"n": len(calls)}

    old = args(workdir=str(tmp_path), fresh=False)
    bench_step.cached(old, ["compare", "m", False], measure)  # an earlier report's result
    monkeypatch.setattr(bench_step, "_MEASURED", set())       # ... in another process
    new = args(workdir=str(tmp_path), fresh=True)
    assert bench_step.cached(new, ["compare", "m", False], measure) == {"n": 2}  # measured again
    bench_step.cached(new, ["compare", "m", True], measure)
    assert bench_step.cached(new, ["compare", "m", False], measure) == {"n": 2}  # once a report
    assert len(calls) == 3
    # an interrupted fresh report leaves every result it measured, not only its last one
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2


def test_trl_accepts_the_device_settings(tmp_path):
    trl = pytest.importorskip("trl", reason="the bench extra: pip install -e '.[bench]'")
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                  report_to="none")
    with warnings.catch_warnings():  # transformers' deprecation of TRL's default, not ours
        warnings.simplefilter("ignore", FutureWarning)
        cpu = bench_step_workers.trl_device_kwargs("cpu")
        assert trl.GRPOConfig(**cpu, **common).gradient_checkpointing  # else nothing is checked
    # the bench turns TRL's activation checkpointing off, by the name this transformers
    # reads, with no deprecation warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        no_ckpt = bench_step_workers.trl_no_checkpointing(trl.GRPOConfig)
        off = trl.GRPOConfig(**cpu, **no_ckpt, **common)
    assert off.gradient_checkpointing is False
    assert getattr(off, "activation_checkpointing", False) is False
    assert not [w for w in caught if "checkpointing" in str(w.message)]
    common.update(no_ckpt)
    assert trl.GRPOConfig(**cpu, **common).use_cpu
    if torch.cuda.is_available():
        assert trl.GRPOConfig(**bench_step_workers.trl_device_kwargs("cuda"), **common).bf16
    else:  # every keyword is known; only the missing GPU is refused
        with pytest.raises(ValueError, match="bf16/gpu"):
            trl.GRPOConfig(**bench_step_workers.trl_device_kwargs("cuda"), **common)


def test_cpu_name_reads_the_first_processor(monkeypatch):
    from minihf.cli.doctor import cpu_name

    assert bench_step_tables.cpu_name is cpu_name  # the report's Machine line names it so
    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n")
    assert cpu_name(info) == "AMD EPYC (family 26, model 2)"
    monkeypatch.setattr("platform.processor", lambda: "")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert cpu_name("") == "aarch64"  # no /proc/cpuinfo fields


def test_phase_bounds_by_hand():
    # 2 prompts x 2 samples (4 rows), prompts of 10 tokens (40 over the rows, 20 distinct),
    # 3 forced new tokens each (12); 1000 matmul parameters, 1500 in all, 8 KV bytes a token
    shape = {"matmul": 1000, "params": 1500, "kv_bytes_per_token": 8}
    m = {"prompt_tokens": 40, "tokens": 12, "reshard_bytes": 500.0,
         "phases": {"gen_prefill": 0.5, "gen_decode": 1.0, "ref": 0.2, "update_actor": 2.0,
                    "reshard": 0.1}}
    b = bench_step_bounds.phase_bounds(m, shape, peak_gflops=1e-6, bandwidth=1e4, rows=4,
                                       samples=2, max_new=3)
    got = {name: bound for name, _, bound, _ in b}
    # float64 arithmetic on small integers: approx only absorbs the decimal constants' rounding
    assert got["gen: prefill"] == pytest.approx(2 * 1000 * 20 / 1e3)         # 40 s at 1 kFLOP/s
    # 2 decode steps: weights 4000 B each + KV 8 B x 4 rows x (10+1), then (10+2), tokens at
    # 1e4 B/s (0.4352 s, 0.4384 s) against 8000 FLOP at 1 kFLOP/s (8 s): compute-bound
    assert got["gen: decode"] == pytest.approx(2 * 8.0)
    fast = bench_step_bounds.phase_bounds(m, shape, peak_gflops=1.0, bandwidth=1e4, rows=4,
                                          samples=2, max_new=3)
    assert fast[1][2] == pytest.approx((2 * 4000 + 8 * 4 * (11 + 12)) / 1e4)  # bandwidth-bound
    assert got["ref"] == pytest.approx(2 * 1000 * 32 / 1e3)                  # 20 + 12 tokens
    assert got["update_actor"] == pytest.approx(6 * 1000 * 32 / 1e3 + 7 * 4 * 1500 / 1e4)
    assert got["reshard"] == pytest.approx(2 * 4 * 1500 / 1e4)  # every weight written once
    lines = bench_step_bounds.bounds_lines(b, step_s=4.0, trl_step_s=12.0)
    assert lines[2].startswith("| gen: prefill | 0.500 | 40.000 | 8000% |")
    total = sum(got.values())
    assert f"| **step** | 4.000 | {total:.3f} |" in lines[-1] and f"**{12.0 / total:.1f}x**" in lines[-1]


def test_decode_floor_lines_by_hand():
    # 4 rows, 3 forced tokens (2 decode steps), prompts of 10 tokens: the middle step reads
    # 4000 B of weights + 8 B x 4 rows x (10 + 1.5) of cache = 4368 B, 0.4368 s at 1e4 B/s
    shape = {"matmul": 1000, "params": 1500, "kv_bytes_per_token": 8}
    m = {"prompt_tokens": 40, "tokens": 12, "phases": {"gen_decode": 2.0}}
    slow = {"minihf": 0.9, "prepacked": 0.8}  # the fastest matmuls alone > 0.4368 / 0.6 s
    lines = bench_step_bounds.decode_floor_lines(slow, m, shape, 1e4, rows=4, max_new=3)
    assert "minihf 1000.0 ms" in lines[1] and "bound 436.8 ms" in lines[1] and "so 44% of it" in lines[1]
    assert "900.0 ms as minihf's engine runs them, 800.0 ms with oneDNN" in lines[1]
    assert lines[2].startswith("60% of the bandwidth bound (728.0 ms a step) is below") and \
        "(800.0 ms): out of reach" in lines[2]
    fast = {"minihf": 0.5, "prepacked": None}  # within reach; a torch without oneDNN
    lines = bench_step_bounds.decode_floor_lines(fast, m, shape, 1e4, rows=4, max_new=3)
    assert len(lines) == 2 and "(no oneDNN in this torch)" in lines[1]
    assert bench_step_bounds.decode_floor_lines(None, m, shape, 1e4, rows=4, max_new=3) == []


def test_model_section_is_replaced_and_kept(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", argparse.Namespace(__version__="0"))  # CI has no trl
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\ntable\n\n## The GPU check\n\nhow\n")
    bench_step_tables.write_model_section(doc, ["### model", "row 1"])
    text = doc.read_text()
    assert text.index("row 1") < text.index("## The GPU check")   # before the GPU check
    bench_step_tables.write_model_section(doc, ["### model", "row 2"])
    text = doc.read_text()
    assert "row 1" not in text and text.count("row 2") == 1 and text.count("## The GPU check") == 1
    # the full report rewrites the file and keeps the section
    bench_step_tables.write_docs(doc, ["new random-model rows"], args())
    text = doc.read_text()
    assert "new random-model rows" in text and "row 2" in text and "table" not in text
    assert text.index("row 2") < text.index("## The GPU check")


def test_model_row_arguments(tmp_path):
    a = args(model=str(tmp_path), prompts=None, samples=None, recipe=None, warmup=None)
    with pytest.raises(SystemExit, match="not a model directory .*convert-gguf"):
        bench_step.check_args(a)
    (tmp_path / "config.json").write_text("{}")
    bench_step.check_args(a)
    # the issue's protocol: 4 prompts x 4 samples on the SmolLM2 recipe
    assert (a.prompts, a.samples, a.recipe, a.warmup) == (4, 4, "grpo_smollm2_arith", 2)
    a = args(prompts=None, samples=None, recipe=None, warmup=None)
    bench_step.check_args(a)
    assert (a.prompts, a.samples, a.recipe, a.warmup) == (16, 8, "grpo", 1)
