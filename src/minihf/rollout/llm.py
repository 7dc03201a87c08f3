"""``LLM``: the offline generation API, shaped like vLLM's so users already know it.

``LLM(model_dir_or_model).generate(prompts, SamplingParams(...))`` takes token-id prompts
and returns one :class:`RequestOutput` per prompt, in order, whose ``.outputs`` holds the
``n`` :class:`CompletionOutput` samples (``token_ids``, ``logprobs`` = log-prob of each
sampled token, ``finish_reason`` "stop" | "length"), as vLLM does. Only token ids go in and
out; tokenization is the caller's (see the ``minihf generate`` command).

With ``tp_group`` the model is sharded over that process group (``minihf.parallel.tp``);
every rank of the group must call ``generate`` with the same prompts and parameters, and
all get the same outputs (sampling is counter-based, so ranks draw identical tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine import Engine
from .sampling import SamplingParams

from minihf.models.hf_io import resolve_dtype
from minihf.utils.files import read_json


@dataclass
class CompletionOutput:
    """One sampled completion (vLLM's name). ``logprobs[i]`` is the log-prob of ``token_ids[i]``
    under the temperature-scaled full distribution (see ``minihf.rollout.sampling``)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cumulative_logprob: float = 0.0


@dataclass
class RequestOutput:
    """All completions of one prompt (vLLM's name)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


def eos_ids(hf_config: dict, generation_config: dict | None = None,
            where: tuple[str, str] = ("the model config", "the generation config")) -> tuple[int, ...]:
    """EOS ids from the generation config (preferred, as transformers does) or the model config.

    ``eos_token_id`` may be an int or a list in either; absent in both gives ``()``. Each id
    must be a whole number below the model config's ``vocab_size`` (an id the model cannot
    sample would never end a sequence): a ValueError naming the file (``where``: the model
    config's, the generation config's) and the key otherwise."""
    from minihf.models.config_checks import check_token_ids
    from minihf.utils.files import MODEL_FIX

    if not isinstance(hf_config, dict):
        raise ValueError(f"{where[0]} must be a JSON object of the model's settings, got "
                         f"{type(hf_config).__name__}; {MODEL_FIX}")
    vocab = hf_config.get("vocab_size")
    ids = check_token_ids(hf_config.get("eos_token_id"), "eos_token_id", where[0], vocab,
                          f"fix that value in config.json, or {MODEL_FIX}")
    if generation_config is not None:
        fix = ("fix that value in generation_config.json, or delete the file (eos ids then come from "
               "config.json)")
        if not isinstance(generation_config, dict):
            raise ValueError(f"{where[1]} must be a JSON object, got {type(generation_config).__name__}; {fix}")
        if "eos_token_id" in generation_config:
            ids = check_token_ids(generation_config["eos_token_id"], "eos_token_id", where[1], vocab, fix)
    return ids


def eos_ids_from_dir(path: Path, hf_config: dict) -> tuple[int, ...]:
    """:func:`eos_ids` with ``path/generation_config.json`` read when the dir has one."""
    gen = Path(path) / "generation_config.json"
    fix = "fix or delete generation_config.json (eos ids then come from config.json)"
    return eos_ids(hf_config, read_json(gen, fix) if gen.exists() else None,
                   where=(str(Path(path) / "config.json"), str(gen)))


class LLM:
    """Generate from a checkpoint dir (HF layout) or an in-memory minihf ``CausalLM``.

    ``dtype`` (a torch dtype or vLLM's names: ``"auto"``, ``"float32"``, ``"bfloat16"``,
    ``"float16"``, ...) and ``device`` default to bf16 on CUDA and fp32 on CPU; ``max_num_seqs`` caps the
    concurrently running sequences (KV-cache slots); ``max_model_len`` caps prompt +
    completion (default: the model's ``max_position_embeddings``); ``kv_cache_memory``
    (bytes) or ``gpu_memory_utilization`` (fraction of free CUDA memory) bound the cache.
    An in-memory model is used as is (not copied): ``apply_tp`` shards it in place.
    ``cpu_column_major`` (default: only for models this class loads itself) re-lays Linear
    weights out column-major on CPU for faster decoding (see ``model_runner.column_major_linears``);
    pass True for an in-memory model that only generates. ``enforce_eager`` and
    ``cudagraph_capture_sizes`` (vLLM's names) choose the decode step (``minihf.rollout.engine``);
    ``decode`` names it outright (``eager``, ``static``, ``graph``: tests and benchmarks).
    ``enable_chunked_prefill`` (vLLM's name) prefills a context longer than
    ``max_num_batched_tokens`` in pieces while the other sequences decode.
    """

    def __init__(self, model, tp_group=None, dtype: torch.dtype | str | None = None, device: str | None = None,
                 max_num_seqs: int = 256, max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float | None = None,
                 eos_token_ids: tuple[int, ...] | None = None, seed: int = 0, cpu_column_major: bool | None = None,
                 enforce_eager: bool = False, cudagraph_capture_sizes: list[int] | None = None,
                 decode: str | None = None, enable_chunked_prefill: bool = False):
        if device is None:
            if tp_group is not None and torch.cuda.is_available():
                device = f"cuda:{torch.cuda.current_device()}"
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(model, (str, Path)) and not (isinstance(model, torch.nn.Module) and hasattr(model, "args")):
            raise TypeError(f"LLM takes a checkpoint dir or a minihf model (minihf.models.load_hf(dir)), "
                            f"got {type(model).__name__}; for a transformers model, save it "
                            f"(save_pretrained) and pass its dir")
        explicit = dtype not in (None, "auto")
        dtype = resolve_dtype(dtype, device)
        if explicit and not isinstance(model, (str, Path)):
            have = next(model.parameters()).dtype
            if have != dtype:  # it was ignored: dtype applies to a model this class loads
                raise ValueError(f"dtype={dtype} but the model passed in is {have}; convert it first "
                                 f"(model.to({dtype})), or pass its checkpoint dir to load it in {dtype}")
        if isinstance(model, (str, Path)):
            from minihf.models import load_hf

            path = Path(model)  # load_hf says what is wrong with a dir that is not a model dir
            model = load_hf(path, dtype=dtype, device=device)
            default_eos = eos_ids_from_dir(path, model.args.hf_config)
            owned = True
        else:
            owned = False
            default_eos = eos_ids(getattr(model.args, "hf_config", None) or {})
        if tp_group is not None:
            from minihf.parallel.tp import apply_tp

            apply_tp(model, tp_group)
        self.engine = Engine(
            model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            eos_token_ids=default_eos if eos_token_ids is None else eos_token_ids, seed=seed,
            cpu_column_major=owned if cpu_column_major is None else cpu_column_major,
            enforce_eager=enforce_eager, cudagraph_capture_sizes=cudagraph_capture_sizes, decode=decode,
            enable_chunked_prefill=enable_chunked_prefill,
        )

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt (token-id lists), each with ``n`` completions."""
        if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
            raise TypeError("prompts must be a list of token-id lists; wrap a single prompt as [ids]")
        groups = self.engine.generate(prompts, sampling_params or SamplingParams())
        return [
            RequestOutput(
                request_id=i, prompt_token_ids=list(group[0].prompt),  # as the engine read it: ints
                outputs=[CompletionOutput(j, s.tokens, s.logprobs, s.finish_reason, float(sum(s.logprobs)))
                         for j, s in enumerate(group)],
            )
            for i, group in enumerate(groups)
        ]

    def free(self, weights: bool = True) -> None:
        """Release the KV cache and, unless ``weights=False``, the weights (e.g. before the
        colocated trainer runs)."""
        self.engine.free(weights)
