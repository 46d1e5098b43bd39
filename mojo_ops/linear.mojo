"""`maxkv.linear_packed`: `x @ w.T` with `w` prepacked for small-batch CPU decoding.

MAX's CPU matmul packs tiles of `w` on every call, which dominates at the
few rows of a decode step.  Here `w` `[N, K]` is packed once, at load time,
into column tiles `[ceil(N / 64), K, 64]` (tile `t`, row `k` holds
`w[64 t : 64 t + 64, k]`, zero-padded), so each call streams every weight
exactly once and contiguously.  Output rows are computed four at a time
with the 4 x 64 accumulator block in registers; the tiles are split into
one contiguous range per worker thread.  CPU and float32 only; other
targets use MAX's matmul (see `maxkv.ops.linear`).

`maxkv.linear_packed_q` also takes a block-quantized copy of the same
weights (GGUF's Q4_0 / Q4_1 / Q8_0 blocks, `maxkv.quantized`): steps of up
to `QUANT_MAX_ROWS` rows stream that copy, 4 to 7 times fewer bytes, and
dequantize each tile row in registers with one rounding per weight, so the
results are bit-identical to the float32 path, which larger steps use (there
the matmul is compute-bound and dequantizing again per row block costs more
than it saves).
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level
from std.math import exp

comptime TILE = 64
"""Output columns per packed tile."""
comptime Acc = SIMD[DType.float32, TILE]
comptime Ptr = UnsafePointer[Float32, MutUntrackedOrigin]


@always_inline
def _rows[R: Int](x: Ptr, w_tile: Ptr, dst: Ptr, m0: Int, K: Int, N: Int, n0: Int):
    """`out[m0 : m0 + R, n0 : n0 + 64] = x[m0 : m0 + R] @ tile`, for R in 1 .. 4."""
    var c0 = Acc(0)
    var c1 = Acc(0)
    var c2 = Acc(0)
    var c3 = Acc(0)
    var x0 = x.unsafe_offset(m0 * K)
    var x1 = x.unsafe_offset((m0 + min(1, R - 1)) * K)
    var x2 = x.unsafe_offset((m0 + min(2, R - 1)) * K)
    var x3 = x.unsafe_offset((m0 + min(3, R - 1)) * K)
    for k in range(K):
        var w = w_tile.unsafe_load[width=TILE](k * TILE)
        c0 = Acc(x0[unsafe_offset=k]).fma(w, c0)
        comptime if R > 1:
            c1 = Acc(x1[unsafe_offset=k]).fma(w, c1)
        comptime if R > 2:
            c2 = Acc(x2[unsafe_offset=k]).fma(w, c2)
        comptime if R > 3:
            c3 = Acc(x3[unsafe_offset=k]).fma(w, c3)
    _store(dst, m0, N, n0, c0)
    comptime if R > 1:
        _store(dst, m0 + 1, N, n0, c1)
    comptime if R > 2:
        _store(dst, m0 + 2, N, n0, c2)
    comptime if R > 3:
        _store(dst, m0 + 3, N, n0, c3)


@always_inline
def _store(dst: Ptr, m: Int, N: Int, n0: Int, c: Acc):
    var row = dst.unsafe_offset(m * N + n0)
    if n0 + TILE <= N:
        row.unsafe_store(0, c)
    else:
        for j in range(N - n0):
            row[unsafe_offset=j] = c[j]


def _linear_f32(xp: Ptr, wp: Ptr, op: Ptr, M: Int, K: Int, N: Int, tiles: Int) raises:
    """`op[M, N] = xp[M, K] @ w.T` over float32 tiles, one tile range per worker."""
    var workers = max(1, min(parallelism_level(None), tiles))

    def work(worker: Int) {imm}:
        for t in range(worker * tiles // workers, (worker + 1) * tiles // workers):
            var w_tile = wp.unsafe_offset(t * K * TILE)
            var n0 = t * TILE
            var m = 0
            while m + 4 <= M:
                _rows[4](xp, w_tile, op, m, K, N, n0)
                m += 4
            var rest = M - m
            if rest == 3:
                _rows[3](xp, w_tile, op, m, K, N, n0)
            elif rest == 2:
                _rows[2](xp, w_tile, op, m, K, N, n0)
            elif rest == 1:
                _rows[1](xp, w_tile, op, m, K, N, n0)

    sync_parallelize(work, workers)


@extensibility.register("maxkv.linear_packed")
struct LinearPacked:
    """`output[M, N] = x[M, K] @ w.T`, `w` packed as `[ceil(N / 64), K, 64]`."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=3, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_packed runs on CPU"
        var M = x.dim_size(0)
        var K = x.dim_size(1)
        var N = output.dim_size(1)
        var tiles = w_packed.dim_size(0)
        if (
            output.dim_size(0) != M
            or w_packed.dim_size(1) != K
            or w_packed.dim_size(2) != TILE
            or (N + TILE - 1) // TILE != tiles
        ):
            raise Error(
                "maxkv.linear_packed: shapes x [", M, ", ", K, "], w_packed [", tiles, ", ",
                w_packed.dim_size(1), ", ", w_packed.dim_size(2), "], output [",
                output.dim_size(0), ", ", N, "] do not match",
            )
        if M == 0:
            return
        _linear_f32(
            x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            w_packed.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            M, K, N, tiles,
        )


