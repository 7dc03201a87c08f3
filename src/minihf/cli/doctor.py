"""Environment report for ``minihf doctor``: what the job will be able to use on this machine."""

from __future__ import annotations

import importlib.util
import os
import platform


def _version_of(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - e.g. flash-attn built for another torch/CUDA
        return f"installed but fails to import ({type(exc).__name__}: {exc})"
    return getattr(mod, "__version__", "installed")


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU as ``/proc/cpuinfo`` names it, with its x86 family and model (a cloud "AMD
    EPYC" may be Zen 4, family 25, with half-width AVX-512 units, or Zen 5, family 26, with
    full-width ones: twice the fp32 peak); ``platform``'s name where that file is missing."""
    from minihf.models.linear import cpu_fields

    fields = cpu_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def cpu_linears() -> str:
    """Which library runs minihf's fp32 linears on this CPU (``minihf.models.linear``)."""
    from minihf.models.linear import MIN_MACS_PER_THREAD, use_onednn

    if not use_onednn():
        return "MKL (torch.mm)"
    return f"oneDNN from {MIN_MACS_PER_THREAD / 2**20:g}M multiply-adds per thread, MKL below"


def threads_report(nproc_per_node: int = 1) -> dict[str, str]:
    """The cores this process may use, and the threads ``nproc_per_node`` ranks would run
    here under ``controller.threads=auto`` and with the environment's value (``inherit``),
    oversubscribed or not (``minihf.utils.threads``)."""
    import torch

    from minihf.utils.threads import plan, usable_cores

    cores = usable_cores()
    env = os.environ.get("OMP_NUM_THREADS")
    ranks = f"{nproc_per_node} rank{'s' if nproc_per_node > 1 else ''}"
    out = {"usable cores": f"{cores.usable} ({cores.why})"}
    # what a rank inherits with OMP_NUM_THREADS unset: this process's default alone, and with
    # several ranks the share minihf's launcher exports (torchrun exports 1)
    inherited = torch.get_num_threads()
    if env is None and nproc_per_node > 1:
        inherited = max(1, cores.usable // nproc_per_node)
        env = str(inherited)
    plans = {s: plan(s, cores, nproc_per_node, inherited, env) for s in ("auto", "inherit")}
    for setting, p in plans.items():
        verdict = (f"oversubscribed: {p.threads * nproc_per_node} threads on {cores.usable} cores"
                   if p.oversubscribed else "fits")
        out[f"threads per rank ({setting})"] = f"{p.threads} x {ranks}: {verdict}"
    if nproc_per_node > cores.usable:
        out["threads per rank (auto)"] += f"; start at most {cores.usable} ranks here"
    elif plans["inherit"].oversubscribed:
        out["threads per rank (inherit)"] += " (controller.threads=auto, the default, avoids it)"
    return out


def report(nproc_per_node: int = 1) -> dict[str, str]:
    """Key/value pairs describing torch, accelerators, distributed backends and threads
    (checked for ``nproc_per_node`` ranks on this host)."""
    import torch
    import torch.distributed as dist

    from minihf import __version__

    cuda = torch.cuda.is_available()
    info = {
        "minihf": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda available": str(cuda),
        "cuda version": str(torch.version.cuda),
        "gpu count": str(torch.cuda.device_count() if cuda else 0),
        "distributed": str(dist.is_available()),
        "gloo": str(dist.is_available() and dist.is_gloo_available()),
        "nccl": str(dist.is_available() and dist.is_nccl_available()),
        "flash-attn": _version_of("flash_attn"),
        "transformers": _version_of("transformers"),
        "safetensors": _version_of("safetensors"),
        "tokenizers": _version_of("tokenizers"),
        "wandb": _version_of("wandb"),
        "cpu": cpu_name(),
        "cpu fp32 linears": cpu_linears(),
        "cpu cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "torch interop threads": str(torch.get_num_interop_threads()),
        **threads_report(nproc_per_node),
    }
    if cuda:
        info["gpu 0"] = torch.cuda.get_device_name(0)
        info["bf16 supported"] = str(torch.cuda.is_bf16_supported())
    return info
