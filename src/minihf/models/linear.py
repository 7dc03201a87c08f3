"""The linear layer: ``F.linear``, except fp32 on a CPU whose MKL lacks an AVX-512 path.

torch's fp32 CPU matmul is MKL's sgemm. On AMD CPUs, MKL runs its generic AVX2 kernels
even where the CPU has AVX-512 (the profile shows ``mkl_blas_def_sgemm_kernel_0_zen``);
oneDNN, also inside torch, JIT-compiles AVX-512 kernels there. Measured on a 2-core AMD
EPYC (Zen 4) at 2 threads, the same moment, fp32:

* 4092-4096 rows (a packed training micro-batch) through the 5M benchmark model's shapes
  (256x832, 832x256, 256x256): forward 1.1-1.65x faster, the input gradient 1.15-1.8x; a
  square 2048 matmul 139 -> 207 GFLOP/s;
* a decode step's linears (16-128 rows, 6 layers, column-major weights): 1.2-1.4x;
* the weight gradient ``grad_out.T @ x``: 0.7x (both operands transposed views, which
  oneDNN copies first), so it stays on MKL. On a Zen 5 EPYC (full-width AVX-512: a
  square 2048 matmul 187 -> 393 GFLOP/s) the same matmul alone is 1.1-2.2x faster by
  oneDNN, but a GRPO step's update_actor was slower with it (5M model, 64 forced tokens,
  3 alternating rounds: 1.75-2.04 s with MKL, 2.10-2.22 s with oneDNN);
* one GRPO step (5M model, 16 prompts x 8, oneDNN and MKL on alternating steps of one
  run, medians of 4-5 pairs): 1.07x and 1.16x with 64 forced tokens (ref 1.17-1.24x, gen
  1.08-1.18x, update_actor 1.07-1.15x), 1.04x with EOS (lengths differ between steps);
  on the Zen 5 EPYC (separate runs, 3 alternating rounds): 1.15x, 1.26x, 1.19x with 64
  forced tokens (ref 1.4-1.5x, update_actor 1.2-1.3x);
* the main job (0.9M model, 2 ranks x 1 thread, on the Zen 5 EPYC, 16 RL steps, 3
  alternating rounds, median seconds in steps): 26.3 with MKL, 30.3 with every linear on
  oneDNN (0.87x: gen 1.5x slower, its decode matmuls being small), 26.4 with the size
  threshold below (1.0x).

So :func:`linear` sends fp32 CPU matmuls of at least :data:`MIN_MACS_PER_THREAD`
multiply-adds per thread to oneDNN (``torch.ops.mkldnn._linear_pointwise``, the op
inductor's CPU backend uses) when :func:`onednn_preferred` says so: an x86 AMD CPU with
AVX-512 and a torch built with oneDNN. Intel CPUs keep MKL (its own AVX-512 path;
not measured here), as do other dtypes, devices and DTensor weights. Results are fp32
throughout (no reduced-precision mode); they differ from MKL's in summation order only.
"""

from __future__ import annotations

import functools
import platform
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


# Below about 2M multiply-adds per thread oneDNN's per-call cost outweighs its faster
# kernel: measured on the Zen 5 EPYC at 1 and 2 threads over the mini/5M/30M models'
# shapes (8-512 rows), oneDNN's speed-up over MKL is 0.2-0.9x below it and 0.94-1.4x from
# 2M to 4M per thread, with or without the backward. So MKL takes the small calls (e.g.
# the mini model's decode).
MIN_MACS_PER_THREAD = 1 << 21


def onednn_preferred(vendor: str, flags: set[str], machine: str, has_onednn: bool) -> bool:
    """Whether fp32 CPU linears should go through oneDNN: on x86 AMD CPUs with AVX-512
    (where MKL runs AVX2 kernels) in a torch built with oneDNN."""
    return (has_onednn and machine in ("x86_64", "AMD64") and vendor == "AuthenticAMD"
            and "avx512f" in flags)


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's ``key: value`` fields of ``/proc/cpuinfo`` (or of the text
    ``cpuinfo``); empty where that file does not exist."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # a blank line ends the first processor's block
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def use_onednn() -> bool:
    """:func:`onednn_preferred` for this machine (the CPU as ``/proc/cpuinfo`` names it;
    False where that file does not exist)."""
    cpu = cpu_fields()
    return onednn_preferred(cpu.get("vendor_id", ""), set(cpu.get("flags", "").split()),
                            platform.machine(), torch.backends.mkldnn.is_available())


