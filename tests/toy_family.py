"""A model family written the way a user adds one: this module and one registry line.

"Toy" is a Llama with GeGLU, Gemma's ``1 + w`` norms and scaled embeddings,
registered as ``ToyForCausalLM``; transformers has no such model, so its
checkpoint is a Gemma 3 checkpoint whose layers are all full attention and
whose ``config.json`` names the toy architecture (the reference is that
Gemma 3 model in transformers).
"""

from typing import Any

from maxkv.models.config import DecoderConfig
from maxkv.models.family import Family, decoder_config, read_rope


def read(hf: Any) -> DecoderConfig:
    theta, scaling = read_rope((hf.rope_parameters or {}).get("full_attention"), "toy")
    return decoder_config(
        hf,
        "toy",
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=float(hf.hidden_size) ** 0.5,
        query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
    )


FAMILY = Family("toy", ("ToyForCausalLM",), read)
