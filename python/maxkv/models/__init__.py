"""Models that run on maxkv: a Llama-style decoder for the multistep demo."""

from .llama import (
    LlamaConfig,
    LlamaModel,
    ModelLoadError,
    default_llama,
    load_llama,
)

__all__ = ["LlamaConfig", "LlamaModel", "ModelLoadError", "default_llama", "load_llama"]
