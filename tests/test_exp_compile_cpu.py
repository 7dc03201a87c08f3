"""scripts/exp_compile_cpu.py on its tiny model: the three paths run, the compiled one
compiles only in the warm-up, and all three agree."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "exp_compile_cpu.py")


def test_the_compiled_step_runs_and_agrees_with_eager():
    """Two prompts, four greedy tokens each. Tokens equal: the tiny random model's top two
    logits are ~0.1 apart, and another summation order moves a logit by ~1e-6, so a flip has
    odds of about 1e-5 a token. Log-probs within 1e-4: a log-softmax over 512 logits of
    magnitude < 10, each a sum of 64-128 fp32 products (rounding ~128 * 6e-8 * 10 = 8e-5 at
    worst, in either order)."""
    out = subprocess.run([sys.executable, SCRIPT, "--tiny", "--batch", "2", "--new-tokens", "4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("compiled bucket (rows, cache length) (2, ") for line in lines), out.stdout
    assert "compiles in the timed rounds: 0" in out.stdout, out.stdout
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["eager"], ["static"], ["compiled"])}
    assert set(rows) == {"eager", "static", "compiled"}, out.stdout
    for name, cells in rows.items():
        assert cells[4] == "0" and float(cells[5]) < 1e-4, (name, out.stdout)


def test_the_bf16_step_compiles_once_per_bucket():
    """``--dtype bfloat16``: the RoPE rows are built in bf16 before the compile, so the timed
    rounds compile nothing. Tokens are not compared: bf16 rounds a logit of the tiny model by
    up to ~0.03, a third of its top-two gap, so another summation order may flip a token."""
    out = subprocess.run([sys.executable, SCRIPT, "--tiny", "--batch", "2", "--new-tokens", "4", "--repeats", "1",
                          "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bfloat16, batch 2," in out.stdout and "compiles in the timed rounds: 0" in out.stdout, out.stdout


def test_bad_sizes_are_refused_in_one_line():
    for args, says in ((["--tiny", "--batch", "0"], "--batch must be at least 1, got 0"),
                       (["--batch", "2"], "pass --model-dir DIR (a checkpoint) or --tiny")):
        out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
