"""minihf.rollout: the generation engine (KV cache, continuous batching, sampling, TP).

``LLM(model_dir).generate(prompt_ids, SamplingParams(max_tokens=..., temperature=...))``
is the offline API (vLLM's names). ``scheduler`` holds the torch-free batching decisions,
``engine`` executes them, ``sampling`` draws tokens, ``kv_cache`` holds the slot cache.
"""

from .engine import Engine
from .llm import LLM, CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "RequestOutput", "Engine"]
