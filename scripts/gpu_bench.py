"""The GPU check's benchmark section (``scripts/gpu_check.py``, section 2): a ~0.5B random
Qwen2-style model (Qwen2.5-0.5B's shapes) in bf16, its prefill and training against the
measured matmul peak, its decode against the measured bandwidth bound on minihf's eager step,
minihf's fast path and transformers' compiled static-cache generate. The dry run measures
the same on a tiny fp32 model on the CPU.
"""

from __future__ import annotations

import copy
import time

import torch

QWEN05 = dict(arch="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, head_dim=64,
              intermediate_size=4864, attention_bias=True, tie_word_embeddings=True,
              max_position_embeddings=4096, rope_theta=1e6)
TINY = dict(arch="qwen2", vocab_size=512, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            attention_bias=True, tie_word_embeddings=True, max_position_embeddings=512)


def rate(flops_per_s: float) -> str:
    """FLOP/s in the unit that fits (a CPU dry run is in GFLOP/s)."""
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} GFLOP/s"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int = 3) -> float:
    """The best of ``repeats`` timed calls after one warm-up (seconds)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def peaks(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, float]:
    """The matmul peak (FLOP/s) and copy bandwidth (bytes read + written per second)."""
    n = 256 if dry else 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    mm = timed(lambda: a @ b, device, repeats=3 if dry else 10)
    size = (1 << 20) if dry else (1 << 31)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cp = timed(lambda: dst.copy_(src), device, repeats=3 if dry else 10)
    return {"flops": 2 * n**3 / mm, "bandwidth": 2 * size / cp}


def benchmark(device: torch.device, dry: bool):
    """The 0.5B section's lines, yielded as each part is measured (the report keeps the
    parts done if the call is stopped from outside)."""
    from minihf.models import ModelArgs, build_model, init_weights
    from minihf.models.model import compile_blocks

    dtype = torch.float32 if dry else torch.bfloat16
    peak = peaks(device, dtype, dry)
    args = ModelArgs(**(TINY if dry else QWEN05))
    with torch.device("cpu"):
        model = init_weights(build_model(args, "lm"), seed=0)
    model = model.to(device=device, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    matmul = params - args.vocab_size * args.hidden_size * (0 if args.tie_word_embeddings else 1)
    # matmul parameters: every Linear, the tied LM head once (the embedding lookup is not a matmul)
    lines = [f"Model: {'tiny (dry run)' if dry else 'Qwen2.5-0.5B shapes'}, random init, {dtype}, "
             f"{params / 1e6:.2f}M parameters ({matmul / 1e6:.2f}M in matmuls)", "",
             f"Measured: {dtype} matmul peak **{rate(peak['flops'])}** "
             f"({'256' if dry else '8192'}^3, best of 10); copy bandwidth **{peak['bandwidth'] / 1e9:.0f} GB/s** "
             "(device-to-device, bytes read + written)", "",
             "| phase | shape | time | achieved | bound | of bound |", "|---|---|---|---|---|---|"]
    L, H = args.num_hidden_layers, args.head_dim * args.num_attention_heads

    def attn_flops(b, t):  # causal QK^T and PV, forward
        return 2 * 2 * b * L * H * t * t / 2
    b, t = (2, 64) if dry else (8, 1024)
    ids = torch.randint(0, args.vocab_size, (b, t), device=device)
    with torch.no_grad():
        s = timed(lambda: model(ids, logits_to_keep=torch.tensor([t - 1], device=device)), device)
    flops = 2 * (matmul - args.vocab_size * args.hidden_size) * b * t + attn_flops(b, t)
    lines.append(f"| prefill (forward) | {b} x {t} | {s * 1e3:.1f} ms | {rate(flops / s)} "
                 f"| {rate(peak['flops'])} | {flops / s / peak['flops']:.1%} |")
    yield lines
    b, t = (2, 64) if dry else (4, 1024)
    ids = torch.randint(0, args.vocab_size, (b, t), device=device)
    model.train()

    def step(m=model):
        m(ids).float().logsumexp(-1).mean().backward()
    s = timed(step, device)
    model.zero_grad(set_to_none=True)
    flops = 3 * (2 * matmul * b * t + attn_flops(b, t))
    yield [f"| training (forward + backward) | {b} x {t} | {s * 1e3:.1f} ms | "
           f"{rate(flops / s)} | {rate(peak['flops'])} | {flops / s / peak['flops']:.1%} |"]
    # actor.use_torch_compile: the same step with each block's norms and MLP compiled (a
    # copy; its first call compiles, untimed), timed right after the eager one. Inductor may
    # be missing what it needs here (Triton, a C compiler): a failure is its row
    row = "| training, `use_torch_compile`"
    try:
        compiled = compile_blocks(copy.deepcopy(model))
        step(compiled)
        sc = timed(lambda: step(compiled), device)
        row += (f" ({s / sc:.2f}x the row above) | {b} x {t} | {sc * 1e3:.1f} ms | "
                f"{rate(flops / sc)} | {rate(peak['flops'])} | {flops / sc / peak['flops']:.1%} |")
    except Exception as exc:  # noqa: BLE001 - recorded, the other rows stand
        row += f" | {b} x {t} | failed: {type(exc).__name__}: {str(exc).strip()[:160]!r} | | | |"
    compiled = None  # frees the copy
    model.zero_grad(set_to_none=True)
    model.eval()
    yield [row]
    weight_bytes = params * torch.finfo(dtype).bits // 8
    yield from decode_rows(model, args, device, dtype, weight_bytes, peak["bandwidth"], dry)
    lines = []
    if device.type == "cuda":
        lines += ["", f"Peak memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated "
                  f"({torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved)"]
    yield lines + ["", "MFU counts 2 FLOPs per multiply-add of the matmul parameters per token (x3 for "
                   "forward + backward) plus causal attention; the decode bound reads each weight and "
                   "the KV cache once per step at the copy's bytes per second (read + written: the "
                   "memory's rate, whichever way the bytes go)."]


def decode_rows(model, args, device, dtype, weight_bytes: int, bandwidth: float, dry: bool):
    """Decode per batch, minihf's eager step against its fast one (``enforce_eager=False``:
    a CUDA graph per bucket; the dry run's CPU runs the same static step uncaptured) and
    transformers' static-cache generate compiled (``reduce-overhead``) where it runs: the same
    prompts and lengths, each against the bandwidth bound. The fast path's tokens are compared
    with the eager path's (bf16: a near-tie may flip a sampled token, then the sequence
    differs) and its log-probs' largest gap on the tokens both sampled is shown. Yields the
    table's head, then each batch's rows as they are measured."""
    from minihf.rollout import LLM, SamplingParams

    L, kv = args.num_hidden_layers, args.num_key_value_heads
    new, prompt = (16, 16) if dry else (128, 32)
    yield ["", "Decode (prefill included), the same prompts and lengths on each path:", "",
           "| batch | path | time | tokens/s | bound | of bound | vs eager |", "|---|---|---|---|---|---|---|"]
    agree = []
    for batch in ((1, 4) if dry else (1, 16, 64, 256)):
        rows = []
        prompts = [[(7 * i + j) % args.vocab_size for j in range(prompt)] for i in range(batch)]
        sp = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=0)
        # per decode step: every weight once, plus the KV cache of all sequences so far
        kv_bytes = 2 * L * kv * args.head_dim * (prompt + new / 2) * batch * torch.finfo(dtype).bits // 8
        # the copy's figure counts bytes read + written: the memory's rate, which a stream of
        # reads alone reaches too (the first window's report halved it: its bounds read 2x low)
        bound = bandwidth / (weight_bytes + kv_bytes) * batch
        outs, times = {}, {}
        for path, decode in (("minihf eager", "eager"), ("minihf fast", "static" if dry else "graph")):
            llm = LLM(model, dtype=dtype, device=str(device), max_num_seqs=batch, eos_token_ids=(), decode=decode)
            times[path] = timed(lambda: outs.__setitem__(path, llm.generate(prompts, sp)), device, repeats=2)
            captured = llm.engine.last_stats["captures"]
            llm.free(weights=False)
        try:
            times["transformers static+compile"] = hf_static_compiled(model, prompts, new, device, dtype, dry)
        except Exception as exc:  # recorded, the other rows stand
            rows.append(f"| {batch} | transformers static+compile | failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''} | | | | |")
        for path, s in times.items():
            tokens = batch * new
            rows.append(f"| {batch} | {path} | {s:.2f} s | {tokens / s:.0f} | {bound:.0f} | {tokens / s / bound:.1%} "
                        f"| {times['minihf eager'] / s:.2f}x |")
        same = gap = 0
        for e, f in zip(outs["minihf eager"], outs["minihf fast"]):
            e, f = e.outputs[0], f.outputs[0]
            same += e.token_ids == f.token_ids
            k = next((i for i, (a, b) in enumerate(zip(e.token_ids, f.token_ids)) if a != b), len(e.token_ids))
            gap = max([gap] + [abs(a - b) for a, b in zip(e.logprobs[:k + 1], f.logprobs[:k + 1])])
        agree.append(f"batch {batch}: {same}/{batch} sequences token-identical, largest log-prob gap "
                     f"{gap:.2e} up to the first differing token; buckets captured in the timed call: {captured}")
        yield rows
    yield ["", "Fast path vs eager: " + "; ".join(agree) + "."]


def hf_static_compiled(model, prompts, new: int, device, dtype, dry: bool) -> float:
    """transformers' best generate on the same weights: a static KV cache, its decode
    forward compiled by ``generate`` itself (``CompileConfig``: inductor, ``reduce-overhead``,
    i.e. CUDA graphs); seconds of the best of two timed calls after the compiling one. The
    dry run compiles with the ``eager`` backend (asked for on the CPU): the same calls, none
    of inductor's minutes."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    from minihf.models import save_hf

    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    config = CompileConfig(backend="eager") if dry else CompileConfig(mode="reduce-overhead")
    config._compile_all_devices = dry  # CUDA compiles by itself; the CPU only when asked
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                        temperature=1.0, top_k=0, pad_token_id=0, cache_implementation="static",
                        compile_config=config)
    return timed(run, device, repeats=2)
