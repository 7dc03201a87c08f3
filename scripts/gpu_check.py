"""The prepared GPU check: everything minihf wants to know from a rare, short GPU window, in one
call that writes one markdown report.

    bash scripts/gpu_check.sh OUTDIR             # on the GPU machine: install, then this
    python scripts/gpu_check.py OUTDIR           # the same without the install step
    python scripts/gpu_check.py --dry-run OUTDIR # CPU, tiny model, seconds (the test suite runs it)

Sections, each timed, its failure recorded without stopping the rest, the report rewritten
after each (a check cut short by the machine's time limit still leaves what it found):

1. the machine: GPU, torch, CUDA, transformers, which attention paths exist (flash-attn's
   varlen kernel when installed; SDPA's flash backend otherwise);
2. a ~0.5B random Qwen2-style model (Qwen2.5-0.5B's shapes) in bf16: the bf16 matmul peak
   and the copy bandwidth measured first, then prefill and training (forward + backward)
   against the peak (MFU), decode at batch 1, 16, 64 and 256 against the bandwidth bound
   (weights + KV cache read once per step) on three paths: minihf eager, minihf's fast path
   (a CUDA graph per bucket) and transformers' static-cache generate compiled, and peak memory;
3. ``pytest -m gpu`` (``tests/test_gpu.py``: engine vs trainer log-probs in fp32 and bf16,
   SDPA flash vs math, packed vs padded, FSDP2 on NCCL, the in-place reshard gather, optimizer
   offload during generation) with its printed figures, within ``--tests-limit`` seconds;
4. one actor update's memory on the 0.5B shapes in bf16 at 4k, 16k and 32k response tokens
   (``scripts/bench_memory.py --device cuda``), within ``--memory-limit`` seconds;
5. the main job on the GPU, one process (``scripts/train_ppo.py``): validation before and
   after, wall time, within ``--main-job-limit`` seconds, and its step 100 under
   torch.profiler (``trainer.profile_steps``): the ops that take its time.

The quickest section runs first, so that a window cut short still reports figures; section 2
writes its rows as they are measured (a call stopped from outside keeps them), sections 3-5
run under their own limits. ``--sections`` picks some of 2-5 (the machine is always
reported): with calls capped at 10 minutes, ``--sections bench tests`` first (the issue's
rows), then ``main-job`` (its limit alone fills a call), then ``memory``.

``--dry-run`` runs sections 1, 2 and 4 on the CPU with a tiny model in fp32 (4 at one length,
two settings, its peak read from Linux's counters), collects the GPU tests without running
them and shows the main job's command without running it.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN05 = dict(arch="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, head_dim=64,
              intermediate_size=4864, attention_bias=True, tie_word_embeddings=True,
              max_position_embeddings=4096, rope_theta=1e6)
PROFILED_STEP, PROFILE_ROWS = 100, 33  # the main job's step profiled; the table's lines in the report
MEMORY_LENGTHS = (4096, 16384, 32768)  # response tokens; the settings below (one GPU: no SP rows)
MEMORY_SETTINGS = ("nothing", "chunked logits", "activation checkpointing", "both")
SECTIONS = ("bench", "tests", "memory", "main-job")
TINY = dict(arch="qwen2", vocab_size=512, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            attention_bias=True, tie_word_embeddings=True, max_position_embeddings=512)


class Report:
    """The markdown report, rewritten to ``path`` after every section."""

    def __init__(self, path: Path, title: str):
        self.path, self.lines = path, [f"# {title}", ""]
        self.failures = 0

    def section(self, name: str, fn) -> None:
        """``fn`` returns the section's lines, or yields them in chunks: the report is then
        rewritten after each, so a call stopped from outside keeps the rows done."""
        self.lines += [f"## {name}", ""]
        t0 = time.perf_counter()
        try:
            result = fn()
            for chunk in [result] if isinstance(result, list) else result:
                self.lines += chunk
                self.path.write_text("\n".join(self.lines))
            status = "ok"
        except Exception:  # noqa: BLE001 - the report must say what failed and go on
            self.failures += 1
            self.lines += ["```", traceback.format_exc()[-3000:], "```"]
            status = "FAILED"
        self.lines += ["", f"({status}, {time.perf_counter() - t0:.1f} s)", ""]
        self.path.write_text("\n".join(self.lines))
        print(f"[gpu_check] {name}: {status}", flush=True)


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


def machine(device: torch.device) -> list[str]:
    from minihf.models.masks import flash_attn_varlen_func

    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CUDA (torch)", torch.version.cuda or "none")]
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        rows += [("GPU", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"),
                 ("SDPA flash backend enabled", str(torch.backends.cuda.flash_sdp_enabled())),
                 ("NCCL", str(torch.distributed.is_nccl_available()))]
    for name in ("transformers", "flash_attn"):
        spec = importlib.util.find_spec(name)
        rows.append((name, __import__(name).__version__ if spec else "not installed"))
    path = ("flash-attn's varlen kernel" if flash_attn_varlen_func is not None and device.type == "cuda"
            else "SDPA (right-padded buckets; on CUDA its flash backend where the inputs allow)")
    rows.append(("packed attention path", path))
    return ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def gpu_tests(dry: bool, out: Path, limit_s: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-s", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_gpu.py")] + (["--collect-only"] if dry else [])
    rc, text = run_logged(cmd, ROOT, out / "pytest_gpu.log", limit_s, "--tests-limit")
    figures = [line for line in text.splitlines()
               if re.search(r"vs|units of the rounding|moments", line) and not line.startswith(("E ", ">"))]
    tail = [line for line in text.splitlines() if line.strip()][-12:]
    if rc not in (0, 5) or (not dry and rc == 5):
        raise RuntimeError(f"pytest -m gpu exited {rc}:\n" + "\n".join(tail))
    return [f"`{' '.join(cmd[2:])}` (exit {rc}; full log: pytest_gpu.log)", "",
            "```", *figures, *tail[-3:], "```"]


def run_logged(cmd: list[str], cwd: Path, log: Path, limit_s: int, option: str) -> tuple[int | str, str]:
    """Run ``cmd`` with its output going to ``log`` as it runs (a run stopped at ``limit_s``
    keeps what it printed); the exit status, or why there is none, and the output. A run
    stopped at its limit is stopped with every process it started (its own session), so none
    holds the GPU into the next section."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"nothing (stopped at the {limit_s} s limit, {option})"
    return rc, log.read_text()


