"""`maxkv.greedy_head`: the exact greedy next token without every float32 logit.

Greedy decoding needs only the argmax of the logits `x @ w.T`, `w` the LM
head `[N, K]` (N ~ 50k).  The op finds the same token as `maxkv.linear_packed`
followed by an argmax (same float32 logits, first index on ties) in three
passes:

1. Approximate every logit with AVX-512 VNNI int8 dot products (4x the
   multiply-adds of float32 per instruction, 4x fewer weight bytes): each row
   of `x` is split into two int8 levels, `x ~ s1 k1 + s2 k2` (`s = max|.| /
   127` of what the levels before left), and `w` is held as a per-row int8
   copy `w' = t q` (`maxkv.ops.pack_greedy_head`).
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
non-finite values are recomputed in full.  CPU with AVX-512 VNNI only
(`maxkv.ops.greedy_head_supported`); elsewhere models compute the logits.
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

from .linear import FLOAT32, TILE, Acc, Ptr, _block

comptime U8Ptr = UnsafePointer[UInt8, MutUntrackedOrigin]
comptime I32x16 = SIMD[DType.int32, 16]
comptime LANES = 16
"""int32 lanes of one VNNI accumulator: 16 vocabulary rows."""
comptime GROUPS = TILE // LANES
"""Accumulators per row across one 64-row tile of the int8 copy."""
comptime LEVELS = 2
"""int8 levels each row of `x` is split into."""
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

    `w_packed` `[tiles, 1, K, 64]` is the float32 head as `maxkv.linear_packed`
    takes it in blocks of 64 columns; `wq` `[tiles, K / 4, 256]` and `info` `[4, tiles * 64]` are
    its int8 copy and per-row bounds from `maxkv.ops.pack_greedy_head`.
    """

    @staticmethod
    def execute[
        target: StaticString, vocab: Int
    ](
        output: OutputTensor[dtype=DType.int64, rank=1, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=4, ...],
        wq: InputTensor[dtype=DType.uint8, rank=3, ...],
        info: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.greedy_head runs on CPU"
        comptime if not CompilationTarget.has_vnni():
            raise Error("maxkv.greedy_head needs AVX-512 VNNI")
        var M = x.dim_size(0)
        var K = x.dim_size(1)
        var tiles = w_packed.dim_size(0)
        var NP = tiles * TILE
        var N = vocab
        if (
            output.dim_size(0) != M
            or K % 4 != 0
            or w_packed.dim_size(1) != 1
            or w_packed.dim_size(2) != K
            or w_packed.dim_size(3) != TILE
            or (N + TILE - 1) // TILE != tiles
            or wq.dim_size(0) != tiles
            or wq.dim_size(1) != K // 4
            or wq.dim_size(2) != 4 * TILE
            or info.dim_size(0) != 4
            or info.dim_size(1) != NP
        ):
            raise Error(
                "maxkv.greedy_head: shapes x [", M, ", ", K, "], w_packed [", tiles, ", ",
                w_packed.dim_size(1), ", ", w_packed.dim_size(2), ", ", w_packed.dim_size(3),
                "], wq [", wq.dim_size(0),
                ", ", wq.dim_size(1), ", ", wq.dim_size(2), "], info [", info.dim_size(0),
                ", ", info.dim_size(1), "], output [", output.dim_size(0), "] do not match a ",
                N, "-row head",
            )
        if M == 0:
            return
        var xp = x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var wp = w_packed.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var wqp = wq.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var ip = info.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var xq = alloc[UInt8](LEVELS * M * K).unsafe_origin_cast[MutUntrackedOrigin]()
        # norms: s per (level, row), then alpha and beta per row.
        var norms = alloc[Float32]((LEVELS + 2) * M).unsafe_origin_cast[MutUntrackedOrigin]()
        var approx = alloc[Float32](M * NP).unsafe_origin_cast[MutUntrackedOrigin]()
        var needed = alloc[Bool](M * tiles).unsafe_origin_cast[MutUntrackedOrigin]()
        var finite = alloc[Bool](M).unsafe_origin_cast[MutUntrackedOrigin]()
        var residual = alloc[Float32](K).unsafe_origin_cast[MutUntrackedOrigin]()

        # Split each row into int8 levels; alpha = |r| + (K + 2) u |x| +
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
                var s = amax / 127 if amax > 0 and ok else Float32(1)
                for k in range(K):
                    var level = Float32(0)
                    if ok:
                        level = max(Float32(-127), min(Float32(127), (residual[unsafe_offset=k] / s).__round__()))
                    xq[unsafe_offset=(l * M + m) * K + k] = UInt8(Int(level) + 128)
                    residual[unsafe_offset=k] = residual[unsafe_offset=k] - level * s
                norms[unsafe_offset=l * M + m] = s
            var rr: Float64 = 0
            var xx: Float64 = 0
            var pp: Float64 = 0
            for k in range(K):
                var v = Float64(row[unsafe_offset=k])
                var approx_v: Float64 = 0
                comptime for l in range(LEVELS):
                    approx_v += (Float64(Int(xq[unsafe_offset=(l * M + m) * K + k])) - 128) * Float64(
                        norms[unsafe_offset=l * M + m]
                    )
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
            comptime R = 4 // LEVELS
            for t in range(worker * tiles // workers, (worker + 1) * tiles // workers):
                var wt = wqp.unsafe_offset(t * K * TILE)
                var m = 0
                while m + R <= M:
                    _approx_rows[R](xq, wt, ip, norms, approx, m, M, K, NP, t * TILE)
                    m += R
                while m < M:
                    _approx_rows[1](xq, wt, ip, norms, approx, m, M, K, NP, t * TILE)
                    m += 1

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
                var w_tile = wp.unsafe_offset(t * K * TILE)
                for m in range(M):
                    if needed[unsafe_offset=m * tiles + t]:
                        # linear_packed's arithmetic: one fma per k, in order.
                        _block[1, FLOAT32, TILE, 0](xp, w_tile, wqp, ip, approx, m, K, NP, t * TILE)

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
