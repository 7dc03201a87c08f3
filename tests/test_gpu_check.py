"""``scripts/gpu_check.sh --dry-run`` on the CPU, so the prepared GPU check cannot rot: every
section runs (the GPU tests collected, the main job's command shown, the benchmark on a tiny
fp32 model) and the report says each one is ok; its limits keep a run cut short readable."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# gpu_check.sh runs $PYTHON when set (else python3): the interpreter running these tests
SH_ENV = dict(os.environ, PYTHON=sys.executable)


def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)], env=SH_ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "gpu_check.md").read_text()
    for section in ("## Machine", "## GPU tests (pytest -m gpu)", "## The main job on one GPU",
                    "## A 0.5B model in bf16", "## Memory of one actor update"):
        assert section in report, report
    assert report.count("(ok, ") == 5 and "FAILED" not in report, report
    row = next(line for line in report.splitlines() if line.startswith("| 256 | "))  # bench_memory's table
    assert re.fullmatch(r"\| 256 \| [0-9.]+ MB, [0-9.]+ s \| [0-9.]+ MB, [0-9.]+ s \|", row), row
    assert "11 tests collected" in report, report          # tests/test_gpu.py imports and collects
    assert "prefill (forward)" in report and "training (forward + backward)" in report, report
    assert "| training, `use_torch_compile` (" in report, report  # its ratio: the compile ran, not "failed"
    for batch in (1, 4):  # a row with its time (a failed path writes "failed: ..." there)
        for path in ("minihf eager", "minihf fast", "transformers static+compile"):
            assert re.search(rf"\| {batch} \| {re.escape(path)} \| [0-9.]+ s \|", report), (batch, path, report)
    assert "batch 4: 4/4 sequences token-identical" in report, report  # the static step vs eager (fp32, tiny)


def test_gpu_check_refuses_a_machine_without_cuda(tmp_path):

    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torch sees no CUDA GPU here; use --dry-run" in proc.stderr


def test_a_command_stopped_at_its_limit_keeps_what_it_printed(tmp_path):
    """The GPU window is short: a section cut off by its limit (pytest -m gpu, the main job)
    still reports the steps it printed, and says it was stopped rather than how it exited."""

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_check import run_logged
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    # the command starts a child of its own (as bench_memory and the main job do): stopped too
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print('step=1', c.pid, flush=True); time.sleep(60)")
    rc, text = run_logged([sys.executable, "-c", code], tmp_path, tmp_path / "x.log", 5, "--x-limit")
    assert rc == "nothing (stopped at the 5 s limit, --x-limit)" and "step=1" in text, (rc, text)
    assert (tmp_path / "x.log").read_text() == text
    child = int(text.split()[1])
    for _ in range(50):  # killed at once; reaped by init (this test's process is not its parent)
        if not Path(f"/proc/{child}").exists() or "State:\tZ" in Path(f"/proc/{child}/status").read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the command's child {child} outlived the limit")
    rc, text = run_logged([sys.executable, "-c", "print('done')"], tmp_path, tmp_path / "y.log", 30, "--y")
    assert rc == 0 and text == "done\n"


def test_gpu_check_refuses_a_limit_below_one_second(tmp_path):

    for option in ("--tests-limit", "--main-job-limit", "--memory-limit"):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run",
                               option, "0", str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"{option} must be >= 1 (seconds), got 0" in proc.stderr, proc.stderr


def test_the_main_job_section_reports_score_phases_and_the_profiled_step(tmp_path, monkeypatch):
    """What the main job's section makes of a finished job (the job itself stubbed): the
    validation scores, the phase line, the generation's parts and log-prob check from its
    metrics.jsonl and the first rows of its profiled step's table."""

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    table = tmp_path / "main_job" / "profile" / f"step_{gpu_check.PROFILED_STEP}" / "rank0.txt"
    table.parent.mkdir(parents=True)
    table.write_text("\n".join(f"row {i}" for i in range(100)))
    metrics = [{"step": 1, "timing_s/gen": 2.0, "timing_s/gen_prefill": 0.5, "timing_s/gen_decode": 1.0,
                "timing_s/gen_capture": 0.25, "training/rollout_log_prob_bound_ratio": 0.5},
               {"step": 2, "val-core/mean": 0.5},
               {"step": 3, "timing_s/gen": 3.0, "timing_s/gen_prefill": 0.5, "timing_s/gen_decode": 2.0,
                "timing_s/gen_capture": 0.5, "training/rollout_log_prob_bound_ratio": 0.75}]
    (tmp_path / "main_job" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics))
    ran = []

    def finished(cmd, cwd, log, limit_s, option):
        ran.append(cmd)
        return 0, "step=150 score=0.9\nvalidation score: 0.3760 (first) -> 0.9167 (last)\nwall time 270.7s; by phase: x\n"
    monkeypatch.setattr(gpu_check, "run_logged", finished)
    lines = gpu_check.main_job(False, tmp_path, 10)
    assert f"trainer.profile_steps=[{gpu_check.PROFILED_STEP}]" in ran[0]
    text = "\n".join(lines)
    assert "validation score 0.3760 -> 0.9167" in text and "wall time 270.7s; by phase: x" in text, text
    assert f"row {gpu_check.PROFILE_ROWS - 1}" in text and f"row {gpu_check.PROFILE_ROWS}\n" not in text, text
    assert ("Generation over 2 steps: gen 5.0 s, gen_prefill 1.0 s, gen_decode 3.0 s, gen_capture 0.8 s; "
            "engine vs trainer log-probs, in units of their rounding bound: 0.750") in text, text


def test_gpu_check_runs_the_sections_asked(tmp_path):
    """A window whose calls are limited runs the check in parts (``--sections``): the machine
    and the sections named, in the usual order, and nothing else."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path), "--sections",
                           "main-job", "tests"], env=SH_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "gpu_check.md").read_text()
    heads = [line for line in report.splitlines() if line.startswith("## ")]
    assert heads == ["## Machine", "## GPU tests (pytest -m gpu)", "## The main job on one GPU"], heads
