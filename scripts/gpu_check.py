"""The prepared GPU check: everything minihf wants to know from a rare, short GPU window, in one
call that writes one markdown report.

    bash scripts/gpu_check.sh OUTDIR             # on the GPU machine: install, then this
    python scripts/gpu_check.py OUTDIR           # the same without the install step
    python scripts/gpu_check.py --dry-run OUTDIR # CPU, tiny model, seconds (the test suite runs it)

Sections, each timed, its failure recorded without stopping the rest, the report rewritten
after each (a check cut short by the machine's time limit still leaves what it found):

1. the machine: GPU, torch, CUDA, transformers, which attention paths exist (flash-attn's
   varlen kernel when installed; SDPA's flash backend otherwise);
2. a ~0.5B random Qwen2-style model (Qwen2.5-0.5B's shapes) in bf16 (``gpu_bench.py``): the
   bf16 matmul peak and the copy bandwidth measured first, then prefill and training (forward + backward)
   against the peak (MFU), decode at batch 1, 16, 64 and 256 against the bandwidth bound
   (weights + KV cache read once per step) on three paths: minihf eager, minihf's fast path
   (a CUDA graph per bucket) and transformers' static-cache generate compiled, and peak memory;
3. ``pytest -m gpu`` (``tests/test_gpu.py``: engine vs trainer log-probs in fp32 and bf16,
   SDPA flash vs math, packed vs padded, FSDP2 on NCCL, the in-place reshard gather, optimizer
   offload during generation) with its printed figures, within ``--tests-limit`` seconds;
4. one actor update's memory on the 0.5B shapes in bf16 at 4k, 16k and 32k response tokens
   (``scripts/bench_memory.py --device cuda``), within ``--memory-limit`` seconds;
5. the main job on the GPU, one process (``scripts/train_ppo.py``): validation before and
   after, wall time, within ``--main-job-limit`` seconds, and its step 100 under
   torch.profiler (``trainer.profile_steps``): the ops that take its time.

The quickest section runs first, so that a window cut short still reports figures; section 2
writes its rows as they are measured (a call stopped from outside keeps them), sections 3-5
run under their own limits. ``--sections`` picks some of 2-5 (the machine is always
reported): with calls capped at 10 minutes, ``--sections bench tests`` first (the issue's
rows), then ``main-job`` (its limit alone fills a call), then ``memory``.

``--dry-run`` runs sections 1, 2 and 4 on the CPU with a tiny model in fp32 (4 at one length,
two settings, its peak read from Linux's counters), collects the GPU tests without running
them and shows the main job's command without running it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from gpu_bench import QWEN05, TINY, benchmark

ROOT = Path(__file__).resolve().parents[1]
PROFILED_STEP, PROFILE_ROWS = 100, 33  # the main job's step profiled; the table's lines in the report
MEMORY_LENGTHS = (4096, 16384, 32768)  # response tokens; the settings below (one GPU: no SP rows)
MEMORY_SETTINGS = ("nothing", "chunked logits", "activation checkpointing", "both")
SECTIONS = ("bench", "tests", "memory", "main-job")


class Report:
    """The markdown report, rewritten to ``path`` after every section."""

    def __init__(self, path: Path, title: str):
        self.path, self.lines = path, [f"# {title}", ""]
        self.failures = 0

    def section(self, name: str, fn) -> None:
        """``fn`` returns the section's lines, or yields them in chunks: the report is then
        rewritten after each, so a call stopped from outside keeps the rows done."""
        self.lines += [f"## {name}", ""]
        t0 = time.perf_counter()
        try:
            result = fn()
            for chunk in [result] if isinstance(result, list) else result:
                self.lines += chunk
                self.path.write_text("\n".join(self.lines))
            status = "ok"
        except Exception:  # noqa: BLE001 - the report must say what failed and go on
            self.failures += 1
            self.lines += ["```", traceback.format_exc()[-3000:], "```"]
            status = "FAILED"
        self.lines += ["", f"({status}, {time.perf_counter() - t0:.1f} s)", ""]
        self.path.write_text("\n".join(self.lines))
        print(f"[gpu_check] {name}: {status}", flush=True)


def machine(device: torch.device) -> list[str]:
    from minihf.models.masks import flash_attn_varlen_func

    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CUDA (torch)", torch.version.cuda or "none")]
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        rows += [("GPU", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"),
                 ("SDPA flash backend enabled", str(torch.backends.cuda.flash_sdp_enabled())),
                 ("NCCL", str(torch.distributed.is_nccl_available()))]
    for name in ("transformers", "flash_attn"):
        spec = importlib.util.find_spec(name)
        rows.append((name, __import__(name).__version__ if spec else "not installed"))
    path = ("flash-attn's varlen kernel" if flash_attn_varlen_func is not None and device.type == "cuda"
            else "SDPA (right-padded buckets; on CUDA its flash backend where the inputs allow)")
    rows.append(("packed attention path", path))
    return ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def gpu_tests(dry: bool, out: Path, limit_s: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-s", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_gpu.py")] + (["--collect-only"] if dry else [])
    rc, text = run_logged(cmd, ROOT, out / "pytest_gpu.log", limit_s, "--tests-limit")
    figures = [line for line in text.splitlines()
               if re.search(r"vs|units of the rounding|moments", line) and not line.startswith(("E ", ">"))]
    tail = [line for line in text.splitlines() if line.strip()][-12:]
    if rc not in (0, 5) or (not dry and rc == 5):
        raise RuntimeError(f"pytest -m gpu exited {rc}:\n" + "\n".join(tail))
    return [f"`{' '.join(cmd[2:])}` (exit {rc}; full log: pytest_gpu.log)", "",
            "```", *figures, *tail[-3:], "```"]


def run_logged(cmd: list[str], cwd: Path, log: Path, limit_s: int, option: str) -> tuple[int | str, str]:
    """Run ``cmd`` with its output going to ``log`` as it runs (a run stopped at ``limit_s``
    keeps what it printed); the exit status, or why there is none, and the output. A run
    stopped at its limit is stopped with every process it started (its own session), so none
    holds the GPU into the next section."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"nothing (stopped at the {limit_s} s limit, {option})"
    return rc, log.read_text()


