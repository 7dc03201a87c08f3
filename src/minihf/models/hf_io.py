"""Read and write Hugging Face checkpoint directories.

A checkpoint dir holds ``config.json`` plus ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. State-dict keys are HF's own (the modules mirror HF's
names); the only renames are the critic head (minihf ``value_head`` <-> HF
``*ForTokenClassification.score``). Tied embeddings are saved without ``lm_head.weight``,
as transformers does. A critic or reward model can start from a causal-LM checkpoint:
the backbone is loaded and the head freshly initialised (one warning says so).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from .args import ModelArgs
from .model import HEADS, build_model, materialize

from minihf.utils.files import MODEL_FIX, CorruptFileError, open_safetensors, read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# vLLM's names for ``LLM(dtype=...)`` and ``load_hf`` ("auto" is None: bf16 on CUDA, fp32 elsewhere)
DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device) -> torch.dtype:
    """A ``dtype`` as ``LLM`` and :func:`load_hf` take it (a torch dtype, one of
    :data:`DTYPE_NAMES`, or None / ``"auto"``) as a torch dtype for ``device``."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype={dtype!r} is neither a floating-point torch dtype nor the name of one; pass one of "
                     f"{['auto', *DTYPE_NAMES]} or a torch dtype such as torch.bfloat16")


def load_args(path: str | Path) -> ModelArgs:
    """ModelArgs from ``path/config.json``."""
    return ModelArgs.from_hf(path)


