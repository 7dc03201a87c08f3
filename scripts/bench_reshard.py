"""Benchmark one reshard (FSDP2 training shards -> the TP rollout engine): hybrid vs naive.

    python scripts/bench_reshard.py                      # N = 2, 4; ~30M and ~100M models
    python scripts/bench_reshard.py --ranks 2 --models 30M --repeats 2
    python scripts/bench_reshard.py --lora 16            # + a LoRA actor's per-step sync

N local processes (gloo on CPU; NCCL when CUDA has N GPUs) shard a random-init Llama-style
model with FSDP2 over all N ranks; for every generation TP size t dividing N, the
``hybrid`` plan (each rank gathers its TP slice inside its group of N/t ranks) and the
``naive`` one (every rank gathers every full weight, then slices) run alternately,
``--repeats`` times each after one warm-up, and the best wall time of each is reported (the least disturbed
by other load on a shared machine), with:

* ``recv MB``: bytes this rank received in the all-gathers (counted as they run), next to
  the formula ``(N/t - 1)/(N/t) x model/t`` for the TP-sharded weights plus
  ``(N - 1)/N x`` the replicated tensors (embedding, norms: every TP rank needs them whole);
* ``engine MB``: weight bytes the engine holds during generation, next to ``model/t +
  replicated x (1 - 1/t)`` (the replicated tensors are whole on every TP rank);
* ``peak MB``: engine weights + this rank's FSDP shard + the largest temporary buffer.

``--lora R``: the model gets rank-R adapters on every projection (``minihf.models.lora``)
and a third mode runs, ``lora``: the engine keeps its base weights between syncs (as a
LoRA actor's does) and each sync moves the adapters alone, next to the same formula over
the adapter tensors. The ``hybrid`` and ``naive`` rows then move base and adapters
(``rollout.free_base_weights``: every weight each time).

Rank 0 prints the table; the figures of every rank are equal by symmetry up to uneven
shards.
"""

from __future__ import annotations

import argparse
import time

import torch

MODELS = {  # name: (hidden, layers, heads, kv_heads, intermediate, vocab); untied embeddings
    "30M": (512, 10, 8, 4, 1408, 8192),
    "100M": (768, 14, 12, 4, 2048, 8192),
}
MB = 1 << 20


def random_model(name: str):
    """The random-init (seed 0) Llama-style LM of ``MODELS[name]``, fp32, untied."""
    from minihf.models import ModelArgs, build_model, init_weights

    h, layers, heads, kv, inter, vocab = MODELS[name]
    args = ModelArgs(arch="llama", vocab_size=vocab, hidden_size=h, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                     max_position_embeddings=1024, tie_word_embeddings=False)
    return init_weights(build_model(args, "lm"), seed=0)


def recv_formula(shapes: dict, world: int, t: int, itemsize: int) -> float:
    """Bytes one rank receives syncing the tensors ``shapes`` (the hybrid plan):
    ``(N/t - 1)/(N/t) x sharded/t + (N - 1)/N x (replicated + misaligned)``."""
    from minihf.hybrid.plan import plan_tensor
    from minihf.parallel.placement import tp_dim

    total = sum(torch.Size(s).numel() * itemsize for s in shapes.values())
    replicated = sum(torch.Size(s).numel() * itemsize for n, s in shapes.items()
                     if tp_dim(n, s, t) is None)
    misaligned = sum(torch.Size(s).numel() * itemsize for n, s in shapes.items()
                     if tp_dim(n, s, t) is not None and plan_tensor(n, s, world, t).over == "all")
    g = world // t
    return (g - 1) / g * (total - replicated - misaligned) / t + (world - 1) / world * (replicated + misaligned)


