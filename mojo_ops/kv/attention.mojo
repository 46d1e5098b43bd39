"""Attention-layer ops over either collection: fused QKV matmul, RoPE, flash attention.

Each op wraps MAX's own kernel (`nn.kv_cache_ragged`, `nn.fused_qk_rope`),
which are generic over any `KVCollectionT`: a collection's `view()` is MAX's
`ContinuousBatchingKVCacheCollection` or `PagedKVCacheCollection`, so the
kernels run unchanged.  Each body is written once, generic over
`MaxkvKVCollection`; `maxkv.<op>` registers it for the contiguous collection
and `maxkv.paged.<op>` for the paged one.

Inputs are ragged: `input_row_offsets` uint32 `[batch + 1]` gives where each
sequence's tokens start in the flattened `[total_tokens, ...]` tensors, in
the batch order of the collection.  `layer_idx` is a uint32 scalar on the host.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from nn.kv_cache_ragged import (
    _fused_qkv_matmul_kv_cache_ragged,
    generic_flash_attention_kv_cache_ragged,
)
from nn.attention.gpu.mha import MHADecodeDispatchMetadata
from nn.fused_qk_rope import fused_qk_rope_ragged

from max.gpu.host.info import is_cpu

from .checks import check_layer, check_row_count
from .collection import ContinuousBatchingKVCacheCollection
from .decode_attention import W, MAX_GROUP, cpu_attention, cpu_attention_applies, is_decode_step
from .kv_trait import MaxkvKVCollection
from .paged_collection import PagedKVCacheCollection


# ------------------------------------------------------------------ bodies


def fused_qkv_matmul[
    C: MaxkvKVCollection, dtype: DType, target: StaticString
](
    output: OutputTensor[dtype=dtype, rank=2, ...],
    input: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    wqkv: InputTensor[dtype=dtype, rank=2, ...],
    kv: C,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """`output` = Q of `input @ wqkv.T`; K and V are written into the cache of `layer_idx`."""
    var layer = check_layer(kv, layer_idx)
    check_row_count[target](kv, input_row_offsets, input.dim_size(0))
    var view = kv.view()
    _fused_qkv_matmul_kv_cache_ragged[C.View.CacheType, target=target](
        input.to_tile_tensor(),
        input_row_offsets.to_tile_tensor(),
        wqkv.to_tile_tensor(),
        view,
        layer,
        output.to_tile_tensor(),
        ctx,
    )


def fused_qk_rope[
    C: MaxkvKVCollection,
    dtype: DType,
    freq_dtype: DType,
    interleaved: Bool,
    target: StaticString,
](
    output: OutputTensor[dtype=dtype, rank=3, ...],
    input: InputTensor[dtype=dtype, rank=3, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    freqs_cis: InputTensor[dtype=freq_dtype, rank=2, ...],
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Rotary embedding on Q (returned) and, in place, on the K just written."""
    var layer = check_layer(kv, layer_idx)
    check_row_count[target](kv, input_row_offsets, input.dim_size(0))
    var view = kv.view()
    fused_qk_rope_ragged[C.View.CacheType, interleaved=interleaved, target=target](
        input.to_tile_tensor(),
        input_row_offsets.to_tile_tensor(),
        view,
        freqs_cis.to_tile_tensor(),
        None,
        layer,
        output.to_tile_tensor(),
        ctx,
    )


