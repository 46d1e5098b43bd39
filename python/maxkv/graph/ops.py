"""The KV-cache graph functions: attention's cache ops over maxkv's Mojo kernels.

Every function here takes an opaque collection, either a
:class:`~maxkv.graph.types.ContinuousBatchingKVCacheCollection` (built by
:class:`~maxkv.graph.types.FetchContinuousBatchingKVCacheCollection`) or a
:class:`~maxkv.graph.types.PagedKVCacheCollection` (built by
:class:`~maxkv.graph.types.FetchPagedKVCacheCollection`), and the
:class:`~maxkv.KVCacheParams` it was built with (MAX 24.x's signatures; they
must match the collection's, which the ops read), checks its arguments at
graph-build time (:mod:`maxkv.graph.checks`), and emits one Mojo op:
``maxkv.<op>`` for the contiguous collection, ``maxkv.paged.<op>`` for the
paged one (one Mojo body, generic over both).  A graph that uses them must
load :func:`maxkv.kernels_path` as a custom extension.  Public as
:mod:`maxkv.ops`, with the CPU kernels of :mod:`maxkv.cpu`.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops
from max.graph.dim import DimLike

from ..cache.params import KVCacheParams
from ..cache.spec import BATCH_DIM
from ..errors import ArgumentTypeError
from .checks import check_bool, check_host, check_on, check_params, check_tensor, static_dim
from .types import KVCacheCollection


def _check_collection(params: KVCacheParams, kv_collection: object) -> KVCacheCollection:
    """The collection, if it is one and was built for ``params``."""
    check_params(params)
    if not isinstance(kv_collection, KVCacheCollection):
        raise ArgumentTypeError(
            "kv_collection must be a ContinuousBatchingKVCacheCollection or a "
            f"PagedKVCacheCollection, got {type(kv_collection).__name__}"
        )
    kv_type = kv_collection.type
    found = dict(kv_type.parameters)
    expected = {
        "dtype_name": params.cache_dtype_name,
        "num_heads": params.n_kv_heads_per_device,
        "head_dim": params.head_dim,
    }
    if kv_type.name != kv_collection.type_name or any(
        found.get(k) != v for k, v in expected.items()
    ):
        raise ValueError(
            f"kv_collection was built for {kv_type.name}{found}, "
            f"but params describe {kv_collection.type_name}{expected}"
        )
    return kv_collection


def _check_same_encoding(params: KVCacheParams, op: str, instead: str) -> None:
    """Refuses an op of MAX's kernels on a cache whose encoding is not the model's dtype."""
    if params.cache_dtype != params.dtype:
        raise ValueError(
            f"{op} runs MAX's kernel, which needs the cache in the model's dtype "
            f"({params.dtype.name}); this cache keeps {params.encoding}: {instead}"
        )


#: ``head_dim`` must be a multiple of this when the cache's encoding is not the
#: model's dtype: maxkv's CPU attention reads rows in SIMD vectors of up to 16 floats.
ENCODED_HEAD_DIM_MULTIPLE = 16


def cache_lengths(
    params: KVCacheParams,
    kv_collection: KVCacheCollection,
    batch_size: DimLike = BATCH_DIM,
) -> TensorValue:
    """Reads each sequence's cache length back through the collection.

    A diagnostic op: what a kernel sees as ``cache_length(b)``.

    Args:
        params: The cache parameters the collection was built with.
        kv_collection: The collection.
        batch_size: The batch dim; the default is the symbolic name that
            ``input_symbols()`` gives ``cache_lengths``.

    Returns:
        uint32 ``[batch_size]`` on the collection's device.
    """
    collection = _check_collection(params, kv_collection)
    device = collection.device
    return ops.inplace_custom(
        collection.op_name("cache_lengths"),
        device=device,
        values=[collection],
        out_types=[TensorType(DType.uint32, [batch_size], device=device)],
        parameters=collection.op_parameters(),
    )[0].tensor


# ------------------------------------------------------------ attention ops

MaskVariant = Literal["causal", "null"]
_MASKS: tuple[str, ...] = ("causal", "null")
_ROPE_DTYPES = (DType.float32, DType.bfloat16, DType.float16)


def check_row_offsets(
    params: KVCacheParams, kv_collection: KVCacheCollection, input_row_offsets: TensorValue
) -> TensorValue:
    """Checks a step's ragged layout against the collection, once per graph.

    Emits ``maxkv[.paged].check_row_offsets``: at run time (CPU) the offsets
    must start at 0 and not decrease, no sequence may bring more than
    ``max_lengths[0, 0]`` new tokens, and every sequence's ``cache_length +
    new tokens`` must have storage; otherwise the graph raises before any
    later op on the device runs (the check is an in-place op, so it sits on
    the device's chain ahead of them).  On GPU only the offsets' count is
    checked.  Every op here calls this for its offsets; the first call for a
    (collection, offsets) pair in a graph emits the check, later calls emit
    nothing, so a model's layers share one check per step.  Each op still
    checks, in O(1), that the offsets end at its own input's row count.

    Args:
        params: The cache parameters the collection was built with.
        kv_collection: The collection.
        input_row_offsets: uint32 ``[batch + 1]`` on the collection's device.

    Returns:
        ``input_row_offsets``, for the ops to take.
    """
    collection = _check_collection(params, kv_collection)
    offsets = check_tensor("input_row_offsets", input_row_offsets, DType.uint32, 1)
    check_on("input_row_offsets", offsets, collection.device)
    key = (Graph.current, offsets._mlir_value)
    if key not in collection.rows_checked:
        ops.inplace_custom(
            collection.op_name("check_row_offsets"),
            device=collection.device,
            values=[offsets, collection],
            parameters=collection.op_parameters(),
        )
        collection.rows_checked.add(key)
    return offsets


def _layer_index(layer_idx: int | TensorValue) -> TensorValue:
    """``layer_idx`` as the uint32 host scalar the Mojo ops read."""
    if isinstance(layer_idx, TensorValue):
        check_tensor("layer_idx", layer_idx, DType.uint32, 0)
        check_host("layer_idx", layer_idx)
        return layer_idx
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)):
        raise ArgumentTypeError(
            f"layer_idx must be an int or a uint32 scalar TensorValue, got "
            f"{type(layer_idx).__name__}"
        )
    if not 0 <= layer_idx < 2**32:
        raise ValueError(f"layer_idx must be in [0, 2**32), got {layer_idx}")
    return ops.constant(np.uint32(layer_idx), DType.uint32, device=DeviceRef.CPU())


def _query_heads(params: KVCacheParams, name: str, n_heads: int) -> int:
    kv_heads = params.n_kv_heads_per_device
    if n_heads <= 0 or n_heads % kv_heads:
        raise ValueError(
            f"{name} implies {n_heads} query heads, which is not a positive multiple of "
            f"n_kv_heads_per_device = {kv_heads}"
        )
    return n_heads


def _check_rope_table(
    params: KVCacheParams,
    freqs_cis: TensorValue,
    dtypes: DType | tuple[DType, ...],
    device: DeviceRef,
    interleaved: object,
) -> None:
    """Validates a RoPE table ``[positions, head_dim]`` of ``dtypes`` on ``device``."""
    check_tensor("freqs_cis", freqs_cis, dtypes, 2)
    if static_dim("freqs_cis", freqs_cis, 1) != params.head_dim:
        raise ValueError(
            f"freqs_cis dim 1 must be head_dim = {params.head_dim}, got {freqs_cis.shape[1]}"
        )
    check_on("freqs_cis", freqs_cis, device)
    check_bool("interleaved", interleaved)


def _check_query(
    params: KVCacheParams,
    input: object,
    input_row_offsets: object,
    kv_collection: object,
) -> tuple[DeviceRef, TensorValue]:
    """Checks a ragged Q ``[total_tokens, n_heads, head_dim]`` and its offsets.

    Returns the collection's device and the offsets.
    """
    collection = _check_collection(params, kv_collection)
    device = collection.device
    query = check_tensor("input", input, params.dtype, 3)
    offsets = check_row_offsets(params, collection, input_row_offsets)
    _query_heads(params, "input", static_dim("input", query, 1))
    if static_dim("input", query, 2) != params.head_dim:
        raise ValueError(f"input dim 2 must be head_dim = {params.head_dim}, got {query.shape[2]}")
    check_on("input", query, device)
    return device, offsets


def fused_qkv_ragged_matmul(
    params: KVCacheParams,
    input: TensorValue,
    input_row_offsets: TensorValue,
    wqkv: TensorValue,
    kv_collection: KVCacheCollection,
    layer_idx: int | TensorValue,
) -> TensorValue:
    """Projects ``input`` to Q, K and V and writes K and V into the cache.

    Computes ``input @ wqkv.T``; the Q part is returned, and each token's K
    and V go into ``layer_idx``'s cache of its sequence at positions
    ``cache_length ..`` (tokens of sequence *b* are rows
    ``input_row_offsets[b] : input_row_offsets[b + 1]``).

    Args:
        params: The cache parameters the collection was built with.
        input: ``[total_tokens, hidden]`` of ``params.dtype``.
        input_row_offsets: uint32 ``[batch + 1]``, on the collection's device.
        wqkv: ``[(n_heads + 2 * n_kv_heads) * head_dim, hidden]`` of
            ``params.dtype`` (Q rows, then K rows, then V rows).
        kv_collection: Either collection (``FetchContinuousBatchingKVCacheCollection`` or
            ``FetchPagedKVCacheCollection``).
        layer_idx: The layer: a Python int or a uint32 scalar on the host.

    Returns:
        Q, ``[total_tokens, n_heads * head_dim]`` of ``params.dtype``.

    Raises:
        ValueError: On a wrong dtype, rank, static dim or head count.
    """
    _check_collection(params, kv_collection)
    _check_same_encoding(
        params, "fused_qkv_ragged_matmul", "project with a matmul and store with store_kv_ragged"
    )
    device = kv_collection.device
    check_tensor("input", input, params.dtype, 2)
    check_tensor("wqkv", wqkv, params.dtype, 2)
    offsets = check_row_offsets(params, kv_collection, input_row_offsets)
    check_on("input", input, device)
    check_on("wqkv", wqkv, device)
    rows = static_dim("wqkv", wqkv, 0)
    kv_width = params.n_kv_heads_per_device * params.head_dim
    if rows % params.head_dim or rows <= 2 * kv_width:
        raise ValueError(
            f"wqkv has {rows} rows; expected (n_heads + 2 * {params.n_kv_heads_per_device}) "
            f"* {params.head_dim}"
        )
    n_heads = _query_heads(
        params, "wqkv", rows // params.head_dim - 2 * params.n_kv_heads_per_device
    )
    if input.shape[1] != wqkv.shape[1]:
        raise ValueError(
            f"input's hidden size {input.shape[1]} differs from wqkv's {wqkv.shape[1]}"
        )
    return ops.inplace_custom(
        kv_collection.op_name("fused_qkv_ragged_matmul"),
        device=device,
        values=[input, offsets, wqkv, kv_collection, _layer_index(layer_idx)],
        out_types=[TensorType(params.dtype, [input.shape[0], n_heads * params.head_dim], device)],
        parameters=kv_collection.kernel_parameters(),
    )[0].tensor


def fused_qk_ragged_rope(
    params: KVCacheParams,
    input: TensorValue,
    input_row_offsets: TensorValue,
    kv_collection: KVCacheCollection,
    freqs_cis: TensorValue,
    layer_idx: int | TensorValue,
    interleaved: bool = False,
) -> TensorValue:
    """Applies rotary embedding to Q and, in place, to the K just written.

    Token *t* of sequence *b* sits at position ``cache_length[b] + t``; its K
    is rotated in ``layer_idx``'s cache, so call this after
    :func:`fused_qkv_ragged_matmul` of the same step.

    Args:
        params: The cache parameters the collection was built with.
        input: Q, ``[total_tokens, n_heads, head_dim]`` of ``params.dtype``.
        input_row_offsets: uint32 ``[batch + 1]``.
        kv_collection: The collection.
        freqs_cis: ``[max_positions, head_dim]`` float; row *p* holds
            ``cos(p θ_0), sin(p θ_0), cos(p θ_1), sin(p θ_1), ...`` (see
            :func:`rope_freqs_cis`).
        layer_idx: The layer: a Python int or a uint32 scalar on the host.
        interleaved: ``True`` rotates pairs ``(x[2i], x[2i+1])`` (GPT-J);
            ``False`` rotates ``(x[i], x[i + head_dim/2])`` (Hugging Face Llama).

    Returns:
        The rotated Q, same shape and dtype as ``input``.
    """
    _check_same_encoding(
        params, "fused_qk_ragged_rope", "rotate while storing, store_kv_ragged(freqs_cis=...)"
    )
    device, offsets = _check_query(params, input, input_row_offsets, kv_collection)
    _check_rope_table(params, freqs_cis, _ROPE_DTYPES, device, interleaved)
    return ops.inplace_custom(
        kv_collection.op_name("fused_qk_ragged_rope"),
        device=device,
        values=[input, offsets, kv_collection, freqs_cis, _layer_index(layer_idx)],
        out_types=[TensorType(input.dtype, input.shape, device)],
        parameters={**kv_collection.kernel_parameters(), "interleaved": interleaved},
    )[0].tensor


def flash_attention_ragged(
    params: KVCacheParams,
    input: TensorValue,
    input_row_offsets: TensorValue,
    kv_collection: KVCacheCollection,
    layer_idx: int | TensorValue,
    mask_variant: MaskVariant = "causal",
    scale: float | None = None,
    window: int | None = None,
) -> TensorValue:
    """Attention of each new token over its sequence's cached keys and values.

    Token *t* of sequence *b* sits at position ``p = cache_length[b] + t``
    and attends to positions ``0 .. p`` of ``layer_idx``'s cache
    (``"causal"``), to ``p - window + 1 .. p`` with a ``window`` (a sliding
    window: its last ``window`` tokens, itself included, as transformers'
    ``sliding_window`` and MAX's ``SLIDING_WINDOW_CAUSAL_MASK``), or to all
    ``cache_length[b] + new_tokens[b]`` of them (``"null"``).  Query heads
    share key/value heads in groups of ``n_heads // n_kv_heads`` (GQA).

    Args:
        params: The cache parameters the collection was built with.
        input: Q, ``[total_tokens, n_heads, head_dim]`` of ``params.dtype``.
        input_row_offsets: uint32 ``[batch + 1]``.
        kv_collection: The collection; this step's K/V must already be written.
        layer_idx: The layer: a Python int or a uint32 scalar on the host.
        mask_variant: ``"causal"`` (default) or ``"null"``.
        scale: Score scale; default ``1 / sqrt(head_dim)``.
        window: A positive int: the causal mask limited to that many tokens;
            ``None`` (default): no window.

    Returns:
        ``[total_tokens, n_heads, head_dim]`` of ``params.dtype``.

    Raises:
        ValueError: On a wrong mask, scale or window (a window with the
            ``"null"`` mask), or a wrong input.
    """
    device, offsets = _check_query(params, input, input_row_offsets, kv_collection)
    if params.cache_dtype != params.dtype:
        if not device.is_cpu():
            raise ValueError(
                f"attention over a {params.encoding} cache from {params.dtype.name} "
                "queries runs on CPU (maxkv's kernel); on a GPU keep the cache in the "
                "model's dtype"
            )
        if params.head_dim % ENCODED_HEAD_DIM_MULTIPLE:
            raise ValueError(
                f"attention over a {params.encoding} cache from {params.dtype.name} "
                f"queries needs head_dim a multiple of {ENCODED_HEAD_DIM_MULTIPLE}, got "
                f"{params.head_dim}"
            )
    if mask_variant not in _MASKS:
        raise ValueError(f"mask_variant must be one of {_MASKS}, got {mask_variant!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(params.head_dim)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    mask_str: str = mask_variant
    if window is not None:
        window = check_window(window)
        if mask_variant != "causal":
            raise ValueError(f"a window limits the causal mask, not {mask_variant!r}")
        mask_str = "sliding_window_causal"
    return ops.inplace_custom(
        kv_collection.op_name("flash_attention_ragged"),
        device=device,
        values=[input, offsets, kv_collection, _layer_index(layer_idx)],
        out_types=[TensorType(input.dtype, input.shape, device)],
        parameters={
            **kv_collection.kernel_parameters(),
            "mask_str": mask_str,
            "window": window or 0,
            "scale": float(scale),
        },
    )[0].tensor


#: The smallest attention window the kernels take: MAX's CPU kernel evaluates
#: a sliding-window mask 128 key positions at a time and refuses (at compile
#: time) a window narrower than that.  Models' windows are 512 tokens or more.
MIN_WINDOW = 128


def check_window(window: object) -> int:
    """``window`` if it is an int in ``[MIN_WINDOW, 2**31)`` (an attention window, in tokens).

    Raises:
        ArgumentTypeError: If it is not an int.
        ValueError: If it is out of that range.
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
        raise ArgumentTypeError(f"window must be an int, got {type(window).__name__}")
    if not MIN_WINDOW <= window < 2**31:
        raise ValueError(
            f"window must be at least {MIN_WINDOW} tokens (MAX's CPU attention masks a window "
            f"{MIN_WINDOW} positions at a time), got {window}"
        )
    return int(window)


def rope_freqs_cis(
    head_dim: int, max_positions: int, theta: float = 10000.0, dtype: type = np.float32
) -> np.ndarray:
    """The ``freqs_cis`` table :func:`fused_qk_ragged_rope` takes, in NumPy.

    Row *p* is ``[cos(p θ_0), sin(p θ_0), cos(p θ_1), ...]`` with
    ``θ_i = theta ** (-2i / head_dim)``: the Llama frequencies.  Shape
    ``[max_positions, head_dim]``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim}")
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    return freqs_cis_table(inv_freq, max_positions, dtype=dtype)


def freqs_cis_table(
    inv_freq: np.ndarray, max_positions: int, scale: float = 1.0, dtype: type = np.float32
) -> np.ndarray:
    """The ``freqs_cis`` layout of any RoPE: row *p* is ``scale *
    [cos(p θ_0), sin(p θ_0), cos(p θ_1), ...]`` for the inverse frequencies
    ``inv_freq`` ``[head_dim / 2]`` (computed in float64, then cast to ``dtype``)."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    table = np.stack([np.cos(angles), np.sin(angles)], axis=-1).reshape(max_positions, -1)
    return (table * scale).astype(dtype)


def store_kv_ragged(
    params: KVCacheParams,
    qkv: TensorValue,
    input_row_offsets: TensorValue,
    kv_collection: KVCacheCollection,
    layer_idx: int | TensorValue,
    *,
    freqs_cis: TensorValue | None = None,
    interleaved: bool = False,
) -> TensorValue:
    """Writes the K and V columns of a fused QKV projection into the cache; returns Q.

    The cache-writing half of :func:`fused_qkv_ragged_matmul`, for graphs that
    compute the projection themselves.
    Token *t* of sequence *b* goes to position ``cache_length[b] + t`` of
    ``layer_idx``, after the same bounds checks as every op (on a GPU, as
    there, only the offsets' count).  For projections the fused matmul
    cannot make: a QKV bias, per-head q/k norms (Qwen, Gemma 3), or
    :func:`maxkv.cpu.linear.linear_packed`'s on the CPU.  On a GPU the cache
    keeps the model's dtype and rotation is :func:`fused_qk_ragged_rope`'s.

    With ``freqs_cis`` (CPU), Q and K are also rotated on the way, in the same
    pass: the same values as this op without it followed by
    :func:`fused_qk_ragged_rope` (MAX's kernel, which on the CPU costs more
    than the copy itself), and a position past ``freqs_cis``'s rows is an
    error.

    Args:
        params: The cache parameters the collection was built with.
        qkv: ``[total_tokens, (n_heads + 2 * n_kv_heads) * head_dim]`` of
            ``params.dtype``: Q columns, then K, then V.
        input_row_offsets: uint32 ``[batch + 1]``.
        kv_collection: The collection.
        layer_idx: The layer: a Python int or a uint32 scalar on the host.
        freqs_cis: float32 ``[max_positions, head_dim]`` on the CPU, as
            :func:`rope_freqs_cis` makes it; ``None`` stores without rotating.
        interleaved: As in :func:`fused_qk_ragged_rope`.

    Returns:
        Q, ``[total_tokens, n_heads * head_dim]`` (rotated with ``freqs_cis``).

    Raises:
        ValueError: On a wrong dtype, rank, width, head count or device.
    """
    _check_collection(params, kv_collection)
    device = kv_collection.device
    if not device.is_cpu():
        if params.cache_dtype != params.dtype:
            raise ValueError(
                f"store_kv_ragged on a GPU needs the cache in the model's dtype "
                f"({params.dtype.name}), not {params.encoding}"
            )
        if freqs_cis is not None:
            raise ValueError(
                "store_kv_ragged rotates on the CPU only; on a GPU store, then fused_qk_ragged_rope"
            )
    check_tensor("qkv", qkv, params.dtype, 2)
    offsets = check_row_offsets(params, kv_collection, input_row_offsets)
    width = static_dim("qkv", qkv, 1)
    kv_width = params.n_kv_heads_per_device * params.head_dim
    q_width = width - 2 * kv_width
    if q_width <= 0 or q_width % params.head_dim:
        raise ValueError(
            f"qkv has {width} columns; expected (n_heads + 2 * {params.n_kv_heads_per_device})"
            f" * {params.head_dim}"
        )
    _query_heads(params, "qkv", q_width // params.head_dim)
    check_on("qkv", qkv, device)
    op, values = "store_kv_ragged", [qkv, offsets, kv_collection]
    parameters = kv_collection.kernel_parameters()
    if freqs_cis is not None:
        _check_rope_table(params, freqs_cis, DType.float32, device, interleaved)
        op, values = "store_kv_rope_ragged", [*values, freqs_cis]
        parameters = {**parameters, "interleaved": interleaved}
    return ops.inplace_custom(
        kv_collection.op_name(op),
        device=device,
        values=[*values, _layer_index(layer_idx)],
        out_types=[TensorType(params.dtype, [qkv.shape[0], q_width], device)],
        parameters=parameters,
    )[0].tensor


def write_kv_ragged(
    params: KVCacheParams,
    keys: TensorValue,
    values: TensorValue,
    input_row_offsets: TensorValue,
    kv_collection: KVCacheCollection,
    layer_idx: int | TensorValue,
) -> TensorValue:
    """Writes precomputed keys and values into the cache of ``layer_idx``.

    Token *t* of sequence *b* (rows ``input_row_offsets[b] ..``) goes to
    position ``cache_length[b] + t``, after the same bounds checks as every op
    (CPU only).  For KV computed outside the model graph (CacheBlend); keys
    must already carry their rotary embedding.

    Args:
        params: The cache parameters the collection was built with.
        keys: ``[total_tokens, n_kv_heads_per_device * head_dim]`` of ``params.dtype``.
        values: Same shape and dtype as ``keys``.
        input_row_offsets: uint32 ``[batch + 1]``.
        kv_collection: Either collection.
        layer_idx: The layer: a Python int or a uint32 scalar on the host.

    Returns:
        uint32 ``[1]``: the rows written.
    """
    collection = _check_collection(params, kv_collection)
    device = collection.device
    if not device.is_cpu():
        raise ValueError("write_kv_ragged runs on CPU")
    kv_width = params.n_kv_heads_per_device * params.head_dim
    for name, value in (("keys", keys), ("values", values)):
        check_tensor(name, value, params.dtype, 2)
        if static_dim(name, value, 1) != kv_width:
            raise ValueError(f"{name} dim 1 must be n_kv_heads_per_device * head_dim = {kv_width}")
        check_on(name, value, device)
    offsets = check_row_offsets(params, collection, input_row_offsets)
    return ops.inplace_custom(
        collection.op_name("write_kv_ragged"),
        device=device,
        values=[keys, values, offsets, collection, _layer_index(layer_idx)],
        out_types=[TensorType(DType.uint32, [1], device)],
        parameters=collection.kernel_parameters(),
    )[0].tensor


def copy_tokens(
    params: KVCacheParams,
    kv_collection: KVCacheCollection,
    token_range: TensorValue,
) -> TensorValue:
    """Copies tokens ``[start, end)`` of batch entry 0 into batch entry 1, every layer.

    The collection must hold two sequences, ``[source, destination]``: keys
    and values of every layer are copied on the collection's device, CPU or
    GPU (``fork``, prefix caching, copy-on-write of a shared page).  On the
    CPU the Mojo op checks that ``end`` is within the source's cache length,
    that both sequences have storage for ``end`` tokens and that no copied
    row is shared; on a GPU the lengths and tables are device memory, and
    the managers' bookkeeping checks the same before they call.

    Args:
        params: The cache parameters the collection was built with.
        kv_collection: The collection of ``[source, destination]``.
        token_range: uint32 ``[2]`` ``(start, end)`` on the host.

    Returns:
        uint32 ``[1]``: the number of tokens copied.
    """
    collection = _check_collection(params, kv_collection)
    device = collection.device
    check_tensor("token_range", token_range, DType.uint32, 1)
    check_host("token_range", token_range)
    return ops.inplace_custom(
        collection.op_name("copy_tokens"),
        device=device,
        values=[collection, token_range],
        out_types=[TensorType(DType.uint32, [1], device)],
        parameters=collection.op_parameters(),
    )[0].tensor
