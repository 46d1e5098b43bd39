"""Model families: from a checkpoint's ``config.json`` to a :class:`DecoderConfig`.

A family is one module of :mod:`maxkv.models.families` holding a
:class:`Family`: the Hugging Face ``architectures`` names it serves and a
function that reads the checkpoint's configuration (parsed by transformers'
own config class, so defaults, legacy keys and ``layer_types`` mean what
they mean to transformers) into the options of maxkv's shared decoder
blocks.  Whatever a checkpoint sets that the blocks do not implement is
refused by name (:func:`refuse`), in the library and in ``max serve``: a
model never runs wrong.  :func:`~maxkv.models.registry.register_family` adds one; the families
maxkv ships are registered in :mod:`maxkv.models.families`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import DecoderConfig
from .errors import ModelLoadError
from .registry import registered_architectures
from .rope import RopeScaling

#: A Llama layer's tensors in llama.cpp's GGUF names (after ``blk.N.``) -> Hugging
#: Face's (after ``model.layers.N.``).
LLAMA_GGUF_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: The Q, K, V and output projections' biases.
GGUF_ATTENTION_BIASES: Mapping[str, str] = {
    f"attn_{g}.bias": f"self_attn.{h}_proj.bias"
    for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
}
#: The per-head RMSNorms of Q and K.
GGUF_QK_NORMS: Mapping[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's converter writes a family's GGUF files, as transformers'
    GGUF loader reads them back (``modeling_gguf_pytorch_utils``: its config
    mapping, tensor names and tensor processors).

    Attributes:
        architecture: ``general.architecture``.
        model_type: transformers' ``model_type`` for the configuration.
        layer_tensors: A layer's tensors, GGUF name -> Hugging Face name (each
            after the layer prefix); the embeddings, final norm and head are
            the same for every family.
        permuted_qk: llama.cpp interleaved the RoPE halves of each Q and K head
            (its Llama converter's ``permute``), undone on reading.
        norm_shift: llama.cpp stores every ``*norm.weight`` plus this (Gemma's
            ``1 + w`` RMSNorm as a plain one: 1), subtracted on reading.
    """

    architecture: str
    model_type: str
    layer_tensors: Mapping[str, str]
    permuted_qk: bool = False
    norm_shift: float = 0.0


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: Its short name (``"qwen3"``), in messages and ``DecoderConfig.family``.
        architectures: The Hugging Face ``architectures`` names it serves.
        read_hf: transformers' config of the checkpoint (its ``config.json``
            parsed by the config class of its ``model_type``) -> the decoder's
            configuration; :meth:`read` applies it to a ``config.json`` dict.
        gguf: How its GGUF files are laid out, or ``None`` if maxkv reads none.
    """

    name: str
    architectures: tuple[str, ...]
    read_hf: Callable[[Any], DecoderConfig] = field(repr=False)
    gguf: GGUFLayout | None = field(default=None, repr=False)

    def read(self, raw: Mapping[str, Any]) -> DecoderConfig:
        """The :class:`DecoderConfig` of a ``config.json`` dict.

        Raises:
            ModelLoadError: If transformers refuses the config, or it sets
                something maxkv does not implement.
        """
        return self.read_hf(hf_config(raw))


def gguf_families() -> dict[str, Family]:
    """transformers' ``model_type`` -> the registered family whose GGUF files use it."""
    return {f.gguf.model_type: f for f in registered_architectures().values() if f.gguf is not None}


def hf_config(raw: Mapping[str, Any]) -> Any:
    """``raw`` parsed by transformers' config class for its ``model_type``.

    Raises:
        ModelLoadError: If the model type is unknown to transformers or
            transformers refuses a value.
    """
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"config.json model_type {model_type!r} is unknown to transformers")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(raw))
    except Exception as error:  # transformers' strict validation raises its own types
        raise ModelLoadError(f"config.json is not a valid {model_type} config: {error}") from None


def refuse(feature: str, value: object, family: str) -> ModelLoadError:
    """The error for a checkpoint that sets what maxkv does not implement."""
    return ModelLoadError(f"{family}: {feature}={value!r} is not supported by maxkv")


def decoder_config(hf: Any, family: str, **options: Any) -> DecoderConfig:
    """The fields every family shares, read from transformers' config ``hf``;
    ``options`` are the family's block options (:class:`DecoderConfig`).

    Checks what every family's layer would otherwise silently ignore: the
    hidden activation (against ``options['activation']``), MLP biases,
    partial rotary embeddings, attention soft-capping, bidirectional attention,
    and the RoPE (:func:`read_rope`) unless the family passes ``rope_theta``
    (and ``rope_scaling``) itself.

    Raises:
        ModelLoadError: Naming the first unsupported setting.
    """
    activation = options.get("activation", "silu")
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    expected = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_new")}[activation]
    if act not in expected:
        raise refuse("hidden_act", act, family)
    for flag in ("mlp_bias", "attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(hf, flag, None):
            raise refuse(flag, getattr(hf, flag), family)
    if getattr(hf, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise refuse("partial_rotary_factor", hf.partial_rotary_factor, family)
    if "rope_theta" in options:  # the family read its RoPE (per layer type)
        theta, scaling = options.pop("rope_theta"), options.pop("rope_scaling", None)
    else:
        theta, scaling = read_rope(getattr(hf, "rope_parameters", None), family)
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    bos = getattr(hf, "bos_token_id", None)
    heads = int(hf.num_attention_heads)
    fields: dict[str, Any] = dict(
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_hidden_layers=int(hf.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        bos_token_id=None if bos is None else int(bos),
        family=family,
        rope_scaling=scaling,
    )
    fields |= options
    return DecoderConfig(**fields)


def read_rope(rope: Mapping[str, Any] | None, family: str) -> tuple[float, RopeScaling | None]:
    """The base and scaling of one of transformers' standardized rope dicts.

    Raises:
        ModelLoadError: On a partial rotary factor, or a RoPE type or
            parameter maxkv does not implement.
    """
    rope = dict(rope or {})
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial_rotary_factor", rope["partial_rotary_factor"], family)
    rope.pop("partial_rotary_factor", None)
    theta = rope.get("rope_theta")
    return float(theta if theta is not None else 10000.0), RopeScaling.from_hf(rope)


def layer_windows(hf: Any, family: str) -> tuple[int | None, ...]:
    """Per layer, its sliding window: transformers' ``layer_types`` (``sliding_attention``
    layers take ``sliding_window``), or every layer's ``sliding_window`` when the
    config has no ``layer_types``; empty when no layer slides.

    Raises:
        ModelLoadError: On a layer type other than full and sliding attention.
    """
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    n = int(hf.num_hidden_layers)
    if types is None:
        return (int(window),) * n if window else ()
    unknown = sorted({t for t in types} - {"full_attention", "sliding_attention"})
    if unknown:
        raise refuse("layer_types", unknown, family)
    if len(types) != n:
        raise ModelLoadError(f"{family}: {len(types)} layer_types for {n} layers")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return windows if any(w is not None for w in windows) else ()
