"""`maxkv.greedy_head`: the exact greedy next token without every float32 logit.

Greedy decoding needs only the argmax of the logits `x @ w.T`, `w` the LM
head `[N, K]` (N ~ 50k).  The op finds the same token as `maxkv.linear_packed`
followed by an argmax (same float32 logits, first index on ties) in three
passes:

1. Approximate every logit with integer dot products, on an int8 copy of
   the head `w' = t q` (per row `t = max|w| / 127`, `maxkv.ops.pack_greedy_head`),
   exact in int32:
   - with AVX-512 VNNI (`VPDPBUSD`, 4x the multiply-adds of float32 per
     instruction), each row of `x` split into two int8 levels,
     `x ~ s1 k1 + s2 k2` (`s = max|.| / 127` of what the levels before left);
   - with AVX2 (`VPMADDWD` on the int8 copy widened to int16, measured 1.7x
     the multiply-adds per second of the float32 kernel here), each row of `x`
     as one int16 level `x ~ s k`, `|k| <= 16383` (fewer where K is so large
     that the int32 sums could overflow).
2. Bound each approximation's error: for the float32 logit `L_n` that
   `linear_packed` computes,
   `|L_n - A_n| <= |w_n| |r| + |w_n - w'_n| |x'| + (K + 2) u |w_n| |x| + rounding`
   (Cauchy-Schwarz; `r = x - x'` the residual, `u = 2^-24`; `|w_n|` and
   `|w_n - w'_n|` are computed in float64 at pack time and rounded up), and
   inflated by 2^-10 relative for the float32 arithmetic of the bound itself.
   Every logit whose upper bound is below the largest lower bound of its row
   cannot be the maximum.
3. Compute, in `linear_packed`'s exact arithmetic (one `fma` per `k`, in
   order), the float32 logits of the 64-column tiles that hold a remaining
   candidate, and take their argmax.

On SmolLM2-135M's decode rows the candidates are 1 to 20 of 49,152 logits, so
step 3 costs little; a row with flat logits (random input) just recomputes
more tiles, each tile read once for all the rows that need it.  Rows with
non-finite values are recomputed in full.  x86 CPUs with AVX-512 VNNI or AVX2
(`maxkv.ops.greedy_head_supported`); elsewhere models compute the logits.
The layout of the int8 copy is the one the compiled target reads (the op
checks it): `[tiles, K / 4, 256]` for VNNI, `[tiles, 2 K, 32]` for AVX2.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level
from std.math import isfinite, sqrt
from std.memory import alloc, bitcast
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget
from std.utils import StaticTuple

from .linear import FLOAT32, PREFETCH_SPAN, TILE, Acc, Ptr, _block, _madd, _next_rows

comptime U8Ptr = UnsafePointer[UInt8, MutUntrackedOrigin]
comptime I32x16 = SIMD[DType.int32, 16]
comptime LANES = 16
"""int32 lanes of one VNNI accumulator: 16 vocabulary rows."""
comptime GROUPS = TILE // LANES
"""Accumulators per row across one 64-row tile of the int8 copy."""
comptime VNNI = CompilationTarget.has_vnni()
"""Whether the target has AVX-512 VNNI (else the AVX2 path runs)."""
comptime LEVELS = 2 if VNNI else 1
"""Integer levels each row of `x` is split into: two int8 (VNNI), one int16 (AVX2)."""
comptime I16_LEVEL_MAX = 16383
"""Largest |k| of an int16 level (AVX2), where K allows (`_level_max`)."""
comptime MADD_COLS = 16
"""Columns per register block of the AVX2 path: two vectors of 8 int32 sums."""
comptime MADD_ROWS = 6
"""Rows per register block of the AVX2 path (12 of 16 vector registers)."""
comptime UNIT = 5.9604644775390625e-8
"""2^-24, float32's unit roundoff."""


@always_inline
def _dpbusd(acc: I32x16, a: I32x16, b: I32x16) -> I32x16:
    """`acc + sum over 4 bytes of u8(a) * s8(b)` per int32 lane (VPDPBUSD)."""
    return llvm_intrinsic["llvm.x86.avx512.vpdpbusd.512", I32x16, has_side_effect=False](
        acc, bitcast[DType.int8, 64](a), bitcast[DType.int8, 64](b)
    )


