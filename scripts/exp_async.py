"""Asynchronous RL on a fixed schedule: the main job synchronous, with staleness k = 1, and
with k = 1 on a standalone rollout (generation on ranks of its own, overlapping training).

    python scripts/exp_async.py                  # every variant; writes docs/async.md
    python scripts/exp_async.py --steps 40       # shorter
    python scripts/exp_async.py --only sync,k1   # some variants (the others' rows are left out)

Variants of the main job (``recipes/grpo``: GRPO on ``sort``, its SFT warm start, same
seeds and data order), each its own ``torchrun`` of ``scripts/train_ppo.py``:

* ``sync``: colocated hybrid engine, 2 processes (the main job as it is);
* ``k1``: colocated, ``async_training.staleness=1`` (the samples of step n from the
  weights of step n - 1; no overlap: the same ranks generate and train);
* ``sync_standalone_3``: 3 processes, the actor on ranks 0-1 and the rollout on rank 2,
  k = 0 (no overlap: it measures G, T and S apart);
* ``k1_standalone_3``: the same placement with k = 1 (generation overlaps training);
* ``k1_standalone_4``: the actor on ranks 0-1, the rollout on 2-3 (two replicas), k = 1.

The parent reads each run's ``metrics.jsonl`` and writes the report: validation along the
run, seconds per step, and per step the generation G (``timing_s/gen``), the training T
(old log-probs, reference, update), the weight sync S and each group's busy share, with
the time model (synchronous ~ G + T, asynchronous ~ max(G, T) + S) set beside the
measured step; then the same model with the planner's estimates for GPUs
(``minihf.planner``, the built-in H100 profile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K1 = "async_training.staleness=1"
STANDALONE_3 = "controller.placement={actor: {ranks: [0, 1]}, rollout: {ranks: [2]}}"
STANDALONE_4 = "controller.placement={actor: {ranks: [0, 1]}, rollout: {ranks: [2, 3]}}"
VARIANTS = {  # name -> (processes, overrides, what it is)
    "sync": (2, [], "colocated, synchronous (the main job)"),
    "k1": (2, [K1], "colocated, k = 1"),
    "sync_standalone_3": (3, [STANDALONE_3], "standalone rollout on 1 rank, actor on 2, synchronous"),
    "k1_standalone_3": (3, [STANDALONE_3, K1], "standalone rollout on 1 rank, actor on 2, k = 1"),
    "k1_standalone_4": (4, [STANDALONE_4, K1], "standalone rollout on 2 ranks, actor on 2, k = 1"),
}
TRAIN = ("old_log_prob", "ref", "adv", "update_actor")


def rows(out: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]


def median(rs: list[dict], key: str) -> float:
    values = [r.get(key, 0.0) for r in rs]
    return statistics.median(values) if values else float("nan")


def timing_row(name: str, rs: list[dict]) -> str:
    """Medians over the steps after the first (start-up and the first k + 1 batches)."""
    steps = [r for r in rs if r["step"] > 1 and "timing_s/step" in r]
    step = median(steps, "timing_s/step")
    g = median(steps, "timing_s/gen")
    t = statistics.median([sum(r.get(f"timing_s/{p}", 0.0) for p in TRAIN) for r in steps])
    s = median(steps, "timing_s/weight_sync")
    procs, overrides, _ = VARIANTS[name]
    overlapped = K1 in overrides and "controller.placement" in " ".join(overrides)
    model = max(g, t) + s if overlapped else g + t + s
    busy = ""
    if "timing_s/busy/rollout" in steps[-1]:
        busy = (f"{median(steps, 'timing_s/busy/actor') / step:.0%} / "
                f"{median(steps, 'timing_s/busy/rollout') / step:.0%}")
    return (f"| `{name}` | {procs} | {step:.3f} | {g:.3f} | {t:.3f} | {s:.3f} | "
            f"{'max(G, T) + S' if overlapped else 'G + T + S'} = {model:.3f} | {busy} |")


def sync_formula(overrides: list[str]) -> int:
    """What one rollout rank receives per sync, from the plan (``plan_transfer``) over the
    main job's model shapes: the actor on ranks 0-1, the rollout (TP 1) on the rest."""
    from minihf.hybrid.transfer import plan_transfer, received_bytes
    from minihf.models import build_model, load_args

    args = load_args(str(ROOT / "outputs" / "sft_sort" / "hf"))
    shapes = {n: tuple(p.shape) for n, p in build_model(args, "lm", device="meta").named_parameters()}
    rollout = [2, 3] if overrides[0] == STANDALONE_4 else [2]
    rounds = plan_transfer(shapes, [0, 1], {r: 0 for r in rollout}, 1, tied_lm_head=bool(args.tie_word_embeddings))
    return received_bytes(rounds, 2, 4)


