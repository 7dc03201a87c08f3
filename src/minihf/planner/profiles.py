"""Device profiles: what one device of a cluster can do, for the planner's cost model.

A profile is a few numbers per device: memory, the matmul FLOP/s a training or prefill
kernel achieves, memory bandwidth (decode and the optimizer step are bound by it), and the
bandwidth of a collective inside a node and across nodes (bytes one rank receives per
second in a ring all-gather). The built-in GPU profiles are vendors' datasheet peaks times
an efficiency, said per figure; ``minihf plan --measure`` measures this machine instead
(``measure``) and writes a YAML file that ``--profile FILE`` reads (through minihf's YAML
loader, type-checked key by key like a config: a broken file is one line naming it and the
key).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: float          # usable memory of one device
    flops: float                 # achieved dense matmul FLOP/s in the compute dtype (prefill, training)
    memory_bandwidth: float      # bytes/s a kernel streams from device memory (decode, optimizer)
    intra_node_bandwidth: float  # bytes/s one rank receives in a collective inside a node
    inter_node_bandwidth: float  # bytes/s one rank receives in a collective spanning nodes
    devices_per_node: int = 8
    bytes_per_param: int = 2     # compute dtype: bf16 on GPUs, fp32 on CPU
    collective_latency: float = 20e-6  # seconds a collective costs besides its bytes
    comm_overlaps_compute: bool = True  # GPUs: NCCL on its own stream; CPU: gloo uses the cores that compute
    host_cores: int = 0          # ranks sharing one host's cores (CPU); 0: each device is its own
    threads_per_rank: int = 1
    source: str = ""

    def __post_init__(self):
        for f in ("memory_bytes", "flops", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"profile {self.name!r}: {f} must be > 0, got {getattr(self, f)!r}")
        if not self.collective_latency >= 0:
            raise ValueError(f"profile {self.name!r}: collective_latency must be >= 0, got {self.collective_latency!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"profile {self.name!r}: devices_per_node must be >= 1, got {self.devices_per_node!r}")
        if self.bytes_per_param not in (2, 4):
            raise ValueError(f"profile {self.name!r}: bytes_per_param must be 2 (bf16) or 4 (fp32), got "
                             f"{self.bytes_per_param!r}")
        if self.host_cores < 0 or self.threads_per_rank < 1:
            raise ValueError(f"profile {self.name!r}: host_cores must be >= 0 and threads_per_rank >= 1, got "
                             f"{self.host_cores!r} and {self.threads_per_rank!r}")


# Efficiencies applied to datasheet peaks: 50% of dense bf16 peak for large training and
# prefill matmuls (what Megatron-style trainers report at scale), 80% of HBM bandwidth for
# streaming reads, 80% of NVLink's per-direction bandwidth and 80% of one 200 Gb/s
# InfiniBand NIC per GPU (DGX/HGX nodes have one NIC per GPU). The 20 us a collective costs
# besides its bytes is an assumed order of magnitude for NCCL's small messages, not a
# datasheet figure.
MATMUL_EFFICIENCY, STREAM_EFFICIENCY, LINK_EFFICIENCY = 0.5, 0.8, 0.8

BUILTIN = {
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e, NVLink 600 GB/s
    # total (300 GB/s per direction); HGX A100 nodes pair each GPU with a 200 Gb/s HDR NIC.
    "A100-80GB": DeviceProfile("A100-80GB", 80 * GB, 312e12 * MATMUL_EFFICIENCY, 2039 * GB * STREAM_EFFICIENCY,
                               300 * GB * LINK_EFFICIENCY, 25 * GB * LINK_EFFICIENCY,
                               source="NVIDIA A100 datasheet (SXM4 80GB)"),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s
    # total (450 per direction); DGX H100 has one 400 Gb/s NDR NIC per GPU.
    "H100": DeviceProfile("H100", 80 * GB, 989e12 * MATMUL_EFFICIENCY, 3350 * GB * STREAM_EFFICIENCY,
                          450 * GB * LINK_EFFICIENCY, 50 * GB * LINK_EFFICIENCY,
                          source="NVIDIA H100 datasheet (SXM5)"),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 900
    # GB/s total; one 400 Gb/s NIC per GPU as for H100.
    "H200": DeviceProfile("H200", 141 * GB, 989e12 * MATMUL_EFFICIENCY, 4800 * GB * STREAM_EFFICIENCY,
                          450 * GB * LINK_EFFICIENCY, 50 * GB * LINK_EFFICIENCY,
                          source="NVIDIA H200 datasheet (SXM)"),
}


def load_profile(spec: str) -> DeviceProfile:
    """A built-in profile by name, or a YAML file written by ``measure`` (or by hand); a file
    that is not YAML, not a mapping, or has a key of the wrong type or range is one line
    naming the file and the key."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--profile {spec!r} is neither a built-in profile ({', '.join(BUILTIN)}) nor a "
                         "file; write one with `minihf plan --measure --profile-out FILE`")
    from minihf.config import ConfigError, from_dict
    from minihf.utils.yaml_load import load_yaml_file

    fix = "fix it, or write a new one with `minihf plan --measure --profile-out FILE`"
    data = load_yaml_file(path, "profile")  # YAMLInputError (a ValueError) names the file
    if not isinstance(data, dict):
        got = "it is empty" if data is None else f"got {type(data).__name__} {data!r:.40}"
        raise ValueError(f"profile {path} must be a mapping of keys (name, memory_bytes, flops, ...), {got}; "
                         f"{fix}")
    try:  # every key type-checked: a wrong one is named, with the type it needs
        return from_dict(DeviceProfile, data, "")
    except ConfigError as exc:  # a range check's message names the profile already
        raise ValueError(f"profile {path}: {str(exc).removeprefix('DeviceProfile: ')}; {fix}") from None


