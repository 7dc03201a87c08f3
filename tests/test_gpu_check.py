"""``scripts/gpu_check.sh --dry-run`` on the CPU, so the prepared GPU check cannot rot: every
section runs (the GPU tests collected, the main job's command shown, the benchmark on a tiny
fp32 model) and the report says each one is ok."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "gpu_check.md").read_text()
    for section in ("## Machine", "## GPU tests (pytest -m gpu)", "## The main job on one GPU",
                    "## A 0.5B model in bf16"):
        assert section in report, report
    assert report.count("(ok, ") == 4 and "FAILED" not in report, report
    assert "7 tests collected" in report, report          # tests/test_gpu.py imports and collects
    for phase in ("prefill (forward)", "training (forward + backward)", "decode (prefill included) | batch 1",
                  "decode (prefill included) | batch 64"):
        assert phase in report, report


def test_gpu_check_refuses_a_machine_without_cuda(tmp_path):
    import sys

    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torch sees no CUDA GPU here; use --dry-run" in proc.stderr