def _rank(rank, world, names, repeats, lora):
    import torch.distributed as dist

    from minihf.hybrid.engine import HybridEngine
    from minihf.hybrid.reshard import rollout_groups
    from minihf.models.lora import apply_lora, init_lora_state, is_lora_param, module_names
    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh
    from minihf.parallel.placement import tp_dim
    from minihf.workers.config import RolloutConfig

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    tps = [t for t in (1, 2, 4, 8) if world % t == 0]
    groups = {t: rollout_groups(t) for t in tps}
    rows = []
    for name in names:
        model = random_model(name)
        if lora:
            apply_lora(model, lora, 2.0 * lora, module_names(model, "all-linear"))
            adapters = {n: tuple(p.shape) for n, p in model.named_parameters() if is_lora_param(n)}
            with torch.no_grad():
                for n, value in init_lora_state(adapters, seed=0).items():
                    model.get_parameter(n).copy_(value)
        model = model.to(device)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        itemsize = 2 if cuda else 4  # the rollout dtype: bf16 on CUDA, fp32 on CPU
        total = sum(p.numel() for p in model.parameters()) * itemsize
        fsdp = apply_fsdp(model, fsdp_mesh(dist.group.WORLD, device.type))
        shard = sum(p.to_local().numel() * p.to_local().element_size() for p in fsdp.parameters())
        for t in tps:
            replicated = sum(torch.Size(s).numel() * itemsize for n, s in shapes.items()
                             if tp_dim(n, s, t) is None)
            sharded = total - replicated
            formula = {"hybrid": recv_formula(shapes, world, t, itemsize)}
            if lora:
                formula["lora"] = recv_formula(adapters, world, t, itemsize)
            engines, best = {}, {}
            for mode in ("hybrid", "naive") + (("lora",) if lora else ()):
                gather, tp_group, tp_rank = groups[t]
                cfg = RolloutConfig(tensor_model_parallel_size=t,
                                    reshard="naive" if mode == "naive" else "hybrid",
                                    free_base_weights=mode != "lora",
                                    prompt_length=8, response_length=8)  # no generation here
                engines[mode] = HybridEngine(fsdp, cfg, all_group=dist.group.WORLD,
                                             gather_group=gather, tp_group=tp_group,
                                             tp_rank=tp_rank, device=device, eos_token_ids=(),
                                             pad_token_id=0)
            for eng in engines.values():  # warm-up: first allocations, group set-up
                eng.sync_weights()
                eng.sleep()
            for _ in range(repeats):
                for mode, eng in engines.items():  # alternated
                    dist.barrier()
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    eng.sync_weights()
                    if cuda:
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    stats = dict(eng.last_reshard, engine=eng.engine_weight_bytes(), time=dt)
                    eng.sleep()
                    if mode not in best or dt < best[mode]["time"]:
                        best[mode] = stats
            for mode, s in best.items():
                rows.append(dict(model=name, N=world, t=t, mode=mode, time_ms=s["time"] * 1e3,
                                 recv=s["bytes_received"] / MB,
                                 recv_formula=formula.get(mode, float("nan")) / MB,
                                 engine=s["engine"] / MB,
                                 engine_formula=(sharded / t + replicated) / MB,
                                 peak=(s["engine"] + shard + s["peak_buffer"]) / MB,
                                 collectives=s["collectives"], model_mb=total / MB))
    return rows


def main() -> None:
    from minihf.testing import spawn_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated N")
    p.add_argument("--models", default="30M,100M", help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--lora", type=int, default=0, help="adapter rank R: add the LoRA sync (0: off)")
    a = p.parse_args()
    names = a.models.split(",")
    bad = [n for n in names if n not in MODELS]
    if bad:
        raise SystemExit(f"unknown model {bad}; choose from {list(MODELS)}")
    print(f"{'model':>6} {'N':>2} {'t':>2} {'mode':>7} {'ms':>8} {'recv MB':>8} {'formula':>8} "
          f"{'engine MB':>9} {'formula':>8} {'peak MB':>8} {'coll':>5}  hybrid/naive time")
    for world in (int(x) for x in a.ranks.split(",")):
        rows = spawn_ranks(_rank, world, names, a.repeats, a.lora, threads=a.threads, timeout_s=3600)[0]
        by = {(r["model"], r["t"], r["mode"]): r for r in rows}
        for r in rows:
            ratio = ""
            if r["mode"] != "naive":
                ratio = f"  {r['time_ms'] / by[r['model'], r['t'], 'naive']['time_ms']:.2f}"
            print(f"{r['model']:>6} {r['N']:>2} {r['t']:>2} {r['mode']:>7} {r['time_ms']:>8.1f} "
                  f"{r['recv']:>8.3f} {r['recv_formula']:>8.3f} "
                  f"{r['engine']:>9.1f} {r['engine_formula']:>8.1f} {r['peak']:>8.1f} "
                  f"{r['collectives']:>5}{ratio}")
    print("model MB = full model in the rollout dtype; formula (recv, hybrid) = (N/t-1)/(N/t) x "
          "sharded/t + (N-1)/N x (replicated + misaligned); engine formula = sharded/t + replicated")
    if a.lora:
        print("lora: the engine kept its base weights, the sync moved the adapters; formula = the same "
              "over the adapter tensors (hybrid/naive rows: base + adapters, every weight)")


if __name__ == "__main__":
    main()
