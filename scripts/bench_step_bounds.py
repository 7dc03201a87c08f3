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

Decode at a small batch is further bounded by the matmul kernels themselves: a [rows, in] x
[in, out] product with rows = 16 runs far below the large-matmul peak. So
:func:`decode_matmul_floor` also times one decode step's matmuls alone (every Linear of the
model once, the model's own shapes, weights from DRAM) at the step's batch: as minihf's
engine's fast path runs them (``minihf.models.linear``, column-major weights, the tied LM
head row-major, the weights this CPU packs packed: ``PackedWeights``) and with every weight
reordered ahead for oneDNN at that batch (``torch.ops.mkldnn._reorder_linear_weight``); no
attention, norms or sampling. Where that floor exceeds what a bound asks, the bound is out
of reach in fp32 on the machine, measured.
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


def mm_peak_gflops(threads: int, device: str = "cpu") -> float:
    """The matmul peak the MFU figures divide by: fp32 at ``threads`` threads on CPU
    (``bench_generate``'s measurement: the faster of MKL and oneDNN), bf16 ``torch.mm`` of
    8192 x 8192 on CUDA."""
    import torch

    if device == "cuda":
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        torch.mm(a, b)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(10):
            t = time.perf_counter()
            torch.mm(a, b)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best / 1e9

    from bench_generate import mm_peak_gflops as peak

    torch.set_num_threads(threads)
    return peak()


def decode_matmul_floor(model_dir: str, rows: int, threads: int, repeats: int = 7) -> dict:
    """Seconds of one decode step's matmuls alone at batch ``rows`` (median of ``repeats``;
    see the module docstring): ``{"minihf": as the engine's fast path runs them, "prepacked": oneDNN
    with weights reordered for the batch, or None where torch has no oneDNN}``."""
    import statistics

    import torch

    from minihf.models import load_hf
    from minihf.models.linear import PackedWeights, linear, mkl_packed
    from minihf.rollout.model_runner import column_major_linears

    torch.set_num_threads(threads)
    model = load_hf(model_dir)
    with torch.no_grad():
        head = model.lm_head  # the engine's layout (its fast path's)
        column_major_linears(model, row_major=lambda m: mkl_packed(m.weight, m is head))
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

        def step_s(fn, ws) -> float:
            for w in ws:  # warm (kernels, caches of their code; the weights do not fit a cache)
                fn(xs[w.shape[1]], w)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                for w in ws:
                    fn(xs[w.shape[1]], w)
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        with PackedWeights(model) as packs:
            packs.refresh()
            out = {"minihf": step_s(linear, weights), "prepacked": None}
        if torch.backends.mkldnn.is_available():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
                      for w in weights]

            def onednn(x, w):
                return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            out["prepacked"] = step_s(onednn, packed)
    return out


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


def decode_floor_lines(floor: dict | None, m: dict, shape: dict, bandwidth: float, *, rows: int,
                       max_new: int) -> list[str]:
    """The decode step against the bandwidth bound and the measured matmul floor
    (:func:`decode_matmul_floor`; none in a report cached before it existed)."""
    if not floor:
        return []
    steps = max_new - 1
    step = m["phases"].get("gen_decode", 0.0) / steps
    # the bandwidth bound of the middle step: the weights and every row's cache half-way
    kv = shape["kv_bytes_per_token"] * rows * (m["prompt_tokens"] / rows + max_new / 2)
    bw = (4 * shape["matmul"] + kv) / bandwidth
    packed = floor["prepacked"]
    best = f"{1e3 * packed:.1f} ms with oneDNN's weights prepacked for the batch" if packed \
        else "(no oneDNN in this torch)"
    lines = [
        "",
        f"Decode at batch {rows}, per step: minihf {1e3 * step:.1f} ms (the median step's "
        f"`gen_decode` / {steps}); its bandwidth bound {1e3 * bw:.1f} ms (weights and the "
        f"half-way KV cache at the copy bandwidth), so {100 * bw / step:.0f}% of it. The "
        f"step's matmuls alone, timed apart (`decode_matmul_floor`): {1e3 * floor['minihf']:.1f} ms "
        f"as minihf's engine runs them, {best}.",
    ]
    fastest = min(x for x in (floor["minihf"], packed) if x)
    if fastest > bw / 0.6:
        lines.append(f"60% of the bandwidth bound ({1e3 * bw / 0.6:.1f} ms a step) is below "
                     f"what the fastest kernel's matmuls alone take ({1e3 * fastest:.1f} ms): "
                     "out of reach in fp32 on this machine.")
    return lines
