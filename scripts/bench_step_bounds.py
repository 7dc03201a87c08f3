"""Each phase of ``bench_step.py --model``'s step against its own bound, from this run's
measured matmul peak and copy bandwidth.

The bounds are what the phase's unavoidable work costs at the machine's measured rates:

* prefill, scoring (``ref``) and the update's forward + backward: model FLOPs (2 x matmul
  parameters per token forward, 6 x forward + backward; attention left out, small at these
  lengths; a prompt counted once for its samples, as minihf runs it) / the matmul peak;
* decode, per step the slower of two (a roofline): bytes read (every matmul weight once,
  plus the KV cache of every sequence up to its length) / the copy bandwidth, and model
  FLOPs (2 x matmul parameters x rows) / the matmul peak; summed over the steps;
* the optimizer step: fused AdamW reads parameter, gradient and both moments and writes
  parameter and moments: 7 x 4 bytes per parameter / the copy bandwidth;
* the reshard: every engine weight written once from its shard (4 bytes per parameter,
  read and written) / the copy bandwidth; a rank's bytes from other ranks
  (``perf/reshard_bytes``, none in one process) are shown beside it.

``% of bound`` = bound / measured: 100% is the machine's limit for that work.
"""

from __future__ import annotations

import time


def copy_bandwidth(threads: int, size: int = 256 << 20, repeats: int = 10) -> float:
    """Bytes read + written per second by a ``size``-byte tensor copy at ``threads`` threads
    (best of ``repeats``, warm buffers): the rate a step streaming weights can reach."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * size / best


def model_shape(model_dir: str) -> dict:
    """What the bounds and MFU figures need of the model: matmul parameters (every Linear
    weight, the LM head included: the parameters each token multiplies), all parameters
    (tied ones once) and the KV bytes per token."""
    import torch

    from minihf.models import load_hf

    model = load_hf(model_dir)
    a = model.args
    return {"matmul": sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)),
            "params": sum(p.numel() for p in model.parameters()),
            "kv_bytes_per_token": 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 4}


def phase_bounds(m: dict, shape: dict, peak_gflops: float, bandwidth: float, *, rows: int,
                 samples: int, max_new: int) -> list[tuple[str, float, float, str]]:
    """``(phase, measured s, bound s, what bounds it)`` per phase of minihf's median step
    ``m`` (``compare``'s ``out["minihf"]``: phases, tokens, prompt tokens, reshard bytes)."""
    flops = peak_gflops * 1e9
    ph = m["phases"]
    prompt = m["prompt_tokens"] / samples          # each distinct prompt's tokens, once
    total = prompt + m["tokens"]
    mean_prompt = m["prompt_tokens"] / rows
    weights = 4 * shape["matmul"]
    # decode step j (1..max_new-1) reads the weights and each row's cache of prompt + j tokens,
    # and multiplies every row by every matmul weight
    kv_step = [shape["kv_bytes_per_token"] * rows * (mean_prompt + j) for j in range(1, max_new)]
    step_flops = 2 * shape["matmul"] * rows
    decode = sum(max((weights + kv) / bandwidth, step_flops / flops) for kv in kv_step)
    memory_bound = weights / bandwidth > step_flops / flops
    adamw = 7 * 4 * shape["params"]
    gb = 1e9
    return [
        ("gen: prefill", ph.get("gen_prefill", 0.0), 2 * shape["matmul"] * prompt / flops,
         f"{2 * shape['matmul'] * prompt / gb:.1f} GFLOP at the mm peak"),
        ("gen: decode", ph.get("gen_decode", 0.0), decode,
         f"{max_new - 1} steps, each {weights / gb:.2f} GB weights + up to {kv_step[-1] / gb:.3f} GB "
         f"KV at the copy bandwidth, or {step_flops / gb:.1f} GFLOP at the mm peak, the slower: "
         f"{'bandwidth' if memory_bound else 'the matmul peak'} here"),
        ("ref", ph.get("ref", 0.0), 2 * shape["matmul"] * total / flops,
         f"{2 * shape['matmul'] * total / gb:.1f} GFLOP at the mm peak"),
        ("update_actor", ph.get("update_actor", 0.0),
         6 * shape["matmul"] * total / flops + adamw / bandwidth,
         f"{6 * shape['matmul'] * total / gb:.1f} GFLOP at the mm peak + AdamW's "
         f"{adamw / gb:.2f} GB at the copy bandwidth"),
        ("reshard", ph.get("reshard", 0.0), 2 * 4 * shape["params"] / bandwidth,
         f"{4 * shape['params'] / gb:.2f} GB of engine weights written once "
         f"({m.get('reshard_bytes', 0.0) / gb:.2f} GB from other ranks)"),
    ]


def bounds_lines(bounds: list[tuple[str, float, float, str]], step_s: float, trl_step_s: float) -> list[str]:
    lines = ["| phase | minihf s | bound s | % of bound | the bound |", "|---|---|---|---|---|"]
    for name, s, b, what in bounds:
        pct = f"{100 * b / s:.0f}%" if s > 0 else "-"
        lines.append(f"| {name} | {s:.3f} | {b:.3f} | {pct} | {what} |")
    total = sum(b for _, _, b, _ in bounds)
    lines.append(f"| **step** | {step_s:.3f} | {total:.3f} | {100 * total / step_s:.0f}% | the sum "
                 f"(TRL's step / this: **{trl_step_s / total:.1f}x**, the most any framework "
                 "could be ahead of TRL here) |")
    return lines
