"""Ops that write keys and values into the cache directly (either collection).

Bodies are generic over `MaxkvKVCollection` and use `row_ptr`, so the same
code writes a contiguous slot or a sequence's pages; `maxkv.<op>` registers
them for the contiguous collection and `maxkv.paged.<op>` for the paged one.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level

from .checks import check_layer, check_rows
from .collection import ContinuousBatchingKVCacheCollection
from .kv_trait import MaxkvKVCollection
from .paged_collection import PagedKVCacheCollection


@always_inline
def _copy_row[
    dtype: DType
](
    dst: UnsafePointer[Scalar[dtype], MutUntrackedOrigin],
    src: UnsafePointer[Scalar[dtype], MutUntrackedOrigin],
    count: Int,
):
    var i = 0
    while i + 16 <= count:
        dst.unsafe_store(i, src.unsafe_load[width=16](i))
        i += 16
    while i < count:
        dst[unsafe_offset=i] = src[unsafe_offset=i]
        i += 1


def store_kv[
    C: MaxkvKVCollection, dtype: DType, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=dtype, rank=2, ...],
    qkv: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Writes the K and V columns of a fused QKV projection into the cache; returns Q.

    `qkv` is `[total_tokens, (n_q_heads + 2 * num_heads) * head_dim]`: Q
    columns, then K, then V.  Token `t` of sequence `b` goes to position
    `cache_length[b] + t` of `layer_idx`; `output` is the Q columns.
    """
    comptime assert is_cpu[target](), "maxkv.store_kv_ragged runs on CPU"
    comptime assert C.View.dtype == dtype, "qkv dtype differs from the cache's"
    comptime kv_width = num_heads * head_dim
    var layer = Int(check_layer(kv, layer_idx))
    var tokens = qkv.dim_size(0)
    check_rows[target](kv, input_row_offsets, tokens)
    var width = qkv.dim_size(1)
    var q_width = output.dim_size(1)
    if output.dim_size(0) != tokens or width != q_width + 2 * kv_width:
        raise Error(
            "maxkv.store_kv_ragged: qkv has ", width, " columns; expected Q (",
            q_width, ") + 2 x ", kv_width,
        )
    var src = qkv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[
        Scalar[C.View.dtype]
    ]()
    var q_out = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[
        Scalar[C.View.dtype]
    ]()
    for b in range(kv.batch()):
        var start = Int(input_row_offsets[b])
        var cached = kv.cache_length(b)
        for t in range(Int(input_row_offsets[b + 1]) - start):
            var row = src.unsafe_offset((start + t) * width)
            _copy_row(q_out.unsafe_offset((start + t) * q_width), row, q_width)
            _copy_row(kv.row_ptr(0, layer, b, cached + t), row.unsafe_offset(q_width), kv_width)
            _copy_row(
                kv.row_ptr(1, layer, b, cached + t),
                row.unsafe_offset(q_width + kv_width),
                kv_width,
            )


