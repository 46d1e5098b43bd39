"""Ops that write keys and values into the cache directly."""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

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