def main_job(dry: bool, out: Path, limit_s: int) -> list[str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "train_ppo.py"),
           f"trainer.default_local_dir={out / 'main_job'}", "actor_rollout_ref.rollout.check_log_probs=warn",
           f"trainer.profile_steps=[{PROFILED_STEP}]"]
    if dry:
        return [f"dry run: would run `{' '.join(cmd[1:])}` (limit {limit_s} s)"]
    t0 = time.perf_counter()
    rc, text = run_logged(cmd, out, out / "main_job.log", limit_s, "--main-job-limit")
    wall = time.perf_counter() - t0
    found = re.search(r"validation score: ([0-9.]+) \(first\) -> ([0-9.]+) \(last\)", text)
    phases = [line for line in text.splitlines() if line.startswith("wall time")]
    if rc != 0 or not found:
        raise RuntimeError(f"the main job exited {rc} after {wall:.0f} s (log: main_job.log):\n{text[-2000:]}")
    lines = [f"`{' '.join(cmd[1:])}` in an empty directory (builds its data, model and SFT warm "
             f"start first): validation score {found.group(1)} -> {found.group(2)}, "
             f"{wall:.0f} s in all; {phases[0] if phases else ''}"]
    lines += generation_summary(out / "main_job" / "metrics.jsonl")
    table = out / "main_job" / "profile" / f"step_{PROFILED_STEP}" / "rank0.txt"
    if table.exists():  # where the launch- and host-bound step's time goes, op by op
        lines += ["", f"Step {PROFILED_STEP} under torch.profiler (`trainer.profile_steps`; the "
                  "ops by their own GPU time, the first rows; the Chrome trace stays on the machine):",
                  "", "```", *table.read_text().splitlines()[:PROFILE_ROWS], "```"]
    return lines


