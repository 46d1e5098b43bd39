"""A benchmark-only op: the memory read bandwidth maxkv's kernels can reach (CPU).

Built apart from maxkv's package (`benchmarks/maxkv_bench/machine.py`), so
it does not ship in the wheel.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu


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
