"""Benchmark the weight sync to a standalone rollout: the actor's FSDP2 shards on N ranks ->
R rollout ranks of TP size t, point to point (``minihf.hybrid.transfer``, docs/async.md).

    python scripts/bench_weight_sync.py                          # 30M and 100M; 2 -> 1 (t 1), 2 -> 2 (t 1, 2)
    python scripts/bench_weight_sync.py --layouts 2:1:1 --models 30M --repeats 1

N + R local processes (gloo on CPU, one thread each). The first N shard a random-init
Llama-style model with FSDP2 over their own group; the other R hold what a TP-t engine
holds (each TP rank's slice of the sharded weights, the replicated ones whole) and receive
into it. One warm-up, then ``--repeats`` timed syncs; the best is reported with:

* ``recv MB``: what one rollout rank received (counted as it runs) next to the formula, its
  TP slice of every weight (``sharded / t + replicated``): each rollout rank gets its slice
  once, from the training ranks holding its rows;
* ``sent MB``: the most one actor rank sent (its shard's share of every replica's slices);
* ``whole MB``: what a rollout rank receives when the whole model is sent to every rollout
  rank (the usual sync of a separate inference engine), for comparison;
* a check that every rollout rank's tensors equal its slices of the model.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_reshard import MB, MODELS, random_model  # the same models as the colocated reshard's


def _slice(full: torch.Tensor, name: str, t: int, j: int) -> torch.Tensor:
    from minihf.parallel.placement import tp_dim

    d = tp_dim(name, tuple(full.shape), t) if t > 1 else None
    return full if d is None else full.narrow(d, j * full.shape[d] // t, full.shape[d] // t)


def _rank(rank, world, n, t, names, repeats):
    import torch.distributed as dist

    from minihf.hybrid.reshard import local_shard
    from minihf.hybrid.transfer import plan_transfer, receive_weights, received_bytes, send_weights
    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh

    train = dist.new_group(list(range(n)))
    rollout = list(range(n, world))
    d = len(rollout) // t
    tp_ranks = {r: i // d for i, r in enumerate(rollout)}  # strided, as the rollout layout
    rows = []
    for name in names:
        model = random_model(name)
        full = {k: v.detach().clone() for k, v in model.named_parameters()}
        shapes = {k: tuple(v.shape) for k, v in full.items()}
        rounds = plan_transfer(shapes, list(range(n)), tp_ranks, t)
        if rank < n:
            fsdp = apply_fsdp(model, fsdp_mesh(train, "cpu"))
            params = {k: local_shard(p) for k, p in fsdp.named_parameters()}
        else:
            dest = {k: torch.empty_like(_slice(v, k, t, tp_ranks[rank])) for k, v in full.items()}
        best = None
        for i in range(repeats + 1):  # the first: warm-up
            dist.barrier()
            t0 = time.perf_counter()
            if rank < n:
                moved = send_weights(params, rounds, rank, dist.group.WORLD, torch.float32)
            else:
                moved = receive_weights(dest, rounds, rank, dist.group.WORLD)
            dt = time.perf_counter() - t0
            times = [None] * world
            dist.all_gather_object(times, dt)
            if i and (best is None or max(times) < best):
                best = max(times)
        ok = rank < n or all(torch.equal(dest[k], _slice(v, k, t, tp_ranks[rank])) for k, v in full.items())
        stats = [None] * world
        dist.all_gather_object(stats, (moved, ok))
        total = sum(v.numel() for v in full.values()) * 4
        rows.append(dict(model=name, N=n, R=len(rollout), t=t, ms=best * 1e3,
                         recv=max(s[0] for s in stats[n:]) / MB,
                         formula=received_bytes(rounds, rollout[0], 4) / MB,
                         slice=sum(_slice(v, k, t, 0).numel() for k, v in full.items()) * 4 / MB,
                         sent=max(s[0] for s in stats[:n]) / MB, whole=total / MB,
                         ok=all(s[1] for s in stats)))
    return rows


def main() -> None:
    from minihf.testing import spawn_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="2:1:1,2:2:1,2:2:2", help="comma-separated N:R:t")
    p.add_argument("--models", default="30M,100M", help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    names = a.models.split(",")
    bad = [m for m in names if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown model {bad}; choose from {list(MODELS)}")
    print(f"{'model':>6} {'N':>2} {'R':>2} {'t':>2} {'ms':>8} {'recv MB':>8} {'slice MB':>8} "
          f"{'sent MB':>8} {'whole MB':>8} {'MB/s':>7}  slices equal")
    for layout in a.layouts.split(","):
        try:
            n, r, t = (int(x) for x in layout.split(":"))
        except ValueError:
            raise SystemExit(f"--layouts {layout!r}: write N:R:t, e.g. 2:2:1") from None
        if n < 1 or r < 1 or t < 1 or r % t:
            raise SystemExit(f"--layouts {layout}: N, R, t >= 1 and t must divide R")
        for row in spawn_ranks(_rank, n + r, n, t, names, a.repeats, timeout_s=3600)[0]:
            assert row["recv"] == row["formula"] == row["slice"], row  # the plan's bytes, as run
            print(f"{row['model']:>6} {row['N']:>2} {row['R']:>2} {row['t']:>2} {row['ms']:>8.1f} "
                  f"{row['recv']:>8.2f} {row['slice']:>8.2f} {row['sent']:>8.2f} {row['whole']:>8.2f} "
                  f"{row['recv'] / (row['ms'] / 1e3):>7.0f}  {row['ok']}")
    print("recv = what one rollout rank received; slice = its TP slice of every weight (sharded/t + "
          "replicated); sent = the most one actor rank sent; whole = the model, what a rank gets when "
          "every rollout rank is sent every weight")


if __name__ == "__main__":
    main()