def generation_summary(path: Path) -> list[str]:
    """The main job's generation from its metrics.jsonl: the seconds of ``gen`` and of its
    parts over the run (the CUDA graphs' captures among them: the engine sleeps after each
    step, so each step captures its buckets again), and the worst engine-vs-trainer
    log-prob gap in units of its rounding bound (``check_log_probs=error`` passes at <= 1)."""
    import json

    if not path.exists():
        return ["", f"(no {path.name}: the generation's parts are not shown)"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/gen" in r]
    total = {k: sum(r.get(f"timing_s/{k}", 0.0) for r in rows)
             for k in ("gen", "gen_prefill", "gen_decode", "gen_capture")}
    ratios = [r["training/rollout_log_prob_bound_ratio"] for r in rows if "training/rollout_log_prob_bound_ratio" in r]
    worst = f"{max(ratios):.3f} (the worst step; <= 1: `check_log_probs=error` passes)" if ratios else "not logged"
    return ["", f"Generation over {len(rows)} steps: " + ", ".join(f"{k} {v:.1f} s" for k, v in total.items())
            + f"; engine vs trainer log-probs, in units of their rounding bound: {worst}."]


def memory(device: torch.device, dry: bool, out: Path, limit_s: int) -> list[str]:
    """One actor update's peak memory and time by response length and setting on the 0.5B
    shapes in bf16: ``scripts/bench_memory.py --device cuda`` on
    the model saved as a checkpoint, a process per cell. The rows it printed stand if the
    limit stops it."""
    import tempfile

    from minihf.models import ModelArgs, build_model, init_weights, save_hf

    dtype = torch.float32 if dry else torch.bfloat16
    # positions up to the prompt (bench_memory's 64 tokens) + the longest response: on CUDA the
    # RoPE table is built for max_position_embeddings and does not grow
    shapes = TINY if dry else dict(QWEN05, max_position_embeddings=max(MEMORY_LENGTHS) + 64)
    with tempfile.TemporaryDirectory() as tmp:  # not in OUTDIR: the report's folder travels back
        with torch.device("cpu"):
            save_hf(init_weights(build_model(ModelArgs(**shapes), "lm"), seed=0).to(dtype), tmp)
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--model", tmp, "--device", device.type,
               "--dtype", str(dtype).removeprefix("torch."), "--chunk", "64" if dry else "1024",
               "--lengths", *(["256"] if dry else map(str, MEMORY_LENGTHS)),
               "--settings", *(("nothing", "both") if dry else MEMORY_SETTINGS)] + (["--threads", "1"] if dry else [])
        rc, text = run_logged(cmd, ROOT, out / "bench_memory.log", limit_s, "--memory-limit")
        cmd[3] = "MODEL"
    rows = [line for line in text.splitlines() if " tokens  " in line]  # printed as each cell ends
    if not rows:
        raise RuntimeError(f"bench_memory exited {rc} with no row (log: bench_memory.log):\n{text[-2000:]}")
    table = [line for line in text.splitlines() if line.startswith("|")]
    return [f"`bench_memory.py {' '.join(cmd[2:])}` (exit {rc}; log: bench_memory.log): one update (forward, "
            f"backward, AdamW) on one response, {dtype}; a peak is what the update adds to the parameters, "
            "their gradients and AdamW's state:", "",
            *(table if rc == 0 else ["```", *rows, "```"])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the report (gpu_check.md) and logs")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, seconds")
    p.add_argument("--tests-limit", type=int, default=150, help="seconds for pytest -m gpu (71 s on an H200)")
    p.add_argument("--main-job-limit", type=int, default=540,
                   help="seconds for the main job (296 s on an H200 before the CUDA-graph decode; each step "
                        "now captures its buckets again after the engine sleeps)")
    p.add_argument("--memory-limit", type=int, default=240, help="seconds for the memory rows (12 processes)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="which sections run (the machine is always reported)")
    args = p.parse_args()
    for name in ("tests_limit", "main_job_limit", "memory_limit"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (seconds), got {getattr(args, name)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA GPU here; use --dry-run on a CPU machine")
    device = torch.device("cpu" if args.dry_run else "cuda")
    report = Report(out / "gpu_check.md", "minihf GPU check" + (" (dry run, CPU)" if args.dry_run else ""))
    report.section("Machine", lambda: machine(device))
    sections = {  # the quickest first: a window cut short by the machine's limit keeps what ran
        "bench": ("A 0.5B model in bf16: prefill, training, decode against their bounds",
                  lambda: benchmark(device, args.dry_run)),
        "tests": ("GPU tests (pytest -m gpu)", lambda: gpu_tests(args.dry_run, out, args.tests_limit)),
        "memory": ("Memory of one actor update by response length",
                   lambda: memory(device, args.dry_run, out, args.memory_limit)),
        "main-job": ("The main job on one GPU", lambda: main_job(args.dry_run, out, args.main_job_limit))}
    for name in SECTIONS:
        if name in args.sections:
            report.section(*sections[name])
    print(f"[gpu_check] wrote {report.path} ({report.failures} section(s) failed)")
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
