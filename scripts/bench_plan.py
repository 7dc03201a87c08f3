"""The planner's predictions against measured steps: every feasible plan of a setting, run.

    python scripts/bench_plan.py                         # ppo and ppo_rm on 2 and 4 processes
    python scripts/bench_plan.py --settings ppo:2 --steps 3
    python scripts/bench_plan.py --paper --out docs/planner-paper-scale.md   # predictions only

For each setting (recipe : processes) this machine is measured first (``minihf plan
--measure`` with that many ranks), the planner ranks its candidates, and every feasible
candidate runs as ``torchrun --nproc_per_node=P scripts/train_ppo.py recipe=PLAN`` (the
recipe ``minihf plan --out`` writes: placement, rollout TP, micro-batches) for ``--steps``
steps without validation or checkpoints, on the main job's prepared models and data under
``outputs/`` (``ppo_rm`` needs ``outputs/rm_sort/hf``: run the recipe once first). The
measured figures are the medians of ``timing_s/<phase>`` over the steps after the first.
Per setting it prints predicted and measured seconds per step and per phase, the rank
correlation of the two orders (Kendall's tau) and how far the predicted best plan is from
the measured best; ``--out`` writes the same as markdown (docs/planner.md).

``--paper``: no run, the planner's choice at HybridFlow's scale (its Section 8 set-up: PPO
with actor, reference, critic and reward model of one Llama size, 1024 prompts of 1024
tokens and 1024-token responses, 7B to 70B on 8 to 128 A100-80GB, 8 per node; groups in
whole nodes from 16 devices on), with the fully colocated plan beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = [("gen", ("gen", "reshard")), ("reward", ("reward",)), ("old_log_prob", ("old_log_prob",)),
          ("ref", ("ref",)), ("values", ("values",)), ("update_actor", ("update_actor",)),
          ("update_critic", ("update_critic",))]
RUN = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "prepare.task=null"]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long lists (1: the same order, -1: reversed)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return 2 * s / (n * (n - 1)) if n > 1 else float("nan")


def measured(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 2] or rows
    out = {"step": statistics.median(r["timing_s/step"] for r in rows)}
    for name, _ in PHASES:
        out[name] = statistics.median(r.get(f"timing_s/{name}", 0.0) for r in rows)
    return out


def run_plan(plan_file: Path, procs: int, steps: int, run_dir: Path) -> dict[str, float]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
            str(ROOT / "scripts" / "train_ppo.py"), f"recipe={plan_file}", f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}", *RUN]
    job = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // procs))))
    if job.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{job.stdout[-2000:]}\n{job.stderr[-3000:]}")
    return measured(run_dir)


def bench_setting(recipe: str, procs: int, steps: int, scratch: Path) -> dict:
    from minihf.cli.plan import write_plan
    from minihf.config import load_config
    from minihf.planner import describe, measure, plan_overrides, search, workload
    from minihf.trainer.ppo_job import PPOJobConfig

    w = workload(load_config(PPOJobConfig, recipe, []))
    actor = w.role("actor").model
    profile = measure(world=procs, linear=(4096, actor.hidden, actor.ffn))  # as `minihf plan RECIPE --measure`
    result = search(w, procs, profile)
    rows = []
    for i, e in enumerate(result.ranked):
        plan_file = write_plan(scratch / f"{recipe}-{procs}-{i}.yaml", recipe, [], plan_overrides(e.plan, procs, w))
        got = run_plan(plan_file, procs, steps, scratch / f"run-{recipe}-{procs}-{i}")
        pred = {"step": e.step_seconds, **{name: sum(e.phases[k] for k in keys) for name, keys in PHASES}}
        rows.append({"plan": describe(e.plan), "predicted": pred, "measured": got})
        print(f"{recipe}:{procs} {describe(e.plan)}: predicted {pred['step']:.2f} s, measured {got['step']:.2f} s",
              flush=True)
    return {"recipe": recipe, "procs": procs, "rows": rows, "profile": profile,
            "considered": result.considered, "refused": result.refused, "infeasible": result.infeasible}


def report(settings: list[dict], steps: int) -> str:
    import torch

    lines = ["# The planner against measured steps", "",
             "Generated by `python scripts/bench_plan.py` (do not edit by hand); its docstring says what runs.", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}; {steps} steps per plan, medians of the steps after the first.", "",
             "`gen` includes the reshard. With the actor, critic (and cost critic) on disjoint devices the "
             "driver runs `ref` with `values` and the two updates at once, and times each as its wait: the first "
             "waited (`ref`, `update_critic`) holds the pair's time and the second only what was left, so "
             "compare those pairs by their sum. Predicted phases are each phase's own time.", ""]
    for s in settings:
        rows, prof = s["rows"], s["profile"]
        pred = [r["predicted"]["step"] for r in rows]
        meas = [r["measured"]["step"] for r in rows]
        best_pred = min(range(len(rows)), key=lambda i: pred[i])
        best_meas = min(meas)
        lines += [f"## `{s['recipe']}` on {s['procs']} processes", "",
                  f"Profile (measured): {prof.flops / 1e9:.1f} GFLOP/s at the actor's MLP shape, "
                  f"{prof.memory_bandwidth / 1e9:.1f} GB/s memory, {prof.intra_node_bandwidth / 1e9:.2f} GB/s all-gather "
                  f"per rank, {prof.collective_latency * 1e6:.0f} us a collective. Candidates: {s['considered']} "
                  f"considered, {s['refused']} refused by the batch sizes, {s['infeasible']} over memory, "
                  f"{len(rows)} run.", "",
                  "| plan | predicted s/step | measured s/step | measured / predicted | "
                  + " | ".join(f"{n} (pred / meas)" for n, _ in PHASES) + " |",
                  "|---|---|---|---|" + "---|" * len(PHASES)]
        for r in rows:
            p, m = r["predicted"], r["measured"]
            lines.append(f"| {r['plan']} | {p['step']:.3f} | {m['step']:.3f} | {m['step'] / p['step']:.2f} | "
                         + " | ".join(f"{p[n]:.3f} / {m[n]:.3f}" for n, _ in PHASES) + " |")
        gap = meas[best_pred] / best_meas - 1
        lines += ["", f"Kendall's tau (predicted vs measured order): {kendall_tau(pred, meas):.2f}. The predicted "
                  f"best plan ({rows[best_pred]['plan']}) measured {meas[best_pred]:.3f} s/step, "
                  f"{100 * gap:.0f}% over the measured best ({best_meas:.3f} s/step).", ""]
    return "\n".join(lines) + "\n"


PAPER = ["data.train_batch_size=1024", "data.max_prompt_length=1024", "data.max_response_length=1024",
         "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
         "critic.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_epochs=1", "critic.ppo_epochs=1",
         "actor_rollout_ref.actor.fsdp.wrap_blocks=true", "actor_rollout_ref.ref.fsdp.wrap_blocks=true",
         "critic.fsdp.wrap_blocks=true", "reward_model.fsdp.wrap_blocks=true",
         "actor_rollout_ref.actor.fsdp.activation_checkpointing=true",
         "critic.fsdp.activation_checkpointing=true"]
PAPER_SIZES = ["llama-7b", "llama-13b", "llama-34b", "llama-70b"]
PAPER_DEVICES = [8, 16, 32, 64, 128]


def paper_scale() -> str:
    """The planner's choices at the paper's scale (a prediction; nothing runs)."""
    from dataclasses import replace

    from minihf.config import load_config
    from minihf.planner import describe, load_profile, search, workload
    from minihf.trainer.ppo_job import PPOJobConfig

    cfg = load_config(PPOJobConfig, "ppo_rm", PAPER)
    lines = ["# The planner at the paper's scale (predictions, not measurements)", "",
             "Generated by `python scripts/bench_plan.py --paper` (do not edit by hand). Nothing here ran: "
             "these are the planner's choices for HybridFlow's Section 8 set-up on the A100-80GB datasheet "
             "profile: PPO (`recipes/ppo_rm` with the overrides below) with actor, reference, critic and reward "
             "model of one Llama size, 1024 prompts x 1024 tokens, 1024-token responses, one PPO epoch over "
             "mini-batches of 256, FSDP per block with activation checkpointing, 8 devices per node; from 16 "
             "devices on, groups take whole nodes (`minihf plan --unit 8`). The colocated plan is every role "
             "on every device (verl's default).", "",
             "Overrides: `" + " ".join(PAPER) + "`", "",
             "| model | devices | chosen plan | s/step | colocated s/step | colocated / chosen | "
             "candidates (refused, over memory, feasible) |",
             "|---|---|---|---|---|---|---|"]
    for size in PAPER_SIZES:
        w = workload(cfg, {"all": size})
        for devices in PAPER_DEVICES:
            prof = replace(load_profile("A100-80GB"), devices_per_node=8)
            result = search(w, devices, prof, unit=8 if devices >= 16 else 1)
            counts = (f"{result.considered} ({result.refused}, {result.infeasible}, "
                      f"{len(result.ranked)})")
            if not result.ranked:
                lines.append(f"| {size} | {devices} | none fits | | | | {counts} |")
                continue
            best = result.ranked[0]
            colocated = [e for e in result.ranked if len(e.plan.groups) == 1]
            col = min(colocated, key=lambda e: e.step_seconds) if colocated else None
            lines.append(f"| {size} | {devices} | {describe(best.plan)} | {best.step_seconds:.0f} | "
                         + (f"{col.step_seconds:.0f} | {col.step_seconds / best.step_seconds:.2f} | "
                            if col else "does not fit | | ") + f"{counts} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="ppo:2,ppo_rm:2,ppo:4,ppo_rm:4", help="RECIPE:PROCS,...")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="markdown report (e.g. docs/planner.md)")
    p.add_argument("--paper", action="store_true", help="the paper-scale predictions instead (no run)")
    args = p.parse_args()
    if args.paper:
        text = paper_scale()
        print(text)
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}")
        return
    settings = []
    with tempfile.TemporaryDirectory(prefix="minihf-bench-plan-") as scratch:
        for item in args.settings.split(","):
            recipe, procs = item.split(":")
            settings.append(bench_setting(recipe, int(procs), args.steps, Path(scratch)))
    text = report(settings, args.steps)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
