"""minihf.models: the Llama-family decoder (Llama, Qwen2, Qwen3, Mistral; the mixture-of-experts
Qwen3-MoE and Mixtral, ``moe.py``), its heads, the default KV cache and Hugging Face
checkpoint I/O. See model.py for the build order."""

from .args import ModelArgs
from .config_checks import SUPPORTED_ARCHITECTURES
from .hf_io import CheckpointReader, load_args, load_hf, read_safetensors, save_hf
from .kv_cache import KVCache
from .model import CausalLM, ScoreModel, ValueModel, build_model, init_weights, materialize

__all__ = [
    "CheckpointReader", "SUPPORTED_ARCHITECTURES", "ModelArgs", "load_args", "load_hf", "read_safetensors",
    "save_hf", "KVCache", "CausalLM", "ScoreModel", "ValueModel", "build_model",
    "init_weights", "materialize",
]