def _onednn_mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` by oneDNN: a [M, K], b [N, K] (any strides) -> [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ W.T + b with oneDNN for y and dL/dx, MKL for dL/dW (see the module
    docstring). x is 2-D [N, in] here; :func:`linear` flattens."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_mm_t(x, weight, bias)  # [N, out]

    @staticmethod
    def backward(ctx, grad):  # grad [N, out]
        x, weight = ctx.saved_tensors
        gx = _onednn_mm_t(grad, weight.t()) if ctx.needs_input_grad[0] else None  # [N, in]
        gw = torch.mm(grad.t(), x) if ctx.needs_input_grad[1] else None  # [out, in]
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by oneDNN for fp32 on CPUs where it is faster and
    the matmul is large enough to repay oneDNN's per-call cost (:data:`MIN_MACS_PER_THREAD`),
    or with the weight's prepacked copy inside a :class:`PackedWeights` context. Inside a
    ``torch.compile`` region (``use_torch_compile``) the compiler chooses the kernel."""
    if _active is not None and not torch.is_grad_enabled():
        packed = _active.get(weight, x.numel() // x.shape[-1])
        if packed is not None:
            kind, w_packed = packed
            x2 = x.reshape(-1, x.shape[-1])
            y = _mkl_mm_t(x2, w_packed, weight, bias) if kind == MKL else _onednn_mm_t(x2, w_packed, bias)
            return y.view(*x.shape[:-1], weight.shape[0])
    if not (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and type(weight) in (torch.Tensor, nn.Parameter) and not torch.compiler.is_compiling()
            and use_onednn()
            and x.numel() * weight.shape[0] >= MIN_MACS_PER_THREAD * torch.get_num_threads()):
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [N, in]
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    y = _OneDNNLinear.apply(x2, weight, bias) if grad else _onednn_mm_t(x2, weight, bias)
    if x.dim() == 2:
        return y
    # not .view: a view output would make FSDP2 warn (and an in-place op on it skip its hook)
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# -- decode weights prepacked (the engine's CPU fast path) ---------------------------------
#
# A decode step multiplies a few rows by every weight; MKL's sgemm streams a large weight
# poorly at 4-64 rows. On AMD CPUs oneDNN with the weight reordered ahead into its blocked
# layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) is
# much faster there. Measured on a 2-core AMD EPYC (Zen 2, AVX2), 2 threads, the same run,
# MKL (column-major) / prepacked microseconds: SmolLM2's LM head [49152, 576] 70845 /
# 19500 at 16 rows and 59461 / 9935 at 4 rows, its MLP [1536, 576] 1473 / 1001 at 16 rows;
# the whole step's matmuls at 16 rows 254 -> 121 ms; at 2 rows [1536, 576] 315 / 157 us.
# Small weights lose (oneDNN's per-call cost: the main job's [448, 128] at 16 rows 69 / 98
# us) and so does a single row (MKL's matrix-vector kernel: [1536, 576] 122 / 144 us)
# except through a very large weight (the LM head: 9130 / 7406 us; 14503 us tied, i.e.
# row-major), hence the thresholds. The layout is chosen for PACK_ROWS rows and serves any
# row count (measured 8-64 rows within noise of a layout chosen for that count).
#
# On Intel CPUs oneDNN's packed layer weights tie MKL's own AVX-512 kernels, but MKL's packed
# sgemm (``cblas_sgemm_pack``/``_compute``, torch's ``mkl::_mkl_linear``, inductor's other CPU
# freezing op) streams them faster. Measured on a 2-core Intel Xeon (AMX), 2 threads, the
# whole step's matmuls of SmolLM2 (210 layer weights, 540 MB with the LM head: not
# cache-resident), alternated, median ms at 1 / 2 / 4 / 8 / 16 / 32 / 64 rows: column-major
# MKL 21.6 / 25.7 / 33.6 / 45.2 / 46.6 / 58.0 / 100.0; everything oneDNN-packed 26.7 / 28.5 /
# 31.2 / 36.7 / 43.9 / 61.0 / 101.7; everything MKL-packed 20.9 / 22.4 / 27.1 / 33.2 / 38.7 /
# 60.8 / 103.3; layers MKL-packed and the LM head oneDNN-packed 21.1 / 22.4 / 26.4 / 32.7 /
# 38.5 / 55.0 / 88.1, the best or within noise of it at every count, so Intel CPUs pack so
# (the head's MKL-packed copy loses at 32-64 rows: 14.0 and 27.7 ms against 9.8 and 15.8). By
# role, not size: a 1B model's MLP weights are as large as SmolLM2's head.
# Tiny weights lose on MKL's packed path too (the main job's [448, 128]: 0.86-0.97x), hence
# MKL_PACK_MIN_NUMEL. MKL documents a packed B for the row count it was packed with; this
# build's layout serves any count (``_mkl_linear`` is told the call's rows), checked once per
# process (:func:`mkl_pack_serves_any_rows`) and for 1-40 rows in tests/test_prepack.py.
PACK_MIN_NUMEL = 1 << 19
MKL_PACK_MIN_NUMEL = 1 << 16
PACK_MIN_ROWS = 2
PACK_ONE_ROW_NUMEL = 1 << 23
PACK_ROWS = 16
ONEDNN, MKL = "onednn", "mkl"

_active: PackedWeights | None = None  # the table `linear` reads, while one is entered


def pack_kind(vendor: str, numel: int, has_onednn: bool, has_mkl: bool, head: bool = False) -> str | None:
    """Which packed copy (:data:`ONEDNN`, :data:`MKL` or none) the decode gives an fp32 weight
    of ``numel`` elements (``head``: the model's LM head) on a CPU of ``vendor``. AMD: oneDNN's
    from :data:`PACK_MIN_NUMEL` (MKL runs generic kernels there: SmolLM2's decode step 1.59x
    faster at 16 rows on a Zen 2 EPYC). Intel: the LM head oneDNN's from PACK_MIN_NUMEL, every
    other weight MKL's from :data:`MKL_PACK_MIN_NUMEL` (the comment above). Other CPUs: none,
    never measured. Decided by the CPU's name, not by timing kernels at start-up: a timed
    choice could differ between the processes of a job, or between a run and its resume, and
    with it the rounding of every log-prob (resume is bitwise)."""
    if vendor == "AuthenticAMD" or (vendor == "GenuineIntel" and head):
        return ONEDNN if has_onednn and numel >= PACK_MIN_NUMEL else None
    if vendor == "GenuineIntel":
        return MKL if has_mkl and numel >= MKL_PACK_MIN_NUMEL else None
    return None


def mkl_pack_serves_any_rows(mm) -> bool:
    """Whether ``mm(x, pack, weight, rows)`` (MKL's packed sgemm) gives ``x @ weight.T`` from
    one pack made for :data:`PACK_ROWS` rows at other row counts too. MKL documents a pack for
    the row count it was made for; the decode calls with each step's rows. Checked once per
    process on a small weight, each output within the fp32 rounding of a dot product of its
    length (``n u sum |x w|``, doubled); where it fails MKL's packed path is not used."""
    g = torch.Generator().manual_seed(0)
    n = 200
    w = torch.randn(96, n, generator=g)
    try:
        pack = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
        for rows in (1, 2, 3, 17, 33, 100):
            x = torch.randn(rows, n, generator=g)
            exact = x.double() @ w.double().T
            bound = 2 * n * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
            if not ((mm(x, pack, w, rows).double() - exact).abs() <= bound).all():
                return False
    except RuntimeError:
        return False
    return True


def _mkl_raw(x, pack, weight, rows):
    return torch.ops.mkl._mkl_linear(x, pack, weight, None, rows)


@functools.cache
def _backends() -> tuple[str, bool, bool]:
    """This machine's CPU vendor (``/proc/cpuinfo``) and whether torch has oneDNN and MKL's
    packed sgemm (serving any row count: :func:`mkl_pack_serves_any_rows`)."""
    vendor = cpu_fields().get("vendor_id", "")
    has_mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    if has_mkl and vendor == "GenuineIntel" and not mkl_pack_serves_any_rows(_mkl_raw):
        warnings.warn("MKL's packed sgemm in this torch gives wrong results at row counts other "
                      "than the one it packed for; the decode's weights stay unpacked on this CPU")
        has_mkl = False
    return vendor, torch.backends.mkldnn.is_available(), has_mkl


def weight_pack_kind(weight: torch.Tensor, head: bool = False) -> str | None:
    """:func:`pack_kind` of ``weight`` (``head``: the LM head's) on this machine: none unless
    a plain 2-D fp32 CPU tensor."""
    return _kind(weight, head) if isinstance(weight, torch.Tensor) and weight.device.type == "cpu" else None


def mkl_packed(weight: torch.Tensor, head: bool = False) -> bool:
    """Whether a decode on this machine packs ``weight`` for MKL once it is on the CPU (it may
    be on the meta device still: the engine lays weights out before they are allocated)."""
    return _kind(weight, head) == MKL


def _kind(weight: torch.Tensor, head: bool) -> str | None:
    if not (type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype == torch.float32
            and weight.dim() == 2):
        return None
    vendor, has_onednn, has_mkl = _backends()
    return pack_kind(vendor, weight.numel(), has_onednn, has_mkl, head=head)


def _pack(kind: str, weight: torch.Tensor) -> torch.Tensor:
    w = weight.contiguous()
    if kind == MKL:
        return torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def _mkl_mm_t(a: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ weight.T (+ bias)`` by MKL's packed sgemm: a [M, K] -> [M, N]."""
    return torch.ops.mkl._mkl_linear(a.contiguous(), packed, weight, bias, a.shape[0])


class PackedWeights:
    """Packed copies (oneDNN's or MKL's layout: :func:`pack_kind`) of a model's large fp32 CPU
    linear weights, for decode steps (every module's 2-D ``weight`` but embeddings': a tied LM
    head's is packed as the head's).

    :meth:`refresh` (re)packs each weight that is new or was written since it was packed
    (its storage or version counter moved: a weight load, a wake-up), so the copies never
    go stale; ``with packed:`` makes :func:`linear` use them for inputs of at least
    :data:`PACK_MIN_ROWS` rows, or of one row through a oneDNN-packed weight of at least
    :data:`PACK_ONE_ROW_NUMEL` elements. The copies cost the packed weights' bytes again
    while they are held; :meth:`clear` drops them. Only on CPUs where packing pays
    (:func:`pack_kind`); elsewhere nothing is packed and every call is F.linear's."""

    def __init__(self, model: nn.Module):
        self.model = model
        # id -> (w, ptr, version, kind, packed)
        self.table: dict[int, tuple[torch.Tensor, int, int, str, torch.Tensor]] = {}
        self.packs = 0  # weights packed so far (tests read it)

    def refresh(self) -> None:
        table = {}
        head = getattr(self.model, "lm_head", None)
        with torch.no_grad():
            for module in self.model.modules():
                w = getattr(module, "weight", None)
                kind = None if isinstance(module, nn.Embedding) else weight_pack_kind(w, module is head)
                if kind is None:
                    continue
                old = self.table.get(id(w))
                key = (w.data_ptr(), w._version, kind)
                if old is not None and old[0] is w and old[1:4] == key:
                    table[id(w)] = old
                else:
                    table[id(w)] = (w, *key, _pack(kind, w))
                    self.packs += 1
        self.table = table

    def clear(self) -> None:
        self.table = {}

    def get(self, weight: torch.Tensor, rows: int) -> tuple[str, torch.Tensor] | None:
        """``(kind, packed copy)`` for a call of ``rows`` rows through ``weight``, or None."""
        entry = self.table.get(id(weight))
        if entry is None or entry[0] is not weight or rows < 1:
            return None
        one_row = entry[3] == ONEDNN and weight.numel() >= PACK_ONE_ROW_NUMEL
        return entry[3:] if rows >= PACK_MIN_ROWS or one_row else None

    def __enter__(self) -> PackedWeights:
        global _active
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
