"""The shared blocks every family's layer is built from, as MAX graph functions.

:class:`Blocks` binds a :class:`~maxkv.models.config.DecoderConfig` to a way of
reading graph weights (named as :func:`maxkv.models.decoder.graph_weights`
names them: graph weights in the decoder, graph inputs in CacheBlend's
layer graphs) and to the matmul of the device (maxkv's packed float32 kernels
on the CPU, MAX's matmul otherwise).  Shapes: ``T`` is the step's token
count, ``H`` the hidden size; values are in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from max.dtype import DType
from max.graph import TensorValue, ops

from .. import ops as kvops
from ..cpu.quantized import PackedFormat
from .config import DecoderConfig

#: Reads the graph weight of a name (:func:`maxkv.models.decoder.graph_weight_shapes`).
WeightFn = Callable[[str], TensorValue]


def part_rows(config: DecoderConfig, matrix: str) -> list[int]:
    """Rows of each weight stacked into graph matrix ``matrix``, in order (see
    :func:`maxkv.models.decoder.matrix_sources`): Q, K and V of a ``wqkv``;
    gate and up of a ``gate_up``; one part otherwise."""
    c = config
    if matrix.endswith(".wqkv"):
        kv = c.num_key_value_heads * c.head_dim
        return [c.num_attention_heads * c.head_dim, kv, kv]
    if matrix.endswith(".gate_up"):
        return [c.intermediate_size, c.intermediate_size]
    if matrix.endswith(".wo") or matrix.endswith(".down"):
        return [c.hidden_size]
    if matrix == "lm_head":
        return [c.vocab_size]
    raise ValueError(f"{matrix!r} is not a graph matrix")


def piece_name(matrix: str, first: int) -> str:
    """The graph weight stem of the piece of ``matrix`` that starts at its part
    ``first``: a stacked matrix whose parts a file holds in different formats is
    held as pieces, runs of parts of one format, each its own quantized copy
    (``layers.0.wqkv`` for Q and K, ``layers.0.wqkv.2`` for V)."""
    return matrix if first == 0 else f"{matrix}.{first}"


def matrix_of(stem: str) -> str:
    """The matrix a :func:`piece_name` is a piece of (a matrix's own name: itself)."""
    matrix, _, last = stem.rpartition(".")
    return matrix if matrix and last.isdigit() else stem


def pieces(
    config: DecoderConfig, matrix: str, quant_formats: Mapping[str, PackedFormat]
) -> list[tuple[str, int]]:
    """``(stem, rows)`` of each piece of ``matrix`` in ``quant_formats`` (see
    :func:`piece_name`): the matrix whole, unless it is held in pieces."""
    rows = part_rows(config, matrix)
    starts = [0] + [p for p in range(1, len(rows)) if piece_name(matrix, p) in quant_formats]
    ends = [*starts[1:], len(rows)]
    return [(piece_name(matrix, a), sum(rows[a:b])) for a, b in zip(starts, ends, strict=True)]


def embedding_table(config: DecoderConfig, quant_formats: Collection[str]) -> str:
    """The graph weight the embedding gathers its rows from: ``lm_head`` where the
    head is tied and held as a quantized copy (one table for both: no
    ``embed_tokens`` weight), else ``embed_tokens`` (float32, or its own copy)."""
    if (
        config.tie_word_embeddings
        and "lm_head" in quant_formats
        and "embed_tokens" not in quant_formats
    ):
        return "lm_head"
    return "embed_tokens"


class Blocks:
    """The layer's blocks for one configuration, weight source and matmul.

    Args:
        config: The decoder's configuration (its block options).
        weight: The graph weight of a name.
        packed: Matrices are packed for :func:`maxkv.ops.linear_packed` (CPU
            float32); otherwise ``[out, in]`` for ``x @ w.T``.
        quant_formats: Matrices held as a block-quantized copy alone
            (``<name>.q``, ``.sm``; no float32 ``<name>``).
    """

    def __init__(
        self,
        config: DecoderConfig,
        weight: WeightFn,
        packed: bool,
        quant_formats: Mapping[str, PackedFormat] | None = None,
    ) -> None:
        self.config = config
        self.weight = weight
        self.packed = packed
        self.quant_formats = dict(quant_formats or {})
        c = config
        self.q_width = c.num_attention_heads * c.head_dim
        self.kv_width = c.num_key_value_heads * c.head_dim

    def linear(
        self, x: TensorValue, name: str, out_features: int, residual: TensorValue | None = None
    ) -> TensorValue:
        """``x [T, in] @ w.T`` (plus ``residual [T, out]``) for the matrix ``name``;
        packed, the add happens in the matmul's epilogue.  A matrix held in pieces
        (:func:`pieces`) is one matmul a piece, their columns concatenated (each
        output the same sum in the same order)."""
        split = pieces(self.config, name, self.quant_formats) if self.packed else []
        if len(split) > 1:
            y = ops.concat([self._matmul(x, stem, rows) for stem, rows in split], axis=1)
            return y if residual is None else residual + y
        return self._matmul(x, name, out_features, residual)

    def _matmul(
        self, x: TensorValue, name: str, out_features: int, residual: TensorValue | None = None
    ) -> TensorValue:
        """:meth:`linear` of one graph matrix or piece ``name``."""
        if self.packed and name in self.quant_formats:  # held as the file stores it
            quantized = (self.weight(f"{name}.q"), self.weight(f"{name}.sm"))
            return kvops.linear_packed(x, None, out_features, quantized, residual=residual)
        w = self.weight(name)
        if self.packed:
            return kvops.linear_packed(x, w, out_features, residual=residual)
        y = x @ w.T
        return y if residual is None else residual + y

    def norm(self, x: TensorValue, name: str) -> TensorValue:
        """RMSNorm over the last dim of ``x`` with weight ``name`` (times
        ``norm_offset + w``: Gemma's ``1 + w``)."""
        c = self.config
        return ops.rms_norm(
            x, self.weight(name), epsilon=c.rms_norm_eps, weight_offset=c.norm_offset
        )

    def embed(self, tokens: TensorValue) -> TensorValue:
        """int64 ``[T]`` -> ``[T, H]``: the embedding rows, scaled by ``embed_scale``.

        Held as the file stores it (the table of :func:`embedding_table` in
        ``quant_formats``: its own, or a tied head's), each row is gathered from
        the quantized tiles by :func:`maxkv.ops.gather_quantized` (the
        dequantized table's values)."""
        c = self.config
        table = embedding_table(c, self.quant_formats)
        if table in self.quant_formats:
            copy = (self.weight(f"{table}.q"), self.weight(f"{table}.sm"))
            h = kvops.gather_quantized(tokens, copy, c.vocab_size, c.hidden_size)
        else:
            h = ops.gather(self.weight("embed_tokens"), tokens, axis=0)
        scale = self.config.embed_scale
        if scale is not None:
            h = h * ops.constant(scale, h.dtype, device=h.device)
        return h

    def qkv(self, x: TensorValue, layer: int) -> TensorValue:
        """Normed input ``[T, H]`` -> ``[T, (heads + 2 kv_heads) * head_dim]``: the Q, K, V
        projection with its bias, and each Q and K head RMS-normed (``qk_norm``).
        RoPE is not applied (the cache op rotates as it stores)."""
        c = self.config
        qkv = self.linear(x, f"layers.{layer}.wqkv", self.q_width + 2 * self.kv_width)
        if c.qkv_bias:
            qkv = qkv + self.weight(f"layers.{layer}.qkv_bias")
        if not c.qk_norm:
            return qkv
        q = ops.reshape(qkv[:, : self.q_width], [-1, c.num_attention_heads, c.head_dim])
        k = ops.reshape(
            qkv[:, self.q_width : self.q_width + self.kv_width],
            [-1, c.num_key_value_heads, c.head_dim],
        )
        q = ops.reshape(self.norm(q, f"layers.{layer}.q_norm"), [-1, self.q_width])
        k = ops.reshape(self.norm(k, f"layers.{layer}.k_norm"), [-1, self.kv_width])
        return ops.concat([q, k, qkv[:, self.q_width + self.kv_width :]], axis=1)

    def attention_residual(self, attn: TensorValue, h: TensorValue, layer: int) -> TensorValue:
        """Attention output ``[T, heads * head_dim]`` through the output projection
        (and its bias) into the residual stream ``h [T, H]``; Gemma's sandwich
        normalizes it before the add."""
        c = self.config
        name = f"layers.{layer}.wo"
        if c.sandwich_norms:
            out = self.linear(attn, name, c.hidden_size)
            if c.o_bias:
                out = out + self.weight(f"layers.{layer}.o_bias")
            return h + self.norm(out, f"layers.{layer}.post_norm")
        h = self.linear(attn, name, c.hidden_size, h)
        return h + self.weight(f"layers.{layer}.o_bias") if c.o_bias else h

    def mlp_residual(self, h: TensorValue, layer: int) -> TensorValue:
        """The MLP half of a layer: ``h [T, H]`` -> ``h`` + MLP(norm(``h``)); SwiGLU
        or GeGLU; Gemma's sandwich normalizes the MLP's output too."""
        c = self.config
        inter = c.intermediate_size
        pre = f"layers.{layer}.pre_ff_norm" if c.sandwich_norms else f"layers.{layer}.post_norm"
        gate_up = self.linear(self.norm(h, pre), f"layers.{layer}.gate_up", 2 * inter)
        if c.activation == "silu" and self.packed:
            act = kvops.swiglu(gate_up)
        elif c.activation == "silu":
            act = ops.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        else:
            act = ops.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
        if c.sandwich_norms:
            out = self.linear(act, f"layers.{layer}.down", c.hidden_size)
            return h + self.norm(out, f"layers.{layer}.post_ff_norm")
        return self.linear(act, f"layers.{layer}.down", c.hidden_size, h)

    def logits(self, h_last: TensorValue) -> TensorValue:
        """Final-normed rows ``[B, H]`` -> float32 logits ``[B, vocab]`` (soft-capped
        with ``final_logit_softcap``)."""
        c = self.config
        if self.packed or not c.tie_word_embeddings:
            logits = self.linear(h_last, "lm_head", c.vocab_size)
        else:
            logits = h_last @ self.weight("embed_tokens").T
        if logits.dtype != DType.float32:
            logits = ops.cast(logits, DType.float32)
        cap = c.final_logit_softcap
        if cap is not None:
            k = ops.constant(cap, DType.float32, device=logits.device)
            logits = ops.tanh(logits / k) * k
        return logits
