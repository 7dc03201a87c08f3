"""minihf.rollout: the generation engine (KV cache, continuous batching, sampling, TP).

``LLM(model_dir).generate(prompt_ids, SamplingParams(max_tokens=..., temperature=...))``
is the offline API (vLLM's names). ``scheduler`` holds the torch-free batching decisions,
``model_runner`` alone runs the model (its weights, the slot cache in ``kv_cache``, the
forwards), ``engine`` loops over the two, ``sampling`` draws tokens.
"""

from .engine import Engine
from .llm import LLM, CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "RequestOutput", "Engine"]
