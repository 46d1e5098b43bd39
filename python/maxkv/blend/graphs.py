"""The decoder layer split into MAX graphs that take explicit token positions.

CacheBlend computes, at each layer, only some tokens of a prompt, at
scattered positions, attending over K/V that are partly retrieved; maxkv's
cache ops (which append at the cache length) cannot express that, so a
blended prefill runs these graphs layer by layer.  Weights are graph *inputs*
(the packed arrays of :func:`maxkv.models.decoder.graph_weights`), so each
graph is compiled once and serves every layer; token counts are symbolic.
The math is the model's: the norms, projections and MLP are the decoder's
own blocks (:class:`maxkv.models.blocks.Blocks`, reading the layer's weights
from graph inputs), RoPE is half-split from the same table, attention is
GQA softmax with the model's query scale.  Models with sliding windows or a
RoPE per layer type (Mistral, Gemma 3) are refused: blending re-rotates
and attends over whole chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from .. import ops as kvops
from ..cache.protocol import KVCacheManagerBase
from ..cache.spec import KVCacheInputs
from ..kernels import kernels_path, load_graph
from ..models.blocks import Blocks
from ..models.config import DecoderConfig
from ..models.decoder import graph_weight_shapes

F32 = DType.float32
#: Most bytes one ``[heads, queries, keys]`` float32 score array of
#: :meth:`LayerGraphs.attention_mlp` takes (queries are tiled to stay within it).
SCORE_BYTES = 64 << 20


def rope(x: TensorValue, table: TensorValue, positions: TensorValue) -> TensorValue:
    """Half-split rotary embedding of ``x`` ``[T, heads, head_dim]`` at int64 ``positions [T]``.

    ``table`` is :func:`maxkv.ops.rope_freqs_cis`'s ``[max_positions, head_dim]``
    (row *p*: cos/sin pairs of each frequency), as the model's RoPE uses it.
    """
    head_dim = int(x.shape[2])
    half = head_dim // 2
    rows = ops.gather(table, positions, axis=0)  # [T, head_dim]
    rows = ops.reshape(rows, [x.shape[0], 1, half, 2])
    cos, sin = rows[:, :, :, 0], rows[:, :, :, 1]
    x1, x2 = x[:, :, :half], x[:, :, half:]
    return ops.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def unrope(x: TensorValue, table: TensorValue, positions: TensorValue) -> TensorValue:
    """The inverse of :func:`rope`: rotates ``x`` back from ``positions`` to 0."""
    head_dim = int(x.shape[2])
    half = head_dim // 2
    rows = ops.reshape(ops.gather(table, positions, axis=0), [x.shape[0], 1, half, 2])
    cos, sin = rows[:, :, :, 0], rows[:, :, :, 1]
    x1, x2 = x[:, :, :half], x[:, :, half:]
    return ops.concat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


class LayerGraphs:
    """Compiled per-layer graphs of one model configuration (CPU, float32).

    - :meth:`qkv`: ``h [T, hidden]`` at ``positions`` -> rotated Q, rotated K, V.
    - :meth:`attention_mlp`: attention of Q (at ``q_positions``) over the long
      K/V of the prompt's first ``N`` tokens (key *j* at position *j*, causal),
      output projection, residual, MLP, residual -> the new ``h`` rows.
    - :meth:`rerotate`: K rotated at ``from_positions`` -> rotated at ``to_positions``.
    - :meth:`head`: last hidden row -> logits.
    - :meth:`write`: blended K/V of one layer into a maxkv cache slot.
    """

    def __init__(self, config: DecoderConfig, session: InferenceSession, device: Device) -> None:
        check_blendable(config)
        self.config = c = config
        self.session = session
        self.device = device
        self.ref = DeviceRef.from_device(device)
        self.shapes = graph_weight_shapes(c, packed=True)
        self.q_width = c.num_attention_heads * c.head_dim
        self.kv_width = c.num_key_value_heads * c.head_dim
        self._qkv = self._load(self._qkv_graph())
        self._attention_mlp = self._load(self._attention_mlp_graph())
        self._rerotate = self._load(self._rerotate_graph())
        self._head = self._load(self._head_graph())
        self._writers: dict[tuple[object, ...], Model] = {}

    def _load(self, graph: Graph) -> Model:
        return load_graph(self.session, graph)

    def _weight_type(self, name: str) -> TensorType:
        return TensorType(F32, list(self.shapes[name]), self.ref)

    def _layer_weights(self, *suffixes: str) -> list[str]:
        """Layer 0's graph weights of these suffixes that this configuration has
        (the layer weights a graph takes as inputs, in order)."""
        return [f"layers.0.{s}" for s in suffixes if f"layers.0.{s}" in self.shapes]

    def _blocks(self, names: list[str], values: list[TensorValue]) -> Blocks:
        """The decoder's blocks reading ``names`` from the graph inputs ``values``."""
        by_name = dict(zip(names, values, strict=True))
        return Blocks(self.config, by_name.__getitem__, packed=True)

    # ----------------------------------------------------------- builders

    #: Layer weights of the QKV graph and of the attention + MLP graph (suffixes).
    QKV_WEIGHTS = ("input_norm", "wqkv", "qkv_bias", "q_norm", "k_norm")
    MLP_WEIGHTS = ("wo", "o_bias", "post_norm", "pre_ff_norm", "gate_up", "down", "post_ff_norm")

    def _qkv_graph(self) -> Graph:
        c = self.config
        names = self._layer_weights(*self.QKV_WEIGHTS)
        types = [
            TensorType(F32, ["tokens", c.hidden_size], self.ref),
            TensorType(DType.int64, ["tokens"], self.ref),
            self._weight_type("rope.freqs_cis"),
            *(self._weight_type(n) for n in names),
        ]
        with Graph("blend_qkv", input_types=types, custom_extensions=[kernels_path()]) as g:
            h, positions, table, *layer = (v.tensor for v in g.inputs)
            blocks = self._blocks(names, layer)
            qkv = blocks.qkv(blocks.norm(h, "layers.0.input_norm"), 0)
            q = ops.reshape(qkv[:, : self.q_width], ["tokens", c.num_attention_heads, c.head_dim])
            k = ops.reshape(
                qkv[:, self.q_width : self.q_width + self.kv_width],
                ["tokens", c.num_key_value_heads, c.head_dim],
            )
            v = ops.reshape(
                qkv[:, self.q_width + self.kv_width :],
                ["tokens", c.num_key_value_heads, c.head_dim],
            )
            g.output(rope(q, table, positions), rope(k, table, positions), v)
        return g

    def _attention_mlp_graph(self) -> Graph:
        c = self.config
        heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        group = heads // kv_heads
        names = self._layer_weights(*self.MLP_WEIGHTS)
        types = [
            TensorType(F32, ["queries", c.hidden_size], self.ref),
            TensorType(F32, ["queries", heads, dim], self.ref),
            TensorType(DType.int64, ["queries"], self.ref),
            TensorType(F32, ["keys", kv_heads, dim], self.ref),
            TensorType(F32, ["keys", kv_heads, dim], self.ref),
            TensorType(DType.int64, ["keys"], self.ref),
            *(self._weight_type(n) for n in names),
        ]
        scale = c.query_scale if c.query_scale is not None else 1.0 / math.sqrt(dim)
        with Graph(
            "blend_attention_mlp", input_types=types, custom_extensions=[kernels_path()]
        ) as g:
            h, q, q_pos, k, v, k_pos, *layer = (v.tensor for v in g.inputs)
            s = q.shape[0]
            qg = ops.permute(ops.reshape(q, [s, kv_heads, group, dim]), [1, 2, 0, 3])
            qg = ops.reshape(qg, [kv_heads, group * s, dim])
            kt = ops.permute(k, [1, 2, 0])  # [kv_heads, dim, N]
            scores = (qg @ kt) * scale  # [kv_heads, group * S, N]
            scores = ops.reshape(scores, [kv_heads, group, s, k.shape[0]])
            allowed = ops.unsqueeze(k_pos, 0) <= ops.unsqueeze(q_pos, 1)  # [S, N]
            masked = ops.where(allowed, scores, ops.constant(-1e30, F32, self.ref))
            # Written out: MAX 26.7's CPU ops.softmax returns wrong values on rows
            # holding -1e30 (measured: 0.89 off); exp(x - max) / sum is exact.
            shifted = ops.exp(masked - ops.max(masked, axis=-1))
            probs = shifted / ops.sum(shifted, axis=-1)
            probs = ops.reshape(probs, [kv_heads, group * s, k.shape[0]])
            out = probs @ ops.permute(v, [1, 0, 2])  # [kv_heads, group * S, dim]
            out = ops.permute(ops.reshape(out, [kv_heads, group, s, dim]), [2, 0, 1, 3])
            attn = ops.reshape(out, [s, heads * dim])
            blocks = self._blocks(names, layer)
            g.output(blocks.mlp_residual(blocks.attention_residual(attn, h, 0), 0))
        return g

    def _rerotate_graph(self) -> Graph:
        c = self.config
        types = [
            TensorType(F32, ["tokens", c.num_key_value_heads, c.head_dim], self.ref),
            TensorType(DType.int64, ["tokens"], self.ref),
            TensorType(DType.int64, ["tokens"], self.ref),
            self._weight_type("rope.freqs_cis"),
        ]
        with Graph("blend_rerotate", input_types=types) as g:
            k, from_pos, to_pos, table = (v.tensor for v in g.inputs)
            g.output(rope(unrope(k, table, from_pos), table, to_pos))
        return g

    def _head_graph(self) -> Graph:
        c = self.config
        types = [
            TensorType(F32, ["rows", c.hidden_size], self.ref),
            self._weight_type("norm"),
            self._weight_type("lm_head"),
        ]
        with Graph("blend_head", input_types=types, custom_extensions=[kernels_path()]) as g:
            h, norm, head = (v.tensor for v in g.inputs)
            blocks = self._blocks(["norm", "lm_head"], [norm, head])
            g.output(blocks.logits(blocks.norm(h, "norm")))
        return g

    # ------------------------------------------------------------ running

    def qkv(
        self, weights: Mapping[str, Buffer], layer: int, h: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rotated Q ``[T, heads, dim]``, rotated K and V ``[T, kv_heads, dim]`` of ``h``."""
        q, k, v = self._qkv.execute(
            _f32(h),
            _i64(positions),
            weights["rope.freqs_cis"],
            *self._layer_inputs(weights, layer, self.QKV_WEIGHTS),
        )
        return _owned(q), _owned(k), _owned(v)

    def attention_mlp(
        self,
        weights: Mapping[str, Buffer],
        layer: int,
        h: np.ndarray,
        q: np.ndarray,
        q_positions: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
    ) -> np.ndarray:
        """The layer's output rows for the queries (causal over keys at 0 .. N-1).

        The graph holds a few ``[heads, queries, N]`` float32 score arrays; queries
        go through it in tiles that keep one of them within
        :data:`SCORE_BYTES` (the rows are independent), so a long prompt's
        memory grows with its length, not its square."""
        n = k.shape[0]
        key_positions, keys, values = _i64(np.arange(n, dtype=np.int64)), _f32(k), _f32(v)
        layer_weights = self._layer_inputs(weights, layer, self.MLP_WEIGHTS)
        rows = max(1, SCORE_BYTES // (4 * self.config.num_attention_heads * max(n, 1)))
        tiles = []
        for first in range(0, max(q.shape[0], 1), rows):
            part = slice(first, first + rows)
            (out,) = self._attention_mlp.execute(
                _f32(h[part]),
                _f32(q[part]),
                _i64(q_positions[part]),
                keys,
                values,
                key_positions,
                *layer_weights,
            )
            tiles.append(_owned(out))
        return tiles[0] if len(tiles) == 1 else np.concatenate(tiles)

    def _layer_inputs(
        self, weights: Mapping[str, Buffer], layer: int, suffixes: tuple[str, ...]
    ) -> list[Buffer]:
        """Layer ``layer``'s weights for the graph of layer-0 ``suffixes``."""
        return [
            weights[name.replace("layers.0.", f"layers.{layer}.", 1)]
            for name in self._layer_weights(*suffixes)
        ]

    def rerotate(
        self,
        weights: Mapping[str, Buffer],
        k: np.ndarray,
        from_positions: np.ndarray,
        to_positions: np.ndarray,
    ) -> np.ndarray:
        """``k`` rotated at ``from_positions``, re-rotated to ``to_positions``."""
        (out,) = self._rerotate.execute(
            _f32(k), _i64(from_positions), _i64(to_positions), weights["rope.freqs_cis"]
        )
        return _owned(out)

    def head(self, weights: Mapping[str, Buffer], h_last: np.ndarray) -> np.ndarray:
        """float32 logits ``[rows, vocab]`` of the last hidden rows."""
        (out,) = self._head.execute(_f32(h_last), weights["norm"], weights["lm_head"])
        return _owned(out)

    def write(
        self,
        manager: KVCacheManagerBase,
        inputs: KVCacheInputs,
        layer: int,
        k: np.ndarray,
        v: np.ndarray,
    ) -> None:
        """Writes one layer's K/V ``[N, kv_heads, dim]`` at the fetched sequence's cache length."""
        n = k.shape[0]
        (written,) = self.writer(manager).execute(
            *inputs,
            _f32(k.reshape(n, self.kv_width)),
            _f32(v.reshape(n, self.kv_width)),
            Buffer.from_numpy(np.array([0, n], dtype=np.uint32)),
            Buffer.from_numpy(np.array(layer, dtype=np.uint32)),
        )
        written.to_numpy()

    def writer(self, manager: KVCacheManagerBase) -> Model:
        """The graph :meth:`write` runs for ``manager``'s cache (compiled once per layout)."""
        fetcher = manager.collection_fetcher()
        key = (type(fetcher).__name__, getattr(fetcher, "page_size", None), manager.num_layers)
        if key not in self._writers:
            types = [
                *manager.input_symbols()[0],
                TensorType(F32, ["tokens", self.kv_width], self.ref),
                TensorType(F32, ["tokens", self.kv_width], self.ref),
                TensorType(DType.uint32, ["offsets"], self.ref),
                TensorType(DType.uint32, [], DeviceRef.CPU()),
            ]
            with Graph(
                "blend_write_kv", input_types=types, custom_extensions=[kernels_path()]
            ) as g:
                *cache, keys, values, offsets, layer_idx = (x.tensor for x in g.inputs)
                kv = fetcher(*cache)
                g.output(
                    kvops.write_kv_ragged(manager.params, keys, values, offsets, kv, layer_idx)
                )
            self._writers[key] = self._load(g)
        return self._writers[key]


def check_blendable(config: DecoderConfig) -> None:
    """Refuses configurations CacheBlend's graphs do not compute.

    Raises:
        ValueError: For sliding windows or a RoPE per layer type.
    """
    if config.sliding or config.local_rope_theta is not None:
        raise ValueError(
            f"CacheBlend does not run {config.family} models: it attends over whole chunks and "
            "re-rotates with one RoPE, but this model has sliding windows or a RoPE per layer type"
        )


def weight_buffers(weights: Mapping[str, np.ndarray]) -> dict[str, Buffer]:
    """The packed graph weights as Buffers (zero-copy views of the arrays)."""
    return {name: Buffer.from_numpy(array) for name, array in weights.items()}


def _owned(buffer: Buffer) -> np.ndarray:
    """A graph output as a NumPy array that owns its data (``to_numpy()`` on the CPU
    is a view of the output buffer; the executor edits and keeps these arrays)."""
    return np.array(buffer.to_numpy(), copy=True)


def _f32(a: np.ndarray) -> Buffer:
    return Buffer.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _i64(a: np.ndarray) -> Buffer:
    return Buffer.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
