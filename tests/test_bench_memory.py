"""scripts/bench_memory.py on a tiny model: it runs, and the figures follow the settings."""

import subprocess
import sys
from pathlib import Path

import pytest

from test_rollout_engine import build_tiny

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc memory counters")
def test_one_update_per_setting(tmp_path):
    """A 64-token prompt and a 2048-token response through a tiny model with a 4096-token
    vocabulary: each setting's row has a peak (MB) and seconds, and the chunked logits'
    peak is the smaller: whole, the [2048, 4096] fp32 logits alone are 32 MB (their
    log-softmax as much again), in chunks of 256 a sixteenth of that, while the rest of
    the tiny model's update is a few MB. With Ulysses on two ranks (``SP=2``) each rank holds
    half the tokens' logits and activations: its peak is the smaller too."""
    path = tmp_path / "llama"
    build_tiny("llama", path, max_position_embeddings=4096, vocab_size=4096)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--model", str(path),
                          "--lengths", "2048", "--chunk", "256", "--threads", "1",
                          "--settings", "nothing", "chunked logits", "SP=2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("  2048 tokens")]
    assert len(rows) == 3, out.stdout
    peaks = [float(line.split()[-4]) for line in rows]  # "... <peak> MB, <s> s"
    assert all(p > 0 for p in peaks) and peaks[1] < peaks[0] and peaks[2] < peaks[0], rows
    assert out.stdout.splitlines()[-1].startswith("| 2048 | ")


def test_the_gpu_rows_refuse_what_the_machine_lacks(tmp_path, monkeypatch):
    """``--device cuda`` (the GPU check's rows) on a machine without a GPU is one line naming
    the fix; on a GPU machine an SP setting with fewer GPUs than ranks is a cell that says so
    (NCCL takes one GPU per rank), and no process starts."""
    import argparse

    import torch

    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--model", str(tmp_path),
                              "--device", "cuda", "--dtype", "bfloat16"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "--device cuda: torch sees no CUDA GPU here" in out.stderr, out.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_memory
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(bench_memory, "_cuda_count", lambda: 1)
    monkeypatch.setattr(bench_memory.subprocess, "run", lambda *a, **k: pytest.fail("a child started"))
    args = argparse.Namespace(device="cuda")
    assert bench_memory.run_child(args, 1024, "SP=2 + both") == {"error": "needs 2 GPUs"}
