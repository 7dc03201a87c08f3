"""Driver state as JSON that comes back exactly as it was saved.

A checkpoint's ``driver_state.json`` holds what the driver keeps across steps (the data
position, the KL controller, plug-ins' ``state_dict()``). Plain JSON turns int dict keys
into strings and tuples into lists, so a resumed run's state would differ from the
uninterrupted run's without a word. :func:`dumps` writes the values JSON has no type for
as one-key objects whose key starts with ``$``, and :func:`loads` turns them back:

    tuple                           {"$tuple": [items]}
    dict with a key other than a    {"$dict": [[key, value], ...]}
      str not starting with "$"       (keys: None, bool, int, float, str, tuples of them)
    float nan, inf, -inf            {"$float": "nan"}   (the file stays strict JSON)
    torch.Tensor                    {"$tensor": {"dtype", "shape", "data": base64 of its bytes}}
    NumPy array, NumPy scalar       {"$ndarray": {...}}, {"$npscalar": {...}}

None, bool, int, str, finite floats (Python writes the shortest repr that reads back to
the same float), lists and dicts with str keys are written as themselves, so a state
without the types above reads as before. Tensors (a Parameter too) come back as plain CPU
tensors of the same dtype, shape and bytes; anything else (sets, dataclasses, enum members,
objects, object or structured arrays, sparse or quantized tensors) is refused by
:class:`StateError` naming its path (``state['seen'][0] is a set``).

Chosen over a pickle: loading runs no code from the file (a checkpoint may come from a
stranger, ``minihf.utils.safe_load``). The file marks itself with ``"$encoding"``; one
without it (written before this encoding) is read as the plain JSON it is.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

from minihf.utils.files import CorruptFileError

ENCODING_KEY, ENCODING = "$encoding", "minihf/1"
SUPPORTED = ("None, bool, int, float, str, lists, tuples, dicts (keys: None, bool, int, float, str or "
             "tuples of them), torch tensors and NumPy arrays")
_TORCH_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
    "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)}


class StateError(ValueError):
    """Driver state that cannot be saved in, or restored from, a checkpoint."""


def _refuse(path: str, what: str) -> StateError:
    return StateError(f"{path} is {what}, which a checkpoint cannot hold; state may hold only {SUPPORTED}")


def _type(obj) -> str:
    t = type(obj)
    name = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _encode_tensor(t: torch.Tensor, path: str) -> dict:
    if t.layout != torch.strided or t.is_quantized or str(t.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
        raise _refuse(path, f"a torch.Tensor of layout {t.layout} and dtype {t.dtype}")
    if t.device.type == "meta":
        raise _refuse(path, "a tensor on the meta device (it has no values)")
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"$tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "data": _bytes(data)}}


def _encode_array(a: np.ndarray, path: str, tag: str) -> dict:
    if a.dtype.hasobject or a.dtype.kind == "V":
        raise _refuse(path, f"a NumPy array of dtype {a.dtype} (Python objects or fields)")
    return {tag: {"dtype": a.dtype.str, "shape": list(a.shape), "data": _bytes(a.tobytes())}}  # C order


def _encode_key(key, path: str):
    if key is None or type(key) in (bool, int, float, str):
        return encode(key, path)
    if type(key) is tuple:
        return {"$tuple": [_encode_key(k, f"{path}[{i}]") for i, k in enumerate(key)]}
    raise _refuse(f"{path} (a dict key)", _type(key))


def encode(obj, path: str = "state") -> Any:
    """``obj`` as JSON values (the table in the module docstring); ``StateError`` naming
    ``path`` and the offending part's path (``state['a'][0]``) and type otherwise."""
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is float:
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if type(obj) is list:
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return {"$tuple": [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):  # an OrderedDict (a module's state_dict) comes back a dict
        if all(type(k) is str and not k.startswith("$") for k in obj):
            return {k: encode(v, f"{path}[{k!r}]") for k, v in obj.items()}
        return {"$dict": [[_encode_key(k, f"{path}[{k!r}]"), encode(v, f"{path}[{k!r}]")]
                          for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, path)
    if isinstance(obj, np.ndarray):
        return _encode_array(obj, path, "$ndarray")
    if isinstance(obj, np.generic):
        return _encode_array(np.asarray(obj), path, "$npscalar")
    base = next((b for b in (int, float, str, list, tuple) if isinstance(obj, b)), None)
    if base is not None:  # an enum member, a namedtuple, ...: it would come back as its base
        raise _refuse(path, f"{_type(obj)} (a subclass of {base.__name__}; convert it to one)")
    raise _refuse(path, _type(obj))


class _Bad(Exception):
    """A tagged value this module did not write (the file was edited or damaged)."""


def _raw(spec, path: str) -> bytes:
    if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and isinstance(spec.get("data"), str)
            and isinstance(spec.get("shape"), list) and all(type(n) is int and n >= 0 for n in spec["shape"])):
        raise _Bad(f"{path}: needs dtype, shape and data")
    try:
        return base64.b64decode(spec["data"], validate=True)
    except ValueError:
        raise _Bad(f"{path}: data is not base64") from None


def _decode_tensor(spec, path: str) -> torch.Tensor:
    raw = _raw(spec, path)
    dtype, shape = _TORCH_DTYPES.get(spec["dtype"]), spec["shape"]
    if dtype is None:
        raise _Bad(f"{path}: unknown tensor dtype {spec['dtype']!r}")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise _Bad(f"{path}: {len(raw)} bytes for shape {shape} of {dtype}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(dtype).reshape(shape)


def _decode_array(spec, path: str, scalar: bool):
    raw = _raw(spec, path)
    try:
        dtype = np.dtype(spec["dtype"])
    except Exception:  # TypeError, ValueError, SyntaxError for a string NumPy does not parse
        raise _Bad(f"{path}: unknown NumPy dtype {spec['dtype']!r}") from None
    if dtype.hasobject or dtype.kind == "V" or len(raw) != math.prod(spec["shape"]) * dtype.itemsize:
        raise _Bad(f"{path}: dtype {dtype} and shape {spec['shape']} do not fit {len(raw)} bytes")
    a = np.frombuffer(raw, dtype=dtype).copy().reshape(spec["shape"])
    return a[()] if scalar else a


def _decode(obj, path: str):
    if isinstance(obj, list):
        return [_decode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    tags = [k for k in obj if k.startswith("$")]
    if not tags:
        return {k: _decode(v, f"{path}[{k!r}]") for k, v in obj.items()}
    if len(obj) != 1:
        raise _Bad(f"{path}: {tags[0]!r} among other keys")
    (tag, value), = obj.items()
    if tag == "$tuple" and isinstance(value, list):
        return tuple(_decode(v, f"{path}[{i}]") for i, v in enumerate(value))
    if tag == "$dict" and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        out = {}
        for k, v in value:
            key = _decode(k, f"{path} key")
            try:
                out[key] = _decode(v, f"{path}[{key!r}]")
            except TypeError:
                raise _Bad(f"{path}: a key of type {type(key).__name__}") from None
        return out
    if tag == "$float" and value in ("nan", "inf", "-inf"):
        return float(value)
    if tag == "$tensor":
        return _decode_tensor(value, path)
    if tag in ("$ndarray", "$npscalar"):
        return _decode_array(value, path, tag == "$npscalar")
    raise _Bad(f"{path}: {tag!r} with a value that does not fit it")


def dumps(state: dict, path: str = "state") -> str:
    """The JSON text of a driver state (a dict of str keys); errors name ``path``."""
    return json.dumps({**encode(dict(state), path), ENCODING_KEY: ENCODING}, allow_nan=False)


def loads(raw: dict, source, fix: str) -> dict:
    """The driver state from the parsed JSON of ``source`` (a file: named in errors, with
    ``fix``); a file without ``"$encoding"`` is plain JSON, returned as it is."""
    if not isinstance(raw, dict):
        raise CorruptFileError(f"{source} holds {type(raw).__name__}, not a driver state; {fix}")
    if ENCODING_KEY not in raw:
        return raw
    raw = dict(raw)
    encoding = raw.pop(ENCODING_KEY)
    if encoding != ENCODING:
        raise CorruptFileError(f"{source} is in encoding {encoding!r}, not {ENCODING!r} "
                               f"(written by a newer minihf?); {fix}")
    try:
        return _decode(raw, "state")
    except _Bad as e:
        raise CorruptFileError(f"{source} is damaged or was edited: {e}; {fix}") from None
