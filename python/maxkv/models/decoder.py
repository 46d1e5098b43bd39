"""The decoder of every family as a MAX graph over maxkv's continuous-batching cache.

Built from shared blocks whose options a :class:`~maxkv.models.config.DecoderConfig`
sets (:mod:`maxkv.models.family`): embedding (scaled or not), RMSNorm
(``w`` or ``1 + w``), QKV projection (biased or not; per-head q/k norms),
half-split RoPE from a table per layer type, grouped-query attention through
:mod:`maxkv.ops` (causal, or a sliding window per layer; a query scale),
pre-norm or Gemma's sandwich residuals, SwiGLU or GeGLU MLP, tied or untied
LM head (soft-capped or not), greedy next token.

The compiled graph takes the weights as named graph weights, so one compiled
graph serves every model of the same shapes.  The model computes in the cache's
dtype: float32 (on the CPU through maxkv's packed kernels) or bfloat16 (MAX's
kernels, the GPU's usual dtype; on the CPU too, slowly).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

from .. import ops as kvops
from ..cache.params import KVCacheParams
from ..cache.protocol import KVCacheManagerBase
from ..cache.spec import CacheInputs, CacheSpec, HybridCacheSpec
from ..cpu.arrays import aligned
from ..cpu.features import int8_dot_products, usable_cores
from ..cpu.quantized import TILE, BlockQuantized, HeldMatrix, PackedFormat, TileBuilder
from ..errors import ArgumentTypeError
from ..graph.types import KVCacheCollection
from ..graph.types import layer_collections as spec_layer_collections
from ..kernels import kernels_path, load_graph
from .blocks import Blocks, embedding_table, matrix_of, part_rows, piece_name, pieces
from .config import DecoderConfig, check_weights
from .held import FileBlocks, HeldWeights, check_held
from .memory import check_fits
from .packed_cache import load_or_pack


def cache_params(
    config: DecoderConfig, dtype: DType = DType.float32, cache_dtype: DType | str | None = None
) -> KVCacheParams:
    """The :class:`KVCacheParams` a manager for this model needs (``dtype``: the
    model's, one of :data:`MODEL_DTYPES`; ``cache_dtype``: the cache's encoding,
    default ``dtype``)."""
    return KVCacheParams(
        dtype,
        config.num_key_value_heads,
        config.head_dim,
        cache_dtype=cache_dtype,  # validated (and a str resolved) by KVCacheParams
    )


#: The dtypes the model computes in.
MODEL_DTYPES: tuple[DType, ...] = (DType.float32, DType.bfloat16)


def uses_packed_kernels(device: DeviceRef, dtype: DType = DType.float32) -> bool:
    """Whether the graph for ``device`` and ``dtype`` multiplies through maxkv's packed
    CPU kernels (float32 on the CPU) rather than MAX's matmul (everything else)."""
    return bool(device.is_cpu()) and dtype == DType.float32


def bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """``array`` rounded to bfloat16 (nearest even, as ``torch`` casts), as the
    uint16 bit patterns NumPy can hold (it has no bfloat16)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)


def bfloat16_buffer(array: np.ndarray) -> Buffer:
    """A host bfloat16 :class:`~max.driver.Buffer` of ``array`` (:func:`bfloat16_bits`)."""
    rounded = bfloat16_bits(array)
    return Buffer.from_numpy(rounded).view(DType.bfloat16, list(rounded.shape))


#: What the graph returns per sequence: its greedy next token (int64
#: ``[batch]``, the demo and scheduler) or the float32 logits of its last
#: token (``[batch, vocab]``, for an external sampler such as MAX's pipelines).
OutputKind = Literal["tokens", "logits"]
OUTPUT_KINDS: tuple[str, ...] = ("tokens", "logits")

#: The rows the LM head reads: each sequence's last token (``"last"``), or
#: the rows an extra int64 ``[n]`` input names (``"given"``: every row of a
#: sequence whose draft tokens are checked in one step, speculative decoding).
HeadRows = Literal["last", "given"]
HEAD_ROWS: tuple[str, ...] = ("last", "given")


def matrix_sources(config: DecoderConfig, *, packed: bool) -> dict[str, list[str]]:
    """Graph matrix name -> the Hugging Face weights stacked (by rows) into it.

    Per layer ``wqkv`` (Q, K, V), ``wo``, ``gate_up`` (gate, up) and
    ``down``; ``lm_head`` (the embedding when tied) where the graph
    multiplies by it as a matrix (always when ``packed``).
    """
    sources: dict[str, list[str]] = {}
    if packed or not config.tie_word_embeddings:
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        sources["lm_head"] = [head]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        sources[f"layers.{i}.wqkv"] = [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")]
        sources[f"layers.{i}.wo"] = [p + "self_attn.o_proj.weight"]
        sources[f"layers.{i}.gate_up"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        sources[f"layers.{i}.down"] = [p + "mlp.down_proj.weight"]
    return sources


def vector_sources(config: DecoderConfig) -> dict[str, str]:
    """Graph weight name -> the Hugging Face weight it is, for the embedding, the
    norms and the output bias (the weights :func:`matrix_sources` does not
    stack; the QKV bias is stacked by :func:`graph_weights`, the RoPE tables
    are computed)."""
    sources = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        sources[f"layers.{i}.input_norm"] = p + "input_layernorm.weight"
        sources[f"layers.{i}.post_norm"] = p + "post_attention_layernorm.weight"
        if config.o_bias:
            sources[f"layers.{i}.o_bias"] = p + "self_attn.o_proj.bias"
        if config.qk_norm:
            sources[f"layers.{i}.q_norm"] = p + "self_attn.q_norm.weight"
            sources[f"layers.{i}.k_norm"] = p + "self_attn.k_norm.weight"
        if config.sandwich_norms:
            sources[f"layers.{i}.pre_ff_norm"] = p + "pre_feedforward_layernorm.weight"
            sources[f"layers.{i}.post_ff_norm"] = p + "post_feedforward_layernorm.weight"
    return sources


def graph_weights(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    *,
    packed: bool,
    quantized: Mapping[str, HeldMatrix] | None = None,
    greedy_head: bool = False,
    dtype: DType = DType.float32,
    activations: str = "float32",
) -> dict[str, np.ndarray | Buffer]:
    """The weights as :func:`build_decoder_graph` names and lays them out.

    Per layer the Q, K and V projections are concatenated into one ``wqkv``
    ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]`` and the gate and up
    projections into one ``gate_up`` ``[2 * intermediate, hidden]``, so each
    is one matmul (:func:`matrix_sources`).  With ``packed`` (CPU) every
    matrix, and the LM head, is packed by :func:`maxkv.ops.pack_linear_weight`
    for :func:`maxkv.ops.linear_packed`; otherwise they stay ``[out, in]``
    (``x @ w.T``).  The RoPE table covers the model's whole context.

    ``weights`` a :class:`~maxkv.models.held.HeldWeights` (a GGUF file's or a
    16-bit checkpoint's): a
    matrix all of whose sources are held as blocks is packed from them alone,
    ``<name>.q`` and ``<name>.sm`` (:meth:`BlockQuantized.pack`), with no
    float32 ``<name>``, and no float32 copy made on the way: every step reads
    it, with the float32 results' bits (:func:`maxkv.ops.linear_packed`).
    The held matrices are read one at a time and their file pages released
    after.  ``quantized`` (CPU only): block-quantized copies of some float32
    weights (Hugging Face names); a matrix whose stacked copy holds exactly
    its float32 values (checked weight by weight) is held as that copy alone
    the same way.  Other matrices of held sources (stacked with a dense one,
    or the greedy head's) are dequantized.  A held embedding is laid out as
    tiles too (:func:`maxkv.ops.gather_quantized` reads its rows); where the
    head is tied and held as a copy, the embedding reads the head's copy and
    has no weight of its own (:func:`~maxkv.models.blocks.embedding_table`).

    ``greedy_head`` (CPU only): also ``lm_head.greedy_q`` and
    ``lm_head.greedy_info``, :func:`maxkv.ops.pack_greedy_head` of the head,
    for graphs that output tokens through :func:`maxkv.ops.greedy_head`
    (whose exact pass reads the head in float32: the head keeps it).

    ``activations`` (packed): how the held integer matrices are multiplied, one
    of :data:`~maxkv.cpu.quantized.ACTIVATIONS` (``"int8"``: laid out as int8
    copies, :meth:`~maxkv.cpu.quantized.PackedFormat.for_activations`; their
    products are then the int8-quantized activations' instead of the exact
    float32 ones).

    ``dtype`` bfloat16 (unpacked only): every weight but the RoPE table
    (float32) as a host bfloat16 :class:`~max.driver.Buffer`.

    Raises:
        ModelLoadError: If a weight is missing or mis-shaped.
    """
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"the model computes in one of {MODEL_DTYPES}, not {dtype}")
    if dtype != DType.float32 and packed:
        raise ValueError("packed weights are float32")
    held: FileBlocks | None = None
    w: Mapping[str, np.ndarray]
    if isinstance(weights, HeldWeights):
        w = check_held(config, weights)
        held = weights.blocks
    else:
        w = check_weights(config, weights)
    out: dict[str, np.ndarray] = config.rope_tables()
    quant_formats: dict[str, PackedFormat] = {}
    # The file's blocks, read by every step (and gathered from, for the embedding).
    stems = held_pieces(config, held, greedy_head=greedy_head) if packed and held else {}
    pack = functools.partial(_held_tiles, activations=activations)
    for stem, (q, sm, fmt) in (
        load_or_pack(held, stems, pack, activations) if held else {}
    ).items():
        out[f"{stem}.q"], out[f"{stem}.sm"], quant_formats[stem] = q, sm, fmt
    if config.qkv_bias:
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            out[f"layers.{i}.qkv_bias"] = np.concatenate([w[p + f"{n}_proj.bias"] for n in "qkv"])
    for name, parts in matrix_sources(config, packed=packed).items():
        # The greedy head's exact pass reads the head in float32.
        as_copy = packed and not (greedy_head and name == "lm_head")
        if name in quant_formats:  # held, as one piece or several
            continue
        matrix = np.concatenate([w[part] for part in parts]) if len(parts) > 1 else w[parts[0]]
        matrix = np.ascontiguousarray(matrix, dtype=np.float32)
        if as_copy and quantized and all(part in quantized for part in parts):
            blocks = [c for c in (quantized[p] for p in parts) if isinstance(c, BlockQuantized)]
            copy = BlockQuantized.concat(blocks) if len(blocks) == len(parts) else None
            if copy is not None and copy.exactly(matrix):  # held as the file stores it
                out[f"{name}.q"], out[f"{name}.sm"] = copy.pack(activations)
                quant_formats[name] = copy.format.for_activations(activations)
                continue
        out[name] = kvops.pack_linear_weight(matrix) if packed else matrix
    # A tied head held as a copy alone is the embedding's table too.
    shared = embedding_table(config, quant_formats) == "lm_head"
    for name, source in vector_sources(config).items():
        if name not in quant_formats and not (shared and name == "embed_tokens"):
            out[name] = w[source]
    if greedy_head:
        if not packed:
            raise ValueError("the greedy head's int8 copy is read on the CPU only")
        head = matrix_sources(config, packed=True)["lm_head"][0]
        out["lm_head.greedy_q"], out["lm_head.greedy_info"] = kvops.pack_greedy_head(w[head])
    if held is not None:
        held.release()
    # On a cache line each: MAX hands these arrays to the kernels where they lie.
    prepared = {name: aligned(a, _weight_dtype(name).to_numpy()) for name, a in out.items()}
    expected = graph_weight_shapes(
        config, packed=packed, quant_formats=quant_formats, greedy_head=greedy_head
    )
    assert {n: a.shape for n, a in prepared.items()} == expected, "graph weight layout drifted"
    if dtype == DType.float32:
        return dict(prepared)
    return {
        name: a if _weight_dtype(name, dtype) == DType.float32 else bfloat16_buffer(a)
        for name, a in prepared.items()
    }


def held_pieces(
    config: DecoderConfig, blocks: FileBlocks, *, greedy_head: bool = False
) -> dict[str, list[str]]:
    """The graph weights a packed graph lays out from ``blocks`` (the matrices a
    file holds as blocks), stem -> the held matrices stacked into it: every matrix
    of :func:`matrix_sources` all of whose parts are held (but the head of a
    ``greedy_head`` graph, read in float32), in pieces where its parts' formats
    differ (:func:`~maxkv.models.blocks.piece_name`: a Q6_K V beside Q4_K Q and K
    rows would widen them to 6 bits), and ``embed_tokens`` unless a tied head held
    so holds it already (:func:`~maxkv.models.blocks.embedding_table`)."""
    held: dict[str, list[str]] = {}
    for name, parts in matrix_sources(config, packed=True).items():
        if (greedy_head and name == "lm_head") or not all(p in blocks for p in parts):
            continue
        start = 0
        for end in range(1, len(parts) + 1):
            if end == len(parts) or blocks.format(parts[end]) != blocks.format(parts[start]):
                held[piece_name(name, start)] = parts[start:end]
                start = end
    embed = vector_sources(config)["embed_tokens"]
    if embed in blocks and embedding_table(config, held) == "embed_tokens":
        held["embed_tokens"] = [embed]
    return held


def held_formats(
    config: DecoderConfig, blocks: FileBlocks, *, greedy_head: bool = False
) -> dict[str, PackedFormat]:
    """:func:`held_pieces`' stems and the format each is laid out in."""
    return {
        stem: blocks.stacked(parts)[0]
        for stem, parts in held_pieces(config, blocks, greedy_head=greedy_head).items()
    }


def graph_weight_bytes(
    config: DecoderConfig,
    weights: Mapping[str, np.ndarray],
    *,
    packed: bool,
    greedy_head: bool = False,
    dtype: DType = DType.float32,
) -> int:
    """The bytes :func:`graph_weights` will hold for these weights, computed from
    shapes and formats alone (nothing is read): what the model needs beyond its
    KV cache (:func:`maxkv.models.memory.check_fits`)."""
    formats: Mapping[str, PackedFormat] = {}
    if packed and isinstance(weights, HeldWeights):
        formats = held_formats(config, weights.blocks, greedy_head=greedy_head)
    shapes = graph_weight_shapes(
        config, packed=packed, quant_formats=formats, greedy_head=greedy_head
    )
    return sum(
        math.prod(shape) * _weight_dtype(name, dtype).size_in_bytes
        for name, shape in shapes.items()
    )


#: Weights of a held matrix read from its file at a time while packing (whole
#: tiles of 64 rows, at least one): its temporaries (a few bytes a weight) stay
#: below glibc's 32 MiB ceiling for reusing freed memory, so a load does not
#: fault in fresh pages for every piece (a third of the 8B's packing time).
PACK_WEIGHTS = 1 << 22
#: At most this many matrices are packed at once (one a core): what a load holds
#: beyond the packed weights is a few of these pieces and file pages.
PACK_THREADS = 8


def _held_tiles(
    blocks: FileBlocks, matrices: Mapping[str, Sequence[str]], *, activations: str = "float32"
) -> dict[str, tuple[np.ndarray, np.ndarray, PackedFormat]]:
    """Graph weight name -> ``(q, sm, format)``: each entry's held matrices stacked by
    rows in the tile layout (:class:`~maxkv.cpu.quantized.TileBuilder`) for
    ``activations`` (:meth:`~maxkv.cpu.quantized.PackedFormat.for_activations`), read
    :data:`PACK_WEIGHTS` weights at a time, one matrix per CPU core at once (up to
    :data:`PACK_THREADS`; NumPy releases the GIL), each part's file pages released
    once it is laid out."""

    def lay_out(parts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, PackedFormat]:
        fmt, n, k = blocks.stacked(parts)
        fmt = fmt.for_activations(activations)
        builder = TileBuilder(fmt, n, k)
        row, step = 0, max(PACK_WEIGHTS // k // TILE, 1) * TILE
        for part in parts:
            n = blocks.shape(part)[0]
            for start in range(0, n, step):
                builder.write(row + start, blocks.read(part, start, min(n, start + step)))
            blocks.release(part)
            row += n
        return builder.q, builder.sm, fmt

    workers = min(usable_cores(), PACK_THREADS, max(len(matrices), 1))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="maxkv-pack")
    try:
        return dict(zip(matrices, pool.map(lay_out, matrices.values()), strict=True))
    finally:  # on an error, the matrices not started are not read
        pool.shutdown(cancel_futures=True)


def _weight_dtype(name: str, dtype: DType = DType.float32) -> DType:
    """The dtype of graph weight ``name`` in a ``dtype`` model: uint8 for the
    quantized copies, float32 for the RoPE table and the greedy head's scales."""
    if name.endswith((".q", ".greedy_q")):
        return DType.uint8
    if name.endswith(("freqs_cis", ".sm")) or name == "lm_head.greedy_info":
        return DType.float32
    return dtype


def quantized_formats(registry: Mapping[str, Any]) -> dict[str, PackedFormat]:
    """Matrix name -> layout of its quantized copy in a :func:`graph_weights` registry
    (``embed_tokens`` too where it has its own)."""
    formats = {}
    for name, q in registry.items():
        if not name.endswith(".q"):
            continue
        matrix = name[: -len(".q")]
        formats[matrix] = PackedFormat.of(q.shape, registry[matrix + ".sm"].shape)
    return formats


def graph_weight_shapes(
    config: DecoderConfig,
    *,
    packed: bool,
    quant_formats: Mapping[str, PackedFormat] | None = None,
    greedy_head: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Name and shape of every graph weight of ``config`` (see :func:`graph_weights`).

    ``quant_formats``: matrix name -> the
    :class:`~maxkv.cpu.quantized.PackedFormat` of each matrix held as a
    quantized copy (``<name>.q`` and ``<name>.sm`` instead of ``<name>``);
    ``greedy_head``: with the head's int8 copy for :func:`maxkv.ops.greedy_head`.
    """
    c = config

    bc = kvops.packed_block_cols()

    def matrix(out_features: int, in_features: int) -> tuple[int, ...]:
        if packed:
            tiles = -(-out_features // kvops.PACKED_TILE)
            return (tiles, kvops.PACKED_TILE // bc, in_features, bc)
        return (out_features, in_features)

    shapes: dict[str, tuple[int, ...]] = {
        name: (c.max_position_embeddings, c.head_dim) for name in c.ropes()
    }
    shapes |= {"embed_tokens": (c.vocab_size, c.hidden_size), "norm": (c.hidden_size,)}
    if packed or not c.tie_word_embeddings:
        shapes["lm_head"] = matrix(c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        qkv = sum(part_rows(c, f"layers.{i}.wqkv"))
        shapes |= {
            f"layers.{i}.input_norm": (c.hidden_size,),
            f"layers.{i}.post_norm": (c.hidden_size,),
            f"layers.{i}.wqkv": matrix(qkv, c.hidden_size),
            f"layers.{i}.wo": matrix(c.hidden_size, c.num_attention_heads * c.head_dim),
            f"layers.{i}.gate_up": matrix(sum(part_rows(c, f"layers.{i}.gate_up")), c.hidden_size),
            f"layers.{i}.down": matrix(c.hidden_size, c.intermediate_size),
        }
        if c.qkv_bias:
            shapes[f"layers.{i}.qkv_bias"] = (qkv,)
        if c.o_bias:
            shapes[f"layers.{i}.o_bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes |= {f"layers.{i}.q_norm": (c.head_dim,), f"layers.{i}.k_norm": (c.head_dim,)}
        if c.sandwich_norms:
            shapes |= {
                f"layers.{i}.pre_ff_norm": (c.hidden_size,),
                f"layers.{i}.post_ff_norm": (c.hidden_size,),
            }
    formats = quant_formats or {}
    if embedding_table(c, formats) == "lm_head":  # gathered from the tied head's copy
        del shapes["embed_tokens"]
    held = {matrix_of(stem) for stem in formats if stem != "embed_tokens"}
    in_features = {name: shapes.pop(name)[2] for name in held}
    for stem, fmt in formats.items():  # held as the copy alone (in pieces, or one)
        if stem == "embed_tokens":  # gathered from its own tiles
            n, k = shapes.pop(stem)
        else:
            whole = matrix_of(stem)
            n, k = dict(pieces(c, whole, formats))[stem], in_features[whole]
        shapes[f"{stem}.q"], shapes[f"{stem}.sm"] = fmt.shapes(n, k)
    if greedy_head:
        tiles = -(-c.vocab_size // kvops.PACKED_TILE)
        layout = kvops.greedy_head_layout() or "vnni"
        shapes["lm_head.greedy_q"] = kvops.greedy_q_shape(c.vocab_size, c.hidden_size, layout)
        shapes["lm_head.greedy_info"] = (4, tiles * kvops.PACKED_TILE)
    return shapes


def build_decoder_graph(
    config: DecoderConfig,
    params: KVCacheParams,
    cache_types: Sequence[TensorType],
    layer_collections: Callable[[Sequence[Any]], list[tuple[KVCacheCollection, int]]],
    device: DeviceRef,
    output: OutputKind = "tokens",
    quant_formats: Mapping[str, PackedFormat] | None = None,
    greedy_head: bool = False,
    head_rows: HeadRows = "last",
) -> Graph:
    """The decoder as one MAX graph over a maxkv cache collection.

    Inputs: token ids int64 ``[total_tokens]``, ``input_row_offsets`` uint32
    ``[batch + 1]`` (both on ``device``), then ``cache_types`` (one device's
    cache inputs, turned into each layer's collection and index there by
    ``layer_collections``: :func:`maxkv.graph.types.layer_collections` of a
    spec, or of a hybrid spec, whose layer groups have collections of their own).
    Output: see :data:`OutputKind` (logits float32 whatever the model's
    dtype).  The model computes in ``params.dtype`` (:data:`MODEL_DTYPES`).
    Weights are graph weights named and laid out as :func:`graph_weights`
    does for ``device`` and that dtype (packed for float32 on the CPU);
    ``quant_formats`` names the matrices that have a quantized copy
    (:func:`quantized_formats` of that registry).  ``greedy_head`` (CPU,
    ``output="tokens"``): the next tokens come from
    :func:`maxkv.ops.greedy_head` (the same tokens as the argmax of every
    logit, see there); the registry then holds its weights.
    ``head_rows="given"`` (:data:`HeadRows`): a last input, int64 row indices
    ``[n]`` into ``total_tokens``, names the rows the head reads; the output
    then has ``n`` rows instead of ``batch``.
    """
    if output not in OUTPUT_KINDS:
        raise ValueError(f"output must be one of {OUTPUT_KINDS}, got {output!r}")
    if head_rows not in HEAD_ROWS:
        raise ValueError(f"head_rows must be one of {HEAD_ROWS}, got {head_rows!r}")
    cfg = config
    dtype = params.dtype
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"the model computes in one of {MODEL_DTYPES}, not {dtype}")
    packed = uses_packed_kernels(device, dtype)
    quant_formats = dict(quant_formats or {})
    if quant_formats and not packed:
        raise ValueError("quantized weight copies are read on the CPU only")
    if greedy_head and (not packed or output != "tokens"):
        raise ValueError("greedy_head needs a CPU graph that outputs tokens")
    shapes = graph_weight_shapes(
        cfg, packed=packed, quant_formats=quant_formats, greedy_head=greedy_head
    )

    weights: dict[str, Weight] = {}

    def weight(name: str) -> Weight:
        """The graph weight ``name``, made once per graph (layers share the RoPE tables)."""
        if name not in weights:
            weights[name] = Weight(name, _weight_dtype(name, dtype), shapes[name], device)
        return weights[name]

    blocks = Blocks(cfg, weight, packed, quant_formats)
    # MAX's fused QKV matmul stores K and V straight from the matmul, so a
    # QKV bias or q/k norms (applied between) need the projection apart.
    projected_apart = cfg.qkv_bias or cfg.qk_norm
    input_types = [
        TensorType(DType.int64, ["total_tokens"], device),
        TensorType(DType.uint32, ["input_row_offsets_len"], device),
        *cache_types,
    ]
    given = head_rows == "given"
    if given:
        input_types.append(TensorType(DType.int64, ["head_rows"], device))
    heads, head_dim = cfg.num_attention_heads, cfg.head_dim
    name = f"maxkv_{cfg.family}_{output}" + ("_given_rows" if given else "")
    with Graph(name, input_types=input_types, custom_extensions=[kernels_path()]) as g:
        tokens, offsets, *cache = (value.tensor for value in g.inputs)
        rows = cache.pop() if given else None
        layers = layer_collections(cache)
        h = blocks.embed(tokens)
        # The rows the head reads: each sequence's last token, or the given ones.
        if rows is not None:
            last = rows  # dimension "head_rows"
        else:
            last = last_token_rows(offsets)
        for i in range(cfg.num_hidden_layers):
            x = blocks.norm(h, f"layers.{i}.input_norm")
            freqs = weight(cfg.rope_name(i))
            kv, li = layers[i]
            if packed:  # projection, then K and V stored and Q and K rotated in one pass
                q = kvops.store_kv_ragged(
                    params, blocks.qkv(x, i), offsets, kv, li, freqs_cis=freqs
                )
                q = q.reshape(["total_tokens", heads, head_dim])
            else:
                if projected_apart:
                    q = kvops.store_kv_ragged(params, blocks.qkv(x, i), offsets, kv, li)
                else:
                    q = kvops.fused_qkv_ragged_matmul(
                        params, x, offsets, weight(f"layers.{i}.wqkv"), kv, li
                    )
                q = q.reshape(["total_tokens", heads, head_dim])
                q = kvops.fused_qk_ragged_rope(params, q, offsets, kv, freqs, li, interleaved=False)
            attn = kvops.flash_attention_ragged(
                params, q, offsets, kv, li, scale=cfg.query_scale, window=cfg.window(i)
            )
            attn = attn.reshape(["total_tokens", heads * head_dim])
            if i == cfg.num_hidden_layers - 1:
                # Every layer's K and V are stored by now, so past the last
                # attention only the rows the head reads matter: the output
                # projection and the MLP of the last layer skip the prompt's
                # other tokens (row-wise ops, so the same values).
                attn, h = ops.gather(attn, last, axis=0), ops.gather(h, last, axis=0)
            h = blocks.attention_residual(attn, h, i)
            h = blocks.mlp_residual(h, i)
        h_last = blocks.norm(h, "norm")
        if greedy_head:
            g.output(
                kvops.greedy_head(
                    h_last,
                    weight("lm_head"),
                    weight("lm_head.greedy_q"),
                    weight("lm_head.greedy_info"),
                    cfg.vocab_size,
                )
            )
            return g
        logits = blocks.logits(h_last)
        if output == "tokens":
            g.output(ops.reshape(ops.argmax(logits, axis=-1), [last.shape[0]]))
        else:
            g.output(logits)
    return g


def last_token_rows(offsets: TensorValue) -> TensorValue:
    """uint32 ``[batch_size + 1]`` row offsets -> int64 ``[batch_size]``: the row
    of each sequence's last token in a step's ragged ``[total_tokens, ...]``
    rows (the rows a head reads)."""
    return ops.cast(ops.rebind(offsets[1:] - 1, ["batch_size"]), DType.int64)


def _check_prepared(
    prepared: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> Mapping[str, Any]:
    """``prepared`` if it holds exactly the graph weights of ``shapes``, each so shaped."""
    missing = sorted(set(shapes) - set(prepared))
    extra = sorted(set(prepared) - set(shapes))
    if missing or extra:
        raise ValueError(f"prepared weights: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in shapes.items():
        found = tuple(int(d) for d in prepared[name].shape)
        if found != shape:
            raise ValueError(f"prepared weight {name} has shape {found}, the graph takes {shape}")
    return prepared


class DecoderModel:
    """The compiled decoder: one step of a ragged batch over a maxkv cache.

    Built from a cache's :class:`~maxkv.cache.spec.CacheSpec` (or a manager,
    whose spec and first device it takes): no cache needs to exist to compile
    it, and one compiled graph serves every manager of that spec, whatever
    its size.  Inputs per :meth:`execute`: token ids int64 ``[total_tokens]``,
    ``input_row_offsets`` uint32 ``[batch + 1]`` and a manager's per-device
    :class:`~maxkv.cache.spec.KVCacheInputs`; output per ``output``
    (:data:`OutputKind`): the next token of each sequence, int64 ``[batch]``
    (left on the device: feed it straight back for the next decode step), or
    its float32 logits ``[batch, vocab]``.

    Weights are graph weights, so one compiled graph serves every model of
    the same configuration (and the same formats).  ``weights`` a
    :class:`~maxkv.models.held.HeldWeights` (a GGUF file's, as
    :func:`~maxkv.models.load_model` returns them): the matrices and the
    embedding it holds as blocks stay so, read by every step with the float32
    results (see :func:`graph_weights`); ``quantized``: block-quantized copies
    of float32 weights, used where exactly equal.  With ``output="tokens"`` on
    an x86 CPU with AVX-512 VNNI or AVX2, and a head held in float32, the
    tokens come from :func:`maxkv.ops.greedy_head` (:attr:`greedy_head`), the
    same tokens as the argmax of every logit at a fraction of the LM head's
    work.  Before laying out any weight on the CPU the model checks that the
    machine has the memory for them
    (:class:`~maxkv.models.memory.InsufficientMemoryError` if not).

    The model computes in the cache's dtype (:data:`MODEL_DTYPES`): float32,
    or bfloat16 through MAX's kernels (a GPU's dtype; on the CPU it runs, slowly).

    Args:
        config: The model's configuration.
        weights: Its weights, under Hugging Face names (float32 NumPy arrays),
            or ``None`` with ``prepared``.
        cache: The cache's spec, or a manager (its spec and first device).
        session: Compiles the graph.
        output: ``"tokens"`` or ``"logits"``.
        quantized: Block-quantized weight copies (CPU).
        device: The device the model runs on, with a spec (default the CPU);
            a manager's first device otherwise.
        prepared: Instead of ``weights``: the graph weights already named,
            stacked and typed as :func:`graph_weights` gives them (shapes per
            :func:`graph_weight_shapes`), as any DLPack arrays, e.g. random
            weights made on a GPU (the benchmarks' 8B-parameter shapes).
        head_rows: ``"given"``: :meth:`execute` takes the rows the head
            reads (:data:`HeadRows`), and returns one token or logits row
            for each.

    Raises:
        ValueError: If the cache does not match the model (heads, head size,
            layers, a dtype outside :data:`MODEL_DTYPES`), ``device`` is given
            with a manager, or not exactly one of ``weights`` and
            ``prepared`` is given, or ``prepared`` misses or mis-shapes a weight.
    """

    def __init__(
        self,
        config: DecoderConfig,
        weights: Mapping[str, np.ndarray] | None,
        cache: CacheSpec | HybridCacheSpec | KVCacheManagerBase,
        session: InferenceSession,
        *,
        output: OutputKind = "tokens",
        quantized: Mapping[str, HeldMatrix] | None = None,
        device: Device | None = None,
        prepared: Mapping[str, Any] | None = None,
        head_rows: HeadRows = "last",
    ) -> None:
        spec: CacheSpec | HybridCacheSpec
        if isinstance(cache, KVCacheManagerBase):
            if device is not None:
                raise ValueError("device comes from the manager; pass a CacheSpec to choose it")
            spec, device = cache.spec, cache.devices[0]
            for layer, kept in enumerate(cache.layer_windows):
                window = config.window(layer)
                if kept is not None and (window is None or window > kept):
                    raise ValueError(
                        f"layer {layer} attends to {window or 'every'} tokens, but the cache "
                        f"gives back the tokens before its last {kept} (sliding_window)"
                    )
        elif isinstance(cache, (CacheSpec, HybridCacheSpec)):
            spec, device = cache, device if device is not None else CPU()
        else:
            raise ArgumentTypeError(
                f"cache must be a CacheSpec or a manager, got {type(cache).__name__}"
            )
        params = cache_params(config, spec.params.dtype, spec.params.cache_dtype)
        if spec.params != params or spec.num_layers != config.num_hidden_layers:
            raise ValueError(
                f"the cache holds {spec.params} x {spec.num_layers} layers; the model "
                f"needs {params} x {config.num_hidden_layers} layers"
            )
        dtype = spec.params.dtype
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"maxkv's decoder computes in one of {MODEL_DTYPES}, not {dtype}")
        if (weights is None) == (prepared is None):
            raise ValueError("give the model exactly one of weights and prepared")
        self.config = config
        self.params = params
        #: The cache this graph was built for.
        self.spec = spec
        self.output: OutputKind = output
        if head_rows not in HEAD_ROWS:
            raise ValueError(f"head_rows must be one of {HEAD_ROWS}, got {head_rows!r}")
        #: Which rows the head reads (:data:`HeadRows`).
        self.head_rows: HeadRows = head_rows
        self.device = device
        ref = DeviceRef.from_device(device)
        packed = uses_packed_kernels(ref, dtype)
        mode = kvops.activations()
        if mode != "float32" and not packed:
            raise ValueError(
                f"MAXKV_ACTIVATIONS={mode} is read by the CPU's float32 kernels; this model "
                f"computes in {dtype} on {device.label}"
            )
        #: Whether next tokens come from :func:`maxkv.ops.greedy_head`.
        head = matrix_sources(config, packed=True)["lm_head"][0]
        self.greedy_head = (
            packed
            and prepared is None
            and output == "tokens"
            and config.hidden_size % 4 == 0
            # A head held as the file's blocks is read as such (its argmax): the
            # greedy head's exact pass would need a float32 copy beside it.
            and not (isinstance(weights, HeldWeights) and head in weights.blocks)
            and kvops.greedy_head_supported()
        )
        registry: Mapping[str, Any]
        if weights is not None:
            needed = graph_weight_bytes(
                config, weights, packed=packed, greedy_head=self.greedy_head, dtype=dtype
            )
            if device.label == "cpu":  # refused before anything large is allocated
                check_fits(f"the {config.family} model", needed)
            registry = graph_weights(
                config,
                weights,
                packed=packed,
                quantized=quantized if packed else None,
                greedy_head=self.greedy_head,
                dtype=dtype,
                activations=mode,
            )
        else:
            assert prepared is not None
            registry = _check_prepared(prepared, graph_weight_shapes(config, packed=packed))
        #: Matrix name -> layout of the quantized copy it is held as (no float32 copy).
        self.quant_formats = quantized_formats(registry)
        #: ``MAXKV_ACTIVATIONS`` as this model reads it.
        self.activations = mode
        #: The matrices multiplied by int8 activations (``MAXKV_ACTIVATIONS=int8``).
        self.int8_matrices = sorted(n for n, f in self.quant_formats.items() if f.int8)
        graph = build_decoder_graph(
            config,
            params,
            spec.input_symbols([ref])[0],
            functools.partial(spec_layer_collections, spec),
            ref,
            output,
            self.quant_formats,
            self.greedy_head,
            head_rows,
        )
        self._model: Model = load_graph(session, graph, weights_registry=registry)
        # The graph reads these arrays where they lie: they live as long as the model.
        self._weights = registry

    def describe_arithmetic(self) -> str:
        """How the linear layers multiply (``MAXKV_ACTIVATIONS``), for a startup log."""
        if self.activations == "float32":
            return "MAXKV_ACTIVATIONS=float32: every matmul in float32 (exact products)"
        held = len(self.int8_matrices)
        if not held:
            return (
                f"MAXKV_ACTIVATIONS={self.activations} changes nothing here: no matrix is "
                "held as integer blocks (a GGUF's), every matmul is float32"
            )
        return (
            f"MAXKV_ACTIVATIONS={self.activations}: the {held} matrices held as integer "
            "blocks are multiplied by activations quantized to int8 per block of 32 or 16 "
            f"({int8_dot_products()}); other matrices and attention in float32"
        )

    @property
    def max_positions(self) -> int:
        """Positions the RoPE table covers (the model's context)."""
        return self.config.max_position_embeddings

    def execute(
        self,
        tokens: Buffer,
        input_row_offsets: Buffer,
        kv: CacheInputs,
        rows: Buffer | None = None,
    ) -> Buffer:
        """Runs one step; returns next tokens or logits (see ``output``) of
        each sequence's last token, or with ``head_rows="given"`` of the rows
        ``rows`` names (int64 ``[n]``, each below ``total_tokens``)."""
        if (rows is None) != (self.head_rows == "last"):
            raise ValueError(
                "rows= names the rows the head reads in a head_rows='given' model, and only there"
            )
        if rows is None:
            (result,) = self._model.execute(tokens, input_row_offsets, *kv)
            return result
        count = tokens.shape[0]
        # Checked on the host before the graph gathers them (a device's rows
        # are copied back: a few bytes).
        picked = (rows if rows.device.is_host else rows.to(CPU())).to_numpy()
        if picked.dtype != np.int64 or ((picked < 0) | (picked >= count)).any():
            raise ValueError(f"rows must be int64 indices below total_tokens = {count}")
        (result,) = self._model.execute(tokens, input_row_offsets, *kv, rows)
        return result


#: The name :class:`DecoderModel` had when maxkv ran Llamas only.
LlamaModel = DecoderModel