# ------------------------------------------------- block-quantized weights

comptime U8Ptr = UnsafePointer[UInt8, MutUntrackedOrigin]
comptime QBLOCK = 32
"""Weights per quantization block along K (GGML's Q4_0, Q4_1 and Q8_0 blocks)."""
comptime QUANT_MAX_ROWS = 8
"""Up to this many rows `maxkv.linear_packed_q` reads the quantized copy."""


@always_inline
def _dequant[BITS: Int](q: U8Ptr, k: Int, scale: Acc, offset: Acc) -> Acc:
    """Row `k` of a quantized tile as float32: `fma(q, scale, offset)`.

    With `q * scale` exact in float32 (a float16 scale times a 4- or 8-bit
    integer), this is the single rounding of `scale * q + offset`, the value
    the float32 copy holds.
    """
    comptime if BITS == 8:
        return q.unsafe_load[width=TILE](k * TILE).cast[DType.float32]().fma(scale, offset)
    else:
        var v = q.unsafe_load[width=TILE // 2](k * (TILE // 2))
        var low = (v & 15).cast[DType.float32]()
        var high = (v >> 4).cast[DType.float32]()
        return low.join(high).fma(scale, offset)


@always_inline
def _rows_q[R: Int, BITS: Int](
    x: Ptr, q: U8Ptr, sm: Ptr, dst: Ptr, m0: Int, K: Int, N: Int, n0: Int
):
    """`_rows` over a quantized tile, dequantized row by row in registers."""
    var c0 = Acc(0)
    var c1 = Acc(0)
    var c2 = Acc(0)
    var c3 = Acc(0)
    var x0 = x.unsafe_offset(m0 * K)
    var x1 = x.unsafe_offset((m0 + min(1, R - 1)) * K)
    var x2 = x.unsafe_offset((m0 + min(2, R - 1)) * K)
    var x3 = x.unsafe_offset((m0 + min(3, R - 1)) * K)
    for kb in range(K // QBLOCK):
        var scale = sm.unsafe_load[width=TILE](kb * 2 * TILE)
        var offset = sm.unsafe_load[width=TILE](kb * 2 * TILE + TILE)
        for kk in range(QBLOCK):
            var k = kb * QBLOCK + kk
            var w = _dequant[BITS](q, k, scale, offset)
            c0 = Acc(x0[unsafe_offset=k]).fma(w, c0)
            comptime if R > 1:
                c1 = Acc(x1[unsafe_offset=k]).fma(w, c1)
            comptime if R > 2:
                c2 = Acc(x2[unsafe_offset=k]).fma(w, c2)
            comptime if R > 3:
                c3 = Acc(x3[unsafe_offset=k]).fma(w, c3)
    _store(dst, m0, N, n0, c0)
    comptime if R > 1:
        _store(dst, m0 + 1, N, n0, c1)
    comptime if R > 2:
        _store(dst, m0 + 2, N, n0, c2)
    comptime if R > 3:
        _store(dst, m0 + 3, N, n0, c3)


def _linear_q[BITS: Int](
    xp: Ptr, qp: U8Ptr, smp: Ptr, op: Ptr, M: Int, K: Int, N: Int, tiles: Int
) raises:
    """`_linear_f32` reading the quantized tiles."""
    var workers = max(1, min(parallelism_level(None), tiles))
    var q_tile = K * TILE * BITS // 8
    var sm_tile = (K // QBLOCK) * 2 * TILE

    def work(worker: Int) {imm}:
        for t in range(worker * tiles // workers, (worker + 1) * tiles // workers):
            var q = qp.unsafe_offset(t * q_tile)
            var sm = smp.unsafe_offset(t * sm_tile)
            var n0 = t * TILE
            var m = 0
            while m + 4 <= M:
                _rows_q[4, BITS](xp, q, sm, op, m, K, N, n0)
                m += 4
            var rest = M - m
            if rest == 3:
                _rows_q[3, BITS](xp, q, sm, op, m, K, N, n0)
            elif rest == 2:
                _rows_q[2, BITS](xp, q, sm, op, m, K, N, n0)
            elif rest == 1:
                _rows_q[1, BITS](xp, q, sm, op, m, K, N, n0)

    sync_parallelize(work, workers)


@extensibility.register("maxkv.linear_packed_q")
struct LinearPackedQ:
    """`maxkv.linear_packed` with a block-quantized copy of `w` for few rows.

    `q` `[tiles, K, 64 * bits / 8]` uint8 and `sm` `[tiles, K / 32, 2, 64]`
    float32 hold the same weights as `w_packed`: tile `t`, row `k`, column
    `j` is `fma(q, sm[t, k / 32, 0, j], sm[t, k / 32, 1, j])`, where `q` is
    byte `j` (8 bits) or, for 4 bits, the low nibble of byte `j` (`j < 32`)
    or the high nibble of byte `j - 32`.  Up to `QUANT_MAX_ROWS` rows read
    the quantized copy (4 to 8 times fewer bytes), more rows the float32
    one; both give bit-identical results.
    """

    @staticmethod
    def execute[
        target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=3, ...],
        q: InputTensor[dtype=DType.uint8, rank=3, ...],
        sm: InputTensor[dtype=DType.float32, rank=4, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_packed_q runs on CPU"
        var M = x.dim_size(0)
        var K = x.dim_size(1)
        var N = output.dim_size(1)
        var tiles = w_packed.dim_size(0)
        var q_width = q.dim_size(2)
        if (
            output.dim_size(0) != M
            or w_packed.dim_size(1) != K
            or w_packed.dim_size(2) != TILE
            or (N + TILE - 1) // TILE != tiles
            or K % QBLOCK != 0
            or q.dim_size(0) != tiles
            or q.dim_size(1) != K
            or (q_width != TILE and q_width != TILE // 2)
            or sm.dim_size(0) != tiles
            or sm.dim_size(1) != K // QBLOCK
            or sm.dim_size(2) != 2
            or sm.dim_size(3) != TILE
        ):
            raise Error(
                "maxkv.linear_packed_q: shapes x [", M, ", ", K, "], w_packed [", tiles,
                ", ", w_packed.dim_size(1), ", ", w_packed.dim_size(2), "], q [",
                q.dim_size(0), ", ", q.dim_size(1), ", ", q_width, "], sm [", sm.dim_size(0),
                ", ", sm.dim_size(1), ", ", sm.dim_size(2), ", ", sm.dim_size(3),
                "], output [", output.dim_size(0), ", ", N, "] do not match",
            )
        if M == 0:
            return
        var xp = x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        if M > QUANT_MAX_ROWS:
            var wp = w_packed.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
            _linear_f32(xp, wp, op, M, K, N, tiles)
            return
        var qp = q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var smp = sm.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        if q_width == TILE:
            _linear_q[8](xp, qp, smp, op, M, K, N, tiles)
        else:
            _linear_q[4](xp, qp, smp, op, M, K, N, tiles)


@extensibility.register("maxkv.swiglu")
struct SwiGLU:
    """`output[t, j] = silu(x[t, j]) * x[t, I + j]` for `x` `[T, 2 I]` (gate, then up)."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.swiglu runs on CPU"
        comptime W = 16
        var T = x.dim_size(0)
        var I = output.dim_size(1)
        if x.dim_size(1) != 2 * I or output.dim_size(0) != T:
            raise Error("maxkv.swiglu: x must be [T, 2 I] for an output [T, I]")
        if T == 0:
            return
        var xp = x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var workers = max(1, min(parallelism_level(None), T))

        def work(worker: Int) {imm}:
            for t in range(worker * T // workers, (worker + 1) * T // workers):
                var gate = xp.unsafe_offset(t * 2 * I)
                var up = gate.unsafe_offset(I)
                var dst = op.unsafe_offset(t * I)
                var j = 0
                while j + W <= I:
                    var g = gate.unsafe_load[width=W](j)
                    dst.unsafe_store(j, g / (1 + exp(-g)) * up.unsafe_load[width=W](j))
                    j += W
                while j < I:
                    var g = gate[unsafe_offset=j]
                    dst[unsafe_offset=j] = g / (1 + exp(-g)) * up[unsafe_offset=j]
                    j += 1

        sync_parallelize(work, workers)
