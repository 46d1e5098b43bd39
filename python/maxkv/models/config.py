"""A Llama's configuration and weights, independent of any graph.

:class:`LlamaConfig` holds the fields of a Hugging Face ``LlamaConfig`` that
maxkv's decoder uses; :func:`check_weights` validates a weight dict against
it; :func:`default_llama` is the small seeded random model (``--model tiny``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


class ModelLoadError(ValueError):
    """A model that cannot be loaded: missing or corrupt file, unsupported
    architecture or tensor type, or a weight of the wrong shape."""


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` this decoder uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"config {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face ``config.json`` dict.

        Raises:
            ModelLoadError: If the architecture is not Llama, or a field this
                decoder does not implement is set (RoPE scaling, biases).
        """
        architectures = config.get("architectures") or []
        if config.get("model_type") != "llama" and "LlamaForCausalLM" not in architectures:
            found = architectures or config.get("model_type")
            raise ModelLoadError(
                f"unsupported architecture {found!r}: maxkv's demo model is a Llama "
                "(model_type 'llama', LlamaForCausalLM)"
            )
        if config.get("rope_scaling"):
            raise ModelLoadError(f"rope_scaling {config['rope_scaling']!r} is not supported")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ModelLoadError(f"{flag}=True is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {config['hidden_act']!r} is not supported")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            eos = config.get("eos_token_id")
            eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            bos = config.get("bos_token_id")
            rope_theta = config.get("rope_theta")
            if rope_theta is None:
                rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                bos_token_id=None if bos is None else int(bos),
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks {missing}") from None

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face weight names and shapes of this configuration."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
            }
        return shapes


Weights = dict[str, np.ndarray]


def check_weights(config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> Weights:
    """Float32 copies of the weights ``config`` needs, with shapes checked.

    Raises:
        ModelLoadError: If a weight is missing or has the wrong shape.
    """
    checked: Weights = {}
    for name, shape in config.weight_shapes().items():
        if name not in weights:
            raise ModelLoadError(f"weight {name} is missing")
        array = np.asarray(weights[name])
        if tuple(array.shape) != shape:
            raise ModelLoadError(
                f"weight {name} has shape {tuple(array.shape)}, config implies {shape}"
            )
        checked[name] = np.ascontiguousarray(array, dtype=np.float32)
    return checked


def default_llama(seed: int = 0) -> tuple[LlamaConfig, Weights]:
    """The built-in demo model: a small, deterministic, seeded random Llama.

    2 layers, hidden 64, 4 query heads over 2 key/value heads of 16, vocabulary
    256; no download needed.
    """
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    return config, random_weights(config, seed)


def random_weights(config: LlamaConfig, seed: int = 0) -> Weights:
    """Seeded random float32 weights for ``config`` (those of :func:`default_llama`).

    Norm weights ``1 + 0.1 N(0, 1)``; matrices ``N(0, 1) / sqrt(in_features)``.
    """
    rng = np.random.default_rng(seed)
    return check_weights(config, random_weight_recipe(config, rng.standard_normal))


def random_weight_recipe(
    config: LlamaConfig, normal: Callable[[tuple[int, ...]], Any]
) -> dict[str, Any]:
    """:func:`random_weights`' recipe over any array library: ``normal(shape)`` draws
    N(0, 1) samples (NumPy here; ``torch`` on a GPU for the benchmarks'
    8B-parameter shapes).  Weights are drawn in ``config.weight_shapes()`` order."""
    weights: dict[str, Any] = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = normal(shape) * 0.1 + 1.0
        else:
            weights[name] = normal(shape) * float(1.0 / np.sqrt(shape[-1]))
    return weights
