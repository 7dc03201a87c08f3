"""Why rollout correction matters: the main job with a deliberately off-policy rollout.

    python scripts/exp_rollout_correction.py                 # all variants; writes docs/rollout-correction.md
    python scripts/exp_rollout_correction.py --steps 40      # shorter
    torchrun --nproc_per_node=2 scripts/exp_rollout_correction.py --variant off_policy --steps 100 --out DIR

The main job (``recipes/grpo``: GRPO on the ``sort`` task, its SFT warm start, 2 processes)
with the engine sampling at ``rollout.temperature`` while the trainer scores the samples
(old log-probs, the PPO ratio) at temperature 1.0, as when an inference server's sampler
settings drift from the trainer's. The samples then come from pi_rollout (T > 1), not from
the pi_old the update assumes. Variants, same seeds and data order:

* ``on_policy``: engine and trainer at T = 1 (the main job as it is);
* ``off_policy``: engine at T = 1.5, no correction;
* ``off_policy_tis``: the same, with token-level truncated importance sampling
  (``algorithm.rollout_correction.rollout_is=token``, cap 2);
* ``off_policy_tis_rs``: TIS plus sequence rejection on the geometric-mean ratio
  (``rollout_rs=seq_mean_k1``, kept within [0.5, 2]).

Each variant runs in its own ``torchrun`` job; the parent collects ``metrics.jsonl`` and
writes the markdown report (validation score, training score, ``rollout_corr/kl``,
``training/rollout_probs_diff_mean``, IS weights and rejected fraction along the run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER_TEMPERATURE = 1.0
CORR = "algorithm.rollout_correction"
VARIANTS = {
    "on_policy": (1.0, []),
    "off_policy": (1.5, []),
    "off_policy_tis": (1.5, [f"{CORR}.rollout_is=token", f"{CORR}.rollout_is_threshold=2.0"]),
    "off_policy_tis_rs": (1.5, [f"{CORR}.rollout_is=token", f"{CORR}.rollout_is_threshold=2.0",
                                f"{CORR}.rollout_rs=seq_mean_k1", f"{CORR}.rollout_rs_threshold=0.5_2.0"]),
}
COLUMNS = [("val-core/mean", "val", "{:.3f}"), ("critic/score/mean", "score", "{:.3f}"),
           ("rollout_corr/kl", "kl(rollout, trainer)", "{:.3f}"),
           ("training/rollout_probs_diff_mean", "probs diff", "{:.3f}"),
           ("rollout_corr/rollout_is_mean", "IS mean", "{:.3f}"),
           ("rollout_corr/rollout_rs_masked_fraction", "rejected", "{:.3f}")]


def run_variant(name: str, steps: int, out: Path) -> None:
    """One variant, inside torchrun: the main job with the engine at the variant's
    temperature and the trainer at TRAINER_TEMPERATURE."""
    from minihf.config import load_config
    from minihf.trainer.ppo import PPOTrainer
    from minihf.trainer.ppo_job import PPOJobConfig, run_ppo

    class TrainerAtFixedTemperature(PPOTrainer):
        """Scores every generated batch at TRAINER_TEMPERATURE, whatever the engine used."""

        def _generate(self, batch, meta):
            out, gen_meta = super()._generate(batch, meta)
            out.meta["temperature"] = TRAINER_TEMPERATURE
            return out, gen_meta

    temperature, overrides = VARIANTS[name]
    cfg = load_config(PPOJobConfig, "grpo", [
        f"actor_rollout_ref.rollout.temperature={temperature}", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=10", "trainer.save_freq=-1", f"trainer.default_local_dir={out / name}",
        "trainer.logger=[console,jsonl]", *overrides])
    run_ppo(cfg, trainer=TrainerAtFixedTemperature)


def report(out: Path, steps: int, names: list[str]) -> list[str]:
    lines = []
    finals = []
    for name in names:
        rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        temperature, overrides = VARIANTS[name]
        lines += ["", f"### `{name}`: engine T = {temperature}, trainer T = {TRAINER_TEMPERATURE}"
                  + (f"; `{' '.join(o.replace(CORR + '.', '') for o in overrides)}`" if overrides else ""),
                  "", "| step | " + " | ".join(c[1] for c in COLUMNS) + " |",
                  "|---" * (len(COLUMNS) + 1) + "|"]
        for row in rows:
            if row["step"] % 10 and row["step"] != steps:
                continue
            cells = [fmt.format(row[k]) if k in row else "" for k, _, fmt in COLUMNS]
            lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
        vals = [r["val-core/mean"] for r in rows if "val-core/mean" in r]
        finals.append(f"| `{name}` | {vals[0]:.3f} | {max(vals):.3f} | {vals[-1]:.3f} |")
    return (["| variant | val before | best val | val at the end |", "|---|---|---|---|", *finals,
             "", "One run per variant, all with the same seeds and data order (a rerun repeats a "
             "how far another seed would move these figures is not measured here, "
             "so read small differences between variants with care. Compare the off-policy rows "
             "with each other, and their `kl` and `probs diff` columns with `on_policy`'s "
             "(rounding only there)."] + lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=list(VARIANTS), help="run one variant (inside torchrun)")
    p.add_argument("--only", default=",".join(VARIANTS), help="the variants to run and report, comma-separated")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="outputs/exp_rollout_correction")
    p.add_argument("--docs", default=str(ROOT / "docs" / "rollout-correction.md"))
    args = p.parse_args()
    out = Path(args.out)
    if args.variant:
        from minihf.controller import run_script

        run_script(lambda argv: run_variant(args.variant, args.steps, out), [])
        return
    names = [n.strip() for n in args.only.split(",")]
    for name in names:
        if (out / name / "metrics.jsonl").exists():
            print(f"{name}: {out / name} exists, reusing it (delete it to rerun)")
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               __file__, "--variant", name, "--steps", str(args.steps), "--out", str(out)]
        print("running", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    text = ["# Rollout correction: the main job, deliberately off-policy", "",
            f"Generated by `python scripts/exp_rollout_correction.py --steps {args.steps}` (do not edit "
            "by hand); the script's docstring says what each variant runs. Validation: greedy "
            "score on the task's test prompts every 10 steps; score: the mean training reward "
            "of the step's samples; kl: mean of rollout - trainer log-probs over response "
            "tokens (`rollout_corr/kl`); probs diff: mean |p_rollout - p_trainer| of the "
            "sampled tokens; IS mean: mean applied importance weight; rejected: fraction of "
            "response tokens rejected.", "", *report(out, args.steps, names), ""]
    Path(args.docs).write_text("\n".join(text))
    print(f"wrote {args.docs}")


if __name__ == "__main__":
    main()
