"""Peak memory and time of one actor update on one long response, by setting and length.

    python scripts/bench_memory.py --model outputs/models/smollm2-135m-instruct            # 1k and 4k
    python scripts/bench_memory.py --model DIR --lengths 1024 4096 16384 --docs             # into docs/training.md

Each (length, setting) runs in its own process, one rank, fp32 on CPU: the model loaded
from ``--model`` (the path a checkpoint takes), one sequence of a ``--prompt``-token prompt and
a response of ``length`` tokens (random ids), packed as the actor packs it (padding-free).
The update is what the actor runs on it: ``forward_log_probs`` (the entropy as a metric), the
``vanilla`` PPO clipped loss (advantages 1, old log-probs the detached new ones), the backward
and AdamW's step. AdamW's state and the gradients are allocated before the measurement (a zero
step, the gradients kept and zeroed, the backward accumulating into them), so the figure is
what the update's forward and backward add, its activations and temporaries: the peak
resident memory during it (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just
before) minus the resident memory before it. (Gradients made during the backward would
count as much of the model as had its gradient at the peak, a share that differs between
settings; FSDP shards them in any case.)
Each child runs with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every block over 64 kB
on its own and unmaps it when freed, so resident memory follows the bytes in use. With its
default (adaptive) threshold, freed tensors stay resident and fragment, and the peak reads
higher by an amount that differs between settings: SmolLM2's shapes cut to 6 layers, at 4k
tokens, measured 788 and 582 MB (both; SP=2 + both) by default against 453 and 383 MB so.
The settings: nothing; ``actor.logits_chunk_size`` (``--chunk`` tokens, never the whole
``[tokens, vocab]`` logits); ``actor.fsdp.activation_checkpointing`` (each block's
activations recomputed in the backward); both; and on request ``torch.compile``
(``actor.use_torch_compile``, after an untimed first update that compiles); ``SP=2`` and ``SP=2 + both`` (Ulysses,
``actor.ulysses_sequence_parallel_size=2``: two gloo ranks started by ``torch.distributed.run``,
one thread each, each holding the whole model and running half the sequence's tokens; the
gradients summed over the two as FSDP would, then AdamW; the figure is the larger rank's).

``--device cuda --dtype bfloat16`` runs the same update on a GPU (the GPU check's rows,
``scripts/gpu_check.py``): the model, its gradients and AdamW's state in bf16 on the device,
and the figure read by torch's allocator (``torch.cuda.max_memory_allocated`` above what was
allocated before the update, its peak reset there) instead of Linux's counters, after a
short untimed update (CUDA's start-up); the SP settings there take one GPU per rank (NCCL) and
are skipped with fewer GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"nothing": (False, False, False, 1), "chunked logits": (True, False, False, 1),  # (chunks, AC, compile, SP)
            "activation checkpointing": (False, True, False, 1), "both": (True, True, False, 1),
            "torch.compile": (False, False, True, 1), "SP=2": (False, False, False, 2),
            "SP=2 + both": (True, True, False, 2)}
DEFAULT_SETTINGS = ["nothing", "chunked logits", "activation checkpointing", "both", "SP=2", "SP=2 + both"]
MARKERS = ("<!-- bench_memory: begin -->", "<!-- bench_memory: end -->")
DTYPES = ("float32", "bfloat16")  # torch's names


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def memory_meter(device) -> tuple:
    """``(start, peak_mb)`` for ``device``: ``start()`` resets the peak and returns the
    baseline, ``peak_mb(base)`` the most in use since, above the baseline, in MB. On the CPU
    the process's resident memory (``VmRSS``/``VmHWM``, reset through ``clear_refs``); on a
    GPU torch's allocator, whose counters are exact."""
    import torch

    if device.type == "cuda":
        def start() -> int:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return torch.cuda.memory_allocated(device)

        def peak_mb(base: int) -> float:
            torch.cuda.synchronize(device)
            return (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return start, peak_mb

    def start() -> int:
        base = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return base

    def peak_mb(base: int) -> float:
        return (_status_kb("VmHWM") - base) / 1024
    return start, peak_mb


def child(args) -> dict:
    """One update in this process; its peak memory above the start and its seconds."""
    import torch
    import torch.distributed as dist

    from minihf.algorithms.policy_loss import compute_policy_loss
    from minihf.models import load_hf
    from minihf.models.model import compile_blocks
    from minihf.parallel.fsdp import enable_activation_checkpointing
    from minihf.parallel.ulysses import seq_parallel
    from minihf.workers.forward import forward_log_probs
    from minihf.workers.optim import OptimConfig, build_optimizer

    chunked, checkpointed, compiled, sp_size = SETTINGS[args.setting]
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    sp = None
    if sp_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        sp = seq_parallel(dist.group.WORLD)
    torch.set_num_threads(max(1, args.threads // sp_size))
    model = load_hf(args.model, dtype=getattr(torch, args.dtype), device=device).train()
    if checkpointed:
        enable_activation_checkpointing(model)
    if compiled:
        compile_blocks(model)
    optimizer = build_optimizer(model.parameters(), OptimConfig(lr=1e-6))
    for p in model.parameters():  # AdamW's state, allocated by a step of zero gradients
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated (the docstring)
    g = torch.Generator().manual_seed(0)

    def update(length: int) -> float:
        ids = torch.randint(0, model.args.vocab_size, (1, args.prompt + length), generator=g).to(device)
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(ids.shape[1], device=device)[None], "responses": ids[:, args.prompt:]}
        out = forward_log_probs(model, mb, calc_entropy=True, entropy_grad=False,
                                logits_chunk=args.chunk if chunked else None, sp=sp)
        mask = torch.ones_like(out["log_probs"])
        loss = compute_policy_loss(out["log_probs"].detach(), out["log_probs"], mask, mask)[0]
        loss.backward()
        if sp is not None:  # each rank's gradient is its tokens' part: the sum is the update's
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return float(loss)

    if compiled:  # compiling is not timed: a first update of another length (dynamic shapes)
        update(max(1, args.length // 4))
    elif device.type == "cuda":  # nor CUDA's start-up (cuBLAS's handles, kernel choices): a short update
        update(min(args.length, 256))
    start, read_peak = memory_meter(device)
    base = start()
    t = time.perf_counter()
    loss = update(args.length)
    peak_mb = read_peak(base)  # on a GPU it waits for the update's kernels first
    seconds = time.perf_counter() - t
    if sp is not None:  # the larger rank's figures
        both = torch.tensor([peak_mb, seconds], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        peak_mb, seconds = both.tolist()
        dist.destroy_process_group()
    return {"peak_mb": peak_mb, "seconds": seconds, "loss": loss}


def run_child(args, length: int, setting: str) -> dict:
    sp = SETTINGS[setting][3]
    if args.device == "cuda" and sp > 1 and _cuda_count() < sp:
        return {"error": f"needs {sp} GPUs"}
    launcher = ([sys.executable] if sp == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={sp}"])
    cmd = launcher + [__file__, "--child", setting, "--model", args.model, "--lengths", str(length),
                      "--prompt", str(args.prompt), "--chunk", str(args.chunk), "--threads", str(args.threads),
                      "--device", args.device, "--dtype", args.dtype]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # resident memory = bytes in use (docstring)
    if sp > 1:
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        if "OutOfMemoryError" in proc.stderr or "CUDA out of memory" in proc.stderr:
            return {"error": "out of memory"}
        return {"error": (proc.stderr.strip().splitlines() or [f"rc={proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def write_docs(args, table: list[str]) -> None:
    import platform

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_step_tables import write_model_section

    from minihf.cli.doctor import cpu_name

    dtype = "fp32" if args.dtype == "float32" else args.dtype
    lines = ["### Memory of one actor update by response length", "",
             f"Generated by `python scripts/bench_memory.py {' '.join(sys.argv[1:])}` (do not edit by hand; the "
             f"script's docstring says what runs). {cpu_name()}, {args.threads} threads, torch {torch.__version__}, "
             f"Python {platform.python_version()}; {dtype}, one rank (SP: two ranks of one thread each, the "
             f"larger rank's figures), a {args.prompt}-token prompt, chunks of {args.chunk} tokens.", "", *table]
    write_model_section(ROOT / "docs" / "training.md", lines, MARKERS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF model dir (e.g. outputs/models/smollm2-135m-instruct)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024, help="actor.logits_chunk_size of the chunked settings")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: on a GPU, the peak read by torch's allocator (the docstring)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="the model's, its gradients' and AdamW's dtype (bfloat16 on a GPU)")
    ap.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS),
                    help="also: 'torch.compile' (actor.use_torch_compile; its compiling is a first update, untimed)")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/training.md")
    ap.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.setting, args.length = args.child, args.lengths[0]
        result = child(args)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(result))
        return
    if args.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        sys.exit("bench_memory reads Linux's /proc/self/status and clear_refs on the CPU; this system "
                 "has none (on a GPU: --device cuda)")
    if args.device == "cuda" and not _cuda_count():
        sys.exit("bench_memory --device cuda: torch sees no CUDA GPU here; leave --device out for the CPU")
    if args.docs and args.device != "cpu":
        sys.exit("bench_memory --docs writes the CPU table of docs/training.md; the GPU rows come from "
                 "scripts/gpu_check.py's report")
    table = ["| response tokens | " + " | ".join(args.settings) + " |", "|---" * (len(args.settings) + 1) + "|"]
    for length in args.lengths:
        cells = []
        for setting in args.settings:
            r = run_child(args, length, setting)
            cell = r["error"][:60] if "error" in r else f"{r['peak_mb']:.0f} MB, {r['seconds']:.1f} s"
            print(f"{length:>6} tokens  {setting:<26} {cell}", flush=True)
            cells.append(cell)
        table.append(f"| {length} | " + " | ".join(cells) + " |")
    print("\n".join(table))
    if args.docs:
        write_docs(args, table)


if __name__ == "__main__":
    main()
