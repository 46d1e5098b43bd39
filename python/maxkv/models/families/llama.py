"""Llama (1, 2, 3.x; SmolLM2): the shared blocks' defaults.

RMSNorm, SwiGLU, one RoPE with any of maxkv's scalings (Llama 3.1-3.3's
``llama3``, ``linear``, ``dynamic``, ``yarn``); ``attention_bias`` puts a bias
on the Q, K, V and output projections.
"""

from typing import Any

from ..config import DecoderConfig
from ..family import (
    GGUF_ATTENTION_BIASES,
    LLAMA_GGUF_TENSORS,
    Family,
    GGUFLayout,
    decoder_config,
    layer_windows,
)


def read(hf: Any) -> DecoderConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return decoder_config(
        hf, "llama", qkv_bias=bias, o_bias=bias, layer_windows=layer_windows(hf, "llama")
    )


FAMILY = Family(
    "llama",
    ("LlamaForCausalLM",),
    read,
    GGUFLayout("llama", "llama", {**LLAMA_GGUF_TENSORS, **GGUF_ATTENTION_BIASES}, permuted_qk=True),
)
