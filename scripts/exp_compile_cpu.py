"""Does ``torch.compile`` pay for the decode step on CPU? minihf's static decode step (the
function a CUDA graph captures: ``minihf.rollout.decode_step``) compiled by inductor, against
the eager step and the same static step uncompiled, on one CPU, in one run.

    python scripts/exp_compile_cpu.py --model-dir outputs/models/smollm2-135m-instruct
    python scripts/exp_compile_cpu.py --batch 16 --new-tokens 64 --repeats 3
    python scripts/exp_compile_cpu.py --tiny          # a random 2-layer model, for a smoke run

Three ``LLM``s on the same weights generate the same prompts greedily (``ignore_eos``),
alternated for ``--repeats`` rounds (the best round of each is printed): ``eager``
(``decode="eager"``, the CPU default), ``static`` (``decode="static"``: fixed shapes per
bucket, run as is) and ``compiled`` (the static step's function per bucket through
``torch.compile(fullgraph=True)``; a warm-up generate compiles the buckets the timed rounds
use, and each compile's seconds are printed). Per path: seconds per generate, milliseconds
per new token (the prefill included), and against ``eager`` how many sequences' tokens
differ and the largest log-prob difference.

Everything is the library's code: a forward with a KV cache builds RoPE's table to the
cache's length without reading the positions, so the step is one graph.
The finding is in docs/models.md (the decode step on CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from minihf.rollout import decode_step
from minihf.rollout.llm import LLM
from minihf.rollout.sampling import SamplingParams

class CompiledSteps:
    """``StaticDecode._prepare`` for the compiled LLM: each bucket's step compiled, timed."""

    def __init__(self, mode: str | None, dtype: torch.dtype):
        self.mode, self.dtype, self.compiles = mode, dtype, []

    def __call__(self, static, key, forward, cache):
        body = static._body(key, forward, cache)
        step = torch.compile(body, fullgraph=True, dynamic=False, **({"mode": self.mode} if self.mode else {}))
        t0 = time.perf_counter()
        step()  # the compile; it also writes the keys and values the step would (same inputs)
        self.compiles.append((key[:2], time.perf_counter() - t0))
        return step


def tiny_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", help="a checkpoint dir (default: --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer model (smoke run)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default=None, help="torch.compile's mode (default: its default)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights and activations (bfloat16 pays only on CPUs with bf16 matmul units, e.g. AMX)")
    args = ap.parse_args()
    if args.model_dir is None and not args.tiny:
        ap.error("pass --model-dir DIR (a checkpoint) or --tiny")
    for name in ("batch", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            tiny_model(tmp)
        run(args.model_dir or tmp, args)


def run(path: str, args) -> None:
    dtype = getattr(torch, args.dtype)
    steps = CompiledSteps(args.mode, dtype)
    llms = {name: LLM(path, dtype=dtype, device="cpu", max_num_seqs=args.batch, decode=mode)
            for name, mode in (("eager", "eager"), ("static", "static"), ("compiled", "static"))}
    vocab = llms["eager"].engine.model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    prepare = decode_step.StaticDecode._prepare

    def compiled(static, key, forward, cache):  # a function, so that the class binds it
        return steps(static, key, forward, cache)

    def generate(name):
        decode_step.StaticDecode._prepare = compiled if name == "compiled" else prepare
        try:
            t0 = time.perf_counter()
            out = llms[name].generate(prompts, params)
            return time.perf_counter() - t0, out
        finally:
            decode_step.StaticDecode._prepare = prepare

    for name in llms:  # warm-up: the compiled path compiles the buckets the timed rounds use
        generate(name)
    for key, s in steps.compiles:
        print(f"compiled bucket (rows, cache length) {key}: {s:.1f} s")
    warm = len(steps.compiles)
    best, outs = {n: float("inf") for n in llms}, {}
    for _ in range(args.repeats):
        for name in llms:
            s, outs[name] = generate(name)
            best[name] = min(best[name], s)
    print(f"{args.dtype}, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {torch.get_num_threads()} "
          f"threads, best of {args.repeats}; compiles in the timed rounds: {len(steps.compiles) - warm}")
    print(f"{'path':9s} {'s':>7s} {'ms/token':>9s} {'vs eager':>9s} {'differ':>7s} {'max |dlogp|':>11s}")
    ref = outs["eager"]
    for name in llms:
        o = outs[name]
        differ = sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(ref, o))
        dlogp = max(abs(x - y) for a, b in zip(ref, o) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        print(f"{name:9s} {best[name]:7.2f} {best[name] / args.new_tokens * 1e3:9.1f} "
              f"{best['eager'] / best[name]:8.2f}x {differ:7d} {dlogp:11.2e}")


if __name__ == "__main__":
    main()