@always_inline
def _approx_rows[R: Int](
    xq: U8Ptr, wq: U8Ptr, info: Ptr, scale_x: Ptr, dst: Ptr, m0: Int, M: Int, K: Int, NP: Int, n0: Int
):
    """`dst[m, n0 : n0 + 64]` = the int8 approximation of rows `m0 .. m0 + R`.

    `xq` `[LEVELS, M, K]` holds `k + 128` as uint8; `wq` is this tile of the
    int8 copy, `[K / 4, GROUPS, LANES, 4]`; `info` rows 0 and 3 hold `t` and
    `sum(q)` (128 times it corrects the `+ 128`).  The int32 sums are
    exact; each level is scaled by `t * s` once.
    """
    var acc = StaticTuple[I32x16, R * GROUPS * LEVELS](fill=I32x16(0))
    var xw = xq.unsafe_bitcast[Int32]()
    var quads = K // 4
    for g in range(quads):
        var wrow = wq.unsafe_offset(g * TILE * 4)
        comptime for s in range(GROUPS):
            var w = bitcast[DType.int32, 16](wrow.unsafe_load[width=64](s * 64))
            comptime for r in range(R):
                comptime for l in range(LEVELS):
                    comptime i = (r * LEVELS + l) * GROUPS + s
                    acc[i] = _dpbusd(acc[i], I32x16(xw[unsafe_offset=(l * M + m0 + r) * quads + g]), w)
    comptime for r in range(R):
        comptime for s in range(GROUPS):
            var n = n0 + s * LANES
            var offset = info.unsafe_load[width=LANES](3 * NP + n).cast[DType.int32]() * 128
            var t = info.unsafe_load[width=LANES](n)
            var a = SIMD[DType.float32, LANES](0)
            comptime for l in range(LEVELS):
                comptime i = (r * LEVELS + l) * GROUPS + s
                a += (acc[i] - offset).cast[DType.float32]() * (t * scale_x[unsafe_offset=l * M + m0 + r])
            dst.unsafe_store((m0 + r) * NP + n, a)


