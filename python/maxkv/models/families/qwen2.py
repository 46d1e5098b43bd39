"""Qwen 2 and 2.5: a Llama with biases on the Q, K and V projections (not the
output's), often tied embeddings, and sliding windows on the layers from
``max_window_layers`` on when ``use_sliding_window``."""

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
    return decoder_config(hf, "qwen2", qkv_bias=True, layer_windows=layer_windows(hf, "qwen2"))


FAMILY = Family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    read,
    GGUFLayout("qwen2", "qwen2", {**LLAMA_GGUF_TENSORS, **GGUF_ATTENTION_BIASES}),
)
