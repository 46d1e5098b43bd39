"""Small ops that read the collection back out: for tests and debugging."""

import extensibility
from extensibility import OutputTensor
from max.algorithm.functional import elementwise
from max.gpu.host import DeviceContext
from layout import Coord

from .collection import ContinuousBatchingKVCacheCollection
from .kv_trait import MaxkvKVCollection
from .paged_collection import PagedKVCacheCollection


def read_cache_lengths[
    C: MaxkvKVCollection, target: StaticString
](output: OutputTensor[dtype=DType.uint32, rank=1, ...], kv: C, ctx: DeviceContext) raises:
    """`output[b]` = cache length of batch entry `b`, as MAX's kernels see it."""
    if output.dim_size(0) != kv.batch():
        raise Error("maxkv.cache_lengths: output length differs from the batch size")
    var key_cache = kv.view().get_key_cache(0)

    # Captured by value: a GPU kernel cannot reach this function's stack.
    @always_inline
    @__copy_capture(output, key_cache)
    @parameter
    def read[width: Int, alignment: Int = 1](idx: Coord):
        var b = Int(idx[0].value())
        output[b] = UInt32(key_cache.cache_length(b))

    elementwise[read, simd_width=1, target=target](kv.batch(), ctx)


@extensibility.register("maxkv.cache_lengths")
struct CacheLengths:
    """See `read_cache_lengths`."""

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        ctx: DeviceContext,
    ) raises:
        read_cache_lengths[target=target](output, kv, ctx)


@extensibility.register("maxkv.paged.cache_lengths")
struct PagedCacheLengths:
    """See `read_cache_lengths`."""

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
        ctx: DeviceContext,
    ) raises:
        read_cache_lengths[target=target](output, kv, ctx)
