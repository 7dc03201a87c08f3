"""The figures of ``bench_step.py``'s report as text: per-phase model-FLOPs utilisation, the
table rows (comparisons and scaling) and the docs file they are written to."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from bench_step_workers import has_flash_attn

from minihf.cli.doctor import cpu_name


def compare_row(label: str, forced: bool, out: dict, params: int, peak: float, samples: int) -> str:
    """The table row of one comparison; adds its per-phase MFU and ``ceiling`` to ``out``."""
    m, t = out["minihf"], out["trl"]
    out["mfu"] = phase_mfu(m, params, peak, samples)
    # the best speed-up possible here: TRL's step vs minihf's model FLOPs at the peak
    out["ceiling"] = ceiling = t["step_s"] / (out["mfu"]["step"][1] * m["step_s"] / peak)
    return (f"| {label} | {'forced 64' if forced else 'eos'} | {m['step_s']:.2f} | "
            f"{t['step_s']:.2f} | **{out['ratio']:.2f}x** | {ceiling:.1f}x | "
            f"{m['tokens']:.0f} / {t['tokens']:.0f} | {1e3 * m['s_per_token']:.2f} | "
            f"{1e3 * t['s_per_token']:.2f} | {out['token_ratio']:.2f}x | "
            f"{', '.join(f'{x:.2f}x' for x in out['round_ratios'])} | {probes(out)} |")


def probes(out: dict) -> str:
    """The mm-peak probes taken during one comparison, lowest-highest: a low one says a
    neighbour was busy during that row."""
    ps = out.get("peaks", [])
    return f"{min(ps):.0f}-{max(ps):.0f}" if ps else ""


def phase_mfu(m: dict, params: int, peak_gflops: float, samples: int) -> dict:
    """Model FLOPs of each phase (per step) / its time / the mm peak. The FLOPs are those of
    the work minihf does: each prompt once for its ``samples`` responses (the engine prefills
    a shared prompt once, and the trainer's packed forwards run it once, ``share_prompt``)."""
    total = m["prompt_tokens"] / samples + m["tokens"]
    flops = {"gen": 2 * params * total, "old_log_prob": 2 * params * total,
             "ref": 2 * params * total, "update_actor": 6 * params * total}
    out = {}
    for p, f in flops.items():
        s = m["phases"].get(p, 0.0)
        if s > 0:
            out[p] = (s, f / s / 1e9, f / s / 1e9 / peak_gflops)
    step_flops = sum(f for p, f in flops.items() if m["phases"].get(p, 0.0) > 0)
    out["step"] = (m["step_s"], step_flops / m["step_s"] / 1e9,
                   step_flops / m["step_s"] / 1e9 / peak_gflops)
    return out


def scaling_row(label: str, r: dict) -> str:
    return (f"| {label} | {r['step_s']:.2f} | {r['phases']['gen']:.2f} | "
            f"{r['phases']['update_actor']:.2f} | {r['peak']:.0f} |")


GPU_CHECK = """
## The GPU check

No GPU has run these benchmarks yet: GPU time comes in short windows, so the check is
prepared and runs in one call. On a machine with one CUDA GPU, its own torch and
transformers and no network:

```
bash scripts/gpu_check.sh OUTDIR
```

installs minihf (`pip install -e . --no-deps --no-build-isolation`, else `src/` on
`PYTHONPATH`), runs the CUDA-only tests (`pytest -m gpu`: engine vs trainer log-probs in
fp32 and bf16, SDPA's flash backend vs its math backend, packed vs padded attention, FSDP2
on NCCL, the reshard's in-place gather, optimizer offload during generation), the main job
on one GPU, and a 0.5B Qwen2-shaped model in bf16 (prefill and training MFU against a
measured bf16 matmul peak, decode tokens/s at batch 1 and 64 against the measured
bandwidth bound, peak memory), and writes `OUTDIR/gpu_check.md`. flash-attn cannot travel
to that machine (PyPI has only its source; `flash-attn-4` needs a 92 MB CUTLASS wheel),
so the packed attention runs SDPA there, and the report says which path ran.
`bash scripts/gpu_check.sh --dry-run OUTDIR` runs the same on the CPU with a tiny model in
seconds (`tests/test_gpu_check.py`). The figures go here after the first GPU run.
"""  # docs/performance.md's last section: how to run the prepared GPU check


MODEL_SECTION = ("<!-- bench_step --model: begin -->", "<!-- bench_step --model: end -->")


def model_section(args, r: dict, shape: dict, bounds: list, *, name: str, task: str, max_new: int,
                  peak: float, bandwidth: float) -> list[str]:
    """The text of ``bench_step.py --model``'s section: the run's settings and machine, the
    comparison ``r`` (``compare``'s) and each phase against its bound (``bounds``)."""
    import torch
    import trl

    from bench_step_bounds import bounds_lines

    from minihf.models.linear import use_onednn

    m, t = r["minihf"], r["trl"]
    return [
        f"### {name} ({shape['matmul'] / 1e6:.1f}M matmul parameters): GRPO on `{task}`",
        "",
        f"`python scripts/bench_step.py --model {args.model} --recipe {args.recipe}`: "
        f"{args.prompts} prompts x {args.samples} samples, every response {max_new} tokens "
        f"(forced), prompts up to {args.prompt_limit} tokens as the recipe cuts them, a k3 KL "
        f"loss (beta 0.04), fp32, {args.threads} threads, {args.rounds} alternating rounds x "
        f"{args.steps} measured steps after {args.warmup} warm-up steps; minihf with the "
        "recipe's other settings. Matmul peak "
        f"{peak:.0f} GFLOP/s (best of {len(r['peaks']) + 1} probes), copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (read + written; best of 3).",
        "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"trl {trl.__version__}"
        + ("; its linears run oneDNN (`minihf.models.linear`)." if use_onednn() else "."),
        "",
        "| | s/step | speed-up | speed-up per round |", "|---|---|---|---|",
        f"| minihf | {m['step_s']:.2f} | **{r['ratio']:.2f}x** | "
        f"{', '.join(f'{x:.2f}x' for x in r['round_ratios'])} |",
        f"| TRL | {t['step_s']:.2f} | | |",
        "",
        "Each phase of minihf's median step against its bound (`scripts/bench_step_bounds.py`):",
        "",
        *bounds_lines(bounds, m["step_s"], t["step_s"]),
    ]


def write_model_section(path: Path, lines: list[str], markers: tuple[str, str] = MODEL_SECTION) -> None:
    """Put a generated section (``markers``: its first and last lines; default the
    real-model one) into the docs file, replacing an earlier one; a new one goes before the
    GPU check."""
    begin, end = markers
    block = "\n".join([begin, "", *lines, "", end])
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif "## The GPU check" in text:
        head, tail = text.split("## The GPU check", 1)
        text = head + block + "\n\n## The GPU check" + tail
    else:
        text = text + "\n" + block + "\n"
    path.write_text(text)
    print(f"wrote {path}")


def write_docs(path: Path, lines: list[str], args) -> None:
    import platform

    import torch
    import trl

    versions = f"torch {torch.__version__}, trl {trl.__version__}, Python {platform.python_version()}"
    if args.device == "cuda":
        flash = (f"flash-attn {getattr(importlib.import_module('flash_attn'), '__version__', '?')}"
                 if has_flash_attn() else "no flash-attn")
        machine = f"{torch.cuda.get_device_name()}, bf16, {flash}, {versions}"
        command, title = "python scripts/bench_step.py --device cuda", " on a GPU"
    else:
        machine = (f"{cpu_name()}, {os.cpu_count()} cores, {versions}; "
                   f"{args.threads} threads per framework")
        command, title = "python scripts/bench_step.py", ""
    text = [
        f"# Performance{title}: a GRPO step, minihf vs TRL",
        "",
        f"Generated by `{command}` (do not edit by hand); the script's "
        "docstring says exactly what both frameworks run.",
        "",
        f"Machine: {machine}; {args.rounds} alternating "
        f"rounds x {args.steps} measured steps after a warm-up step; medians.",
        "",
        *lines,
        "",
    ]
    old = path.read_text() if path.exists() else ""
    begin, end = MODEL_SECTION
    if begin in old and end in old:  # bench_step.py --model's section stays
        text += [begin + old.split(begin, 1)[1].split(end, 1)[0] + end, ""]
    if args.device != "cuda":
        text += GPU_CHECK.splitlines()[1:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))
    print(f"wrote {path}")
