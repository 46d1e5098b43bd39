"""Graph functions over maxkv's Mojo ops.

Every function here takes an opaque collection, either a
:class:`~maxkv.graph.ContinuousBatchingKVCacheCollection` (built by
:class:`~maxkv.graph.FetchContinuousBatchingKVCacheCollection`) or a
:class:`~maxkv.graph.PagedKVCacheCollection` (built by
:class:`~maxkv.graph.FetchPagedKVCacheCollection`), and the
:class:`~maxkv.params.KVCacheParams` it was built with, validates its
arguments at graph-build time, and emits one Mojo op: ``maxkv.<op>`` for the
contiguous collection, ``maxkv.paged.<op>`` for the paged one (one Mojo body,
generic over both).  A graph that uses them
must load :func:`maxkv.kernels_path` as a custom extension.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Literal

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, TensorType, TensorValue, ops
from max.graph.dim import DimLike

from .arrays import aligned, aligned_zeros
from .graph import BATCH_DIM, KVCacheCollection, same_device
from .params import KVCacheParams


def _check_collection(params: KVCacheParams, kv_collection: object) -> KVCacheCollection:
    if not isinstance(params, KVCacheParams):
        raise TypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
    if not isinstance(kv_collection, KVCacheCollection):
        raise TypeError(
            "kv_collection must be a ContinuousBatchingKVCacheCollection or a "
            f"PagedKVCacheCollection, got {type(kv_collection).__name__}"
        )
    kv_type = kv_collection.type
    found = dict(kv_type.parameters)
    expected = {
        "dtype_name": params.dtype_name,
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


def _kernel_parameters(
    params: KVCacheParams, kv_collection: KVCacheCollection
) -> dict[str, bool | int | str | DType]:
    """The collection's Mojo parameters plus ``dtype``: a kernel parameter that
    no tensor argument carries cannot be inferred, so they are passed again."""
    return {**kv_collection.op_parameters(), "dtype": params.dtype}


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


def _check_tensor(
    name: str, value: object, dtype: DType | tuple[DType, ...], rank: int
) -> TensorValue:
    if not isinstance(value, TensorValue):
        raise TypeError(f"{name} must be a TensorValue, got {type(value).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if value.dtype not in dtypes:
        expected = " or ".join(d.name for d in dtypes)
        raise ValueError(f"{name} must have dtype {expected}, got {value.dtype.name}")
    if value.rank != rank:
        raise ValueError(f"{name} must have rank {rank}, got rank {value.rank} ({value.shape})")
    return value


def _static_dim(name: str, value: TensorValue, axis: int) -> int:
    try:
        return int(value.shape[axis])
    except TypeError:
        raise ValueError(
            f"{name} dim {axis} must be static, got symbolic {value.shape[axis]}"
        ) from None


def _check_row_offsets(input_row_offsets: object, device: DeviceRef) -> TensorValue:
    offsets = _check_tensor("input_row_offsets", input_row_offsets, DType.uint32, 1)
    if not same_device(offsets.device, device):
        raise ValueError(f"input_row_offsets must be on {device}, got {offsets.device}")
    return offsets


def _layer_index(layer_idx: int | TensorValue) -> TensorValue:
    """``layer_idx`` as the uint32 host scalar the Mojo ops read."""
    if isinstance(layer_idx, TensorValue):
        _check_tensor("layer_idx", layer_idx, DType.uint32, 0)
        if not layer_idx.device.is_cpu():
            raise ValueError(f"layer_idx must live on the host, got {layer_idx.device}")
        return layer_idx
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)):
        raise TypeError(
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
    _check_tensor("freqs_cis", freqs_cis, dtypes, 2)
    if _static_dim("freqs_cis", freqs_cis, 1) != params.head_dim:
        raise ValueError(
            f"freqs_cis dim 1 must be head_dim = {params.head_dim}, got {freqs_cis.shape[1]}"
        )
    if not same_device(freqs_cis.device, device):
        raise ValueError(f"freqs_cis must be on {device}, got {freqs_cis.device}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")


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
    query = _check_tensor("input", input, params.dtype, 3)
    offsets = _check_row_offsets(input_row_offsets, device)
    _query_heads(params, "input", _static_dim("input", query, 1))
    if _static_dim("input", query, 2) != params.head_dim:
        raise ValueError(f"input dim 2 must be head_dim = {params.head_dim}, got {query.shape[2]}")
    if not same_device(query.device, device):
        raise ValueError(f"input must be on {device}, got {query.device}")
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
    device = kv_collection.device
    _check_tensor("input", input, params.dtype, 2)
    _check_tensor("wqkv", wqkv, params.dtype, 2)
    offsets = _check_row_offsets(input_row_offsets, device)
    for name, value in (("input", input), ("wqkv", wqkv)):
        if not same_device(value.device, device):
            raise ValueError(f"{name} must be on {device}, got {value.device}")
    rows = _static_dim("wqkv", wqkv, 0)
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
        parameters=_kernel_parameters(params, kv_collection),
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
    device, offsets = _check_query(params, input, input_row_offsets, kv_collection)
    _check_rope_table(params, freqs_cis, _ROPE_DTYPES, device, interleaved)
    return ops.inplace_custom(
        kv_collection.op_name("fused_qk_ragged_rope"),
        device=device,
        values=[input, offsets, kv_collection, freqs_cis, _layer_index(layer_idx)],
        out_types=[TensorType(input.dtype, input.shape, device)],
        parameters={**_kernel_parameters(params, kv_collection), "interleaved": interleaved},
    )[0].tensor


def flash_attention_ragged(
    params: KVCacheParams,
    input: TensorValue,
    input_row_offsets: TensorValue,
    kv_collection: KVCacheCollection,
    layer_idx: int | TensorValue,
    mask_variant: MaskVariant = "causal",
    scale: float | None = None,
) -> TensorValue:
    """Attention of each new token over its sequence's cached keys and values.

    Token *t* of sequence *b* attends to positions ``0 .. cache_length[b] + t``
    of ``layer_idx``'s cache (``"causal"``) or to all
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

    Returns:
        ``[total_tokens, n_heads, head_dim]`` of ``params.dtype``.
    """
    device, offsets = _check_query(params, input, input_row_offsets, kv_collection)
    if mask_variant not in _MASKS:
        raise ValueError(f"mask_variant must be one of {_MASKS}, got {mask_variant!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(params.head_dim)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return ops.inplace_custom(
        kv_collection.op_name("flash_attention_ragged"),
        device=device,
        values=[input, offsets, kv_collection, _layer_index(layer_idx)],
        out_types=[TensorType(input.dtype, input.shape, device)],
        parameters={
            **_kernel_parameters(params, kv_collection),
            "mask_str": mask_variant,
            "scale": float(scale),
        },
    )[0].tensor


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
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    table = np.stack([np.cos(angles), np.sin(angles)], axis=-1).reshape(max_positions, head_dim)
    return table.astype(dtype)


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
    compute the projection themselves (e.g. with :func:`linear_packed`).
    Token *t* of sequence *b* goes to position ``cache_length[b] + t`` of
    ``layer_idx``, after the same bounds checks as every op (CPU only).

    With ``freqs_cis``, Q and K are also rotated on the way, in the same
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
        raise ValueError("store_kv_ragged runs on CPU; use fused_qkv_ragged_matmul on GPU")
    _check_tensor("qkv", qkv, params.dtype, 2)
    offsets = _check_row_offsets(input_row_offsets, device)
    width = _static_dim("qkv", qkv, 1)
    kv_width = params.n_kv_heads_per_device * params.head_dim
    q_width = width - 2 * kv_width
    if q_width <= 0 or q_width % params.head_dim:
        raise ValueError(
            f"qkv has {width} columns; expected (n_heads + 2 * {params.n_kv_heads_per_device})"
            f" * {params.head_dim}"
        )
    _query_heads(params, "qkv", q_width // params.head_dim)
    if not same_device(qkv.device, device):
        raise ValueError(f"qkv must be on {device}, got {qkv.device}")
    op, values = "store_kv_ragged", [qkv, offsets, kv_collection]
    parameters = _kernel_parameters(params, kv_collection)
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
        _check_tensor(name, value, params.dtype, 2)
        if _static_dim(name, value, 1) != kv_width:
            raise ValueError(f"{name} dim 1 must be n_kv_heads_per_device * head_dim = {kv_width}")
        if not same_device(value.device, device):
            raise ValueError(f"{name} must be on {device}, got {value.device}")
    offsets = _check_row_offsets(input_row_offsets, device)
    return ops.inplace_custom(
        collection.op_name("write_kv_ragged"),
        device=device,
        values=[keys, values, offsets, collection, _layer_index(layer_idx)],
        out_types=[TensorType(DType.uint32, [1], device)],
        parameters=_kernel_parameters(params, collection),
    )[0].tensor


def copy_tokens(
    params: KVCacheParams,
    kv_collection: KVCacheCollection,
    token_range: TensorValue,
) -> TensorValue:
    """Copies tokens ``[start, end)`` of batch entry 0 into batch entry 1, every layer.

    The collection must hold two sequences, ``[source, destination]``: keys
    and values of every layer are copied on the device (``fork``, prefix
    caching, copy-on-write of a shared page).  The Mojo op checks (CPU) that
    ``end`` is within the source's cache length, that both sequences have
    storage for ``end`` tokens and that no copied row is shared.

    Args:
        params: The cache parameters the collection was built with.
        kv_collection: The collection of ``[source, destination]``.
        token_range: uint32 ``[2]`` ``(start, end)`` on the host.

    Returns:
        uint32 ``[1]``: the number of tokens copied.
    """
    collection = _check_collection(params, kv_collection)
    device = collection.device
    if not device.is_cpu():
        raise ValueError("copy_tokens runs on CPU")
    _check_tensor("token_range", token_range, DType.uint32, 1)
    if not token_range.device.is_cpu():
        raise ValueError(f"token_range must live on the host, got {token_range.device}")
    return ops.inplace_custom(
        collection.op_name("copy_tokens"),
        device=device,
        values=[collection, token_range],
        out_types=[TensorType(DType.uint32, [1], device)],
        parameters=collection.op_parameters(),
    )[0].tensor


# ------------------------------------------------------------ packed matmul

#: Output columns per tile of a weight packed by :func:`pack_linear_weight`.
PACKED_TILE = 64
#: Column-block widths :func:`linear_packed` takes (see :func:`packed_block_cols`).
BLOCK_COLS = (16, 64)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This host's CPU feature flags from ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def packed_block_cols() -> int:
    """The column-block width :func:`pack_linear_weight` uses on this host.

    64 on x86 CPUs with AVX-512 (32 vector registers hold a 4 x 64 block of
    outputs), 16 elsewhere (AVX2's 16 registers hold 6 x 16).  Either width
    gives the same results on any CPU; this one is the fast one here.
    """
    return 64 if "avx512f" in _cpu_flags() else 16


def pack_linear_weight(weight: np.ndarray, block_cols: int | None = None) -> np.ndarray:
    """Packs a float32 ``[N, K]`` weight for :func:`linear_packed`.

    Returns ``[ceil(N / 64), 64 / block_cols, K, block_cols]``: tile *t*,
    column block *b*, row *k* holds ``weight[64 t + block_cols b : 64 t +
    block_cols (b + 1), k]``, zero-padded past ``N``, so that each of the
    kernel's register blocks reads its weights contiguously.  ``block_cols``
    (16 or 64) defaults to :func:`packed_block_cols`.  The array starts on a
    cache line (:mod:`maxkv.arrays`), as the kernel's vector loads want.
    """
    bc = packed_block_cols() if block_cols is None else block_cols
    if bc not in BLOCK_COLS:
        raise ValueError(f"block_cols must be one of {BLOCK_COLS}, got {block_cols!r}")
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be [N, K], got shape {w.shape}")
    n, k = w.shape
    tiles = -(-n // PACKED_TILE)
    blocks = PACKED_TILE // bc
    packed = aligned_zeros((tiles, blocks, k, bc), np.float32)
    full = n // bc  # column blocks with no padding
    flat = packed.reshape(tiles * blocks, k, bc)
    flat[:full] = w[: full * bc].reshape(full, bc, k).transpose(0, 2, 1)
    if n > full * bc:
        flat[full, :, : n - full * bc] = w[full * bc :].T
    return packed


def linear_packed(
    x: TensorValue,
    w_packed: TensorValue,
    out_features: int,
    quantized: tuple[TensorValue, TensorValue] | None = None,
    *,
    residual: TensorValue | None = None,
) -> TensorValue:
    """``x @ w.T`` with ``w`` packed by :func:`pack_linear_weight` (CPU, float32).

    Faster than MAX's CPU matmul at the few rows of a decode step, which
    packs ``w`` again on every call; every weight is streamed once.  With
    ``quantized``, a block-quantized copy of the same weights
    (:meth:`maxkv.quantized.BlockQuantized.pack`, checked exact with
    :meth:`~maxkv.quantized.BlockQuantized.exactly`), steps of at most 8
    rows read that copy instead: 4 to 7 times fewer bytes, bit-identical
    results.

    Args:
        x: float32 ``[M, K]`` on the CPU.
        w_packed: float32 ``[ceil(out_features / 64), 64 / block_cols, K,
            block_cols]`` on the CPU (:func:`pack_linear_weight`).
        out_features: ``N``, the rows of the unpacked weight.
        quantized: ``(q, sm)``: uint8 ``[ceil(N / 64), K, 64 * bits / 8]``
            (bits 4 or 8) and float32 ``[ceil(N / 64), K / 32, 2, 64]``.
        residual: float32 ``[M, out_features]`` on the CPU: returns
            ``residual + x @ w.T``, added as each output tile is stored (a
            layer's residual add without another pass; the same bits as
            adding afterwards).

    Returns:
        float32 ``[M, out_features]``.
    """
    _check_tensor("x", x, DType.float32, 2)
    _check_tensor("w_packed", w_packed, DType.float32, 4)
    values = [x, w_packed]
    if quantized is not None:
        q, sm = quantized
        _check_tensor("q", q, DType.uint8, 3)
        _check_tensor("sm", sm, DType.float32, 4)
        values += [q, sm]
    if residual is not None:
        _check_tensor("residual", residual, DType.float32, 2)
        values.append(residual)
    names = ("x", "w_packed", *(("q", "sm") if quantized is not None else ()), "residual")
    for name, value in zip(names[: len(values)], values, strict=True):
        if not value.device.is_cpu():
            raise ValueError(f"linear_packed runs on CPU; {name} is on {value.device}")
    if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be a positive int, got {out_features!r}")
    k = _static_dim("x", x, 1)
    tiles, blocks, k_w, bc = (_static_dim("w_packed", w_packed, i) for i in range(4))
    if (
        bc not in BLOCK_COLS
        or blocks * bc != PACKED_TILE
        or k_w != k
        or tiles != -(-out_features // PACKED_TILE)
    ):
        raise ValueError(
            f"w_packed {list(w_packed.shape)} is not a packed [{out_features}, {k}] weight "
            f"(expected [{-(-out_features // PACKED_TILE)}, 64 / b, {k}, b], b in {BLOCK_COLS})"
        )
    if quantized is not None:
        q, sm = quantized
        q_shape = [_static_dim("q", q, i) for i in range(3)]
        sm_shape = [_static_dim("sm", sm, i) for i in range(4)]
        if (
            k % 32
            or q_shape[:2] != [tiles, k]
            or q_shape[2] not in (PACKED_TILE, PACKED_TILE // 2)
            or sm_shape != [tiles, k // 32, 2, PACKED_TILE]
        ):
            raise ValueError(
                f"q {q_shape} / sm {sm_shape} are not a packed quantized [{out_features}, {k}] "
                f"weight (expected [{tiles}, {k}, 64 or 32] / [{tiles}, {k // 32}, 2, 64])"
            )
    if residual is not None and (
        residual.shape[0] != x.shape[0] or _static_dim("residual", residual, 1) != out_features
    ):
        raise ValueError(
            f"residual {list(residual.shape)} must be [{x.shape[0]}, {out_features}]: x @ w.T's"
        )
    op = "maxkv.linear_packed" + ("" if quantized is None else "_q")
    return ops.custom(
        op + ("" if residual is None else "_add"),
        device=x.device,
        values=values,
        out_types=[TensorType(DType.float32, [x.shape[0], out_features], x.device)],
        parameters={"block_cols": bc},
    )[0].tensor


#: Layouts of :func:`pack_greedy_head`'s int8 copy: read by AVX-512 VNNI's
#: VPDPBUSD, or widened to int16 for AVX2's VPMADDWD.
GreedyHeadLayout = Literal["vnni", "avx2"]
GREEDY_HEAD_LAYOUTS: tuple[str, ...] = ("vnni", "avx2")


def greedy_head_layout() -> GreedyHeadLayout | None:
    """The layout :func:`greedy_head` reads on this host, or ``None`` where it cannot run.

    ``"vnni"`` on x86 CPUs with AVX-512 VNNI, ``"avx2"`` on those with AVX2
    and FMA (read from ``/proc/cpuinfo``, Linux); ``MAXKV_GREEDY_HEAD=0``
    turns the op off (models then compute every logit and take their argmax).
    """
    if os.environ.get("MAXKV_GREEDY_HEAD", "1") == "0":
        return None
    flags = _cpu_flags()
    if "avx512_vnni" in flags:
        return "vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def greedy_head_supported() -> bool:
    """Whether this host's CPU runs :func:`greedy_head` (see :func:`greedy_head_layout`)."""
    return greedy_head_layout() is not None


def pack_greedy_head(
    weight: np.ndarray, layout: GreedyHeadLayout | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The int8 copy and error bounds :func:`greedy_head` reads for an LM head.

    Each row of the float32 ``weight`` ``[N, K]`` becomes ``t q``, ``q`` int8
    in ``[-127, 127]``, ``t = max|row| / 127``: an approximation whose error
    the op bounds, not a replacement (the op's tokens come from the float32
    weights).  ``layout`` defaults to :func:`greedy_head_layout` (``"vnni"``
    where the op cannot run).

    Returns:
        ``q``, the int8 bytes as uint8, tile *t* of 64 rows at a time:
        ``"vnni"``: ``[ceil(N / 64), K / 4, 256]`` (group of four columns
        *g*, then 4 x 16 rows of 4 bytes, as VPDPBUSD reads them);
        ``"avx2"``: ``[ceil(N / 64), 2 K, 32]`` (4 blocks of 16 rows, each
        ``[K / 2, 16, 2]``: two consecutive columns per row, as VPMADDWD
        pairs them).  And ``info`` float32 ``[4, 64 ceil(N / 64)]``: per row
        ``t``, ``|w|``, ``|w - t q|`` (both from float64 and rounded up) and
        ``sum(q)``.  Padding rows past ``N`` get ``|w| = 1e30`` so that
        their bounds never decide anything.

    Raises:
        ValueError: If ``weight`` is not a finite ``[N, K]`` matrix with
            ``K`` a multiple of 4, or on an unknown ``layout``.
    """
    layout = layout or greedy_head_layout() or "vnni"
    if layout not in GREEDY_HEAD_LAYOUTS:
        raise ValueError(f"layout must be one of {GREEDY_HEAD_LAYOUTS}, got {layout!r}")
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % 4 or not w.size:
        raise ValueError(f"weight must be [N, K] with K a multiple of 4, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    n, k = w.shape
    tiles = -(-n // PACKED_TILE)
    q = np.zeros((tiles * PACKED_TILE, k), np.int8)
    info = np.zeros((4, tiles * PACKED_TILE), np.float32)
    info[1, n:] = 1e30
    for start in range(0, n, 4096):  # bounded float64 temporaries
        rows = w[start : start + 4096]
        t = np.abs(rows).max(axis=1) / np.float32(127)
        t[t == 0] = 1
        qr = np.clip(np.rint(rows / t[:, None]), -127, 127)
        err = rows.astype(np.float64) - t[:, None].astype(np.float64) * qr
        up = np.float32(1 + 2**-20)
        end = start + len(rows)
        q[start:end] = qr
        info[0, start:end] = t
        info[1, start:end] = np.linalg.norm(rows.astype(np.float64), axis=1).astype(np.float32) * up
        info[2, start:end] = np.linalg.norm(err, axis=1).astype(np.float32) * up
        info[3, start:end] = qr.sum(axis=1)
    if layout == "vnni":
        packed = q.reshape(tiles, 4, 16, k // 4, 4).transpose(0, 3, 1, 2, 4)
    else:
        packed = q.reshape(tiles, 4, 16, k // 2, 2).transpose(0, 1, 3, 2, 4)
    shape = greedy_q_shape(n, k, layout)
    return aligned(packed.reshape(shape)).view(np.uint8), info


def greedy_q_shape(vocab: int, k: int, layout: GreedyHeadLayout) -> tuple[int, int, int]:
    """Shape of :func:`pack_greedy_head`'s int8 copy of a ``[vocab, k]`` head."""
    tiles = -(-vocab // PACKED_TILE)
    if layout == "vnni":
        return (tiles, k // 4, 4 * PACKED_TILE)
    return (tiles, 2 * k, 32)


def greedy_head(
    x: TensorValue,
    w_packed: TensorValue,
    q: TensorValue,
    info: TensorValue,
    vocab: int,
) -> TensorValue:
    """``argmax(x @ w.T, axis=-1)``, exactly, without every float32 logit (CPU).

    The same token per row as :func:`linear_packed` then an argmax (first
    index on ties), from integer approximations (AVX-512 VNNI or AVX2) with
    a rigorous error bound and float32 logits only for the tiles that bound
    cannot rule out (see ``mojo_ops/greedy_head.mojo``).  Needs
    :func:`greedy_head_supported`.

    Args:
        x: float32 ``[M, K]`` on the CPU.
        w_packed: the head as :func:`pack_linear_weight` packs it.
        q, info: :func:`pack_greedy_head` of the same head, in this host's
            :func:`greedy_head_layout`.
        vocab: ``N``, the head's rows.

    Returns:
        int64 ``[M]``.
    """
    _check_tensor("x", x, DType.float32, 2)
    _check_tensor("w_packed", w_packed, DType.float32, 4)
    _check_tensor("q", q, DType.uint8, 3)
    _check_tensor("info", info, DType.float32, 2)
    for name, value in (("x", x), ("w_packed", w_packed), ("q", q), ("info", info)):
        if not value.device.is_cpu():
            raise ValueError(f"greedy_head runs on CPU; {name} is on {value.device}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    k = _static_dim("x", x, 1)
    tiles = -(-vocab // PACKED_TILE)
    bc = _static_dim("w_packed", w_packed, 3)
    layout = greedy_head_layout() or "vnni"
    shapes = {
        "w_packed": (
            [_static_dim("w_packed", w_packed, i) for i in range(4)],
            [tiles, PACKED_TILE // bc, k, bc] if bc in BLOCK_COLS else "a packed head",
        ),
        "q": ([_static_dim("q", q, i) for i in range(3)], list(greedy_q_shape(vocab, k, layout))),
        "info": ([_static_dim("info", info, i) for i in range(2)], [4, tiles * PACKED_TILE]),
    }
    if k % 4:
        raise ValueError(f"greedy_head needs K a multiple of 4, got {k}")
    for name, (got, want) in shapes.items():
        if got != want:
            raise ValueError(f"{name} {got} does not match a [{vocab}, {k}] head (expected {want})")
    return ops.custom(
        "maxkv.greedy_head",
        device=x.device,
        values=[x, w_packed, q, info],
        out_types=[TensorType(DType.int64, [x.shape[0]], x.device)],
        parameters={"vocab": vocab, "block_cols": bc},
    )[0].tensor


def swiglu(gate_up: TensorValue) -> TensorValue:
    """``silu(gate) * up`` of a fused gate/up projection (CPU, float32).

    Args:
        gate_up: float32 ``[tokens, 2 * intermediate]``: gate columns, then up.

    Returns:
        float32 ``[tokens, intermediate]``.
    """
    _check_tensor("gate_up", gate_up, DType.float32, 2)
    if not gate_up.device.is_cpu():
        raise ValueError(f"swiglu runs on CPU; gate_up is on {gate_up.device}")
    width = _static_dim("gate_up", gate_up, 1)
    if width % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {width}")
    return ops.custom(
        "maxkv.swiglu",
        device=gate_up.device,
        values=[gate_up],
        out_types=[TensorType(DType.float32, [gate_up.shape[0], width // 2], gate_up.device)],
    )[0].tensor
