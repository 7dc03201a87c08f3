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
from safetensors import safe_open
from safetensors.torch import save_file

from .args import ModelArgs
from .model import HEADS, build_model, materialize

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def load_args(path: str | Path) -> ModelArgs:
    """ModelArgs from ``path/config.json``."""
    return ModelArgs.from_hf(path)


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu", head: str = "lm") -> torch.nn.Module:
    """Load an HF checkpoint dir as a minihf model with ``head`` (lm|value|score).

    Built on the meta device, materialised on ``device`` and filled from the safetensors
    files, cast to ``dtype``."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")
    path = Path(path)
    args = load_args(path)
    if head == "lm" and args.head != "lm":
        raise ValueError(f"{path} holds a {args.hf_config['architectures'][0]} (no LM head); "
                         "load it with head='value' or head='score', or pass a causal-LM checkpoint")
    if args.sliding_window is not None and args.sliding_window < args.max_position_embeddings:
        warnings.warn(f"{path}: sliding-window attention (window {args.sliding_window}) is not "
                      "implemented; minihf attends over the full context, which matches "
                      f"transformers only for sequences up to {args.sliding_window} tokens.")
    model = materialize(build_model(args, head, device="meta", dtype=dtype), device)
    state = _rename_for_load(read_safetensors(path), args.head, head)
    fresh_head = args.head != head
    expected = {n: p for n, p in model.named_parameters()}  # dedups tied lm_head
    if fresh_head:
        head_params = {n: expected.pop(n) for n in list(expected) if not n.startswith("model.")}
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints carry a copy; the embedding rules
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the {args.arch} {head} model: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    with torch.no_grad():
        for name, p in expected.items():
            t = state[name]
            if t.shape != p.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, the config implies "
                                 f"{tuple(p.shape)}; config.json and weights disagree")
            p.copy_(t)
        if fresh_head:
            gen = torch.Generator().manual_seed(0)
            for name, p in head_params.items():
                init = torch.randn(p.shape, generator=gen) * args.initializer_range
                p.copy_(torch.zeros(p.shape) if name.endswith(".bias") else init)
    if fresh_head:
        warnings.warn(f"{path} is a {args.head} checkpoint: loaded its backbone into a {head} "
                      f"model and initialised the new head {sorted(head_params)} randomly "
                      f"(normal, std={args.initializer_range}).")
    return model


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir (single file or sharded with an index), on CPU."""
    path = Path(path)
    if (path / INDEX).exists():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE).exists():
        files = [SINGLE]
    else:
        found = sorted(p.name for p in path.glob("pytorch_model*.bin"))
        hint = f"found {found[0]}, a PyTorch pickle; " if found else ""
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {path}: {hint}minihf reads safetensors "
                                "checkpoints only (convert .bin files with transformers: "
                                "from_pretrained(dir).save_pretrained(out) writes safetensors)")
    state = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as fh:
            for k in fh.keys():
                if not _IGNORED.match(k):
                    state[k] = fh.get_tensor(k)
    return state


def _rename_for_load(state: dict, ckpt_head: str, head: str) -> dict:
    if ckpt_head != head:  # drop the checkpoint's head; the new one is initialised fresh
        return {k: v for k, v in state.items() if k.startswith("model.")}
    if head == "value":
        return {("value_head" + k[5:] if k.startswith("score.") else k): v for k, v in state.items()}
    return state


def save_hf(model: torch.nn.Module, path: str | Path, max_shard_size: int | str = "5GB",
            state_dict: dict | None = None) -> Path:
    """Write ``model`` as an HF checkpoint dir that transformers' ``from_pretrained`` loads.

    ``state_dict`` overrides ``model.state_dict()`` (e.g. a full state dict gathered from
    FSDP shards by the caller). Shards above ``max_shard_size`` (bytes or "500MB"/"5GB")
    are split with an index. Previous ``model*.safetensors`` files in ``path`` are removed
    so a re-save never mixes old and new shards."""
    path = Path(path)
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
