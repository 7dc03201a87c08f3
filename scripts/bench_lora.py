"""LoRA vs full-parameter GRPO on SmolLM2-135M-Instruct, alternated in one run.

    python scripts/bench_lora.py                          # 30 steps in chunks of 10, 2 ranks
    python scripts/bench_lora.py --steps 20 --chunk 5 --doc docs/lora.md

The two recipes (``grpo_smollm2_arith_lora``: rank-16 adapters on every projection, lr
1e-4; ``grpo_smollm2_arith``: every weight, lr 1e-5) train in turns of ``--chunk`` steps,
each turn a ``torchrun`` job that resumes its run where the last one stopped (exact
resume), the order swapped every turn: the two share the machine's state over the whole
run instead of one running on a quieter stretch than the other. The per-step figures come
from each run's ``metrics.jsonl`` (medians over the steps; start-up and validation are not
in them):

* ``s/step``, ``update_actor`` and ``gen`` seconds (``timing_s/...``);
* ``reshard`` bytes one rank received per step (``perf/reshard_bytes``);
* the optimizer state and checkpoint bytes of the last checkpoint (files on disk);
* the validation score (``val-core/mean``: mean@4 sampled answers) at every turn's end.

``--doc`` writes the table (and the host's CPU) as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPES = {"lora": "grpo_smollm2_arith_lora", "full": "grpo_smollm2_arith"}
ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def run_turn(name: str, until: int, out: Path, nproc: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "scripts/train_ppo.py", f"recipe={RECIPES[name]}",
           f"trainer.total_training_steps={until}", f"trainer.default_local_dir={out / name}",
           f"trainer.test_freq={until}", *extra]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{name} turn to step {until} failed (exit {done.returncode}); see {out / name}.log")
    return time.perf_counter() - t0


def summary(run: Path, steps: int) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] > 0 and "timing_s/step" in r]

    def med(key):
        vals = [r[key] for r in train if key in r]
        return statistics.median(vals) if vals else float("nan")
    ckpt = run / f"global_step_{steps}" / "actor"
    return {"s_step": med("timing_s/step"), "update": med("timing_s/update_actor"),
            "gen": med("timing_s/gen"), "reshard_s": med("timing_s/reshard"),
            "reshard_bytes": med("perf/reshard_bytes"),
            "optim_bytes": dir_bytes(ckpt / "optim"), "ckpt_bytes": dir_bytes(ckpt),
            "val": {r["step"]: r["val-core/mean"] for r in rows if "val-core/mean" in r}}


def table(res: dict, steps: int, chunk: int, nproc: int, walls: dict) -> str:
    lo, fu = res["lora"], res["full"]
    mb = 1 << 20
    lines = [
        f"Host: {cpu_name()}, {os.cpu_count()} cores; {nproc} ranks; {steps} steps per recipe in "
        f"turns of {chunk}, alternated (`python scripts/bench_lora.py --steps {steps} --chunk {chunk}`).",
        "",
        "| | LoRA (r=16, all-linear) | full parameters | LoRA / full |",
        "|---|---|---|---|",
        f"| s/step (median) | {lo['s_step']:.1f} | {fu['s_step']:.1f} | {lo['s_step'] / fu['s_step']:.2f} |",
        f"| update_actor s (median) | {lo['update']:.1f} | {fu['update']:.1f} | {lo['update'] / fu['update']:.2f} |",
        f"| gen s (median) | {lo['gen']:.1f} | {fu['gen']:.1f} | {lo['gen'] / fu['gen']:.2f} |",
        f"| reshard s (median) | {lo['reshard_s']:.3f} | {fu['reshard_s']:.3f} | {lo['reshard_s'] / fu['reshard_s']:.3f} |",
        f"| reshard MB received per rank per step | {lo['reshard_bytes'] / mb:.2f} | "
        f"{fu['reshard_bytes'] / mb:.1f} | {lo['reshard_bytes'] / fu['reshard_bytes']:.4f} |",
        f"| optimizer state MB (checkpoint) | {lo['optim_bytes'] / mb:.1f} | {fu['optim_bytes'] / mb:.1f} | "
        f"{lo['optim_bytes'] / fu['optim_bytes']:.4f} |",
        f"| actor checkpoint MB | {lo['ckpt_bytes'] / mb:.1f} | {fu['ckpt_bytes'] / mb:.1f} | "
        f"{lo['ckpt_bytes'] / fu['ckpt_bytes']:.4f} |",
        f"| wall s, all turns (start-up and validation included) | {walls['lora']:.0f} | {walls['full']:.0f} | "
        f"{walls['lora'] / walls['full']:.2f} |",
        "",
        "Validation (val-core/mean: mean@4 sampled answers on 64 test prompts):",
        "",
        "| step | " + " | ".join(str(s) for s in sorted(lo["val"])) + " |",
        "|---|" + "---|" * len(lo["val"]),
        "| LoRA | " + " | ".join(f"{lo['val'][s]:.3f}" for s in sorted(lo["val"])) + " |",
        "| full | " + " | ".join(f"{fu['val'].get(s, float('nan')):.3f}" for s in sorted(lo["val"])) + " |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--chunk", type=int, default=10, help="steps per turn")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="outputs/bench_lora", help="run dirs (must not hold other runs)")
    p.add_argument("--doc", default=None, help="write the table as markdown here")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for both recipes")
    a = p.parse_args()
    if a.steps < 1 or a.chunk < 1 or a.steps % a.chunk:
        raise SystemExit(f"--steps {a.steps} must be a positive multiple of --chunk {a.chunk}")
    out = (ROOT / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    walls = {"lora": 0.0, "full": 0.0}
    for turn, until in enumerate(range(a.chunk, a.steps + 1, a.chunk)):
        order = ("lora", "full") if turn % 2 == 0 else ("full", "lora")
        for name in order:
            walls[name] += run_turn(name, until, out, a.nproc, a.overrides)
            print(f"{name}: step {until} done ({walls[name]:.0f} s so far)", flush=True)
    res = {name: summary(out / name, a.steps) for name in RECIPES}
    text = table(res, a.steps, a.chunk, a.nproc, walls)
    print(text)
    if a.doc:
        head = ("# LoRA vs full-parameter GRPO (generated)\n\nWritten by `scripts/bench_lora.py --doc`; "
                "see docs/training.md for what LoRA does in minihf.\n\n")
        Path(a.doc).write_text(head + text)


if __name__ == "__main__":
    main()