def flash_attention[
    C: MaxkvKVCollection,
    dtype: DType,
    kv_heads: Int,
    head_dim: Int,
    mask_str: StaticString,
    window: Int,
    scale: Float32,
    target: StaticString,
](
    output: OutputTensor[dtype=dtype, rank=3, ...],
    input: InputTensor[dtype=dtype, rank=3, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Ragged flash attention of Q against the cached K/V of `layer_idx` (GQA).

    `mask_str` is "causal", "null" or "sliding_window_causal"; with the last,
    token at position `p` attends to positions `p - window + 1 .. p` (MAX's
    `SlidingWindowCausalMask[window]`, transformers' sliding window), and
    `window` is positive; it is 0 with the other two.

    On CPU maxkv's `cpu_attention` runs a decode step (one new token per
    sequence), a step that verifies speculative drafts (at most `MAX_VERIFY`
    new tokens per sequence) and every step over a cache whose encoding is not the query's
    dtype (MAX's CPU kernel needs them equal); MAX's generic kernel runs the
    rest (prefill and mixed steps over a cache in the model's dtype, and
    every step on a GPU, where the graph side refuses another encoding).
    """
    comptime assert (window > 0) == (mask_str == "sliding_window_causal"), (
        "a window goes with the sliding_window_causal mask, and only with it"
    )
    comptime converts = C.View.dtype != dtype
    var layer = check_layer(kv, layer_idx)
    check_row_count[target](kv, input_row_offsets, input.dim_size(0))
    comptime if is_cpu[target]():
        var q_heads = input.dim_size(1)
        var ours = cpu_attention_applies[head_dim](q_heads, kv_heads)
        comptime if converts:
            if not ours:
                raise Error(
                    "maxkv: attention over a ", C.View.dtype, " cache from ", dtype,
                    " queries needs head_dim (", head_dim, ") a multiple of the SIMD width and",
                    " whole groups of query heads per KV head",
                )
        comptime if head_dim % W == 0:  # otherwise the kernel is not even instantiated
            var decode = q_heads // kv_heads <= MAX_GROUP and is_decode_step(
                input_row_offsets, kv.batch()
            )
            if ours and (converts or decode):
                cpu_attention[
                    kv_heads=kv_heads, head_dim=head_dim, null_mask=mask_str == "null"
                ](output, input, input_row_offsets, kv, Int(layer), scale, window)
                return
    comptime if not converts:
        _max_flash_attention[mask_str=mask_str, window=window, scale=scale, target=target](
            output, input, input_row_offsets, kv, layer, ctx
        )
    else:
        raise Error("maxkv: attention over a cache in another encoding runs on CPU only")


def _max_flash_attention[
    C: MaxkvKVCollection,
    dtype: DType,
    mask_str: StaticString,
    window: Int,
    scale: Float32,
    target: StaticString,
](
    output: OutputTensor[dtype=dtype, rank=3, ...],
    input: InputTensor[dtype=dtype, rank=3, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer: UInt32,
    ctx: DeviceContext,
) raises:
    """MAX's generic ragged flash attention (the cache in the query's dtype)."""
    var view = kv.view()
    var metadata = MHADecodeDispatchMetadata(
        kv.batch(), Int(kv.max_new_tokens()), 0, Int(kv.max_context_length())
    )
    generic_flash_attention_kv_cache_ragged[
        target=target, mask_str=mask_str, local_window_size=window if window > 0 else -1
    ](
        input.to_tile_tensor(),
        input_row_offsets.to_tile_tensor(),
        view,
        layer,
        scale,
        output.to_tile_tensor(),
        ctx,
        metadata,
    )


# ----------------------------------------------------- contiguous collection


@extensibility.register("maxkv.fused_qkv_ragged_matmul")
struct FusedQKVRaggedMatmul:
    """See `fused_qkv_matmul`."""

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
        fused_qkv_matmul[target=target](
            output, input, input_row_offsets, wqkv, kv, layer_idx, ctx
        )


@extensibility.register("maxkv.fused_qk_ragged_rope")
struct FusedQKRaggedRope:
    """See `fused_qk_rope`."""

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
        fused_qk_rope[interleaved=interleaved, target=target](
            output, input, input_row_offsets, kv, freqs_cis, layer_idx, ctx
        )


@extensibility.register("maxkv.flash_attention_ragged")
struct FlashAttentionRagged:
    """See `flash_attention` (`mask_str`, `window`)."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        mask_str: StaticString,
        window: Int,
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
        flash_attention[
            kv_heads=num_heads,
            head_dim=head_dim,
            mask_str=mask_str,
            window=window,
            scale=scale,
            target=target,
        ](
            output, input, input_row_offsets, kv, layer_idx, ctx
        )


# ---------------------------------------------------------- paged collection


@extensibility.register("maxkv.paged.fused_qkv_ragged_matmul")
struct PagedFusedQKVRaggedMatmul:
    """See `fused_qkv_matmul`."""

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
        input: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        wqkv: InputTensor[dtype=dtype, rank=2, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        fused_qkv_matmul[target=target](
            output, input, input_row_offsets, wqkv, kv, layer_idx, ctx
        )


@extensibility.register("maxkv.paged.fused_qk_ragged_rope")
struct PagedFusedQKRaggedRope:
    """See `fused_qk_rope`."""

    @staticmethod
    def execute[
        dtype: DType,
        freq_dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        interleaved: Bool,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        input: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        freqs_cis: InputTensor[dtype=freq_dtype, rank=2, ...],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        fused_qk_rope[interleaved=interleaved, target=target](
            output, input, input_row_offsets, kv, freqs_cis, layer_idx, ctx
        )


@extensibility.register("maxkv.paged.flash_attention_ragged")
struct PagedFlashAttentionRagged:
    """See `flash_attention`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        mask_str: StaticString,
        window: Int,
        scale: Float32,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        input: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        flash_attention[
            kv_heads=num_heads,
            head_dim=head_dim,
            mask_str=mask_str,
            window=window,
            scale=scale,
            target=target,
        ](
            output, input, input_row_offsets, kv, layer_idx, ctx
        )