def _level_max(K: Int) -> Int:
    """Largest |level| of `x`: 127 (int8, VNNI), else 16383 or what keeps
    `K * level * 127` (the int32 sum's largest magnitude) below 2^31."""
    comptime if VNNI:
        return 127
    return min(I16_LEVEL_MAX, 2147483647 // (127 * K))


@always_inline
def _approx_rows_madd[R: Int, C0: Int](
    xq: U8Ptr, wq: U8Ptr, info: Ptr, scale_x: Ptr, dst: Ptr, m0: Int, K: Int, NP: Int, n0: Int
):
    """`dst[m, n0 + C0 : n0 + C0 + 16]` = the int16-level approximation of rows `m0 .. m0 + R`.

    `xq` `[M, K]` holds each row's int16 level; `wq` is this tile's
    16-column block of the int8 copy, `[K / 2, 16, 2]` (two consecutive `k`
    per column, as VPMADDWD pairs them), widened to int16 on load.  The
    int32 sums are exact (`_level_max`); each is scaled by `t * s` once.
    """
    comptime V = SIMD[DType.int32, 8]
    var acc = StaticTuple[V, 2 * R](fill=V(0))
    var xw = xq.unsafe_bitcast[Int32]()
    var pairs = K // 2
    for p in range(pairs):
        var w0 = bitcast[DType.int8, 16](wq.unsafe_load[width=16](p * 32)).cast[DType.int16]()
        var w1 = bitcast[DType.int8, 16](wq.unsafe_load[width=16](p * 32 + 16)).cast[DType.int16]()
        comptime for r in range(R):
            var xv = bitcast[DType.int16, 16](V(xw[unsafe_offset=(m0 + r) * pairs + p]))
            acc[2 * r] = acc[2 * r] + _madd(xv, w0)
            acc[2 * r + 1] = acc[2 * r + 1] + _madd(xv, w1)
    comptime for r in range(R):
        comptime for v in range(2):
            var n = n0 + C0 + 8 * v
            var t = info.unsafe_load[width=8](n)
            var a = acc[2 * r + v].cast[DType.float32]() * (t * scale_x[unsafe_offset=m0 + r])
            dst.unsafe_store((m0 + r) * NP + n, a)


@always_inline
def _bounds(approx: Ptr, info: Ptr, norms: Ptr, M: Int, NP: Int, m: Int, t: Int) -> Tuple[Acc, Acc]:
    """Lower and upper bounds of row `m`'s float32 logits in tile `t`."""
    var a = approx.unsafe_load[width=TILE](m * NP + t * TILE)
    var b = (
        info.unsafe_load[width=TILE](NP + t * TILE) * norms[unsafe_offset=LEVELS * M + m]
        + info.unsafe_load[width=TILE](2 * NP + t * TILE) * norms[unsafe_offset=(LEVELS + 1) * M + m]
    ) * (1 + 1.0 / 1024) + abs(a) * (1.0 / 1048576)
    return (a - b, a + b)


@extensibility.register("maxkv.greedy_head")
struct GreedyHead:
    """`output[m] = argmax_n (x @ w.T)[m, n]` over the first `vocab` columns.

    `w_packed` `[tiles, 64 / block_cols, K, block_cols]` is the float32 head
    as `maxkv.linear_packed` takes it; `wq` (`[tiles, K / 4, 256]` with VNNI,
    `[tiles, 2 K, 32]` with AVX2) and `info` `[4, tiles * 64]` are its int8
    copy and per-row bounds from `maxkv.ops.pack_greedy_head`.
    """

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString, vocab: Int
    ](
        output: OutputTensor[dtype=DType.int64, rank=1, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=4, ...],
        wq: InputTensor[dtype=DType.uint8, rank=3, ...],
        info: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.greedy_head runs on CPU"
        comptime if not VNNI and not CompilationTarget.has_avx2():
            raise Error("maxkv.greedy_head needs AVX-512 VNNI or AVX2")
        var M = x.dim_size(0)
        var K = x.dim_size(1)
        var tiles = w_packed.dim_size(0)
        var NP = tiles * TILE
        var N = vocab
        if (
            output.dim_size(0) != M
            or K % (4 if VNNI else 2) != 0
            or w_packed.dim_size(1) != TILE // block_cols
            or w_packed.dim_size(2) != K
            or w_packed.dim_size(3) != block_cols
            or (N + TILE - 1) // TILE != tiles
            or wq.dim_size(0) != tiles
            or wq.dim_size(1) != (K // 4 if VNNI else 2 * K)
            or wq.dim_size(2) != (4 * TILE if VNNI else 2 * MADD_COLS)
            or info.dim_size(0) != 4
            or info.dim_size(1) != NP
        ):
            raise Error(
                "maxkv.greedy_head: shapes x [", M, ", ", K, "], w_packed [", tiles, ", ",
                w_packed.dim_size(1), ", ", w_packed.dim_size(2), ", ", w_packed.dim_size(3),
                "], wq [", wq.dim_size(0),
                ", ", wq.dim_size(1), ", ", wq.dim_size(2), "], info [", info.dim_size(0),
                ", ", info.dim_size(1), "], output [", output.dim_size(0), "] do not match a ",
                N, "-row head (int8 copy laid out for ", "VNNI" if VNNI else "AVX2", ")",
            )
        if M == 0:
            return
        var xp = x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var wp = w_packed.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var wqp = wq.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var ip = info.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        # x's levels: uint8 `k + 128` [LEVELS, M, K] (VNNI), int16 `k` [M, K] (AVX2).
        var xq = alloc[UInt8](LEVELS * M * K * (1 if VNNI else 2)).unsafe_origin_cast[
            MutUntrackedOrigin
        ]()
        var xq16 = xq.unsafe_bitcast[Int16]()
        var level_max = Float32(_level_max(K))
        # norms: s per (level, row), then alpha and beta per row.
        var norms = alloc[Float32]((LEVELS + 2) * M).unsafe_origin_cast[MutUntrackedOrigin]()
        var approx = alloc[Float32](M * NP).unsafe_origin_cast[MutUntrackedOrigin]()
        var needed = alloc[Bool](M * tiles).unsafe_origin_cast[MutUntrackedOrigin]()
        var finite = alloc[Bool](M).unsafe_origin_cast[MutUntrackedOrigin]()
        var residual = alloc[Float32](K).unsafe_origin_cast[MutUntrackedOrigin]()

        # Split each row into integer levels; alpha = |r| + (K + 2) u |x| +
        # 2^-19 |x| (the last covers rounding each level's `t s I` product),
        # beta = |x'|, both from float64 sums of exact float64 values.
        for m in range(M):
            var row = xp.unsafe_offset(m * K)
            var ok = True
            for k in range(K):
                ok = ok and isfinite(row[unsafe_offset=k])
                residual[unsafe_offset=k] = row[unsafe_offset=k]
            finite[unsafe_offset=m] = ok
            comptime for l in range(LEVELS):
                var amax: Float32 = 0
                for k in range(K):
                    amax = max(amax, abs(residual[unsafe_offset=k]))
                var s = amax / level_max if amax > 0 and ok else Float32(1)
                for k in range(K):
                    var level = Float32(0)
                    if ok:
                        level = max(-level_max, min(level_max, (residual[unsafe_offset=k] / s).__round__()))
                    comptime if VNNI:
                        xq[unsafe_offset=(l * M + m) * K + k] = UInt8(Int(level) + 128)
                    else:
                        xq16[unsafe_offset=m * K + k] = Int16(Int(level))
                    residual[unsafe_offset=k] = residual[unsafe_offset=k] - level * s
                norms[unsafe_offset=l * M + m] = s
            var rr: Float64 = 0
            var xx: Float64 = 0
            var pp: Float64 = 0
            for k in range(K):
                var v = Float64(row[unsafe_offset=k])
                var approx_v: Float64 = 0
                comptime for l in range(LEVELS):
                    var level: Float64
                    comptime if VNNI:
                        level = Float64(Int(xq[unsafe_offset=(l * M + m) * K + k])) - 128
                    else:
                        level = Float64(Int(xq16[unsafe_offset=m * K + k]))
                    approx_v += level * Float64(norms[unsafe_offset=l * M + m])
                rr += (v - approx_v) * (v - approx_v)
                xx += v * v
                pp += approx_v * approx_v
            var x_norm = sqrt(xx)
            norms[unsafe_offset=LEVELS * M + m] = Float32(
                sqrt(rr) + Float64(K + 2) * Float64(UNIT) * x_norm + x_norm * 1.9073486328125e-6
            )
            norms[unsafe_offset=(LEVELS + 1) * M + m] = Float32(sqrt(pp))

        var workers = max(1, min(parallelism_level(None), tiles))

        def approximate(worker: Int) {imm}:
            for t in range(worker * tiles // workers, (worker + 1) * tiles // workers):
                var wt = wqp.unsafe_offset(t * K * TILE)
                comptime if VNNI:
                    comptime R = 4 // LEVELS
                    var m = 0
                    while m + R <= M:
                        _approx_rows[R](xq, wt, ip, norms, approx, m, M, K, NP, t * TILE)
                        m += R
                    while m < M:
                        _approx_rows[1](xq, wt, ip, norms, approx, m, M, K, NP, t * TILE)
                        m += 1
                else:
                    comptime for b in range(TILE // MADD_COLS):
                        var wb = wt.unsafe_offset(b * K * MADD_COLS)
                        var m = 0
                        while m < M:
                            var rows = _next_rows[MADD_ROWS](M - m)
                            comptime for r in range(1, MADD_ROWS + 1):
                                if rows == r:
                                    _approx_rows_madd[r, b * MADD_COLS](
                                        xq, wb, ip, norms, approx, m, K, NP, t * TILE
                                    )
                            m += rows

        sync_parallelize(approximate, workers)

        var row_workers = max(1, min(parallelism_level(None), M))

        def select(worker: Int) {imm}:
            for m in range(worker * M // row_workers, (worker + 1) * M // row_workers):
                if not finite[unsafe_offset=m]:
                    for t in range(tiles):
                        needed[unsafe_offset=m * tiles + t] = True
                    continue
                var lower = Float32(-3.0e38)
                for t in range(tiles):
                    lower = max(lower, _bounds(approx, ip, norms, M, NP, m, t)[0].reduce_max())
                for t in range(tiles):
                    var upper = _bounds(approx, ip, norms, M, NP, m, t)[1]
                    needed[unsafe_offset=m * tiles + t] = upper.reduce_max() >= lower

        sync_parallelize(select, row_workers)

        def recompute(worker: Int) {imm}:
            for t in range(worker * tiles // workers, (worker + 1) * tiles // workers):
                for m in range(M):
                    if needed[unsafe_offset=m * tiles + t]:
                        # linear_packed's arithmetic: one fma per k, in order.
                        comptime for b in range(TILE // block_cols):
                            var w = wp.unsafe_offset((t * TILE + b * block_cols) * K)
                            _block[1, FLOAT32, block_cols, b * block_cols](
                                xp, w, wqp, ip, approx, m, K, NP, t * TILE,
                                w, PREFETCH_SPAN, 0,  # no prefetch
                                approx,  # no residual: never read
                            )

        sync_parallelize(recompute, workers)

        for m in range(M):
            var best = Float32(0)
            var best_n = -1
            for t in range(tiles):
                if needed[unsafe_offset=m * tiles + t]:
                    for j in range(min(TILE, N - t * TILE)):
                        var v = approx[unsafe_offset=m * NP + t * TILE + j]
                        if best_n < 0 or v > best:
                            best = v
                            best_n = t * TILE + j
            op[unsafe_offset=m] = Int64(max(best_n, 0))
        xq.unsafe_free()
        norms.unsafe_free()
        approx.unsafe_free()
        needed.unsafe_free()
        finite.unsafe_free()
        residual.unsafe_free()
