"""Attention-layer ops over the collection: fused QKV matmul, RoPE, flash attention.

Each op wraps MAX's own kernel (`nn.kv_cache_ragged`, `nn.fused_qk_rope`),
which are generic over any `KVCollectionT`: the collection's `view()` is MAX's
`ContinuousBatchingKVCacheCollection`, so the kernels run unchanged.

Inputs are ragged: `input_row_offsets` uint32 `[batch + 1]` gives where each
sequence's tokens start in the flattened `[total_tokens, ...]` tensors, in
the batch order of the collection.  `layer_idx` is a uint32 scalar on the host.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from nn.kv_cache_ragged import (
    _fused_qkv_matmul_kv_cache_ragged,
    generic_flash_attention_kv_cache_ragged,
)
from nn.attention.gpu.mha import MHADecodeDispatchMetadata
from nn.fused_qk_rope import fused_qk_rope_ragged

from .checks import check_layer, check_rows
from .collection import ContinuousBatchingKVCacheCollection


@extensibility.register("maxkv.fused_qkv_ragged_matmul")
struct FusedQKVRaggedMatmul:
    """`output` = Q of `input @ wqkv.T`; K and V are written into the cache of `layer_idx`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        input: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        wqkv: InputTensor[dtype=dtype, rank=2, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var layer = check_layer(kv, layer_idx)
        check_rows[target](kv, input_row_offsets, input.dim_size(0))
        var view = kv.view()
        _fused_qkv_matmul_kv_cache_ragged[view.CacheType, target=target](
            input.to_tile_tensor(),
            input_row_offsets.to_tile_tensor(),
            wqkv.to_tile_tensor(),
            view,
            layer,
            output.to_tile_tensor(),
            ctx,
        )


@extensibility.register("maxkv.fused_qk_ragged_rope")
struct FusedQKRaggedRope:
    """Rotary embedding on Q (returned) and, in place, on the K just written."""

    @staticmethod
    def execute[
        dtype: DType,
        freq_dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        interleaved: Bool,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        input: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        freqs_cis: InputTensor[dtype=freq_dtype, rank=2, ...],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var layer = check_layer(kv, layer_idx)
        check_rows[target](kv, input_row_offsets, input.dim_size(0))
        var view = kv.view()
        fused_qk_rope_ragged[view.CacheType, interleaved=interleaved, target=target](
            input.to_tile_tensor(),
            input_row_offsets.to_tile_tensor(),
            view,
            freqs_cis.to_tile_tensor(),
            None,
            layer,
            output.to_tile_tensor(),
            ctx,
        )


@extensibility.register("maxkv.flash_attention_ragged")
struct FlashAttentionRagged:
    """Ragged flash attention of Q against the cached K/V of `layer_idx` (GQA).

    `mask_str` is "causal" or "null"; `scale` multiplies the scores.
    """

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        mask_str: StaticString,
        scale: Float32,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        input: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var layer = check_layer(kv, layer_idx)
        check_rows[target](kv, input_row_offsets, input.dim_size(0))
        var view = kv.view()
        var metadata = MHADecodeDispatchMetadata(
            kv.batch_size, Int(kv.max_seq_length), 0, Int(kv.max_cache_length)
        )
        generic_flash_attention_kv_cache_ragged[target=target, mask_str=mask_str](
            input.to_tile_tensor(),
            input_row_offsets.to_tile_tensor(),
            view,
            layer,
            scale,
            output.to_tile_tensor(),
            ctx,
            metadata,
        )
