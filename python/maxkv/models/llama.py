"""A Llama-style decoder as a MAX graph over maxkv's continuous-batching cache.

Embedding, RMSNorm, half-split RoPE, grouped-query attention through
:mod:`maxkv.ops`, SwiGLU MLP, tied or untied LM head, greedy next token.
Weights come from a Hugging Face Llama directory (``config.json`` and
``*.safetensors``) or from :func:`default_llama`, a small seeded random model.

The compiled graph takes the weights as named graph weights, so one compiled
graph serves every model of the same shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

from .. import ops as kvops
from ..graph import FetchContinuousBatchingKVCacheCollection
from ..kernels import kernels_path
from ..manager import ContinuousBatchingKVCacheManager, KVCacheInputs
from ..params import KVCacheParams


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded: missing file, unsupported
    architecture, or a weight of the wrong shape."""


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


def load_llama(model_dir: str | Path) -> tuple[LlamaConfig, Weights]:
    """Loads a Hugging Face Llama directory (``config.json`` + ``*.safetensors``).

    Raises:
        ModelLoadError: On a missing directory or file, an unsupported
            architecture, or a weight that is missing or mis-shaped.
    """
    from safetensors.numpy import load_file

    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file} is missing")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from None
    config = LlamaConfig.from_hf(raw)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {directory}")
    weights: Weights = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as error:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {file}: {error}") from None
    return config, check_weights(config, weights)


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
    rng = np.random.default_rng(seed)
    weights: Weights = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            weights[name] = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return config, check_weights(config, weights)


def cache_params(config: LlamaConfig, dtype: DType = DType.float32) -> KVCacheParams:
    """The :class:`KVCacheParams` a manager for this model needs."""
    return KVCacheParams(dtype, config.num_key_value_heads, config.head_dim)