def write_kv[
    C: MaxkvKVCollection, dtype: DType, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=DType.uint32, rank=1, ...],
    keys: InputTensor[dtype=dtype, rank=2, ...],
    values: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Writes precomputed K and V rows (`[total_tokens, num_heads * head_dim]`) into
    the cache of `layer_idx`: token `t` of sequence `b` at `cache_length[b] + t`.

    For KV computed outside the model graph (CacheBlend).  Returns the rows written.
    """
    comptime assert is_cpu[target](), "maxkv.write_kv_ragged runs on CPU"
    comptime assert C.View.dtype == dtype, "K/V dtype differs from the cache's"
    comptime kv_width = num_heads * head_dim
    var layer = Int(check_layer(kv, layer_idx))
    var tokens = keys.dim_size(0)
    check_rows[target](kv, input_row_offsets, tokens)
    if (
        values.dim_size(0) != tokens
        or keys.dim_size(1) != kv_width
        or values.dim_size(1) != kv_width
    ):
        raise Error("maxkv.write_kv_ragged: keys and values must be [total_tokens, ", kv_width, "]")
    var k_src = keys.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[
        Scalar[C.View.dtype]
    ]()
    var v_src = values.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[
        Scalar[C.View.dtype]
    ]()
    for b in range(kv.batch()):
        var start = Int(input_row_offsets[b])
        var cached = kv.cache_length(b)
        for t in range(Int(input_row_offsets[b + 1]) - start):
            _copy_row(kv.row_ptr(0, layer, b, cached + t), k_src.unsafe_offset((start + t) * kv_width), kv_width)
            _copy_row(kv.row_ptr(1, layer, b, cached + t), v_src.unsafe_offset((start + t) * kv_width), kv_width)
    output[0] = UInt32(tokens)


def copy_tokens[
    C: MaxkvKVCollection, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    token_range: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Copies tokens `[start, end)` of batch entry 0 into batch entry 1, all layers.

    The collection holds two sequences, `[source, destination]`; keys and
    values of every layer are copied.  `token_range` is the host uint32
    pair `(start, end)`; `end` must not pass the source's cache length and
    both sequences must have storage for `end` tokens, in different rows.
    Returns the number of tokens copied.
    """
    comptime assert is_cpu[target](), "maxkv.copy_tokens runs on CPU"
    if kv.batch() != 2:
        raise Error("maxkv.copy_tokens: the collection must hold [source, destination]")
    if token_range.dim_size(0) != 2:
        raise Error("maxkv.copy_tokens: token_range must be (start, end)")
    var start = Int(token_range.unsafe_ptr()[unsafe_offset=0])
    var end = Int(token_range.unsafe_ptr()[unsafe_offset=1])
    if start > end or end > kv.cache_length(0):
        raise Error(
            "maxkv.copy_tokens: cannot copy tokens [", start, ", ", end, ") of a sequence of ",
            kv.cache_length(0),
        )
    kv.check_extent(0, end)
    kv.check_extent(1, end)
    for t in range(start, end):
        if kv.row_ptr(0, 0, 0, t) == kv.row_ptr(0, 0, 1, t):
            raise Error("maxkv.copy_tokens: source and destination share token ", t)
    output[0] = UInt32(end - start)
    if end == start:
        return
    comptime row = num_heads * head_dim
    var jobs = 2 * kv.num_layers()
    var workers = max(1, min(parallelism_level(None), jobs))

    def work(worker: Int) {imm}:
        for job in range(worker * jobs // workers, (worker + 1) * jobs // workers):
            var kv_idx = job % 2
            var layer = job // 2
            for t in range(start, end):
                _copy_row(kv.row_ptr(kv_idx, layer, 1, t), kv.row_ptr(kv_idx, layer, 0, t), row)

    sync_parallelize(work, workers)


# ----------------------------------------------------- contiguous collection


@extensibility.register("maxkv.store_kv_ragged")
struct StoreKVRagged:
    """See `store_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        qkv: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        store_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, qkv, input_row_offsets, kv, layer_idx
        )


@extensibility.register("maxkv.copy_tokens")
struct CopyTokens:
    """See `copy_tokens`."""

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        token_range: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        copy_tokens[num_heads=num_heads, head_dim=head_dim, target=target](
            output, kv, token_range
        )


# ---------------------------------------------------------- paged collection


@extensibility.register("maxkv.paged.store_kv_ragged")
struct PagedStoreKVRagged:
    """See `store_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        qkv: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        store_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, qkv, input_row_offsets, kv, layer_idx
        )


@extensibility.register("maxkv.paged.copy_tokens")
struct PagedCopyTokens:
    """See `copy_tokens`."""

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        token_range: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        copy_tokens[num_heads=num_heads, head_dim=head_dim, target=target](
            output, kv, token_range
        )


@extensibility.register("maxkv.write_kv_ragged")
struct WriteKVRagged:
    """See `write_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        keys: InputTensor[dtype=dtype, rank=2, ...],
        values: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        write_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, keys, values, input_row_offsets, kv, layer_idx
        )


@extensibility.register("maxkv.paged.write_kv_ragged")
struct PagedWriteKVRagged:
    """See `write_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        keys: InputTensor[dtype=dtype, rank=2, ...],
        values: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        write_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, keys, values, input_row_offsets, kv, layer_idx
        )
