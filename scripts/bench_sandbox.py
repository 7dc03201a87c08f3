"""Cost of one call of the ``python`` tool, per sandbox mode, alternated.

    python scripts/bench_sandbox.py                 # 20 rounds, both modes
    python scripts/bench_sandbox.py --rounds 50 --code "print(sum(range(10**6)))"

Each round runs the same code once in every mode (``isolated``: namespaces, the default;
``process``: rlimits and an audit hook only), so a machine that slows down slows both
alike; it prints the median and the 90th percentile of the wall time per call, and the
ratio of each mode's median to the process mode's. ``PYTHONPATH=OTHER/src`` measures another
checkout (one without modes runs its single mode, named ``default``).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

from minihf.multi_turn import sandbox


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--code", default="print(6 * 7)")
    args = p.parse_args()
    has_modes = "mode" in inspect.signature(sandbox.run_python).parameters
    modes = [m for m in getattr(sandbox, "MODES", ()) if m != "isolated" or sandbox.isolation_missing() is None]
    if not has_modes:
        modes = ["default"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    expected = None
    for _ in range(args.rounds):
        for mode in modes:
            t0 = time.perf_counter()
            out = sandbox.run_python(args.code) if mode == "default" else sandbox.run_python(args.code, mode=mode)
            times[mode].append(time.perf_counter() - t0)
            expected = expected or out
            if out != expected:
                raise SystemExit(f"{mode}: the output differs: {out[:200]!r} vs {expected[:200]!r}")
    base = statistics.median(times.get("process", times[modes[0]]))
    print(f"{args.rounds} calls per mode of {args.code!r} (output {expected[:40]!r})")
    print("| mode | median s | p90 s | / process |\n|---|---|---|---|")
    for mode, ts in times.items():
        ts = sorted(ts)
        med = statistics.median(ts)
        print(f"| {mode} | {med:.3f} | {ts[int(0.9 * (len(ts) - 1))]:.3f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