class LlamaModel:
    """The compiled decoder: one step of a ragged batch, greedy next token.

    Inputs per :meth:`execute`: token ids int64 ``[total_tokens]``,
    ``input_row_offsets`` uint32 ``[batch + 1]`` and the manager's 4-tuple;
    output: the next token of each sequence, int64 ``[batch]``, left on the
    device (feed it straight back for the next decode step).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: Mapping[str, np.ndarray],
        manager: ContinuousBatchingKVCacheManager,
        session: InferenceSession,
    ) -> None:
        params = cache_params(config, manager.params.dtype)
        if manager.params != params or manager.num_layers != config.num_hidden_layers:
            raise ValueError(
                f"the manager holds {manager.params} x {manager.num_layers} layers; the model "
                f"needs {params} x {config.num_hidden_layers} layers"
            )
        if manager.params.dtype != DType.float32:
            raise ValueError("the demo model runs in float32")
        self.config = config
        self.params = params
        self.device = manager.devices[0]
        checked = check_weights(config, weights)
        self._positions = min(config.max_position_embeddings, manager.max_seq_len)
        graph, registry = self._build(manager, checked)
        self._model: Model = session.load(graph, weights_registry=registry)

    def _build(
        self, manager: ContinuousBatchingKVCacheManager, weights: Weights
    ) -> tuple[Graph, dict[str, np.ndarray]]:
        cfg, params = self.config, self.params
        device = DeviceRef.from_device(self.device)
        registry: dict[str, np.ndarray] = {}

        def weight(name: str, array: np.ndarray) -> Weight:
            registry[name] = np.ascontiguousarray(array, dtype=np.float32)
            return Weight(name, DType.float32, array.shape, device)

        input_types = [
            TensorType(DType.int64, ["total_tokens"], device),
            TensorType(DType.uint32, ["input_row_offsets_len"], device),
            *manager.input_symbols()[0],
        ]
        with Graph("maxkv_llama", input_types=input_types, custom_extensions=[kernels_path()]) as g:
            tokens, offsets, *cache = (value.tensor for value in g.inputs)
            kv = FetchContinuousBatchingKVCacheCollection(params)(*cache)
            freqs = weight(
                "rope.freqs_cis",
                kvops.rope_freqs_cis(cfg.head_dim, self._positions, cfg.rope_theta),
            )
            embed = weight("model.embed_tokens.weight", weights["model.embed_tokens.weight"])
            h = ops.gather(embed, tokens, axis=0)
            q_width = cfg.num_attention_heads * cfg.head_dim
            for i in range(cfg.num_hidden_layers):
                p = f"model.layers.{i}."
                wqkv = np.concatenate(
                    [weights[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
                )
                x = self._norm(
                    h, weight(p + "input_layernorm.weight", weights[p + "input_layernorm.weight"])
                )
                q = kvops.fused_qkv_ragged_matmul(
                    params, x, offsets, weight(p + "wqkv", wqkv), kv, i
                )
                q = q.reshape(["total_tokens", cfg.num_attention_heads, cfg.head_dim])
                q = kvops.fused_qk_ragged_rope(params, q, offsets, kv, freqs, i, interleaved=False)
                attn = kvops.flash_attention_ragged(params, q, offsets, kv, i)
                wo = weight(p + "self_attn.o_proj.weight", weights[p + "self_attn.o_proj.weight"])
                h = h + attn.reshape(["total_tokens", q_width]) @ wo.T
                x = self._norm(
                    h,
                    weight(
                        p + "post_attention_layernorm.weight",
                        weights[p + "post_attention_layernorm.weight"],
                    ),
                )
                gate = weight(p + "mlp.gate_proj.weight", weights[p + "mlp.gate_proj.weight"])
                up = weight(p + "mlp.up_proj.weight", weights[p + "mlp.up_proj.weight"])
                down = weight(p + "mlp.down_proj.weight", weights[p + "mlp.down_proj.weight"])
                h = h + (ops.silu(x @ gate.T) * (x @ up.T)) @ down.T
            h = self._norm(h, weight("model.norm.weight", weights["model.norm.weight"]))
            last = ops.rebind(offsets[1:] - 1, ["batch_size"])
            h_last = ops.gather(h, ops.cast(last, DType.int64), axis=0)
            if cfg.tie_word_embeddings:
                head: TensorValue = embed
            else:
                head = weight("lm_head.weight", weights["lm_head.weight"])
            logits = h_last @ head.T
            g.output(ops.reshape(ops.argmax(logits, axis=-1), ["batch_size"]))
        return g, registry

    def _norm(self, x: TensorValue, w: TensorValue) -> TensorValue:
        return ops.rms_norm(x, w, epsilon=self.config.rms_norm_eps)

    @property
    def max_positions(self) -> int:
        """Positions the RoPE table covers."""
        return self._positions

    def execute(self, tokens: Buffer, input_row_offsets: Buffer, kv: KVCacheInputs) -> Buffer:
        """Runs one step; returns the next token of each sequence (int64 ``[batch]``)."""
        (next_tokens,) = self._model.execute(tokens, input_row_offsets, *kv)
        return next_tokens


def greedy_reference(
    config: LlamaConfig,
    weights: Mapping[str, np.ndarray],
    prompt: Sequence[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy generation by a NumPy forward pass over the whole sequence, no cache.

    Independent of maxkv's graph and kernels: written from the Llama
    definition, in float64, recomputing every position for every token.
    """
    w = {name: np.asarray(array, dtype=np.float64) for name, array in weights.items()}
    tokens = list(prompt)
    out: list[int] = []
    d, n_heads, n_kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    inv_freq = config.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        normed: np.ndarray = x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps)
        scaled: np.ndarray = normed * weight
        return scaled

    def rope(x: np.ndarray) -> np.ndarray:  # [seq, heads, d], half-split (HF Llama)
        angles = np.arange(x.shape[0])[:, None] * inv_freq[None, :]
        cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        rotated_x: np.ndarray = x * cos + rotated * sin
        return rotated_x

    for _ in range(max_new_tokens):
        seq = len(tokens)
        h = w["model.embed_tokens.weight"][tokens]
        mask = np.triu(np.full((seq, seq), -np.inf), 1)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            x = norm(h, w[p + "input_layernorm.weight"])
            q = rope((x @ w[p + "self_attn.q_proj.weight"].T).reshape(seq, n_heads, d))
            k = rope((x @ w[p + "self_attn.k_proj.weight"].T).reshape(seq, n_kv, d))
            v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(seq, n_kv, d)
            k = np.repeat(k, n_heads // n_kv, axis=1)
            v = np.repeat(v, n_heads // n_kv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, n_heads * d)
            h = h + attn @ w[p + "self_attn.o_proj.weight"].T
            x = norm(h, w[p + "post_attention_layernorm.weight"])
            gate = x @ w[p + "mlp.gate_proj.weight"].T
            act = gate / (1.0 + np.exp(-gate)) * (x @ w[p + "mlp.up_proj.weight"].T)
            h = h + act @ w[p + "mlp.down_proj.weight"].T
        last = norm(h[-1], w["model.norm.weight"])
        head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        token = int(np.argmax(head @ last))
        out.append(token)
        tokens.append(token)
        if token in config.eos_token_ids:
            break
    return out
