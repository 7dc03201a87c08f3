"""Main job entry point. For now: a smoke job of the single controller (the PPO trainer
replaces it later).

    python scripts/train_ppo.py                           # one process: driver + all roles
    torchrun --nproc_per_node=2 scripts/train_ppo.py      # rank 0 drives, both ranks work
    torchrun --nproc_per_node=2 scripts/train_ppo.py placement.sum.ranks=[1] timeout_s=60

Arguments are ``ControllerConfig`` overrides (``key=value``). Rank 0 drives two toy roles:
``double`` (DP_COMPUTE: doubles every tensor of its Batch chunk) and ``sum`` (DP_COMPUTE
row sums, then an ALL_TO_ALL/ONE_TO_ALL reduction over its process group), checks every
result against the same computation done locally, prints it, and exits non-zero on a
mismatch or error on any rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from minihf.config import load_config
from minihf.controller import Dispatch, Worker, launch, register
from minihf.controller.config import ControllerConfig
from minihf.protocol import Batch


class ToyWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def describe(self) -> str:
        return (f"{self.role} rank {self.rank} (role rank {self.role_rank}/{self.role_size}, "
                f"dp {self.dp_rank}/{self.dp_size}, tp {self.tp_rank}/{self.tp_size}, "
                f"{self.device})")


class DoubleWorker(ToyWorker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        return Batch({k: t * 2 for k, t in batch.tensors.items()}, batch.non_tensors, batch.meta)


class SumWorker(ToyWorker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def row_sums(self, batch: Batch) -> Batch:
        return Batch({"row_sum": batch.tensors["x"].sum(dim=1)}, meta=batch.meta)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def group_total(self, value: float) -> float:
        t = torch.tensor([value * (self.role_rank + 1)], device=self.device)
        dist.all_reduce(t, group=self.group)  # uses the role's own process group
        return t.item()


def driver(groups) -> None:
    double, summ = groups["double"], groups["sum"]
    for line in double.describe() + summ.describe():
        print(line)
    batch = Batch({"x": torch.arange(15, dtype=torch.float32).view(5, 3),
                   "ids": torch.arange(5)}, {"uid": [f"p{i}" for i in range(5)]}, {"step": 0})
    doubled = double.double(batch)  # 5 rows over the DP ranks: padded, then stripped
    sums = summ.row_sums(doubled)
    expect = (batch.tensors["x"] * 2).sum(dim=1)
    ok = torch.equal(sums.tensors["row_sum"].cpu(), expect)
    ok &= list(doubled.non_tensors["uid"]) == list(batch.non_tensors["uid"])
    n = summ.world_size
    totals = summ.group_total(1.0)
    ok &= totals == [n * (n + 1) / 2] * n
    print(f"doubled ids: {doubled.tensors['ids'].tolist()}")
    print(f"row sums: {sums.tensors['row_sum'].tolist()}")
    print(f"group totals over {n} rank(s): {totals}")
    if not ok:
        raise RuntimeError(f"smoke job mismatch: row sums {sums.tensors['row_sum'].tolist()} "
                           f"vs expected {expect.tolist()}, totals {totals}")
    print("controller smoke job OK")


def main(argv: list[str]) -> None:
    config = load_config(ControllerConfig, None, argv)
    launch(driver, {"double": DoubleWorker, "sum": SumWorker}, config)


if __name__ == "__main__":
    main(sys.argv[1:])
