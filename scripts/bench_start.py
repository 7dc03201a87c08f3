"""Time from command to the first training step of the main job, per way of starting it.

    python scripts/bench_start.py                  # 3 rounds of each way, medians
    python scripts/bench_start.py --rounds 5 --nproc 2

Each way runs the default recipe (``grpo``) for one step, with no validation
(``trainer.val_before_train=false trainer.test_freq=-1``), in a fresh run dir, on the data
and warm-started model the main job prepares under ``outputs/`` (prepared first, untimed,
when absent). The ways alternate within each round, so a machine that slows down during the
run slows all of them alike:

* ``torchrun``: ``torchrun --nproc_per_node=N scripts/train_ppo.py``;
* ``minihf train``: ``minihf train --nproc-per-node N`` (checks the config in the launcher
  process, then starts the ranks);
* ``one process``: ``python scripts/train_ppo.py``.

Per way it prints the median seconds from the command to: the first line the job prints
(``first output``), the launcher's config check passing (``minihf train`` only: its
``OMP_NUM_THREADS`` line), and the ``step=1`` line; ``set-up`` is that last time less the
step's own ``step_s``: what a run pays before its first step (interpreter, imports, config,
process group, datasets, model load and sharding).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_STEP = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1"]


def commands(nproc: int) -> dict[str, list[str]]:
    script = str(ROOT / "scripts" / "train_ppo.py")
    return {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={nproc}", script],
            "minihf train": [sys.executable, "-m", "minihf.cli", "train", "--nproc-per-node", str(nproc)],
            "one process": [sys.executable, script]}


def timed_run(argv: list[str], run_dir: Path, env: dict) -> dict:
    """Seconds from the start to the first line, the launcher's check, the step=1 line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv + ONE_STEP + [f"trainer.default_local_dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen, lines = {}, []
    for line in proc.stdout:
        t = time.perf_counter() - t0
        lines.append(line.rstrip())
        seen.setdefault("first output", t)
        if line.startswith("[minihf] OMP_NUM_THREADS="):
            seen.setdefault("config checked", t)
        if line.startswith("step=1 "):
            seen["step 1"] = t
            seen["step_s"] = float(re.search(r"step_s=([\d.]+)", line).group(1))
    if proc.wait() != 0 or "step 1" not in seen:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n" + "\n".join(lines[-30:]))
    seen["set-up"] = seen["step 1"] - seen["step_s"]
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each way's own thread choice
    env["PYTHONUNBUFFERED"] = "1"  # a line reaches the pipe when printed, not when the process exits
    ways = commands(args.nproc)
    scratch = Path(tempfile.mkdtemp(prefix="minihf-bench-start-"))
    try:
        print("preparing the main job's data and warm start when absent (not timed) ...", flush=True)
        timed_run(ways["one process"], scratch / "warmup", env)
        results: dict[str, list[dict]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name, argv in ways.items():
                results[name].append(timed_run(argv, scratch / f"{r}-{name.replace(' ', '_')}", env))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} {results[name][-1]['set-up']:.2f}s" for name in ways), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    keys = ["first output", "config checked", "step 1", "step_s", "set-up"]
    print(f"\nmedian seconds over {args.rounds} rounds ({args.nproc} ranks; {os.cpu_count()} cores):")
    print(f"| way | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    for name, runs in results.items():
        cells = [f"{statistics.median(r[k] for r in runs):.2f}" if all(k in r for r in runs) else ""
                 for k in keys]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
