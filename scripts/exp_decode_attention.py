"""Is there a cheaper decode attention than SDPA on CPU? One layer's attention of a decode
step, as the engine's static step runs it: one query token per row, keys and values read
from the KV cache's strided view (``[rows, kv_heads, :keys]`` of a longer cache), a boolean
mask hiding each row's later slots. Three ways, alternated in one run:

* ``sdpa_bool``: ``F.scaled_dot_product_attention`` with the cache's boolean mask (the engine);
* ``sdpa_float``: the same with the mask made additive (0 / -inf) once, outside the call;
* ``manual``: the query heads grouped over their KV head, two batched matmuls and a softmax.

    python scripts/exp_decode_attention.py                      # SmolLM2-135M's shapes, 16 rows
    python scripts/exp_decode_attention.py --rows 64 --keys 64 128

Prints microseconds per call (best of ``--repeats`` rounds of ``--calls`` calls) per key count,
after checking that the three agree within fp32 rounding. The finding is in
docs/performance.md (the decode step on CPU).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def attention_paths(rows: int, heads: int, kv_heads: int, head_dim: int, keys: int, cache_len: int,
                    seed: int = 0) -> tuple[dict, torch.Tensor]:
    """The three calls on one random layer's query, cache and mask (each row at a position in
    the last half of ``keys``), and the values they weigh."""
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(rows, kv_heads, cache_len, head_dim, generator=g)
    cache_v = torch.randn(rows, kv_heads, cache_len, head_dim, generator=g)
    q = torch.randn(rows, heads, 1, head_dim, generator=g)
    positions = torch.randint(keys // 2, keys, (rows,), generator=g)
    bool_mask = (torch.arange(keys)[None, :] <= positions[:, None])[:, None, None, :]   # [rows, 1, 1, keys]
    float_mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, float("-inf"))
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]                                  # the cache's view
    group, scale = heads // kv_heads, head_dim ** -0.5

    def manual():
        scores = torch.matmul(q.view(rows, kv_heads, group, head_dim), k.transpose(-1, -2)) * scale
        probs = torch.softmax(scores + float_mask.view(rows, 1, 1, keys), -1)         # [rows, kv, group, keys]
        return torch.matmul(probs, v).view(rows, heads, 1, head_dim)

    return {"sdpa_bool": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True),
            "sdpa_float": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, enable_gqa=True),
            "manual": manual}, v


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", type=int, nargs="+", default=[48, 96, 160])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads or min(a.rows, a.heads, a.head_dim, a.calls, a.repeats, *a.keys) < 1:
        ap.error("every count must be >= 1 and --heads a multiple of --kv-heads")
    torch.set_num_threads(a.threads)
    print(f"decode attention, {a.rows} rows, {a.heads} query heads over {a.kv_heads} KV heads, head dim "
          f"{a.head_dim}, fp32, {a.threads} threads; us per call (best of {a.repeats} x {a.calls})")
    results = {}
    for keys in a.keys:
        paths, values = attention_paths(a.rows, a.heads, a.kv_heads, a.head_dim, keys, cache_len=2 * max(a.keys))
        want = paths["sdpa_bool"]()
        # each output is a convex combination of <= keys values: the paths' orders of summation
        # differ by at most keys roundings of fp32 (2^-24 relative each) of the largest |value|,
        # and the softmax weights by a few more, so keys * 2^-23 * max|v| bounds the difference
        bound = keys * 2.0 ** -23 * values.abs().max().item()
        for name, call in paths.items():
            err = (call() - want).abs().max().item()
            assert err <= bound, f"{name} differs from sdpa_bool by {err:.2e} at {keys} keys (bound {bound:.1e})"
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(a.repeats):  # alternated, so a slow spell of the machine hits every path
            for name, call in paths.items():
                for _ in range(min(20, a.calls)):
                    call()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    call()
                best[name] = min(best[name], (time.perf_counter() - t0) / a.calls * 1e6)
        results[keys] = best
        print(f"{keys:5d} keys: " + ", ".join(f"{n} {us:.1f}" for n, us in best.items())
              + f"  (manual / sdpa_bool {best['manual'] / best['sdpa_bool']:.2f}x)")
    return results


if __name__ == "__main__":
    main()
