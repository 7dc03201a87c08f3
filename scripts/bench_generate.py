"""Benchmark minihf's rollout engine against transformers ``generate`` on the same weights.

    python scripts/bench_generate.py            # ~5M and ~30M models, batch 1/16/64, 128 new tokens
    python scripts/bench_generate.py --quick    # ~5M model only, fewer tokens and repeats
    python scripts/bench_generate.py --model-dir outputs/models/smollm2-135m-instruct --new-tokens 32

Models are random-init Llama configs built locally (no download) and loaded by both
libraries from the same checkpoint dir (or a real one: ``--model-dir``). Greedy decoding
with ``ignore_eos`` so lengths match. Four paths run alternately (``--repeats`` rounds; the
best round of each, the least disturbed by other load on a shared machine): minihf's eager
step (``enforce_eager=True``), minihf's fast path (the default ``enforce_eager=False``: a
CUDA graph per bucket on CUDA, the large weights prepacked on CPU), transformers'
default ``generate`` and its best path (a static cache and ``torch.compile``, compiled by
``generate`` itself; a warm-up call per batch compiles, untimed). Each row prints tokens/s,
``fast/eager``, ``fast/hf best``, the fast path's decode ms per step, and how many sequences'
greedy tokens differ between paths (only near-ties may: another kernel sums in another order). A second workload (``--varlen``) gives
requests very different lengths (per-request ``max_tokens``) to compare continuous batching
(slots refilled as sequences finish) with static batching (transformers: each batch of
``--slots`` prompts runs until its longest member is done). On CUDA the decode step time is
also compared with the weight-bandwidth limit (bytes of weights / measured copy bandwidth).

On CPU each row also says how hard both libraries push the machine: the model FLOPs of the
run (matmuls and attention of the prefill and every decode step, the same count for both)
divided by wall time, next to two rates measured in the same run at the same thread count:
``mm peak`` (a large square matmul in the run's dtype, after each row) and ``linear`` (the model's own
Linear layers at this batch size, unpacked, as transformers runs them). ``ceiling`` =
transformers' time / (FLOPs at the ``linear`` rate) is the speedup over transformers that an
engine would reach if everything but those matmuls cost nothing; minihf's fast path passes it
only by faster matmuls (the weights it packs on CPU: ``minihf.models.linear.pack_kind``).
``--dtype bfloat16`` runs both libraries in bf16 (on a CPU it pays only where the CPU has bf16
matmul units, such as Intel's AMX; the logits then come from a bf16 model, as on a GPU).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

MODELS = {  # name: (hidden, layers, heads, kv_heads, intermediate, vocab); untied embeddings (Llama-style)
    "5M": (256, 4, 8, 4, 688, 4096),
    "30M": (512, 8, 8, 4, 1408, 8192),
}


def build(name: str, path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    h, layers, heads, kv, inter, vocab = MODELS[name]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Clock:
    """Wall and process-CPU seconds of a block. On a shared CPU, other jobs stretch wall time;
    with --threads 1 the CPU time is the steadier figure (it excludes time spent descheduled)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def mm_peak_gflops(n: int = 1024, repeats: int = 10, dtype=torch.float32) -> float:
    """The matmul peak of this machine in ``dtype`` at the current thread count: best of
    ``repeats`` products of two n x n matrices, by ``torch.mm`` (MKL in fp32) and by minihf's
    ``linear`` (oneDNN where it is faster, ``minihf.models.linear``), whichever is faster."""
    from minihf.models.linear import linear

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for mm in (torch.mm, lambda a, b: linear(a, b.t())):
        mm(a, b)
        for _ in range(repeats):
            t = time.perf_counter()
            mm(a, b)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def linear_gflops(model, batch: int, repeats: int = 5) -> float:
    """GFLOP/s of ``model``'s own Linear layers (their weights and memory layout) applied in
    turn to ``batch`` rows, as a decode step does: the matmul rate its shapes allow."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=m.weight.dtype) for m in linears}
    flops = 2 * batch * sum(m.weight.numel() for m in linears)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for m in linears:
                m(xs[m.in_features])
            best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def generate_flops(model, batch: int, prompt_len: int, new: int) -> float:
    """Model FLOPs of greedy generation: the prompt and ``new - 1`` decode tokens go through
    the body, ``new`` positions through the LM head; attention (QK and PV) at each position
    over the keys up to it."""
    a = model.args
    body = sum(m.weight.numel() for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    head = a.hidden_size * a.vocab_size
    positions = prompt_len + new - 1
    attn_keys = positions * (positions + 1) // 2  # sum over positions p of (p + 1) keys
    per_row = 2 * body * positions + 2 * head * new + 4 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * attn_keys
    return batch * per_row


def hf_generate_kwargs(device, best: bool) -> dict:
    """transformers' default generate (a dynamic cache), or its best path: a static cache
    with the forward compiled by ``generate`` itself (on CPU only when asked: its
    ``CompileConfig._compile_all_devices``)."""
    if not best:
        return {}
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = device.type != "cuda"
    return {"cache_implementation": "static", "compile_config": config}


def run_hf(hf, prompts: torch.Tensor, new: int, **kwargs) -> tuple[list[list[int]], Clock]:
    with Clock(prompts.device) as clock, torch.inference_mode():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
    return out[:, prompts.shape[1]:].tolist(), clock


def run_minihf(llm, prompts: list[list[int]], params) -> tuple[list, Clock]:
    with Clock(llm.engine.device) as clock:
        outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], clock


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


PATHS = ("minihf eager", "minihf fast", "hf", "hf best")


def bench_fixed(name, path, device, dtype, batches, prompt_len, new, repeats, vocab):
    """Greedy generation of ``new`` tokens after random ``prompt_len``-token prompts at each
    batch size on four paths, alternated ``repeats`` rounds (best round each): minihf's eager
    step (``enforce_eager=True``), minihf's fast path (the default: CUDA graphs on CUDA,
    weights prepacked on CPU), transformers' default generate and its best path
    (static cache, compiled; its compilation is a warm-up call per batch, not timed)."""
    from transformers import AutoModelForCausalLM

    from minihf.rollout import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    eager = LLM(path, dtype=dtype, device=str(device), max_num_seqs=max(batches), enforce_eager=True)
    fast = LLM(path, dtype=dtype, device=str(device), max_num_seqs=max(batches))
    nparams = sum(p.numel() for p in hf.parameters())
    print(f"\n== model {name} ({nparams / 1e6:.1f}M params), prompt {prompt_len}, {new} new tokens, greedy ==")
    cpu = device.type == "cpu"
    flop_cols = f" {'linear GF/s':>11} {'mm peak':>7} {'ceiling':>7}" if cpu else ""
    print(f"{'batch':>5} " + " ".join(f"{p + ' tok/s':>17}" for p in PATHS)
          + f" {'fast/eager':>10} {'fast/hf best':>12} {'fast ms/step':>12}{flop_cols}"
          + "  differing (fast vs eager, eager vs hf, hf best vs hf)")
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
        hf_prompts = prompts.to(device)
        run_hf(hf, hf_prompts, new, **hf_generate_kwargs(device, best=True))  # compiles for this shape
        best = dict.fromkeys(PATHS, float("inf"))
        step_ms = float("inf")
        for _ in range(repeats):
            out = {}
            for p in PATHS:
                if p.startswith("minihf"):
                    llm = eager if p == "minihf eager" else fast
                    out[p], clock = run_minihf(llm, prompts.tolist(), params)
                    if p == "minihf fast":
                        s = llm.engine.last_stats
                        step_ms = min(step_ms, 1e3 * s["decode_s"] / max(1, s["decode_steps"]))
                else:
                    out[p], clock = run_hf(hf, hf_prompts, new, **hf_generate_kwargs(device, best=p == "hf best"))
                best[p] = min(best[p], clock.wall)
        # greedy tokens may differ only where the top two logits are within rounding of each
        # other (another kernel's summation order); tests/test_prepack.py checks log-probs
        diff = (differing(out["minihf fast"], out["minihf eager"]), differing(out["minihf eager"], out["hf"]),
                differing(out["hf best"], out["hf"]))
        tok_s = {p: batch * new / best[p] for p in PATHS}
        flop_vals = ""
        if cpu:
            flops = generate_flops(eager.engine.model, batch, prompt_len, new)
            lin = linear_gflops(eager.engine.model, batch)
            flop_vals = (f" {lin:>11.1f} {mm_peak_gflops(dtype=dtype):>7.1f}"
                         f" {best['hf best'] / (flops / lin / 1e9):>6.2f}x")
        print(f"{batch:>5} " + " ".join(f"{tok_s[p]:>17.0f}" for p in PATHS)
              + f" {tok_s['minihf fast'] / tok_s['minihf eager']:>9.2f}x"
              + f" {tok_s['minihf fast'] / tok_s['hf best']:>11.2f}x {step_ms:>12.1f}{flop_vals}"
              + f"  {diff[0]}, {diff[1]}, {diff[2]} of {batch}")
        rows.append((name, batch, tok_s, step_ms, diff))
        if device.type == "cuda":
            report_bandwidth(fast, hf, prompts.tolist(), new, best["minihf fast"])
    eager.free()
    fast.free()
    del hf
    return rows


def report_bandwidth(llm, hf, prompts, new, total_s):
    from minihf.rollout import SamplingParams

    _, prefill = run_minihf(llm, prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill_s = prefill.wall
    step_ms = (total_s - prefill_s) / max(1, new - 1) * 1e3
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)  # read + write bytes/s
    limit_ms = weight_bytes / bw * 1e3
    print(f"      decode step {step_ms:.3f} ms vs weight-bandwidth limit {limit_ms:.3f} ms "
          f"({weight_bytes / 2**20:.0f} MiB at {bw / 1e9:.0f} GB/s): {limit_ms / step_ms:.0%} of peak")


def bench_varlen(name, path, device, dtype, num_requests, slots, prompt_len, max_new, repeats):
    from transformers import AutoModelForCausalLM

    from minihf.rollout import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    llm = LLM(path, dtype=dtype, device=str(device), max_num_seqs=slots)
    vocab = MODELS[name][5]
    rng = random.Random(0)
    # long-tailed lengths: most responses short, a few long (as in RL rollouts)
    lengths = [min(max_new, max(4, int(rng.expovariate(1 / (max_new / 6))))) for _ in range(num_requests)]
    prompts = torch.randint(0, vocab, (num_requests, prompt_len), generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    useful = sum(lengths)
    best = {"minihf continuous": float("inf"), "minihf batch-at-a-time": float("inf"), "hf static": float("inf")}
    for _ in range(repeats):
        with Clock(device) as clock:
            hf_out = []
            for i in range(0, num_requests, slots):
                out, _ = run_hf(hf, prompts[i:i + slots].to(device), max(lengths[i:i + slots]))
                hf_out += [o[:n] for o, n in zip(out, lengths[i:i + slots])]
        best["hf static"] = min(best["hf static"], clock.wall)
        got, clock = run_minihf(llm, prompts.tolist(), params)
        best["minihf continuous"] = min(best["minihf continuous"], clock.wall)
        assert got == hf_out, "continuous batching outputs differ from transformers"
        # the next batch is admitted only when the previous one is done (finished rows still
        # leave the batch, by compaction, so this is stronger than padded static batching)
        with Clock(device) as clock:
            for i in range(0, num_requests, slots):
                run_minihf(llm, prompts[i:i + slots].tolist(), params[i:i + slots])
        best["minihf batch-at-a-time"] = min(best["minihf batch-at-a-time"], clock.wall)
    print(f"\n== variable lengths, model {name}: {num_requests} requests, {slots} slots, max_tokens "
          f"{min(lengths)}..{max(lengths)} (mean {useful / num_requests:.0f}) ==")
    for k, v in best.items():
        print(f"{k:>18}: {useful / v:8.0f} useful tok/s ({v:.2f} s)")
    print(f"continuous vs hf static: {best['hf static'] / best['minihf continuous']:.2f}x; "
          f"vs minihf batch-at-a-time: {best['minihf batch-at-a-time'] / best['minihf continuous']:.2f}x")
    llm.free()


def write_docs(rows, args, device) -> None:
    """The fixed-length rows as a table in docs/performance.md, between this script's markers."""
    import platform
    import sys

    import transformers

    from bench_step_tables import write_model_section

    from minihf.cli.doctor import cpu_name

    where = "CPU" if device.type == "cpu" else "a GPU"
    machine = (f"{cpu_name()}, {torch.get_num_threads()} threads" if device.type == "cpu"
               else torch.cuda.get_device_name())
    lines = [f"## Decode on {where}", "",
             f"Generated by `python {' '.join(['scripts/bench_generate.py'] + sys.argv[1:])}` (do not edit by hand; the "
             "script's docstring says what runs). Greedy, every response "
             f"{args.new_tokens} tokens after a {args.prompt_len}-token random prompt, {args.repeats} alternating "
             f"rounds, the best of each path. {machine}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}, Python {platform.python_version()}.", "",
             "| model | batch | minihf eager tok/s | minihf fast tok/s | transformers tok/s | transformers best tok/s "
             "| fast / eager | fast / transformers best | fast decode ms/step | sequences differing (fast vs eager, "
             "eager vs transformers, best vs default) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, batch, tok_s, step_ms, diff in rows:
        lines.append(f"| {name} | {batch} | {tok_s['minihf eager']:.0f} | {tok_s['minihf fast']:.0f} | {tok_s['hf']:.0f} "
                     f"| {tok_s['hf best']:.0f} | {tok_s['minihf fast'] / tok_s['minihf eager']:.2f}x "
                     f"| **{tok_s['minihf fast'] / tok_s['hf best']:.2f}x** | {step_ms:.1f} "
                     f"| {diff[0]}, {diff[1]}, {diff[2]} of {batch} |")
    markers = (f"<!-- bench_generate {where}: begin -->", f"<!-- bench_generate {where}: end -->")
    write_model_section(Path(__file__).resolve().parent.parent / "docs" / "performance.md", lines, markers)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5M model, 32 new tokens, 1 repeat, small varlen run")
    ap.add_argument("--models", nargs="*", default=None, choices=sorted(MODELS),
                    help="random-init models built here (default: 5M 30M, none with --model-dir)")
    ap.add_argument("--model-dir", action="append", default=[],
                    help="also a model directory (e.g. SmolLM2's; repeatable); with it, --models defaults to none")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="both libraries' weights and activations (auto: bf16 on CUDA, fp32 on CPU; bf16 on a CPU "
                         "pays only with bf16 matmul units, e.g. Intel AMX)")
    ap.add_argument("--no-varlen", action="store_true")
    ap.add_argument("--docs", action="store_true",
                    help="write the fixed-length rows into docs/performance.md (its 'Decode on CPU/GPU' section)")
    args = ap.parse_args()
    if args.docs and args.dtype != "auto":
        ap.error(f"--docs writes the tables of the default dtype; drop --dtype {args.dtype} or --docs")
    if args.quick:
        args.models, args.new_tokens, args.repeats = ["5M"], 32, 1
    elif args.models is None:
        args.models = [] if args.model_dir else ["5M", "30M"]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else getattr(torch, args.dtype)
    print(f"device {device}, dtype {dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if device.type == "cpu":
        print("linear GF/s: the model's Linear layers alone at this batch (as transformers runs them); mm peak:\n"
              f"1024^3 {str(dtype).removeprefix('torch.')} matmul, same threads, measured after each row (a shared machine drifts); ceiling: the\n"
              "speedup over transformers' best path if only the matmuls took time, at the unpacked linear rate")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = f"{tmp}/{name}"
            build(name, path)
            rows += bench_fixed(name, path, device, dtype, args.batches, args.prompt_len, args.new_tokens,
                                args.repeats, MODELS[name][5])
        for path in args.model_dir:
            from minihf.models import load_args

            rows += bench_fixed(Path(path).name, path, device, dtype, args.batches, args.prompt_len,
                                args.new_tokens, args.repeats, load_args(path).vocab_size)
        if args.docs:
            write_docs(rows, args, device)
        if not args.no_varlen and args.models:
            name = args.models[0]
            n, slots, max_new = (32, 8, 64) if args.quick else (128, 32, 256)
            bench_varlen(name, f"{tmp}/{name}", device, dtype, n, slots, args.prompt_len, max_new, max(1, args.repeats - 1))


if __name__ == "__main__":
    main()
