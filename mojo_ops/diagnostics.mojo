"""Small ops that read the collection back out: for tests and debugging."""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.algorithm.functional import elementwise
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
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

    @parameter
    @always_inline
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


@extensibility.register("maxkv.stream_read")
struct StreamRead:
    """Reads all of `x` once, one contiguous chunk per CPU worker; `output[w]` = chunk sum.

    For benchmarks: bytes of `x` / time is the memory read bandwidth maxkv's
    kernels can reach (CPU only).
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=1, ...],
        x: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.stream_read runs on CPU"
        comptime W = 16
        var n = x.dim_size(0)
        var workers = output.dim_size(0)
        var xp = x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

        def work(worker: Int) {imm}:
            var begin = worker * n // workers
            var end = (worker + 1) * n // workers
            var a0 = SIMD[DType.float32, W](0)
            var a1 = SIMD[DType.float32, W](0)
            var a2 = SIMD[DType.float32, W](0)
            var a3 = SIMD[DType.float32, W](0)
            var i = begin
            while i + 4 * W <= end:
                a0 += xp.unsafe_load[width=W](i)
                a1 += xp.unsafe_load[width=W](i + W)
                a2 += xp.unsafe_load[width=W](i + 2 * W)
                a3 += xp.unsafe_load[width=W](i + 3 * W)
                i += 4 * W
            var total = (a0 + a1 + a2 + a3).reduce_add()
            while i < end:
                total += xp[unsafe_offset=i]
                i += 1
            op[unsafe_offset=worker] = total

        sync_parallelize(work, workers)
