"""A decoder's configuration and weights, independent of any graph and of any family.

:class:`DecoderConfig` holds what maxkv's decoder graph reads: the shapes and
the options of the shared blocks (biases, per-head q/k norms, Gemma's norms,
the MLP's activation, windows per layer, RoPE per layer type).  Each model
family (:mod:`maxkv.models.families`) turns a checkpoint's ``config.json``
into one.  :func:`check_weights` validates a weight dict against it;
:func:`default_llama` is the small seeded random model (``--model tiny``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

import numpy as np

from ..cache.rotation import KeyRotation
from ..graph.ops import check_window
from .errors import ModelLoadError
from .registry import family_for
from .rope import RopeScaling, rope_table

__all__ = ["ACTIVATIONS", "DecoderConfig", "LlamaConfig", "ModelLoadError", "Weights"]

#: The smallest ``head_dim`` a checkpoint may have.  Every ``head_dim`` must also be
#: a power of two: MAX 26.7's graph compiler fails on the attention of other head
#: sizes ("Failed to compile the model"; 24, 40 and 80 tried on an AVX2 CPU, where
#: 8 to 256 compile), so a checkpoint with one is refused at load, by name.
MIN_HEAD_DIM = 8
#: The MLP activations: SwiGLU (``silu``) and GeGLU with tanh GELU (``gelu_tanh``).
Activation = Literal["silu", "gelu_tanh"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer as maxkv's graph builds it.

    The defaults are a Llama's: RMSNorm before attention and MLP, no
    biases, SwiGLU, one RoPE, causal attention over every token.

    Attributes beyond the shapes:
        family: The registry name of the family that read it (messages).
        rope_scaling: The RoPE scaling of the (full-attention) layers.
        local_rope_theta: The RoPE base of the sliding-window layers (Gemma 3),
            default RoPE; ``None``: every layer uses ``rope_theta`` and
            ``rope_scaling``.
        qkv_bias / o_bias: Biases on the Q, K, V / output projections.
        qk_norm: An RMSNorm over each head of Q and of K before RoPE (Qwen 3,
            Gemma 3), weights ``q_norm``/``k_norm`` of ``head_dim``.
        norm_offset: RMSNorm multiplies by ``norm_offset + weight`` (Gemma: 1).
        sandwich_norms: Gemma's layer: the attention output and the MLP output
            are normalized before their residual add
            (``post_attention_layernorm``, ``post_feedforward_layernorm``) and
            the MLP input by ``pre_feedforward_layernorm``.
        activation: :data:`ACTIVATIONS`.
        embed_scale: Multiplies the embeddings (Gemma: ``sqrt(hidden_size)``).
        query_scale: The attention score scale (default ``head_dim ** -0.5``).
        layer_windows: Per layer, its sliding window (tokens it attends to,
            itself included) or ``None``; empty: no layer slides.
        final_logit_softcap: Logits become ``cap * tanh(logits / cap)``.
    """

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
    family: str = "llama"
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    activation: Activation = "silu"
    embed_scale: float | None = None
    query_scale: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    final_logit_softcap: float | None = None

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
        if self.head_dim < MIN_HEAD_DIM or self.head_dim & (self.head_dim - 1):
            raise ModelLoadError(
                f"head_dim {self.head_dim} is not a power of two of at least {MIN_HEAD_DIM}: "
                "the attention kernels do not build for it (MAX's graph compiler fails on it)"
            )
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(
                f"activation {self.activation!r} is not supported (maxkv implements "
                f"{', '.join(ACTIVATIONS)})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ModelLoadError(
                f"{len(self.layer_windows)} layer windows for {self.num_hidden_layers} layers"
            )
        for i, window in enumerate(self.layer_windows):
            if window is not None:
                try:
                    check_window(window)
                except ValueError as error:
                    raise ModelLoadError(
                        f"layer {i}'s sliding window is not supported by maxkv's kernels: {error}"
                    ) from None
        for name in ("embed_scale", "query_scale", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, float) and value > 0):
                raise ModelLoadError(f"config {name} must be a positive float, got {value!r}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """Reads a Hugging Face ``config.json`` dict through the family its
        ``architectures`` name (:func:`maxkv.models.family_for`).

        Raises:
            ModelLoadError: If no family is registered for it, or it sets
                something maxkv does not implement (naming it).
        """
        return family_for(config).read(config)

    def is_plain_llama(self) -> bool:
        """Whether every block option is a Llama-2-style default (no biases, norms
        or scales beyond a Llama's, no RoPE scaling, no window): the model that
        GGUF files, :func:`~maxkv.models.export.llama_config_json` and the NumPy
        reference describe."""
        options = (
            "rope_scaling", "local_rope_theta", "qkv_bias", "o_bias", "qk_norm", "norm_offset",
            "sandwich_norms", "activation", "embed_scale", "query_scale", "layer_windows",
            "final_logit_softcap",
        )  # fmt: skip
        defaults = {f.name: f.default for f in fields(DecoderConfig) if f.default is not MISSING}
        return all(getattr(self, name) == defaults[name] for name in options)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or ``None`` (every token)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def sliding(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def cache_window(self) -> int | None:
        """The sliding window a paged cache gives pages back by
        (``PagedKVCacheManager(sliding_window=...)``): the widest layer window when
        every layer slides; ``None`` when some layer attends to every token."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def rope_name(self, layer: int) -> str:
        """The RoPE table graph weight layer ``layer`` rotates with: ``rope_local.freqs_cis``
        for a sliding layer with a local RoPE, else ``rope.freqs_cis``."""
        local = self.local_rope_theta is not None and self.window(layer) is not None
        return "rope_local.freqs_cis" if local else "rope.freqs_cis"

    def ropes(self) -> dict[str, tuple[float, RopeScaling | None]]:
        """The graph's RoPE table weights -> their base and scaling: ``rope.freqs_cis``
        and, with a local RoPE, ``rope_local.freqs_cis`` (default RoPE)."""
        ropes = {"rope.freqs_cis": (self.rope_theta, self.rope_scaling)}
        if self.local_rope_theta is not None:
            ropes["rope_local.freqs_cis"] = (self.local_rope_theta, None)
        return ropes

    def key_rotation(self) -> KeyRotation:
        """Each layer's RoPE as the cache moves keys by it (attention sinks)."""
        inv_freq = []
        ropes = self.ropes()
        for layer in range(self.num_hidden_layers):
            theta, scaling = ropes[self.rope_name(layer)]
            if scaling is None:
                d = self.head_dim
                inv_freq.append(1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
            else:
                inv_freq.append(scaling.inv_freq(theta, self.head_dim)[0])
        return KeyRotation.of_layers(inv_freq)

    def rope_tables(self) -> dict[str, np.ndarray]:
        """The tables of :meth:`ropes`, float32 ``[max_position_embeddings, head_dim]``."""
        n, d = self.max_position_embeddings, self.head_dim
        return {
            name: rope_table(d, n, theta, scaling)
            for name, (theta, scaling) in self.ropes().items()
        }

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
            if self.qkv_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
            if self.sandwich_norms:
                shapes |= {
                    p + "pre_feedforward_layernorm.weight": (h,),
                    p + "post_feedforward_layernorm.weight": (h,),
                }
        return shapes


#: The name maxkv's decoder configuration had when it ran Llamas only.
LlamaConfig = DecoderConfig


Weights = dict[str, np.ndarray]


def check_weights(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    held: Mapping[str, tuple[int, ...]] | None = None,
) -> Weights:
    """Float32 copies of the weights ``config`` needs, with shapes checked.

    ``held``: name -> shape of the weights held elsewhere, as their file
    stores them (:class:`~maxkv.models.held.HeldWeights`): checked by shape,
    neither read nor returned.

    Raises:
        ModelLoadError: If a weight is missing or has the wrong shape.
    """
    held = held or {}
    checked: Weights = {}
    for name, shape in config.weight_shapes().items():
        if name not in weights and name not in held:
            raise ModelLoadError(f"weight {name} is missing")
        array = None if name in held else np.asarray(weights[name])
        actual = tuple(held[name] if array is None else array.shape)
        if actual != shape:
            raise ModelLoadError(f"weight {name} has shape {actual}, config implies {shape}")
        if array is not None:
            checked[name] = np.ascontiguousarray(array, dtype=np.float32)
    return checked


def default_llama(seed: int = 0) -> tuple[DecoderConfig, Weights]:
    """The built-in demo model: a small, deterministic, seeded random Llama.

    2 layers, hidden 64, 4 query heads over 2 key/value heads of 16, vocabulary
    256; no download needed.
    """
    config = DecoderConfig(
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


def random_weights(config: DecoderConfig, seed: int = 0) -> Weights:
    """Seeded random float32 weights for ``config`` (those of :func:`default_llama`).

    Norm weights ``1 + 0.1 N(0, 1)`` (``0.1 N(0, 1)`` where the norm adds 1
    itself); biases ``0.1 N(0, 1)``; matrices ``N(0, 1) / sqrt(in_features)``.
    """
    rng = np.random.default_rng(seed)
    return check_weights(config, random_weight_recipe(config, rng.standard_normal))


def random_weight_recipe(
    config: DecoderConfig, normal: Callable[[tuple[int, ...]], Any]
) -> dict[str, Any]:
    """:func:`random_weights`' recipe over any array library: ``normal(shape)`` draws
    N(0, 1) samples (NumPy here; ``torch`` on a GPU for the benchmarks'
    8B-parameter shapes).  Weights are drawn in ``config.weight_shapes()`` order."""
    weights: dict[str, Any] = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = normal(shape) * 0.1 + (1.0 - config.norm_offset)
        elif name.endswith(".bias"):
            weights[name] = normal(shape) * 0.1
        else:
            weights[name] = normal(shape) * float(1.0 / np.sqrt(shape[-1]))
    return weights
