"""Probe: kill the whole pipeline at random points, rerun, and check the result equals an
uninterrupted run; start two jobs at once. Prints one row per case (docs/reliability.md).

    python scripts/probe_faults.py --kills 8 --seed 0 [--work DIR]

The job is the default recipe (grpo: task data, a random-init model, the SFT warm start and
its export, RL with checkpoints) shortened to run in about a minute on 2 CPU cores, under
torchrun with 2 processes, in a fresh directory each time. A reference run goes through
once; it also gives the time to kill within. Each case then kills the whole job (SIGKILL,
or SIGINT as Ctrl-C does, alternating) at a uniformly random time in the pipeline, reruns
the same command to the end, and checks:

* the rerun exits 0; after a SIGINT the interrupted job said so (no damaged-file error);
* ``metrics.jsonl`` of the RL run and of the warm start hold each step once and equal the
  reference's (timings aside): the data, the model, the warm start and RL resumed exactly;
* the final RL parameters equal the reference's bitwise;
* no lock or ``.partial`` file is left.

Two jobs at once: the same command twice in one directory (the second must be refused in
one line naming the first, the first must finish), and two recipes sharing the warm start
(the later one refused while the first builds it, then run again to the end).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["prepare.num_train=400", "prepare.num_test=40", "prepare.size=tiny",
         "prepare.sft_overrides=[trainer.total_training_steps=12,trainer.save_freq=4,data.val_batch_size=40]",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
         "actor_rollout_ref.actor.ppo_epochs=1", "trainer.total_training_steps=6", "trainer.save_freq=2",
         "trainer.test_freq=3", "controller.timeout_s=60"]


def command(extra=()):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "scripts" / "train_ppo.py"), *SHORT, *extra]


def start(cwd: Path, extra=()):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(command(extra), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc, timeout=900):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(("timing_s/", "perf/", "throughput"))} for line in path.read_text().splitlines()]


def params(run: Path):
    import torch

    from minihf.models import load_hf
    from minihf.hub import export_hf

    with tempfile.TemporaryDirectory() as scratch:
        model = load_hf(export_hf(run / "global_step_6", Path(scratch) / "hf"))
        return {k: v.clone() for k, v in model.state_dict().items()}, torch


def leftovers(cwd: Path) -> list[str]:
    return sorted(str(p.relative_to(cwd)) for p in cwd.rglob(".*") if p.name.endswith((".lock", ".partial")))


def phase_at(out: str) -> str:
    """Where the job was when it died, from its last progress line."""
    marks = [("[prepare] writing", "data"), ("[prepare] building", "base model"),
             ("[prepare] SFT warm start", "SFT"), ("exported", "RL start"), ("score=", "RL"),
             ("validation score", "RL done")]
    where = "start-up"
    for line in out.splitlines():
        for mark, name in marks:
            if mark in line:
                where = name
    return where


def check(cwd: Path, ref: Path) -> list[str]:
    bad = []
    for name in ("outputs/grpo_sort/metrics.jsonl", "outputs/sft_sort/metrics.jsonl"):
        got, want = rows(cwd / name), rows(ref / name)
        if got != want:
            bad.append(f"{name} differs ({len(got)} rows vs {len(want)})")
    a, torch = params(cwd / "outputs" / "grpo_sort")
    b, _ = params(ref / "outputs" / "grpo_sort")
    if not all(torch.equal(a[k], b[k]) for k in b):
        bad.append("final parameters differ")
    if leftovers(cwd):
        bad.append(f"left behind: {leftovers(cwd)}")
    return bad


def disk_full(work: Path, ref: Path) -> tuple[str, str]:
    """The RL run dir on a 3.5 MiB tmpfs (the third checkpoint does not fit), then grown
    and the command rerun (needs root to mount; skipped otherwise)."""
    case = "disk full at the third RL checkpoint, then space freed"
    cwd = work / "disk_full"
    shutil.rmtree(cwd, ignore_errors=True)
    mount = cwd / "outputs" / "grpo_sort"
    mount.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3500k", "tmpfs", str(mount)]).returncode != 0:
        return case, "skipped (cannot mount a tmpfs here)"
    try:
        code, out, err = finish(start(cwd))
        said = "WriteFailedError: could not write the checkpoint" in err and "no space left on device" in err
        kept = (mount / "latest_checkpointed_iteration.txt").read_text().strip()
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        code2, _, err2 = finish(start(cwd))
        bad = [] if code != 0 and said and kept == "4" else [f"exit {code}, pointer {kept}: {err[-300:]}"]
        bad += [f"rerun exit {code2}: {err2[-300:]}"] if code2 != 0 else check(cwd, ref)
        return case, "BAD: " + "; ".join(bad) if bad else "ok"
    finally:
        subprocess.run(["umount", str(mount)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary dir)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.work or Path(tempfile.mkdtemp(prefix="minihf-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    table = []

    ref = work / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir()
    t0 = time.monotonic()
    code, out, err = finish(start(ref))
    total = time.monotonic() - t0
    assert code == 0, err
    print(f"reference: {total:.0f} s", flush=True)

    for k in range(args.kills):
        cwd = work / f"kill{k}"
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir()
        sig = signal.SIGKILL if k % 2 == 0 else signal.SIGINT
        at = rng.uniform(0.5, total)
        proc = start(cwd)
        time.sleep(at)
        done_early = proc.poll() is not None
        if not done_early:
            os.killpg(proc.pid, sig)
        code, out, err = finish(proc, timeout=120)
        (cwd / "killed.out").write_text(out)
        (cwd / "killed.err").write_text(err)
        where = phase_at(out)
        bad, note = [], ""
        if code == 0:  # it ended on its own: the signal came as it finished, or torchrun lost it starting
            note = " (the killed job still ended normally)"
        elif "_get_module_details" in err and "[minihf" not in err:  # torchrun's own `-m` import
            note = " (torchrun itself was importing torch: its own traceback, no rank had started)"
        elif sig == signal.SIGINT and not done_early:
            if "interrupted (SIGINT)" not in err:
                bad.append(f"no interrupt line: {err.strip().splitlines()[-1:]}")
            if "CorruptFileError" in err or "damaged" in err:
                bad.append("interrupt reported as a damaged file")
        code2, out2, err2 = finish(start(cwd))
        if code2 != 0:
            bad.append(f"rerun exit {code2}: {err2.strip().splitlines()[-1:]}")
        else:
            bad += check(cwd, ref)
        table.append((f"{sig.name} at {at:.1f} s ({where})", "BAD: " + "; ".join(bad) if bad else "ok" + note))
        print(table[-1], flush=True)

    cwd = work / "twice"  # the same command twice, a second apart
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir()
    first = start(cwd)
    time.sleep(1.0)
    second = finish(start(cwd))
    first = finish(first)
    (cwd / "second.err").write_text(second[2])
    refused = second[0] == 1 and "is in use by another job" in second[2] and 'minihf/' not in "".join(
        line for line in second[2].splitlines() if line.lstrip().startswith("File "))  # no traceback of ours
    ok = first[0] == 0 and refused and not check(cwd, ref)
    table.append(("the same command twice in one dir", "ok" if ok else
                  f"BAD: first exit {first[0]}, second exit {second[0]}: {second[2][-400:]}"))
    print(table[-1], flush=True)

    cwd = work / "two_recipes"  # grpo, and 5 s later ppo: both need outputs/sft_sort
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir()
    first = start(cwd)
    time.sleep(5.0)
    other = ["recipe=ppo", "trainer.default_local_dir=outputs/ppo_sort", "critic.ppo_mini_batch_size=16"]
    second = finish(start(cwd, other))
    first = finish(first)
    again = finish(start(cwd, other)) if second[0] != 0 else second
    refused = second[0] == 0 or ("is in use by another job" in second[2])
    ok = first[0] == 0 and again[0] == 0 and refused and not leftovers(cwd)
    table.append(("grpo and ppo started 5 s apart in one empty dir", "ok" if ok else
                  f"BAD: exits {first[0]}, {second[0]}, {again[0]}: {second[2][-300:]} {again[2][-300:]}"))
    print(table[-1], flush=True)

    table.append(disk_full(work, ref))
    print(table[-1], flush=True)

    print("\n| case | result |\n|---|---|")
    for case, result in table:
        print(f"| {case} | {result} |")
    print(f"\n{sum(r.startswith('BAD') for _, r in table)} BAD of {len(table)}; runs in {work}")


if __name__ == "__main__":
    main()