def gpu_model() -> list[str]:
    """The time model with the planner's estimates (H100 profile): 4 GPUs colocated vs 2 + 2."""
    from minihf.config import load_config
    from minihf.planner.profiles import load_profile
    from minihf.planner.search import search
    from minihf.planner.job import workload
    from minihf.trainer.ppo_job import PPOJobConfig

    profile = load_profile("H100")
    lines = ["| workload | 4 GPUs colocated: G + T | 2 + 2 standalone: G2, T2, S | max(G2, T2) + S |",
             "|---|---|---|---|"]
    cases = [("SmolLM2-135M, `grpo_smollm2_arith` (8 prompts x 8, 24 tokens)", "grpo_smollm2_arith", [], {}),
             ("llama-7b shape, 64 prompts x 8, 1024-token responses", "grpo_smollm2_arith",
              ["data.train_batch_size=64", "data.max_response_length=1024",
               "actor_rollout_ref.actor.ppo_mini_batch_size=128"], {"all": "llama-7b"})]
    for label, recipe, overrides, models in cases:
        cfg = load_config(PPOJobConfig, recipe, [K1, "prepare.task=null", "prepare.sft_recipe=null", *overrides])
        w = workload(cfg, models)
        four, two = search(w, 4, profile).ranked[0], search(w, 2, profile).ranked[0]

        def split(e):
            g = e.phases["gen"] + e.phases["reshard"]
            return g, sum(e.phases[p] for p in ("old_log_prob", "ref", "update_actor"))
        g4, t4 = split(four)
        g2, t2 = split(two)
        params = w.role("actor").model.params
        s = params * profile.bytes_per_param / two.plan.rollout_tp / profile.intra_node_bandwidth
        lines.append(f"| {label} | {g4:.3g} + {t4:.3g} = {g4 + t4:.3g} s | {g2:.3g}, {t2:.3g}, {s:.2g} s | "
                     f"{max(g2, t2) + s:.3g} s |")
    return lines


def report(out: Path, steps: int, names: list[str]) -> list[str]:
    runs = {n: rows(out, n) for n in names}
    lines = ["## Validation", "", "Greedy score on the task's 200 test prompts (`val-core/mean`).", "",
             "| step | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for step in sorted({r["step"] for rs in runs.values() for r in rs if "val-core/mean" in r}):
        cells = []
        for n in names:
            v = [r["val-core/mean"] for r in runs[n] if r["step"] == step and "val-core/mean" in r]
            cells.append(f"{v[0]:.3f}" if v else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "## Time per step", "",
              "Medians over steps 2..end, seconds. G: `timing_s/gen` (the generate call, incl. the "
              "colocated reshard); T: old log-probs + reference + advantages + update; S: "
              "`timing_s/weight_sync` (standalone only); model: the time model's step from the "
              "measured G, T, S; busy: the share of the step each group worked "
              "(`timing_s/busy/{actor,rollout}`, the driver's waits for its calls).", "",
              "| variant | processes | s/step | G | T | S | model | busy actor / rollout |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [timing_row(n, runs[n]) for n in names]
    synced = [n for n in names if "controller.placement" in " ".join(VARIANTS[n][1])]
    if synced:
        lines += ["", "Weight sync per step (standalone runs): bytes one rollout rank received "
                  "(`perf/weight_sync_bytes`, median) against the plan's formula (its TP slice of every "
                  "weight, fp32), and the time.", "",
                  "| variant | received | formula | seconds | MB/s |", "|---|---|---|---|---|"]
        for n in synced:
            steps = [r for r in runs[n] if "perf/weight_sync_bytes" in r]
            got, secs = median(steps, "perf/weight_sync_bytes"), median(steps, "timing_s/weight_sync")
            want = sync_formula(VARIANTS[n][1])
            lines.append(f"| `{n}` | {got:,.0f} B | {want:,.0f} B | {secs:.4f} | {got / secs / 1e6:.0f} |")
    lines += ["", "Runs:", ""] + [f"* `{n}`: {VARIANTS[n][2]}; overrides `{' '.join(VARIANTS[n][1]) or '-'}`"
                                   for n in names]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(VARIANTS), help="variants to run and report, comma-separated")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default="outputs/exp_async")
    p.add_argument("--docs", default=str(ROOT / "docs" / "async.md"))
    args = p.parse_args()
    out = Path(args.out)
    names = [n.strip() for n in args.only.split(",")]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        p.error(f"--only: unknown variants {bad}; choose from {list(VARIANTS)}")
    for name in names:
        if (out / name / "metrics.jsonl").exists():
            print(f"{name}: {out / name} exists, reusing it (delete it to rerun)")
            continue
        procs, overrides, _ = VARIANTS[name]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
               str(ROOT / "scripts" / "train_ppo.py"), f"trainer.total_training_steps={args.steps}",
               "trainer.save_freq=-1", f"trainer.default_local_dir={out / name}", *overrides]
        print("running", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    head = (Path(args.docs).read_text().split(MARK)[0] if Path(args.docs).exists()
            else "# Asynchronous RL\n\n")
    text = [head.rstrip("\n"), "", MARK, "",
            f"Generated by `python scripts/exp_async.py --steps {args.steps}` (do not edit below this "
            "line by hand); the script's docstring says what each variant runs. Host: "
            f"{host()}.", "", *report(out, args.steps, names), "",
            "## The time model on GPUs", "",
            "The planner's estimates (`minihf.planner`, built-in H100 profile, its best plan for each "
            "group size), k = 1: on 4 GPUs colocated a step is G + T; with the rollout on 2 and the "
            "actor on 2, max(G2, T2) + S, S the TP slice of the weights over the node's links.", "",
            *gpu_model(), ""]
    Path(args.docs).write_text("\n".join(text))
    print(f"wrote {args.docs}")


MARK = "<!-- generated by scripts/exp_async.py -->"


def host() -> str:
    import os
    import platform

    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