def main_job(dry: bool, out: Path, limit_s: int) -> list[str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "train_ppo.py"),
           f"trainer.default_local_dir={out / 'main_job'}", "actor_rollout_ref.rollout.check_log_probs=warn",
           f"trainer.profile_steps=[{PROFILED_STEP}]"]
    if dry:
        return [f"dry run: would run `{' '.join(cmd[1:])}` (limit {limit_s} s)"]
    t0 = time.perf_counter()
    rc, text = run_logged(cmd, out, out / "main_job.log", limit_s, "--main-job-limit")
    wall = time.perf_counter() - t0
    found = re.search(r"validation score: ([0-9.]+) \(first\) -> ([0-9.]+) \(last\)", text)
    phases = [line for line in text.splitlines() if line.startswith("wall time")]
    if rc != 0 or not found:
        raise RuntimeError(f"the main job exited {rc} after {wall:.0f} s (log: main_job.log):\n{text[-2000:]}")
    lines = [f"`{' '.join(cmd[1:])}` in an empty directory (builds its data, model and SFT warm "
             f"start first): validation score {found.group(1)} -> {found.group(2)}, "
             f"{wall:.0f} s in all; {phases[0] if phases else ''}"]
    lines += generation_summary(out / "main_job" / "metrics.jsonl")
    table = out / "main_job" / "profile" / f"step_{PROFILED_STEP}" / "rank0.txt"
    if table.exists():  # where the launch- and host-bound step's time goes, op by op
        lines += ["", f"Step {PROFILED_STEP} under torch.profiler (`trainer.profile_steps`; the "
                  "ops by their own GPU time, the first rows; the Chrome trace stays on the machine):",
                  "", "```", *table.read_text().splitlines()[:PROFILE_ROWS], "```"]
    return lines


