"""Qwen 3 (dense): a Llama with an RMSNorm over each head of Q and K before
RoPE; ``attention_bias`` biases every attention projection."""

from typing import Any

from ..config import DecoderConfig
from ..family import (
    GGUF_ATTENTION_BIASES,
    GGUF_QK_NORMS,
    LLAMA_GGUF_TENSORS,
    Family,
    GGUFLayout,
    decoder_config,
    layer_windows,
)


def read(hf: Any) -> DecoderConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return decoder_config(
        hf,
        "qwen3",
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        layer_windows=layer_windows(hf, "qwen3"),
    )


FAMILY = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    read,
    GGUFLayout("qwen3", "qwen3", {**LLAMA_GGUF_TENSORS, **GGUF_ATTENTION_BIASES, **GGUF_QK_NORMS}),
)
