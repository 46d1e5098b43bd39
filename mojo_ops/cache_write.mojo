"""Ops that write keys and values into the cache directly."""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level

from .checks import check_layer, check_rows
from .collection import ContinuousBatchingKVCacheCollection


@extensibility.register("maxkv.store_kv_ragged")
struct StoreKVRagged:
    """Writes the K and V columns of a fused QKV projection into the cache; returns Q.

    `qkv` is `[total_tokens, (n_q_heads + 2 * num_heads) * head_dim]`: Q
    columns, then K, then V.  Token `t` of sequence `b` goes to position
    `cache_length[b] + t` of `layer_idx`; `output` is the Q columns.
    """

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
        comptime assert is_cpu[target](), "maxkv.store_kv_ragged runs on CPU"
        comptime assert kv.dtype == dtype, "qkv dtype differs from the cache's"
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
            Scalar[kv.dtype]
        ]()
        var q_out = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[
            Scalar[kv.dtype]
        ]()
        for b in range(kv.batch_size):
            var start = Int(input_row_offsets[b])
            var cached = kv.cache_length(b)
            for t in range(Int(input_row_offsets[b + 1]) - start):
                var row = src.unsafe_offset((start + t) * width)
                var q_row = q_out.unsafe_offset((start + t) * q_width)
                for j in range(q_width):
                    q_row[unsafe_offset=j] = row[unsafe_offset=j]
                var k_dst = kv.row_ptr(0, layer, b, cached + t)
                var v_dst = kv.row_ptr(1, layer, b, cached + t)
                for j in range(kv_width):
                    k_dst[unsafe_offset=j] = row[unsafe_offset=q_width + j]
                    v_dst[unsafe_offset=j] = row[unsafe_offset=q_width + kv_width + j]


@extensibility.register("maxkv.copy_prefix")
struct CopyPrefix:
    """Copies the first `length` tokens of batch entry 0 into batch entry 1, all layers.

    The collection is built for two sequences, `[source, destination]`; both
    keys and values of every layer are copied (tokens `0 .. length`), so the
    destination's slot then holds the source's prefix.  `length` is a uint32
    scalar on the host and must not exceed the source's cache length or the
    slots' capacity.  Returns the number of tokens copied.
    """

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        length: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.copy_prefix runs on CPU"
        if kv.batch_size != 2:
            raise Error("maxkv.copy_prefix: the collection must hold [source, destination]")
        var n = Int(length.unsafe_ptr()[0])
        if n > kv.cache_length(0) or n > kv.capacity():
            raise Error(
                "maxkv.copy_prefix: cannot copy ", n, " tokens from a sequence of ",
                kv.cache_length(0), " (capacity ", kv.capacity(), ")",
            )
        if kv.lookup_table[unsafe_offset=0] == kv.lookup_table[unsafe_offset=1]:
            raise Error("maxkv.copy_prefix: source and destination are the same slot")
        output[0] = UInt32(n)
        if n == 0:
            return
        var row = num_heads * head_dim
        var jobs = 2 * kv.num_layers()
        var workers = max(1, min(parallelism_level(None), jobs))

        def work(worker: Int) {imm}:
            for job in range(worker * jobs // workers, (worker + 1) * jobs // workers):
                var kv_idx = job % 2
                var layer = job // 2
                var src = kv.row_ptr(kv_idx, layer, 0, 0)
                var dst = kv.row_ptr(kv_idx, layer, 1, 0)
                var count = n * row
                var i = 0
                while i + 16 <= count:
                    dst.unsafe_store(i, src.unsafe_load[width=16](i))
                    i += 16
                while i < count:
                    dst[unsafe_offset=i] = src[unsafe_offset=i]
                    i += 1

        sync_parallelize(work, workers)
