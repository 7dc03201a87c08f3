"""Controller overhead vs raw torch.distributed, measured in the same run on 2 ranks.

    python scripts/bench_rpc.py                       # spawns 2 local ranks (gloo on CPU)
    torchrun --nproc_per_node=2 scripts/bench_rpc.py  # same, under torchrun (NCCL with GPUs)
    python scripts/bench_rpc.py --mb 64 --repeats 7 --pings 200

Each controller figure is printed next to raw ``torch.distributed`` p2p of the same bytes,
with the ratio of the medians and the median of paired ratios (neighbouring runs, robust to
load that changes during the run); controller and raw runs alternate:

* no-op call latency: ``remote.noop()`` on a role placed on rank 1 vs a 1-element
  send/recv ping-pong.
* ``remote``: DP_COMPUTE round trip of a ``--mb`` Batch to a role on rank 1 only (all bytes
  cross the wire both ways) vs sending the same tensors to rank 1 and back.
* ``dp2``: DP_COMPUTE over a role on ranks 0 and 1 (rank 0 keeps its half, rank 1's half
  goes there and back, the results are concatenated) vs (a) sending rank 1's half there and
  back (the p2p floor: same bytes on the wire, but not the same result), and (b) the same
  result built by hand as cheaply as we know: per key one new output tensor, rank 0's half
  copied into it, rank 1's half received straight into the other rows.

Raw traffic uses the default process group, which the controller itself never uses. Like
the controller, the raw path receives into newly allocated tensors on both sides (a result
must live in fresh memory), so page-faulting new memory is in both figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from minihf.controller.config import ControllerConfig, RoleSpec
from minihf.controller import Dispatch, Worker, launch, register, run
from minihf.protocol import Batch


def make_batch(megabytes: float, device: torch.device) -> Batch:
    """A PPO-like Batch: 2 int64 and 4 float32 [B, T] tensors, ~``megabytes`` in total."""
    seq = 8192
    rows = max(2, int(megabytes * 2**20 / (seq * (2 * 8 + 4 * 4))) // 2 * 2)
    ids = torch.randint(0, 32000, (rows, seq), device=device)
    f = lambda: torch.randn(rows, seq, device=device)  # noqa: E731
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "old_log_probs": f(),
                  "values": f(), "advantages": f(), "returns": f()},
                 {"uid": [str(i) for i in range(rows)]})


def nbytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.tensors.values())


class BenchWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=Dispatch.DP_COMPUTE)
    def identity(self, batch: Batch) -> Batch:
        return batch

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def raw_echo(self, specs: list, repeats: int) -> None:
        """Receive tensors of ``specs`` from rank 0 and send them back, ``repeats`` times."""
        for _ in range(repeats):
            bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
            for w in [dist.irecv(b, 0) for b in bufs]:
                w.wait()
            for w in [dist.isend(b, 0) for b in bufs]:
                w.wait()


def raw_round_trip(tensors: list[torch.Tensor], local: list[torch.Tensor] | None = None,
                   check: list[torch.Tensor] | None = None) -> float:
    """Send ``tensors`` to rank 1 and receive them back into new tensors (as a result needs);
    with ``local``, receive them into the last rows of new outputs whose first rows are a
    copy of ``local[i]`` (the concatenation, built in place); ``check``: expected outputs."""
    t0 = time.perf_counter()
    for w in [dist.isend(t, 1) for t in tensors]:
        w.wait()
    if local is None:
        back = [torch.empty_like(t) for t in tensors]
        dest = back
    else:
        back = [torch.empty((a.shape[0] + t.shape[0], *t.shape[1:]), dtype=t.dtype,
                            device=t.device) for a, t in zip(local, tensors)]
        for out, a in zip(back, local):
            out[:a.shape[0]].copy_(a)
        dest = [out[a.shape[0]:] for out, a in zip(back, local)]
    for w in [dist.irecv(b, 1) for b in dest]:
        w.wait()
    if back[0].is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if check is not None:
        assert all(torch.equal(b, c) for b, c in zip(back, check))
    return elapsed


def timed(fn) -> float:
    t0 = time.perf_counter()
    out = fn()
    if isinstance(out, Batch) and out.tensors["values"].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_transfer(target, remote, batch: Batch, repeats: int, split: bool) -> list[float]:
    """Median seconds: controller round trip of ``batch`` on ``target``; raw p2p of the bytes
    rank 1 handles (all of ``batch``, or its second half if ``split``); and, if ``split``,
    raw p2p plus the concatenation with the first half (the same result built by hand)."""
    out = target.identity(batch)  # the controller's result equals the input, too
    assert all(torch.equal(out.tensors[k], t) for k, t in batch.tensors.items())
    del out
    first, second = (batch[:len(batch) // 2], batch[len(batch) // 2:]) if split else (None, batch)
    tensors = [t for _, t in second.tensor_items()]
    local = [t for _, t in first.tensor_items()] if split else None
    check = [t for _, t in batch.tensor_items()]  # the raw path's result equals the input
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    times: list[list[float]] = [[], [], []]
    for _ in range(repeats + 1):  # the first of each is a warm-up
        times[0].append(timed(lambda: target.identity(batch)))
        fut = remote.raw_echo.future(specs, 2 if split else 1)
        times[1].append(raw_round_trip(tensors))
        if split:
            times[2].append(raw_round_trip(tensors, local, check))
        fut.result()
    return [statistics.median(t[1:]) for t in times if t] + [
        statistics.median(c / r for c, r in zip(times[0][1:], t[1:])) for t in times[1:] if t]


def paired(ctl: list[float], raw: list[float]) -> float:
    """Median of the ratios of neighbouring runs: robust to load that drifts during the run."""
    return statistics.median(c / r for c, r in zip(ctl, raw))


def driver(groups, args) -> None:
    remote, dp2 = groups["remote"], groups["dp2"]
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(
        dist.get_backend()) else torch.device("cpu")
    print(f"backend={dist.get_backend()} device={device} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}  (medians; alternating controller/raw)")
    # no-op latency, alternating blocks of controller calls and raw ping-pongs
    one = torch.zeros(1, device=device)
    ctl, raw = [], []
    for _ in range(10):
        for _ in range(args.pings // 10):
            ctl.append(timed(remote.noop))
        fut = remote.raw_echo.future([((1,), one.dtype)], args.pings // 10)
        raw += [raw_round_trip([one]) for _ in range(args.pings // 10)]
        fut.result()
    c, r = statistics.median(ctl), statistics.median(raw)
    print(f"{'no-op call, role on rank 1':<36} controller {c * 1e3:7.2f} ms | raw ping-pong "
          f"{r * 1e3:7.2f} ms | ratio {c / r:5.2f} (paired {paired(ctl, raw):5.2f})")
    batch = make_batch(args.mb, device)
    mb = nbytes(batch) / 2**20
    c, r, pr = bench_transfer(remote, remote, batch, args.repeats, split=False)
    print(f"{f'{mb:.0f} MB round trip, role on rank 1':<36} controller {c * 1e3:7.1f} ms | "
          f"raw send+recv {r * 1e3:7.1f} ms | ratio {c / r:5.2f} (paired {pr:5.2f})")
    c, r, rc, pr, prc = bench_transfer(dp2, remote, batch, args.repeats, split=True)
    print(f"{f'{mb:.0f} MB DP_COMPUTE over ranks 0,1':<36} controller {c * 1e3:7.1f} ms | "
          f"raw send+recv {r * 1e3:7.1f} ms | ratio {c / r:5.2f} (paired {pr:5.2f}); raw: "
          f"rank 1's half only\n{'':<36} {'':<21} | raw in place {rc * 1e3:8.1f} ms | "
          f"ratio {c / rc:5.2f} (paired {prc:5.2f}); the same result built by hand")


ROLES = {"remote": BenchWorker, "dp2": BenchWorker}
PLACEMENT = {"remote": RoleSpec([1]), "dp2": RoleSpec([0, 1])}


def _spawned(rank: int, world_size: int, args) -> None:
    run(lambda groups: driver(groups, args), ROLES,
        ControllerConfig(timeout_s=300, placement=PLACEMENT))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=64.0, help="Batch size in MB (default 64)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per transfer figure")
    p.add_argument("--pings", type=int, default=200, help="timed no-op calls (and raw pings)")
    args = p.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        if os.environ.get("WORLD_SIZE") != "2":
            sys.exit("bench_rpc.py needs exactly 2 ranks: torchrun --nproc_per_node=2")
        launch(lambda groups: driver(groups, args), ROLES,
               ControllerConfig(timeout_s=300, placement=PLACEMENT))
    else:
        from minihf.testing import spawn_ranks
        spawn_ranks(_spawned, 2, args, timeout_s=900, threads=1)


if __name__ == "__main__":
    main(sys.argv[1:])