def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(dataclasses.asdict(profile), sort_keys=False))
    return path


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_compute(size: int = 1024, repeats: int = 5, linear: tuple[int, int, int] | None = None
                    ) -> tuple[float, float]:
    """This process's fp32 matmul FLOP/s and its memory bandwidth (a 256 MB copy: bytes read
    + written per second). The matmul is ``size``-square, or with ``linear = (tokens, in,
    out)`` minihf's linear at the job's own shape (small layers run far below the square
    peak); the fastest of ``repeats``."""
    import torch

    from minihf.models.linear import linear as minihf_linear

    if linear is None:
        a, b = torch.randn(size, size), torch.randn(size, size)
        flops = 2 * size ** 3 / _best_seconds(lambda: torch.mm(a, b), repeats)
    else:
        tokens, n_in, n_out = linear
        x, w = torch.randn(tokens, n_in), torch.randn(n_out, n_in)
        flops = 2 * tokens * n_in * n_out / _best_seconds(lambda: minihf_linear(x, w), repeats)
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), repeats)
    return flops, bandwidth


def _allgather_rank(rank, world, nbytes, repeats):
    import statistics

    import torch
    import torch.distributed as dist

    shard = torch.ones(nbytes // 4 // world)
    out = [torch.empty_like(shard) for _ in range(world)]
    seconds = _best_seconds(lambda: dist.all_gather(out, shard), repeats)
    tiny, tiny_out = torch.ones(1), [torch.empty(1) for _ in range(world)]
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        dist.all_gather(tiny_out, tiny)
        times.append(time.perf_counter() - t0)
    # bytes this rank received per second, and the cost of a call with (almost) no bytes
    return (world - 1) * shard.numel() * 4 / seconds, statistics.median(times)


def measure_collective(world: int = 2, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, float]:
    """(bytes/s one rank receives in an all-gather of ``nbytes``, seconds of a 4-byte
    all-gather) over ``world`` local processes, with the backend a job here would use (gloo
    on CPU)."""
    from minihf.testing import spawn_ranks

    results = spawn_ranks(_allgather_rank, world, nbytes, repeats, timeout_s=300)
    return min(r[0] for r in results), max(r[1] for r in results)


def measure(name: str = "this-machine", world: int = 2, linear: tuple[int, int, int] | None = None) -> DeviceProfile:
    """A profile of this machine with ``world`` ranks sharing it: matmul FLOP/s (at the
    job's own linear shape when ``linear`` is given, see ``measure_compute``) and copy
    bandwidth measured with each rank's share of the cores (``cores / world`` threads, one
    process measuring at a time, so a bandwidth the ranks would share is counted in full;
    the cost model slows a phase down when its busy ranks want more threads than the host
    has cores: ``host_cores``),
    memory divided by ``world``, and the local all-gather bandwidth and latency for both
    link kinds."""
    import os

    import torch

    from minihf.utils.threads import usable_cores

    cores = usable_cores().usable  # what controller.threads=auto shares out (affinity, cgroup quota)
    threads = max(1, cores // world)
    torch.set_num_threads(threads)
    flops, bandwidth = measure_compute(linear=linear)
    link, latency = measure_collective(world)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    shape = f", matmuls at {linear[0]} x {linear[1]} -> {linear[2]}" if linear else ""
    return DeviceProfile(name, memory, flops, bandwidth, link, link, devices_per_node=world, bytes_per_param=4,
                         collective_latency=latency, comm_overlaps_compute=False, host_cores=cores,
                         threads_per_rank=threads,
                         source=f"measured by `minihf plan --measure` with {world} ranks x {threads} threads{shape}")
