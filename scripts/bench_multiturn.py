"""Multi-turn rollouts: the engine's KV reuse against re-prefilling every turn.

    python scripts/bench_multiturn.py            # 5M model, 16 episodes, 1/2/4/8 turns
    python scripts/bench_multiturn.py --quick    # fewer turns and rounds

Both paths generate the same work: episodes of ``--turns`` assistant turns of exactly
``--turn-len`` sampled tokens (``max_turn_tokens``; the random model has no EOS), each
followed by an observation of ``--obs-len`` tokens, after a ``--prompt-len`` prompt.

* KV reuse (minihf's multi-turn engine): a turn end pauses the sequence with its KV cache;
  only the observation (and the turn's last token) is prefilled; the other sequences keep
  decoding meanwhile.
* re-prefill (a stateless rollout server without prefix caching, one request per turn):
  every turn is a new ``generate`` call whose prompt is the whole conversation so far.

Printed per turn count: prefill tokens per episode (counted), episodes/s (best of
``--rounds`` alternating rounds) and the ratio. With KV reuse the prefill work grows
linearly with the turns; re-prefilling grows quadratically.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import MODELS, build  # noqa: E402


class FixedEnv:
    """Answers every turn with ``obs_len`` fixed random tokens; done after ``turns`` turns."""

    def __init__(self, turns: int, obs: list[list[int]]):
        self.turns, self.obs, self.count, self.queue = turns, obs, {}, []

    def end_turn(self, seq):
        self.queue.append(seq)

    def poll(self, wait):
        out, self.queue = self.queue, []
        res = []
        for seq in out:
            k = self.count[seq.seq_id] = self.count.get(seq.seq_id, 0) + 1
            res.append((seq, None, "done") if k >= self.turns else (seq, self.obs[k - 1], ""))
        return res


def kv_reuse(engine, prompts, turns, turn_len, obs):
    from minihf.rollout import SamplingParams

    budget = turns * turn_len + (turns - 1) * len(obs[0]) + 1
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=budget, max_turn_tokens=turn_len)
              for i in range(len(prompts))]
    groups = engine.generate(prompts, params, turns=FixedEnv(turns, obs))
    assert all(sum(1 for m in g[0].token_mask() if m) == turns * turn_len for g in groups)
    return len(prompts) * len(prompts[0]) + engine.last_stats["extend_tokens"]


def re_prefill(engine, prompts, turns, turn_len, obs):
    from minihf.rollout import SamplingParams

    contexts = [list(p) for p in prompts]
    prefilled = 0
    for t in range(turns):
        params = [SamplingParams(temperature=1.0, seed=1000 * t + i, max_tokens=turn_len)
                  for i in range(len(contexts))]
        prefilled += sum(len(c) for c in contexts)
        outs = engine.generate(contexts, params)
        for c, g in zip(contexts, outs):
            assert len(g[0].tokens) == turn_len
            c.extend(g[0].tokens)
            if t < turns - 1:
                c.extend(obs[t])
    return prefilled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="5M", choices=sorted(MODELS))
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--turn-len", type=int, default=24)
    ap.add_argument("--obs-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="turns 1 and 4, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.rounds = [1, 4], 2
    torch.set_num_threads(args.threads)
    from minihf.models import load_hf
    from minihf.rollout import Engine

    rng = random.Random(0)
    vocab = MODELS[args.model][-1]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.episodes)]
    obs = [[rng.randrange(vocab) for _ in range(args.obs_len)] for _ in range(max(args.turns))]
    with tempfile.TemporaryDirectory() as tmp:
        build(args.model, tmp)
        longest = args.prompt_len + max(args.turns) * (args.turn_len + args.obs_len) + 1
        engine = Engine(load_hf(tmp), max_num_seqs=args.episodes, max_model_len=longest)
    print(f"model {args.model}, {args.episodes} episodes, prompt {args.prompt_len}, turns of "
          f"{args.turn_len} sampled + {args.obs_len} observation tokens, {args.threads} threads, "
          f"torch {torch.__version__}")
    print(f"{'turns':>5} | {'prefill tok/episode: reuse':>26} {'re-prefill':>10} | "
          f"{'episodes/s: reuse':>17} {'re-prefill':>10} {'ratio':>6}")
    for turns in args.turns:
        best = {"reuse": float("inf"), "re-prefill": float("inf")}
        tokens = {}
        for _ in range(args.rounds):  # alternate, keep each path's best round
            for name, fn in (("reuse", kv_reuse), ("re-prefill", re_prefill)):
                t0 = time.perf_counter()
                tokens[name] = fn(engine, prompts, turns, args.turn_len, obs)
                best[name] = min(best[name], time.perf_counter() - t0)
        eps = {k: args.episodes / v for k, v in best.items()}
        print(f"{turns:>5} | {tokens['reuse'] / args.episodes:>26.0f} "
              f"{tokens['re-prefill'] / args.episodes:>10.0f} | {eps['reuse']:>17.2f} "
              f"{eps['re-prefill']:>10.2f} {eps['reuse'] / eps['re-prefill']:>5.2f}x")


if __name__ == "__main__":
    main()
