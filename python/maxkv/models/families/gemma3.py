"""Gemma 3 (text): interleaved sliding-window and full layers with their own
RoPE bases, Gemma's ``1 + w`` RMSNorm before and after attention and MLP,
per-head q/k norms, GeGLU (tanh GELU), embeddings scaled by
``sqrt(hidden_size)``, scores scaled by ``query_pre_attn_scalar ** -0.5``."""

import math
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
    read_rope,
    refuse,
)


def read(hf: Any) -> DecoderConfig:
    rope = getattr(hf, "rope_parameters", None) or {}
    theta, scaling = read_rope(rope.get("full_attention"), "gemma3")
    local_theta, local_scaling = read_rope(rope.get("sliding_attention"), "gemma3")
    if local_scaling is not None:
        raise refuse("rope_parameters.sliding_attention", local_scaling.rope_type, "gemma3")
    bias = bool(getattr(hf, "attention_bias", False))
    cap = getattr(hf, "final_logit_softcapping", None)
    return decoder_config(
        hf,
        "gemma3",
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=math.sqrt(int(hf.hidden_size)),
        query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        layer_windows=layer_windows(hf, "gemma3"),
        final_logit_softcap=None if cap is None else float(cap),
    )


FAMILY = Family(
    "gemma3",
    ("Gemma3ForCausalLM",),
    read,
    GGUFLayout(
        "gemma3",
        "gemma3_text",
        {
            **LLAMA_GGUF_TENSORS,
            **GGUF_ATTENTION_BIASES,
            **GGUF_QK_NORMS,
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        norm_shift=1.0,
    ),
)