def load_hf(path: str | Path, dtype: torch.dtype | str = torch.float32,
            device: torch.device | str = "cpu", head: str = "lm") -> torch.nn.Module:
    """Load an HF checkpoint dir as a minihf model with ``head`` (lm|value|score).

    Built on the meta device, materialised on ``device`` and filled from the safetensors
    files, cast to ``dtype``. The shapes are checked against the checkpoint's before any
    memory is allocated, so a config.json that disagrees with its weights (say a vocab_size
    with an extra digit) is one line, not an allocation of the size it claims. ``dtype`` may
    also be one of :data:`DTYPE_NAMES` or ``"auto"`` (bf16 on CUDA, fp32 elsewhere); None is fp32."""
    dtype = torch.float32 if dtype is None else resolve_dtype(dtype, device)
    reader = CheckpointReader(path, head)
    model = build_model(reader.args, head, device="meta", dtype=dtype)
    reader.check({n: tuple(p.shape) for n, p in model.named_parameters()})  # dedups tied lm_head
    materialize(model, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(reader.read(name))
    return model


class CheckpointReader:
    """The tensors of an HF checkpoint dir by minihf parameter name, read lazily: whole, or
    one slice along one dim (``read(name, dim, start, end)``), so a sharded model reads only
    its rank's bytes (safetensors files are memory-mapped).

    Knows the renames (critic ``score`` <-> ``value_head``), tied embeddings (a tied
    ``lm_head.weight`` is never read) and a fresh head (a critic or reward model loaded
    from a causal-LM checkpoint: the backbone is read, the head drawn from
    N(0, initializer_range) with seed 0, biases 0, one warning). Call :meth:`check` with
    the model's parameter shapes before reading: it reports missing, unexpected and
    mis-shaped tensors in one error.
    """

    def __init__(self, path: str | Path, head: str = "lm"):
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")
        self.path, self.head = Path(path), head
        self.args = args = load_args(self.path)
        if head == "lm" and args.head != "lm":
            raise ValueError(f"{self.path} holds a {args.hf_config['architectures'][0]} (no LM "
                             "head); load it with head='value' or head='score', or pass a "
                             "causal-LM checkpoint")
        if args.sliding_window is not None and args.sliding_window < args.max_position_embeddings:
            warnings.warn(f"{self.path}: sliding-window attention (window {args.sliding_window}) "
                          "is not implemented; minihf attends over the full context, which "
                          f"matches transformers only for sequences up to {args.sliding_window} "
                          "tokens.")
        self._files = {}  # minihf name -> (file, checkpoint key)
        for f, keys in _checkpoint_keys(self.path).items():
            for key in keys:
                name = self._rename(key)
                if name is not None:
                    self._files[name] = (f, key)
        if args.tie_word_embeddings:
            self._files.pop("lm_head.weight", None)  # a tied copy; the embedding rules
        self._fresh: dict[str, torch.Tensor] = {}
        self._handles: dict[str, object] = {}

    def _rename(self, key: str) -> str | None:
        if _IGNORED.match(key):
            return None
        if self.args.head != self.head:  # the checkpoint's head is dropped; a new one is drawn
            return key if key.startswith("model.") else None
        if self.head == "value" and key.startswith("score."):
            return "value_head" + key[len("score"):]
        return key

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise ValueError unless the checkpoint holds exactly ``expected`` (name -> full
        shape, tied weights once); draws the fresh head's values."""
        fresh = {n: s for n, s in expected.items() if self.args.head != self.head
                 and not n.startswith("model.")}
        wanted = {n: s for n, s in expected.items() if n not in fresh}
        missing = sorted(set(wanted) - set(self._files))
        unexpected = sorted(set(self._files) - set(wanted))
        if missing or unexpected:
            raise ValueError(f"checkpoint {self.path} does not match the {self.args.arch} "
                             f"{self.head} model: missing {missing[:8]}"
                             f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                             f"{'...' if len(unexpected) > 8 else ''}")
        for name, shape in wanted.items():
            found = tuple(self._slice(name).get_shape())
            if found != tuple(shape):
                raise ValueError(f"{self.path}: {name} has shape {found}, the config implies "
                                 f"{tuple(shape)}; config.json and weights disagree")
        gen = torch.Generator().manual_seed(0)
        for name, shape in fresh.items():
            init = torch.randn(shape, generator=gen) * self.args.initializer_range
            self._fresh[name] = torch.zeros(shape) if name.endswith(".bias") else init
        if fresh:
            warnings.warn(f"{self.path} is a {self.args.head} checkpoint: loaded its backbone "
                          f"into a {self.head} model and initialised the new head "
                          f"{sorted(fresh)} randomly (normal, std={self.args.initializer_range}).")

    def _slice(self, name: str):
        f, key = self._files[name]
        if f not in self._handles:
            self._handles[f] = open_safetensors(self.path / f, MODEL_FIX)
        return self._handles[f].get_slice(key)

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (on CPU, the file's dtype), whole or ``[start:end]`` along ``dim``."""
        if name in self._fresh:
            full = self._fresh[name]
            return full if dim is None else full.narrow(dim, start, (end or full.shape[dim]) - start)
        if dim is None:
            return self._slice(name)[:]
        index = (slice(None),) * dim + (slice(start, end),)
        return self._slice(name)[index]


def _checkpoint_keys(path: Path) -> dict[str, list[str]]:
    """File name -> tensor keys of a checkpoint dir (single file or sharded with an index)."""
    if (path / INDEX).exists():
        weight_map = read_json(path / INDEX, MODEL_FIX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CorruptFileError(f"{path / INDEX} has no 'weight_map' object; {MODEL_FIX}")
        files: dict[str, list[str]] = {}
        for key, f in weight_map.items():
            files.setdefault(f, []).append(key)
        return files
    if (path / SINGLE).exists():
        with open_safetensors(path / SINGLE, MODEL_FIX) as fh:
            return {SINGLE: list(fh.keys())}
    found = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    hint = f"found {found[0]}, a PyTorch pickle; " if found else ""
    raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {path}: {hint}minihf reads safetensors "
                            "checkpoints only (convert .bin files with transformers: "
                            "from_pretrained(dir).save_pretrained(out) writes safetensors)")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir (single file or sharded with an index), on CPU."""
    path = Path(path)
    state = {}
    for f, keys in _checkpoint_keys(path).items():
        with open_safetensors(path / f, MODEL_FIX) as fh:
            for k in keys:
                if not _IGNORED.match(k):
                    state[k] = fh.get_tensor(k)
    return state


def save_hf(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "5GB",
            state_dict: dict | None = None) -> Path:
    """Write ``model`` as an HF checkpoint dir that transformers' ``from_pretrained`` loads.

    ``state_dict`` overrides ``model.state_dict()`` (e.g. a full state dict gathered from
    FSDP shards by the caller). Shards above ``max_shard_size`` (bytes or "500MB"/"5GB")
    are split with an index. Previous ``model*.safetensors`` files in ``path`` are removed
    so a re-save never mixes old and new shards."""
    if not isinstance(getattr(model, "args", None), ModelArgs):
        raise TypeError(f"save_hf writes a minihf model (minihf.models.load_hf / build_model), got "
                        f"{type(model).__name__}; a transformers model saves itself (save_pretrained)")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file; save_hf writes a checkpoint dir: pass a dir path")
    path.mkdir(parents=True, exist_ok=True)
    args: ModelArgs = model.args
    head = model.head
    state = model.state_dict() if state_dict is None else state_dict
    tensors = {}
    for k, v in state.items():
        if args.tie_word_embeddings and k == "lm_head.weight":
            continue
        if k.startswith("value_head."):
            k = "score." + k[len("value_head."):]
        tensors[k] = v.detach().to("cpu").contiguous().clone()
    dtype = next(iter(tensors.values())).dtype
    config = args.to_hf_config(head, dtype=str(dtype).removeprefix("torch."))
    for old in list(path.glob("model*.safetensors")) + [path / INDEX]:
        old.unlink(missing_ok=True)
    shards = _shard(tensors, _parse_size(max_shard_size))
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata=meta)
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def _shard(tensors: dict, limit: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > limit:
            shards.append(current)
            current, size = {}, 0
        current[k] = t
        size += n
    shards.append(current)
    return shards


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; use bytes or e.g. '500MB', '5GB'")
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(m.group(1)) * units[m.group(2) or "B"])