def generation_summary(path: Path) -> list[str]:
    """The main job's generation from its metrics.jsonl: the seconds of ``gen`` and of its
    parts over the run (the CUDA graphs' captures among them: the engine sleeps after each
    step, so each step captures its buckets again), and the worst engine-vs-trainer
    log-prob gap in units of its rounding bound (``check_log_probs=error`` passes at <= 1)."""
    import json

    if not path.exists():
        return ["", f"(no {path.name}: the generation's parts are not shown)"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/gen" in r]
    total = {k: sum(r.get(f"timing_s/{k}", 0.0) for r in rows)
             for k in ("gen", "gen_prefill", "gen_decode", "gen_capture")}
    ratios = [r["training/rollout_log_prob_bound_ratio"] for r in rows if "training/rollout_log_prob_bound_ratio" in r]
    worst = f"{max(ratios):.3f} (the worst step; <= 1: `check_log_probs=error` passes)" if ratios else "not logged"
    return ["", f"Generation over {len(rows)} steps: " + ", ".join(f"{k} {v:.1f} s" for k, v in total.items())
            + f"; engine vs trainer log-probs, in units of their rounding bound: {worst}."]


def memory(device: torch.device, dry: bool, out: Path, limit_s: int) -> list[str]:
    """One actor update's peak memory and time by response length and setting on the 0.5B
    shapes in bf16: ``scripts/bench_memory.py --device cuda`` on
    the model saved as a checkpoint, a process per cell. The rows it printed stand if the
    limit stops it."""
    import tempfile

    from minihf.models import ModelArgs, build_model, init_weights, save_hf

    dtype = torch.float32 if dry else torch.bfloat16
    # positions up to the prompt (bench_memory's 64 tokens) + the longest response: on CUDA the
    # RoPE table is built for max_position_embeddings and does not grow
    shapes = TINY if dry else dict(QWEN05, max_position_embeddings=max(MEMORY_LENGTHS) + 64)
    with tempfile.TemporaryDirectory() as tmp:  # not in OUTDIR: the report's folder travels back
        with torch.device("cpu"):
            save_hf(init_weights(build_model(ModelArgs(**shapes), "lm"), seed=0).to(dtype), tmp)
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--model", tmp, "--device", device.type,
               "--dtype", str(dtype).removeprefix("torch."), "--chunk", "64" if dry else "1024",
               "--lengths", *(["256"] if dry else map(str, MEMORY_LENGTHS)),
               "--settings", *(("nothing", "both") if dry else MEMORY_SETTINGS)] + (["--threads", "1"] if dry else [])
        rc, text = run_logged(cmd, ROOT, out / "bench_memory.log", limit_s, "--memory-limit")
        cmd[3] = "MODEL"
    rows = [line for line in text.splitlines() if " tokens  " in line]  # printed as each cell ends
    if not rows:
        raise RuntimeError(f"bench_memory exited {rc} with no row (log: bench_memory.log):\n{text[-2000:]}")
    table = [line for line in text.splitlines() if line.startswith("|")]
    return [f"`bench_memory.py {' '.join(cmd[2:])}` (exit {rc}; log: bench_memory.log): one update (forward, "
            f"backward, AdamW) on one response, {dtype}; a peak is what the update adds to the parameters, "
            "their gradients and AdamW's state:", "",
            *(table if rc == 0 else ["```", *rows, "```"])]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the report (gpu_check.md) and logs")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, seconds")
    p.add_argument("--tests-limit", type=int, default=150, help="seconds for pytest -m gpu (71 s on an H200)")
    p.add_argument("--main-job-limit", type=int, default=540,
                   help="seconds for the main job (296 s on an H200 before the CUDA-graph decode; each step "
                        "now captures its buckets again after the engine sleeps)")
    p.add_argument("--memory-limit", type=int, default=240, help="seconds for the memory rows (12 processes)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="which sections run (the machine is always reported)")
    args = p.parse_args()
    for name in ("tests_limit", "main_job_limit", "memory_limit"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (seconds), got {getattr(args, name)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA GPU here; use --dry-run on a CPU machine")
    device = torch.device("cpu" if args.dry_run else "cuda")
    report = Report(out / "gpu_check.md", "minihf GPU check" + (" (dry run, CPU)" if args.dry_run else ""))
    report.section("Machine", lambda: machine(device))
    sections = {  # the quickest first: a window cut short by the machine's limit keeps what ran
        "bench": ("A 0.5B model in bf16: prefill, training, decode against their bounds",
                  lambda: benchmark(device, args.dry_run)),
        "tests": ("GPU tests (pytest -m gpu)", lambda: gpu_tests(args.dry_run, out, args.tests_limit)),
        "memory": ("Memory of one actor update by response length",
                   lambda: memory(device, args.dry_run, out, args.memory_limit)),
        "main-job": ("The main job on one GPU", lambda: main_job(args.dry_run, out, args.main_job_limit))}
    for name in SECTIONS:
        if name in args.sections:
            report.section(*sections[name])
    print(f"[gpu_check] wrote {report.path} ({report.failures} section(s) failed)")
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
