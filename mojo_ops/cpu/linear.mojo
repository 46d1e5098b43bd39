"""`maxkv.linear_packed`: `x @ w.T` with `w` prepacked for small-batch CPU decoding.

MAX's CPU matmul packs tiles of `w` on every call, which dominates at the
few rows of a decode step.  Here `w` `[N, K]` is packed once, at load time,
into tiles of 64 output columns, each split into column blocks of
`block_cols` columns stored one after the other:
`[ceil(N / 64), 64 / block_cols, K, block_cols]` (tile `t`, block `b`, row
`k` holds `w[64 t + block_cols b : 64 t + block_cols (b + 1), k]`,
zero-padded), so each register block streams its weights contiguously and
every weight is read once per call.  The block is sized for the target's
vector registers: `block_cols` 64 with AVX-512 (4 rows x 64 columns, 16 of
32 registers), 16 with AVX2 (6 x 16, 12 of 16 registers; a 4 x 64 block
there spills, and 16-column blocks read from a 64-column row stream their
weights with a stride the prefetchers follow badly: 0.7 vs 0.9 ms per
3072 x 576 matmul at 32 rows, measured).  Worker threads claim the column
blocks one at a time, two workers from either end of a shared range (see
`_linear`); with AVX2's blocks each register block also prefetches part of
the weights two column blocks ahead (see `_column_block`).  CPU and float32 only; other targets
use MAX's matmul (see `maxkv.ops.linear`).

`maxkv.linear_packed_q` also takes a block-quantized copy of the same
weights (GGUF's blocks, `maxkv.cpu.quantized`: 4-bit integers with a float32
scale and offset per 32 weights along K, or 8-bit ones per 32 or 16; or, for
the K-quants, 4-bit integers per 32 or 6-bit ones per 16 whose scales and
offsets are products of two float16 factors per 256 weights and two int8
multipliers per block, see `_scales`): steps of up
to `QUANT_MAX_ROWS` rows stream that copy, 3 to 7 times fewer bytes, and
dequantize each tile row in registers with one rounding per weight, so the
results are bit-identical to the float32 path, which larger steps use (there
the matmul is compute-bound and dequantizing again per row block costs more
than it saves).

A copy may also hold 16-bit floats (`HALF`: a bfloat16 or float16
checkpoint's values, no scales), each widened to float32 exactly as it is
read, so a checkpoint's matrices are multiplied as its own values, two bytes
a weight.

`maxkv.linear_quantized` takes the quantized copy alone, with no float32
tiles at all (a model held as its file stores it): few rows read it as
above; more rows dequantize `PANEL_K` weight rows of a column block at a
time into a scratch panel of their worker's, which stays in cache while
every register block of the step reads it (see `_panel_column_block`).
Every output is still `fma(x[m, k], w[k], acc)` for `k` in order, so all
three paths give the same bits.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level
from std.atomic import Atomic
from std.math import exp, isfinite
from std.memory import alloc, bitcast
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget
from std.sys.intrinsics import PrefetchOptions, prefetch
from std.utils import StaticTuple

comptime TILE = 64
"""Output columns per packed tile."""
comptime Acc = SIMD[DType.float32, TILE]
comptime Ptr = UnsafePointer[Float32, MutUntrackedOrigin]
comptime U8Ptr = UnsafePointer[UInt8, MutUntrackedOrigin]
comptime FLOAT32 = 32
"""`BITS` of the float32 tiles (the quantized copies have 4 or 8)."""
comptime QBLOCK = 32
"""Weights per quantization block along K (most GGML types; Q6_K's are `QBLOCK_SMALL`)."""
comptime QBLOCK_SMALL = 16
"""The smaller block along K, read with 8-bit integers only."""
comptime HALF = 16
"""`BITS` of a copy of 16-bit floats (bfloat16, or float16 with `F16`): no scales."""
comptime QUANT_MAX_ROWS = 8
"""Up to this many rows `maxkv.linear_packed_q` reads the quantized copy."""
comptime PREFETCH_SPAN = 6
"""Weight rows per prefetch round of a register block (see `_column_block`)."""
comptime PREFETCH_AHEAD = 2
"""Column blocks ahead of the current one whose weights are prefetched."""
comptime SUPER_K = 256
"""Weights along K per float32 scale pair of a factored copy (GGML's K-quant super-block)."""
comptime PANEL_K = 256
"""Weight rows of a column block dequantized at a time by steps of more than
`QUANT_MAX_ROWS` rows over a quantized copy alone: 256 x 64 float32 is 64 KiB,
in L2 with room for the rows of `x` (a multiple of both block sizes)."""
comptime CLAIM_STRIDE = 8
"""Int64s between two pairs' claim counters in `_linear` (one 64-byte line each)."""
comptime QUAD = 4
"""Weight rows along K interleaved per column in an int8 copy (`_quad_values`)."""
comptime GROUP_COLS = 16
"""Columns of a group of an int8 copy: a tile holds `TILE / GROUP_COLS` groups."""
comptime INT8_ROWS = 8 if _VNNI else 4
"""Output rows of an int8 register block: with AVX2 4 (Llama 3.2 3B's Q4_K
gate/up at 16 rows, 2-core Zen 3: 4 rows 1.71x float32's speed, 3 rows 1.61x,
2 rows 1.32x); with AVX-512 VNNI 8, whose 32 registers hold 8 rows' sums and
accumulators, so each decoded quad row feeds 8 VPDPBUSDs (2-core Zen 4, one
run each: Q6_K gate/up at 16 rows 8.4 ms with 4 rows, 6.1 ms with 8)."""
comptime I8_MAX = 127
"""Largest |level| of an activation quantized to int8."""


def sm_slots[QB: Int, FACT: Bool]() -> Int:
    """float32 rows of 64 in `sm` per block (`FACT` False: a scale and an offset)
    or, factored, per `SUPER_K` rows: one of its two float16 factors `[2, 64]`,
    then the int8 multipliers of its `SUPER_K / QB` blocks, four to a float32
    slot."""
    comptime if FACT:
        return 1 + 2 * (SUPER_K // QB) // 4
    return 2


@always_inline
def _scales[C: Int, QB: Int, FACT: Bool](
    sm: Ptr, kb: Int, C0: Int
) -> StaticTuple[SIMD[DType.float32, C], 2]:
    """Block `kb`'s scale and offset for columns `C0 .. C0 + C` of a tile.

    Plain (`FACT` False): stored, `sm[kb, 0 | 1, j]`.  Factored: the products
    `d[0, j] * a[kb, j]` and `d[1, j] * b[kb, j]` of its super-block's float16
    factors and its int8 multipliers, exact in float32 (a float16 times an
    integer of at most 2^7), so the same values the plain layout stores.
    """
    var out = StaticTuple[SIMD[DType.float32, C], 2](fill=SIMD[DType.float32, C](0))
    comptime if FACT:
        comptime PER = SUPER_K // QB
        var base = sm.unsafe_offset((kb // PER) * sm_slots[QB, FACT]() * TILE)
        var d = base.unsafe_bitcast[Float16]()
        var mult = base.unsafe_offset(TILE).unsafe_bitcast[Int8]().unsafe_offset(
            (kb % PER) * 2 * TILE + C0
        )
        out[0] = d.unsafe_load[width=C](C0).cast[DType.float32]() * mult.unsafe_load[
            width=C
        ](0).cast[DType.float32]()
        out[1] = d.unsafe_load[width=C](TILE + C0).cast[DType.float32]() * mult.unsafe_load[
            width=C
        ](TILE).cast[DType.float32]()
    else:
        out[0] = sm.unsafe_load[width=C](kb * 2 * TILE + C0)
        out[1] = sm.unsafe_load[width=C](kb * 2 * TILE + TILE + C0)
    return out


def block_rows[C: Int]() -> Int:
    """Output rows of a register block of `C` columns: 4 x 64 (AVX-512's
    layout, 16 accumulator registers of 32) or 6 x 16 (AVX2's, 12 of 16)."""
    return 4 if C == TILE else 6


@always_inline
def _half[C: Int, F16: Bool](q: U8Ptr, k: Int, c0: Int) -> SIMD[DType.float32, C]:
    """Columns `c0 .. c0 + C` of row `k` of a tile of 16-bit floats, widened to
    float32 (exact): column `j` in bytes `2 j, 2 j + 1` (little-endian), a
    bfloat16 (float32's top half) or, with `F16`, a float16."""
    var at = q.unsafe_offset(k * TILE * 2 + 2 * c0)
    comptime if F16:
        return at.unsafe_bitcast[Float16]().unsafe_load[width=C](0).cast[DType.float32]()
    var bits = at.unsafe_bitcast[UInt16]().unsafe_load[width=C](0).cast[DType.uint32]() << 16
    return bitcast[DType.float32, C](bits)


@always_inline
def _dequant[BITS: Int, C: Int, C0: Int](
    q: U8Ptr, k: Int, scale: SIMD[DType.float32, C], offset: SIMD[DType.float32, C]
) -> SIMD[DType.float32, C]:
    """Columns `C0 .. C0 + C` of row `k` of a quantized tile: `fma(q, scale, offset)`.

    With `q * scale` exact in float32 (a float16 scale times an integer of
    at most 8 bits), this is the single rounding of `scale * q + offset`, the
    value the float32 copy holds.  A row holds `64 * BITS / 8` bytes: 8 bits,
    column `j` in byte `j`; 4 bits, column `j < 32` in the low nibble of byte
    `j` and column `j >= 32` in the high nibble of byte `j - 32`; 6 bits, those
    32 bytes of low nibbles, then 16 bytes of the top two bits: column `j` in
    bits `2 (j / 16)` of byte `32 + j % 16`.
    """
    comptime ROW = TILE * BITS // 8
    comptime if BITS == 8:
        return q.unsafe_load[width=C](k * ROW + C0).cast[DType.float32]().fma(scale, offset)
    var low: SIMD[DType.uint8, C]
    comptime if C == TILE:
        var v = q.unsafe_load[width=TILE // 2](k * ROW)
        low = rebind[SIMD[DType.uint8, C]]((v & 15).join(v >> 4))
    elif C0 < TILE // 2:
        low = q.unsafe_load[width=C](k * ROW + C0) & 15
    else:
        low = q.unsafe_load[width=C](k * ROW + C0 - TILE // 2) >> 4
    comptime if BITS == 6:
        var high: SIMD[DType.uint8, C]
        comptime if C == TILE:
            var h = q.unsafe_load[width=16](k * ROW + TILE // 2)
            high = rebind[SIMD[DType.uint8, C]](
                ((h & 3).join((h >> 2) & 3)).join(((h >> 4) & 3).join(h >> 6))
            )
        else:
            high = (q.unsafe_load[width=C](k * ROW + TILE // 2) >> UInt8(2 * (C0 // 16))) & 3
        low = low | (high << 4)
    return low.cast[DType.float32]().fma(scale, offset)


@always_inline
def _fma_k[R: Int, C: Int](
    rows: StaticTuple[Ptr, R],
    k: Int,
    wk: SIMD[DType.float32, C],
    mut acc: StaticTuple[SIMD[DType.float32, C], R],
):
    """`acc[r] = fma(x[r, k], wk, acc[r])` for the `R` rows of a register block."""
    comptime for r in range(R):
        acc[r] = SIMD[DType.float32, C](rows[r][unsafe_offset=k]).fma(wk, acc[r])


@always_inline
def _block[
    R: Int, BITS: Int, C: Int, C0: Int, ADD: Bool = False, QB: Int = QBLOCK, FACT: Bool = False,
    F16: Bool = False,
](
    x: Ptr,
    w: Ptr,
    q: U8Ptr,
    sm: Ptr,
    dst: Ptr,
    m0: Int,
    K: Int,
    N: Int,
    n0: Int,
    pf: Ptr,
    pf_first: Int,
    pf_step: Int,
    residual: Ptr,
):
    """`out[m0 : m0 + R, n0 + C0 : n0 + C0 + C] = x[m0 : m0 + R] @ w`: one register block.

    With `ADD`, `residual[m, n] + (x @ w)[m, n]` instead (`residual` `[M, N]`
    like `dst`): the residual add of a transformer layer, one float32 add
    per output, the bits of adding the two afterwards.

    `BITS == FLOAT32` reads `w`, this block's `[K, C]` float32 weights; 4, 6
    or 8 read the quantized tile `q` with its scales and offsets `sm` per `QB`
    rows (factored with `FACT`, see `_scales`), dequantized row by row in registers to the same float32 values;
    `HALF` reads `q`'s 16-bit floats (`_half`), widened to the same values.  Either
    way each output is `fma(x[m, k], w[k], acc)` for `k = 0 .. K - 1` in
    order, so the block shape, the layout and the weight copy never change
    a result's bits.

    Float32 blocks also prefetch part of the next column block's weights
    `pf` (`[K, C]`): of every `PREFETCH_SPAN` weight rows, rows `pf_first,
    pf_first + pf_step, ...` (none where `pf_first >= PREFETCH_SPAN`); see
    `_column_block`.
    """
    comptime Vec = SIMD[DType.float32, C]
    var acc = StaticTuple[Vec, R](fill=Vec(0))
    var rows = StaticTuple[Ptr, R](fill=x)
    comptime for r in range(R):
        rows[r] = x.unsafe_offset((m0 + r) * K)
    # The 6 x 16 loop below compiles to 12 accumulators held in registers;
    # LLVM keeps it so only while the code around it stays simple.  A
    # rewrite of `_column_block`'s prefetch count that computed the same
    # values made it spill accumulators to the stack in every k step
    # (SmolLM2 at batch 32: 25-35% slower end to end, three A/B runs).
    # After changing `_block` or `_column_block`, check the loop for stack
    # traffic: `mojo build --emit asm` of a caller of `_column_block`.
    comptime if BITS == FLOAT32:
        var k0 = 0
        while k0 + PREFETCH_SPAN <= K:
            for p in range(pf_first, PREFETCH_SPAN, max(pf_step, 1)):
                comptime for line in range(C // 16):  # 16 floats per 64-byte line
                    prefetch[PrefetchOptions().for_read().high_locality().to_data_cache()](
                        pf.unsafe_offset((k0 + p) * C + 16 * line)
                    )
            comptime for kk in range(PREFETCH_SPAN):
                _fma_k[R, C](rows, k0 + kk, w.unsafe_load[width=C]((k0 + kk) * C), acc)
            k0 += PREFETCH_SPAN
        for k in range(k0, K):
            _fma_k[R, C](rows, k, w.unsafe_load[width=C](k * C), acc)
    elif BITS == HALF:
        for k in range(K):
            _fma_k[R, C](rows, k, _half[C, F16](q, k, C0), acc)
    else:
        for kb in range(K // QB):
            var so = _scales[C, QB, FACT](sm, kb, C0)
            for kk in range(QB):
                var k = kb * QB + kk
                _fma_k[R, C](rows, k, _dequant[BITS, C, C0](q, k, so[0], so[1]), acc)
    _store[R, C, C0, ADD](acc, dst, residual, m0, N, n0, True)


@always_inline
def _store[R: Int, C: Int, C0: Int, ADD: Bool](
    acc: StaticTuple[SIMD[DType.float32, C], R],
    dst: Ptr,
    residual: Ptr,
    m0: Int,
    N: Int,
    n0: Int,
    add: Bool,
):
    """Stores a register block's accumulators at `dst[m0 .., n0 + C0 ..]` (`[M, N]`),
    plus `residual` where `ADD` and `add`; columns past `N` are left out."""
    comptime for r in range(R):
        var at = (m0 + r) * N + n0 + C0
        var row = dst.unsafe_offset(at)
        if n0 + C0 + C <= N:
            comptime if ADD:
                if add:
                    row.unsafe_store(0, residual.unsafe_load[width=C](at) + acc[r])
                else:
                    row.unsafe_store(0, acc[r])
            else:
                row.unsafe_store(0, acc[r])
        else:
            for j in range(N - n0 - C0):
                comptime if ADD:
                    if add:
                        row[unsafe_offset=j] = residual[unsafe_offset=at + j] + acc[r][j]
                    else:
                        row[unsafe_offset=j] = acc[r][j]
                else:
                    row[unsafe_offset=j] = acc[r][j]


@always_inline
def _panel_block[R: Int, C: Int, C0: Int, ADD: Bool](
    x: Ptr,
    panel: Ptr,
    dst: Ptr,
    m0: Int,
    k0: Int,
    kc: Int,
    K: Int,
    N: Int,
    n0: Int,
    first: Bool,
    last: Bool,
    residual: Ptr,
):
    """One register block over panel rows `k0 .. k0 + kc` (`panel` `[kc, C]`
    float32): starts from zero on the first panel, else from what the last
    panel stored in `dst`; the residual is added after the last panel.  Per
    output, the fmas of `_block`'s float32 path in the same order."""
    comptime Vec = SIMD[DType.float32, C]
    var acc = StaticTuple[Vec, R](fill=Vec(0))
    var rows = StaticTuple[Ptr, R](fill=x)
    comptime for r in range(R):
        rows[r] = x.unsafe_offset((m0 + r) * K + k0)
    if not first:
        comptime for r in range(R):
            var at = (m0 + r) * N + n0 + C0
            if n0 + C0 + C <= N:
                acc[r] = dst.unsafe_load[width=C](at)
            else:
                var v = Vec(0)
                for j in range(N - n0 - C0):
                    v[j] = dst[unsafe_offset=at + j]
                acc[r] = v
    for k in range(kc):
        _fma_k[R, C](rows, k, panel.unsafe_load[width=C](k * C), acc)
    _store[R, C, C0, ADD](acc, dst, residual, m0, N, n0, last)


@always_inline
def _panel_column_block[BITS: Int, C: Int, C0: Int, ADD: Bool, QB: Int, FACT: Bool, F16: Bool](
    x: Ptr, q: U8Ptr, sm: Ptr, dst: Ptr, M: Int, K: Int, N: Int, n0: Int, residual: Ptr, panel: Ptr
):
    """Columns `n0 + C0 .. n0 + C0 + C` for all `M` rows from a quantized tile
    alone (`q`, `sm`, as `_block` reads them): `PANEL_K` weight rows at a time
    are dequantized into `panel` (`[PANEL_K, C]`, the worker's own) with
    `_dequant`'s single rounding, then every register block of the step reads
    them from cache.  The weights are dequantized once per step, not once per
    register block, and never held in float32 beyond one panel."""
    if n0 + C0 >= N:  # all padding (the last tile)
        return
    comptime R = block_rows[C]()
    var k0 = 0
    while k0 < K:
        var kc = min(PANEL_K, K - k0)
        comptime if BITS == HALF:
            for k in range(k0, k0 + kc):
                panel.unsafe_store((k - k0) * C, _half[C, F16](q, k, C0))
        else:
            for kb in range(k0 // QB, (k0 + kc) // QB):
                var so = _scales[C, QB, FACT](sm, kb, C0)
                for kk in range(QB):
                    var k = kb * QB + kk
                    panel.unsafe_store((k - k0) * C, _dequant[BITS, C, C0](q, k, so[0], so[1]))
        var m = 0
        while m < M:
            var rows = _next_rows[R](M - m)
            comptime for r in range(1, R + 1):
                if rows == r:
                    _panel_block[r, C, C0, ADD](
                        x, panel, dst, m, k0, kc, K, N, n0, k0 == 0, k0 + kc == K, residual
                    )
            m += rows
        k0 += kc


@always_inline
def _next_rows[R: Int](rest: Int) -> Int:
    """Rows of the next register block (at most `R`) when `rest` rows are left.

    Full blocks while at least two more follow, then the remainder split into
    two near-equal blocks (8 rows in blocks of 6: 4 + 4, not 6 + 2): a block
    of few rows has too few independent accumulators to keep the FMA units
    busy.
    """
    if rest >= 2 * R or rest <= R:
        return min(rest, R)
    return (rest + 1) // 2


@always_inline
def _column_block[BITS: Int, C: Int, C0: Int, ADD: Bool, QB: Int, FACT: Bool, F16: Bool](
    x: Ptr, w: Ptr, q: U8Ptr, sm: Ptr, dst: Ptr, M: Int, K: Int, N: Int, n0: Int, pf: Ptr, residual: Ptr
):
    """Columns `n0 + C0 .. n0 + C0 + C` for all `M` rows, a register block at a time.

    With AVX2's 16-column blocks, float32 blocks prefetch the weights `pf` of
    the worker's next column block, spread over this block's register blocks
    (register block `i` of `n` takes weight rows `i, i + n, ...` of every
    `PREFETCH_SPAN`, so together they take each row once).  Without it the
    first register block of each column block waits on memory: 8 layers of
    SmolLM2's matmuls at 32 rows took 20.9-25.0 ms without, 15.5-17.8 ms
    with it (2-core Zen 3, two runs, medians of 21).
    """
    if n0 + C0 >= N:  # all padding (the last tile)
        return
    comptime R = block_rows[C]()
    # Register blocks of this column block, for the prefetch pattern.
    var count = 0
    var m = 0
    while m < M:
        m += _next_rows[R](M - m)
        count += 1
    var step = min(count, PREFETCH_SPAN)
    comptime if BITS != FLOAT32 or C != 16:
        step = 0  # quantized tiles and AVX-512's blocks: measured no gain
    var index = 0
    m = 0
    while m < M:
        var rows = _next_rows[R](M - m)
        var first = index if step > 0 and index < step else PREFETCH_SPAN
        comptime for r in range(1, R + 1):
            if rows == r:
                _block[r, BITS, C, C0, ADD, QB, FACT, F16](
                    x, w, q, sm, dst, m, K, N, n0, pf, first, step, residual
                )
        m += rows
        index += 1


def _linear[
    BITS: Int, C: Int, ADD: Bool, QB: Int = QBLOCK, PANEL: Bool = False, FACT: Bool = False,
    F16: Bool = False, INT8: Bool = False,
](
    xp: Ptr, wp: Ptr, qp: U8Ptr, smp: Ptr, op: Ptr, M: Int, K: Int, N: Int, tiles: Int, residual: Ptr,
    xv: U8Ptr, xd: Ptr, xs: Ptr,
) raises:
    """`op[M, N] = xp[M, K] @ w.T` (plus `residual[M, N]` with `ADD`) over the float32 tiles `wp` (`BITS == FLOAT32`,
    column blocks of `C`) or the quantized tiles `qp` / `smp`, read in column
    blocks of `C` (of tiles where `C` is the whole tile): SmolLM2's 576-column
    matrices have 9 tiles, which two workers would split 5 to 4, but 36 blocks
    of 16 split evenly (30 layers of its matmuls at 32 rows: 101 -> 92 ms,
    Zen 3).

    Workers go in pairs over one contiguous range of column blocks per pair,
    the first from its start up, the second from its end down, each claiming
    one block at a time from the pair's counter until the range is used up, so
    a worker that starts late or runs slower does fewer blocks instead of
    holding the other at the join.  With a fixed half each, the two workers
    of one call finished 20-300 us apart (2-core Zen 3; one worker could as
    well run slower as start later); SmolLM2's 120 matmuls of a step (30
    layers, distinct weights, in a chain) at 32 rows took 53.2 ms that way and
    49.0 ms claimed this way (medians over 8 A/B pairs of processes).  Each
    worker still walks its blocks in order, so it prefetches the ones it will
    take next.

    With `PANEL` (a quantized `BITS`), more rows than a register block's
    dequantize panels into a scratch of each worker's (`_panel_column_block`).
    With `INT8` (`C == GROUP_COLS`), `qp` is an int8 copy, multiplied by `x`'s
    int8 rows `xv`, `xd`, `xs` (`_quantize_rows`; else never read) a group at
    a time (`_int8_column_block`)."""
    comptime BLOCKS = TILE // C
    var blocks = tiles * BLOCKS
    var workers = max(1, min(parallelism_level(None), blocks))
    var pairs = (workers + 1) // 2
    var q_tile = K * TILE * BITS // 8
    var sm_tile = 0 if BITS == HALF else (K // (SUPER_K if FACT else QB)) * sm_slots[QB, FACT]() * TILE
    # One claim counter per pair, each on its own cache line.
    var claimed = alloc[Int64](pairs * CLAIM_STRIDE).unsafe_origin_cast[MutUntrackedOrigin]()
    for p in range(pairs):
        claimed[unsafe_offset=p * CLAIM_STRIDE] = 0

    def work(worker: Int) {imm}:
        var pair = worker // 2
        var first = pair * blocks // pairs
        var last = (pair + 1) * blocks // pairs - 1
        var up = worker % 2 == 0
        var claim = claimed.unsafe_offset(pair * CLAIM_STRIDE)
        var done = 0
        var panel = alloc[Float32](PANEL_K * C if PANEL else 1).unsafe_origin_cast[
            MutUntrackedOrigin
        ]()
        while Int(Atomic[Int64].fetch_add(claim, 1)) <= last - first:
            var i = first + done if up else last - done
            done += 1
            var t = i // BLOCKS
            var q = qp.unsafe_offset(t * q_tile)
            var sm = smp.unsafe_offset(t * sm_tile)
            var w = wp.unsafe_offset(i * C * K)
            # The block two ahead in this worker's direction (its own at the end).
            var ahead = min(i + PREFETCH_AHEAD, last) if up else max(i - PREFETCH_AHEAD, first)
            var pf = wp.unsafe_offset(ahead * C * K)
            comptime if INT8:
                _int8_column_block[BITS, ADD, QB, FACT](
                    xv, xd, xs, q, sm, i % BLOCKS, op, M, K, N, t * TILE, residual
                )
                continue
            comptime for b in range(BLOCKS):
                if i % BLOCKS == b:
                    comptime if PANEL:
                        _panel_column_block[BITS, C, b * C, ADD, QB, FACT, F16](
                            xp, q, sm, op, M, K, N, t * TILE, residual, panel
                        )
                    else:
                        _column_block[BITS, C, b * C, ADD, QB, FACT, F16](
                            xp, w, q, sm, op, M, K, N, t * TILE, pf, residual
                        )
        panel.unsafe_free()

    sync_parallelize(work, workers)
    claimed.unsafe_free()


# ---------------------------------------------------------------- int8 activations


@always_inline
def _maddubs(w: SIMD[DType.uint8, 32], x: SIMD[DType.int8, 32]) -> SIMD[DType.int16, 16]:
    """`w[2 i] x[2 i] + w[2 i + 1] x[2 i + 1]` per int16 lane (VPMADDUBSW: unsigned
    times signed bytes; saturates above 32767 in size, which `_span` keeps
    below)."""
    return llvm_intrinsic["llvm.x86.avx2.pmadd.ub.sw", SIMD[DType.int16, 16], has_side_effect=False](
        bitcast[DType.int8, 32](w), x
    )


@always_inline
def _madd(a: SIMD[DType.int16, 16], b: SIMD[DType.int16, 16]) -> SIMD[DType.int32, 8]:
    """`a[2 i] b[2 i] + a[2 i + 1] b[2 i + 1]` per int32 lane (VPMADDWD), exact."""
    return llvm_intrinsic["llvm.x86.avx2.pmadd.wd", SIMD[DType.int32, 8], has_side_effect=False](a, b)


comptime I32x16 = SIMD[DType.int32, 16]
comptime INT8_PREFETCH = 2048
"""Bytes ahead of a VNNI block's integers that it prefetches: a group's integers
are a short stream (24 KiB for 3,072 rows of 4-bit ones) that the hardware
prefetchers pick up late (one run, 2-core Zen 4, Llama 3.2 3B's Q4_K gate/up
at one row: 1.39-1.70 ms without, 1.18 ms with; Q6_K 2.65 -> 2.31 ms)."""
comptime _VNNI = CompilationTarget.has_avx512f() and CompilationTarget.has_vnni()
"""Whether int8 blocks use AVX-512 VNNI's VPDPBUSD (`_dpbusd`) instead of AVX2's
VPMADDUBSW / VPMADDWD pairs."""


@always_inline
def _dpbusd(acc: I32x16, w: SIMD[DType.uint8, 64], x: I32x16) -> I32x16:
    """`acc[j] + sum_i w[4 j + i] x[4 j + i]` per int32 lane, `w` unsigned and
    `x`'s bytes signed (VPDPBUSD, 512 bits): exact, no intermediate saturation
    (4 * 255 * 127 per lane and step)."""
    return llvm_intrinsic["llvm.x86.avx512.vpdpbusd.512", I32x16, has_side_effect=False](
        acc, bitcast[DType.int8, 64](w), bitcast[DType.int8, 64](x)
    )


@always_inline
def _span[BITS: Int, QB: Int]() -> Int:
    """Quad rows whose VPMADDUBSW pair sums an int16 lane holds before they are
    widened to int32: each pair sum of a 4-bit (or a split 8-bit) integer and an
    int8 level is at most 2 * 15 * 127 = 3810, so a block's 8 fit (30480); a
    6-bit one's, 2 * 63 * 127 = 16002, two at a time."""
    comptime if BITS == 6:
        return 2
    return QB // QUAD


@always_inline
def _quad_values[BITS: Int](g: U8Ptr) -> StaticTuple[SIMD[DType.uint8, 32], 2]:
    """The integers of one quad row of a group of an int8 copy (`g`, `8 * BITS`
    bytes): columns 0-7, then 8-15, each as `[8 columns, QUAD rows]`.

    Value `v = QUAD c + i` (column `c` of a half, row `i` of the quad) of half
    `h`: 8 bits, byte `32 h + v`; 4 bits, the low (`h` 0) or high nibble of
    byte `v`; 6 bits, those nibbles, then its top two bits in bits `2 (u / 16)`
    of byte `32 + u % 16`, `u = 32 h + v`."""
    var out = StaticTuple[SIMD[DType.uint8, 32], 2](fill=SIMD[DType.uint8, 32](0))
    comptime if BITS == 8:
        out[0] = g.unsafe_load[width=32](0)
        out[1] = g.unsafe_load[width=32](32)
        return out
    var v = g.unsafe_load[width=32](0)
    out[0] = v & 15
    out[1] = v >> 4
    comptime if BITS == 6:
        var t = g.unsafe_load[width=16](32)
        out[0] = out[0] | (((t & 3).join((t >> 2) & 3)) << 4)
        out[1] = out[1] | ((((t >> 4) & 3).join(t >> 6)) << 4)
    return out


@always_inline
def _int8_block[R: Int, BITS: Int, ADD: Bool, QB: Int, FACT: Bool](
    xv: U8Ptr, xd: Ptr, xs: Ptr, g: U8Ptr, sm: Ptr, C0: Int, dst: Ptr, m0: Int, K: Int, N: Int,
    n0: Int, residual: Ptr,
):
    """`out[m0 : m0 + R, n0 + C0 : n0 + C0 + 16]` from a group of an int8 copy
    (`g`: `[K / QUAD, 8 * BITS]` bytes) and the int8 rows of `x` (`_quantize_rows`).

    Per block `kb` of `QB` rows along K the integer sums `sum_k x8[m, k] q[k, j]`
    are exact: with AVX-512 VNNI (`_VNNI`), VPDPBUSD adds each quad row's four
    products per column straight into int32 (16 columns an instruction, 8-bit
    integers whole); with AVX2, VPMADDUBSW pair sums added in int16 over
    `_span` quad rows, then widened to int32 by VPMADDWD (8-bit integers as
    two nibbles, the high one's sums times 16).  Each block's sum is scaled
    once: `acc += float(sum) *
    (scale[kb, j] * d[m, kb]) + offset[kb, j] * s[m, kb]`, `d` the row's int8
    step and `s` its sum over the block (`d * sum x8`), so each output is the
    product of the quantized row with the dequantized weights, up to float32
    rounding."""
    comptime I32 = SIMD[DType.int32, 8]
    comptime I16 = SIMD[DType.int16, 16]
    comptime Vec = SIMD[DType.float32, GROUP_COLS]
    comptime GROUP = 8 * BITS
    comptime SPAN = _span[BITS, QB]()
    comptime PARTS = 2 if BITS == 8 else 1  # nibbles of an 8-bit integer
    var acc = StaticTuple[Vec, R](fill=Vec(0))
    var xw = xv.unsafe_bitcast[Int32]()
    var quads = K // QUAD
    var blocks = K // QB
    comptime if _VNNI:
        for kb in range(blocks):
            comptime BLOCK_BYTES = (QB // QUAD) * GROUP
            comptime for line in range(0, BLOCK_BYTES, 64):
                prefetch[PrefetchOptions().for_read().high_locality().to_data_cache()](
                    g.unsafe_offset(kb * BLOCK_BYTES + INT8_PREFETCH + line)
                )
            var dots = StaticTuple[I32x16, R](fill=I32x16(0))
            comptime for i in range(QB // QUAD):
                var p = kb * (QB // QUAD) + i
                var w = _quad_values[BITS](g.unsafe_offset(p * GROUP))
                var both = w[0].join(w[1])
                comptime for r in range(R):
                    dots[r] = _dpbusd(dots[r], both, I32x16(xw[unsafe_offset=(m0 + r) * quads + p]))
            var so = _scales[GROUP_COLS, QB, FACT](sm, kb, C0)
            comptime for r in range(R):
                var at = (m0 + r) * blocks + kb
                acc[r] = dots[r].cast[DType.float32]().fma(so[0] * xd[unsafe_offset=at], acc[r])
                acc[r] = so[1].fma(Vec(xs[unsafe_offset=at]), acc[r])
        _store[R, GROUP_COLS, 0, ADD](acc, dst, residual, m0, N, n0 + C0, True)
        return
    for kb in range(blocks):
        var sums = StaticTuple[I32, 2 * R](fill=I32(0))
        comptime for span in range(QB // QUAD // SPAN):
            var part = StaticTuple[I16, 2 * R * PARTS](fill=I16(0))
            comptime for i in range(SPAN):
                var p = kb * (QB // QUAD) + span * SPAN + i
                var w = _quad_values[BITS](g.unsafe_offset(p * GROUP))
                comptime for r in range(R):
                    var x4 = bitcast[DType.int8, 32](I32(xw[unsafe_offset=(m0 + r) * quads + p]))
                    comptime for h in range(2):
                        comptime if BITS == 8:
                            part[4 * r + 2 * h] += _maddubs(w[h] & 15, x4)
                            part[4 * r + 2 * h + 1] += _maddubs(w[h] >> 4, x4)
                        else:
                            part[2 * r + h] += _maddubs(w[h], x4)
            comptime for r in range(R):
                comptime for h in range(2):
                    comptime if BITS == 8:
                        sums[2 * r + h] += _madd(part[4 * r + 2 * h], I16(1)) + _madd(
                            part[4 * r + 2 * h + 1], I16(16)
                        )
                    else:
                        sums[2 * r + h] += _madd(part[2 * r + h], I16(1))
        var so = _scales[GROUP_COLS, QB, FACT](sm, kb, C0)
        comptime for r in range(R):
            var at = (m0 + r) * blocks + kb
            var total = sums[2 * r].join(sums[2 * r + 1]).cast[DType.float32]()
            acc[r] = total.fma(so[0] * xd[unsafe_offset=at], acc[r])
            acc[r] = so[1].fma(Vec(xs[unsafe_offset=at]), acc[r])
    _store[R, GROUP_COLS, 0, ADD](acc, dst, residual, m0, N, n0 + C0, True)


@always_inline
def _int8_column_block[BITS: Int, ADD: Bool, QB: Int, FACT: Bool](
    xv: U8Ptr, xd: Ptr, xs: Ptr, q: U8Ptr, sm: Ptr, group: Int, dst: Ptr, M: Int, K: Int, N: Int,
    n0: Int, residual: Ptr,
):
    """Columns `n0 + 16 group ..` for all `M` rows from group `group` of a tile of an
    int8 copy (`q`, the tile), `INT8_ROWS` rows at a time."""
    var C0 = group * GROUP_COLS
    if n0 + C0 >= N:  # all padding (the last tile)
        return
    var g = q.unsafe_offset(group * (K // QUAD) * 8 * BITS)
    var m = 0
    while m < M:
        var rows = _next_rows[INT8_ROWS](M - m)
        comptime for r in range(1, INT8_ROWS + 1):
            if rows == r:
                _int8_block[r, BITS, ADD, QB, FACT](
                    xv, xd, xs, g, sm, C0, dst, m, K, N, n0, residual
                )
        m += rows


def _quantize_rows(x: Ptr, M: Int, K: Int, QB: Int, xv: U8Ptr, xd: Ptr, xs: Ptr):
    """Each block of `QB` values of each row of `x` `[M, K]` as int8 levels
    `x8 = round(x / d)` (halves away from zero), `d = max|x| / 127`, into `xv`
    `[M, K]`; `d` into `xd` and `d * sum(x8)` into `xs` (`[M, K / QB]`).  A
    block with a NaN or an infinity gets levels 0 and `d` NaN, so its outputs
    are NaN; an all-zero block, `d` 0."""
    comptime W = 16
    var levels = xv.unsafe_bitcast[Int8]()
    var blocks = K // QB
    for m in range(M):
        for b in range(blocks):
            var src = x.unsafe_offset(m * K + b * QB)
            var amax = SIMD[DType.float32, W](0)
            var probe = SIMD[DType.float32, W](0)  # x * 0: NaN where x is NaN or infinite
            for k in range(0, QB, W):
                var v = src.unsafe_load[width=W](k)
                amax = max(amax, abs(v))
                probe += v * 0
            var top = amax.reduce_max()
            var d = top / Float32(I8_MAX)
            var inv = Float32(I8_MAX) / top if top > 0 else Float32(0)
            if not isfinite(probe.reduce_add()) or not isfinite(top):
                d, inv = bitcast[DType.float32, 1](UInt32(0x7FC00000)), Float32(0)  # NaN
            var total = SIMD[DType.int32, W](0)
            for k in range(0, QB, W):
                var v = src.unsafe_load[width=W](k) * inv
                var r = (v + _half_away(v)).cast[DType.int32]()
                r = min(max(r, SIMD[DType.int32, W](-I8_MAX)), SIMD[DType.int32, W](I8_MAX))
                total += r
                levels.unsafe_offset(m * K + b * QB + k).unsafe_store(0, r.cast[DType.int8]())
            xd[unsafe_offset=m * blocks + b] = d
            xs[unsafe_offset=m * blocks + b] = d * Float32(total.reduce_add())


@always_inline
def _half_away(v: SIMD[DType.float32, 16]) -> SIMD[DType.float32, 16]:
    """0.5 with `v`'s sign: `v + _half_away(v)` truncated rounds halves away from zero."""
    return v.lt(0).select(SIMD[DType.float32, 16](-0.5), SIMD[DType.float32, 16](0.5))


def _check_packed[block_cols: Int](
    name: StaticString, M: Int, K: Int, N: Int, w_packed: InputTensor[dtype=DType.float32, rank=4, ...]
) raises -> Int:
    """The tile count of `w_packed`, after checking it is a packed `[N, K]` weight."""
    comptime assert block_cols == 16 or block_cols == TILE, "block_cols must be 16 or 64"
    var tiles = w_packed.dim_size(0)
    if (
        w_packed.dim_size(1) != TILE // block_cols
        or w_packed.dim_size(2) != K
        or w_packed.dim_size(3) != block_cols
        or (N + TILE - 1) // TILE != tiles
    ):
        raise Error(
            name, ": w_packed [", tiles, ", ", w_packed.dim_size(1), ", ",
            w_packed.dim_size(2), ", ", w_packed.dim_size(3), "] is not a [", N, ", ", K,
            "] weight packed in blocks of ", block_cols, " columns",
        )
    return tiles


def _ptr[dtype: DType](t: InputTensor[dtype=dtype, ...]) -> UnsafePointer[Scalar[dtype], MutUntrackedOrigin]:
    return t.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def _run[
    block_cols: Int, ADD: Bool
](
    name: StaticString,
    output: OutputTensor[dtype=DType.float32, rank=2, ...],
    x: InputTensor[dtype=DType.float32, rank=2, ...],
    tiles: Int,
    wp: Ptr,
    has_w: Bool,
    qp: U8Ptr,
    q_kind: Int,
    smp: Ptr,
    residual: Ptr,
    residual_rows: Int,
    residual_cols: Int,
) raises:
    """The body of every `maxkv.linear_packed*` and `maxkv.linear_quantized*`
    op, after its own checks of the weights (`tiles` tiles of 64 columns).

    `wp`: the float32 tiles where `has_w` (else never read: a quantized copy alone).  `q_kind`
    `NO_COPY`: no quantized copy (`qp` and `smp` are never read); else its
    format (`_check_quantized`).  With `ADD`,
    `residual` is `[residual_rows, residual_cols]`, checked here against the
    output.
    """
    var M = x.dim_size(0)
    var K = x.dim_size(1)
    var N = output.dim_size(1)
    if output.dim_size(0) != M:
        raise Error(name, ": output rows ", output.dim_size(0), " != x rows ", M)
    comptime if ADD:
        if residual_rows != M or residual_cols != N:
            raise Error(
                name, ": residual [", residual_rows, ", ", residual_cols, "] is not the output's [",
                M, ", ", N, "]",
            )
    if M == 0:
        return
    var xp = _ptr(x)
    var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var xv = qp  # x's int8 rows: an int8 copy's only
    if q_kind >= INT8_COPY:
        if has_w:
            raise Error(name, ": an int8 copy is the weight alone (maxkv.linear_quantized)")
        comptime if not CompilationTarget.has_avx2():
            raise Error(name, ": an int8 copy needs AVX2")
        var kind = q_kind - INT8_COPY
        var QB = QBLOCK_SMALL if kind == Q8_SMALL or kind == Q6_FACTORED else QBLOCK
        xv = alloc[UInt8](M * K).unsafe_origin_cast[MutUntrackedOrigin]()
        var xd = alloc[Float32](2 * M * (K // QB)).unsafe_origin_cast[MutUntrackedOrigin]()
        var xs = xd.unsafe_offset(M * (K // QB))
        _quantize_rows(xp, M, K, QB, xv, xd, xs)
        _dispatch_quantized[GROUP_COLS, ADD, False, True](
            xp, qp, kind, smp, op, M, K, N, tiles, residual, xv, xd, xs
        )
        xv.unsafe_free()
        xd.unsafe_free()
    elif q_kind == NO_COPY or (M > QUANT_MAX_ROWS and has_w):
        _linear[FLOAT32, block_cols, ADD](
            xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, smp, smp
        )
    elif M > QUANT_MAX_ROWS:
        _dispatch_quantized[block_cols, ADD, True](
            xp, qp, q_kind, smp, op, M, K, N, tiles, residual, xv, smp, smp
        )
    elif M == 1 and block_cols != TILE:
        # One row over AVX2: whole 64-column tile rows (8 accumulators), not 16
        # columns (2).  Each output is a chain of K dependent fmas either way;
        # 2 chains leave the FMA units waiting on their latency, 8 keep them busy.
        # The same fmas in the same order: the same bits.
        _dispatch_quantized[TILE, ADD, False](
            xp, qp, q_kind, smp, op, M, K, N, tiles, residual, xv, smp, smp
        )
    else:
        _dispatch_quantized[block_cols, ADD, False](
            xp, qp, q_kind, smp, op, M, K, N, tiles, residual, xv, smp, smp
        )


comptime NO_COPY = -1
"""`q_kind` of an op with no quantized copy."""
comptime Q4 = 0
"""4-bit integers, a float32 scale and offset per `QBLOCK` (Q4_0, Q4_1)."""
comptime Q8 = 1
"""8-bit integers, a float32 scale and offset per `QBLOCK` (Q5_0, Q5_1, Q8_0)."""
comptime Q8_SMALL = 2
"""8-bit integers, a float32 scale and offset per `QBLOCK_SMALL`."""
comptime Q4_FACTORED = 3
"""4-bit integers, int8 multipliers per `QBLOCK` and float16 factors per `SUPER_K` (Q4_K)."""
comptime Q6_FACTORED = 4
"""6-bit integers, int8 multipliers per `QBLOCK_SMALL` and float16 factors per
`SUPER_K` (Q6_K, and Q2_K, Q3_K, Q5_K's integers)."""
comptime BF16_FLOATS = 5
"""bfloat16 values, no scales (a bfloat16 checkpoint's matrices)."""
comptime F16_FLOATS = 6
"""float16 values, no scales (a float16 checkpoint's, or a GGUF's F16 matrices)."""
comptime INT8_COPY = 8
"""Added to the `q_kind` of an integer format laid out as an int8 copy: groups
of `GROUP_COLS` columns, `QUAD` rows interleaved per column (`_check_quantized`),
multiplied by int8 activations."""


def _dispatch_quantized[block_cols: Int, ADD: Bool, PANEL: Bool, INT8: Bool = False](
    xp: Ptr, qp: U8Ptr, q_kind: Int, smp: Ptr, op: Ptr, M: Int, K: Int, N: Int,
    tiles: Int, residual: Ptr, xv: U8Ptr, xd: Ptr, xs: Ptr,
) raises:
    """`_linear` over a quantized copy in its format (`q_kind`, less `INT8_COPY`
    with `INT8`: an integer format)."""
    var wp = smp  # no float32 tiles are read
    if q_kind == Q4:
        _linear[4, block_cols, ADD, QBLOCK, PANEL, INT8=INT8](
            xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
        )
    elif q_kind == Q8:
        _linear[8, block_cols, ADD, QBLOCK, PANEL, INT8=INT8](
            xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
        )
    elif q_kind == Q8_SMALL:
        _linear[8, block_cols, ADD, QBLOCK_SMALL, PANEL, INT8=INT8](
            xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
        )
    elif q_kind == Q4_FACTORED:
        _linear[4, block_cols, ADD, QBLOCK, PANEL, True, INT8=INT8](
            xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
        )
    elif q_kind == Q6_FACTORED:
        _linear[6, block_cols, ADD, QBLOCK_SMALL, PANEL, True, INT8=INT8](
            xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
        )
    else:
        comptime if not INT8:
            if q_kind == BF16_FLOATS:
                _linear[HALF, block_cols, ADD, 1, PANEL](
                    xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
                )
            else:
                _linear[HALF, block_cols, ADD, 1, PANEL, False, True](
                    xp, wp, qp, smp, op, M, K, N, tiles, residual, xv, xd, xs
                )


def _check_quantized(
    name: StaticString,
    K: Int,
    N: Int,
    tiles: Int,
    q: InputTensor[dtype=DType.uint8, rank=3, ...],
    sm: InputTensor[dtype=DType.float32, rank=4, ...],
) raises -> Int:
    """Checks a quantized copy of a packed `[N, K]` weight of `tiles` tiles; returns its
    format (`Q4` .. `F16_FLOATS`, plus `INT8_COPY` for an int8 copy), told apart
    by the shapes: `q` `[tiles, K, 64 * bits / 8]`, or for an int8 copy of an
    integer format `[tiles * 64 / GROUP_COLS, K / QUAD, 64 * bits / 8]`; plain,
    `sm` `[tiles, K / QB, 2, 64]`; factored, `sm` `[tiles, K / SUPER_K,
    sm_slots, 64]`; 16-bit floats, `q` `[tiles, K, 128]` and `sm` `[tiles, 1,
    1, 64]` (bfloat16) or `[tiles, 2, 1, 64]` (float16), never read: its second
    dimension names the type."""
    var q_width = q.dim_size(2)
    var blocks = sm.dim_size(1)
    # An int8 copy: `[tiles * TILE / GROUP_COLS, K / QUAD, 64 * bits / 8]`.
    var quads = q.dim_size(0) == tiles * (TILE // GROUP_COLS) and K % QUAD == 0
    var kind = NO_COPY
    if K > 0 and sm.dim_size(2) == 1:
        if q_width == 2 * TILE and blocks == 1:
            kind = BF16_FLOATS
        elif q_width == 2 * TILE and blocks == 2:
            kind = F16_FLOATS
    elif K > 0 and sm.dim_size(2) == 2:
        if q_width == TILE // 2 and blocks * QBLOCK == K:
            kind = Q4
        elif q_width == TILE and blocks * QBLOCK == K:
            kind = Q8
        elif q_width == TILE and blocks * QBLOCK_SMALL == K:
            kind = Q8_SMALL
    elif K > 0 and blocks * SUPER_K == K:
        if q_width == TILE // 2 and sm.dim_size(2) == sm_slots[QBLOCK, True]():
            kind = Q4_FACTORED
        elif q_width == TILE * 6 // 8 and sm.dim_size(2) == sm_slots[QBLOCK_SMALL, True]():
            kind = Q6_FACTORED
    var integers = kind != NO_COPY and kind != BF16_FLOATS and kind != F16_FLOATS
    if quads and integers and q.dim_size(1) == K // QUAD:
        kind += INT8_COPY
    elif q.dim_size(0) != tiles or q.dim_size(1) != K:
        kind = NO_COPY
    if (
        kind == NO_COPY
        or sm.dim_size(0) != tiles
        or sm.dim_size(3) != TILE
    ):
        raise Error(
            name, ": q [", q.dim_size(0), ", ", q.dim_size(1), ", ", q_width,
            "], sm [", sm.dim_size(0), ", ", blocks, ", ", sm.dim_size(2), ", ",
            sm.dim_size(3), "] are not a quantized [", N, ", ", K, "] weight",
        )
    return kind


@extensibility.register("maxkv.linear_packed")
struct LinearPacked:
    """`output[M, N] = x[M, K] @ w.T`, `w` packed as `[ceil(N / 64), 64 / block_cols, K, block_cols]`."""

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=4, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_packed runs on CPU"
        comptime name = "maxkv.linear_packed"
        var tiles = _check_packed[block_cols](name, x.dim_size(0), x.dim_size(1), output.dim_size(1), w_packed)
        var wp = _ptr(w_packed)  # no quantized copy or residual: never read
        _run[block_cols, False](name, output, x, tiles, wp, True, wp.unsafe_bitcast[UInt8](), NO_COPY, wp, wp, 0, 0)


@extensibility.register("maxkv.linear_packed_add")
struct LinearPackedAdd:
    """`output = residual + x @ w.T`: `maxkv.linear_packed` with the residual add in its epilogue."""

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=4, ...],
        residual: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_packed_add runs on CPU"
        comptime name = "maxkv.linear_packed_add"
        var tiles = _check_packed[block_cols](name, x.dim_size(0), x.dim_size(1), output.dim_size(1), w_packed)
        var wp = _ptr(w_packed)  # no quantized copy: never read
        _run[block_cols, True](
            name, output, x, tiles, wp, True, wp.unsafe_bitcast[UInt8](), NO_COPY, wp,
            _ptr(residual), residual.dim_size(0), residual.dim_size(1),
        )


@extensibility.register("maxkv.linear_packed_q")
struct LinearPackedQ:
    """`maxkv.linear_packed` with a block-quantized copy of `w` for few rows.

    `q` `[tiles, K, 64 * bits / 8]` uint8 and `sm` `[tiles, K / B, 2, 64]`
    float32 (`B` 32, or 16 with 8 bits) hold the same weights as `w_packed`:
    tile `t`, row `k`, column `j` is
    `fma(q, sm[t, k / B, 0, j], sm[t, k / B, 1, j])`, where `q` is
    byte `j` (8 bits) or, for 4 bits, the low nibble of byte `j` (`j < 32`)
    or the high nibble of byte `j - 32` (6 bits: see `_dequant`).  Factored
    copies' `sm` is `[tiles, K / 256, sm_slots, 64]` (see `_scales`); the
    shapes tell the formats apart (`_check_quantized`).  Up to `QUANT_MAX_ROWS` rows read
    the quantized copy (4 to 8 times fewer bytes), more rows the float32
    one; both give bit-identical results.
    """

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=4, ...],
        q: InputTensor[dtype=DType.uint8, rank=3, ...],
        sm: InputTensor[dtype=DType.float32, rank=4, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_packed_q runs on CPU"
        comptime name = "maxkv.linear_packed_q"
        var tiles = _check_packed[block_cols](name, x.dim_size(0), x.dim_size(1), output.dim_size(1), w_packed)
        var q_kind = _check_quantized(name, x.dim_size(1), output.dim_size(1), tiles, q, sm)
        var smp = _ptr(sm)  # no residual: never read
        _run[block_cols, False](
            name, output, x, tiles, _ptr(w_packed), True, _ptr(q), q_kind, smp, smp, 0, 0
        )


@extensibility.register("maxkv.linear_packed_q_add")
struct LinearPackedQAdd:
    """`output = residual + x @ w.T`: `maxkv.linear_packed_q` with the residual add in its epilogue."""

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w_packed: InputTensor[dtype=DType.float32, rank=4, ...],
        q: InputTensor[dtype=DType.uint8, rank=3, ...],
        sm: InputTensor[dtype=DType.float32, rank=4, ...],
        residual: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_packed_q_add runs on CPU"
        comptime name = "maxkv.linear_packed_q_add"
        var tiles = _check_packed[block_cols](name, x.dim_size(0), x.dim_size(1), output.dim_size(1), w_packed)
        var q_kind = _check_quantized(name, x.dim_size(1), output.dim_size(1), tiles, q, sm)
        _run[block_cols, True](
            name, output, x, tiles, _ptr(w_packed), True, _ptr(q), q_kind, _ptr(sm),
            _ptr(residual), residual.dim_size(0), residual.dim_size(1),
        )


@extensibility.register("maxkv.linear_quantized")
struct LinearQuantized:
    """`output[M, N] = x[M, K] @ w.T` with `w` held only as a block-quantized copy.

    `q` and `sm` as `maxkv.linear_packed_q` takes them, no float32 tiles:
    up to `QUANT_MAX_ROWS` rows dequantize in registers, more rows a panel
    of `PANEL_K` weight rows at a time into their worker's scratch; every
    row count gives the bits of `maxkv.linear_packed` over the float32 values.
    """

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        q: InputTensor[dtype=DType.uint8, rank=3, ...],
        sm: InputTensor[dtype=DType.float32, rank=4, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_quantized runs on CPU"
        comptime assert block_cols == 16 or block_cols == TILE, "block_cols must be 16 or 64"
        comptime name = "maxkv.linear_quantized"
        var N = output.dim_size(1)
        var tiles = (N + TILE - 1) // TILE
        var q_kind = _check_quantized(name, x.dim_size(1), N, tiles, q, sm)
        var smp = _ptr(sm)  # no float32 tiles or residual: never read
        _run[block_cols, False](
            name, output, x, tiles, smp, False, _ptr(q), q_kind, smp, smp, 0, 0
        )


@extensibility.register("maxkv.linear_quantized_add")
struct LinearQuantizedAdd:
    """`output = residual + x @ w.T`: `maxkv.linear_quantized` with the residual add in its epilogue."""

    @staticmethod
    def execute[
        block_cols: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        q: InputTensor[dtype=DType.uint8, rank=3, ...],
        sm: InputTensor[dtype=DType.float32, rank=4, ...],
        residual: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.linear_quantized_add runs on CPU"
        comptime assert block_cols == 16 or block_cols == TILE, "block_cols must be 16 or 64"
        comptime name = "maxkv.linear_quantized_add"
        var N = output.dim_size(1)
        var tiles = (N + TILE - 1) // TILE
        var q_kind = _check_quantized(name, x.dim_size(1), N, tiles, q, sm)
        _run[block_cols, True](
            name, output, x, tiles, _ptr(sm), False, _ptr(q), q_kind, _ptr(sm),
            _ptr(residual), residual.dim_size(0), residual.dim_size(1),
        )


@always_inline
def _quad_value[BITS: Int](q: U8Ptr, K: Int, k: Int, c: Int) -> UInt8:
    """Row `k`, column `c` of a tile of an int8 copy (`q`), as `_quad_values` reads it."""
    comptime GROUP = 8 * BITS
    var g = q.unsafe_offset(((c // GROUP_COLS) * (K // QUAD) + k // QUAD) * GROUP)
    var h = (c % GROUP_COLS) // 8
    var v = QUAD * (c % 8) + k % QUAD
    comptime if BITS == 8:
        return g[unsafe_offset=32 * h + v]
    var byte = g[unsafe_offset=v]
    var value = byte & 15 if h == 0 else byte >> 4
    comptime if BITS == 6:
        var u = 32 * h + v
        value = value | (((g[unsafe_offset=32 + u % 16] >> UInt8(2 * (u // 16))) & 3) << 4)
    return value


@always_inline
def _column_value[BITS: Int, QB: Int, FACT: Bool, F16: Bool, QUADS: Bool](
    q: U8Ptr, sm: Ptr, K: Int, k: Int, c: Int
) -> Float32:
    """Row `k`, column `c` of a quantized tile: the value `_dequant` gives there,
    `fma(q, scale, offset)` with `_scales`' scale and offset (`_half`'s widened
    16-bit float with `HALF`), one column at a time; with `QUADS`, of an int8
    copy's tile (the same value)."""
    comptime ROW = TILE * BITS // 8
    comptime if BITS == HALF:
        return _half[1, F16](q, k, c)[0]
    var v: UInt8
    comptime if QUADS:
        v = _quad_value[BITS](q, K, k, c)
    elif BITS == 8:
        v = q[unsafe_offset=k * ROW + c]
    else:
        var byte = q[unsafe_offset=k * ROW + c % (TILE // 2)]
        v = byte & 15 if c < TILE // 2 else byte >> 4
        comptime if BITS == 6:
            var top = q[unsafe_offset=k * ROW + TILE // 2 + c % 16]
            v = v | (((top >> UInt8(2 * (c // 16))) & 3) << 4)
    var so = _scales[1, QB, FACT](sm, k // QB, c)
    return Float32(v).fma(so[0][0], so[1][0])


def _gather[BITS: Int, QB: Int, FACT: Bool, F16: Bool = False, QUADS: Bool = False](
    op: Ptr, tokens: UnsafePointer[Int64, MutUntrackedOrigin], T: Int, K: Int, qp: U8Ptr, smp: Ptr
):
    """`op[t] = w[tokens[t]]` (`[T, K]`) from the quantized tiles, a token per worker step."""
    var q_tile = K * TILE * BITS // 8
    var sm_tile = 0 if BITS == HALF else (K // (SUPER_K if FACT else QB)) * sm_slots[QB, FACT]() * TILE
    var workers = max(1, min(parallelism_level(None), T))

    def work(worker: Int) {imm}:
        for t in range(worker * T // workers, (worker + 1) * T // workers):
            var row = Int(tokens[unsafe_offset=t])
            var q = qp.unsafe_offset((row // TILE) * q_tile)
            var sm = smp.unsafe_offset((row // TILE) * sm_tile)
            var dst = op.unsafe_offset(t * K)
            for k in range(K):
                dst[unsafe_offset=k] = _column_value[BITS, QB, FACT, F16, QUADS](
                    q, sm, K, k, row % TILE
                )

    sync_parallelize(work, workers)


def _gather_int8(
    op: Ptr, tp: UnsafePointer[Int64, MutUntrackedOrigin], T: Int, K: Int, qp: U8Ptr, smp: Ptr,
    kind: Int,
):
    """`_gather` over an int8 copy of format `kind`."""
    if kind == Q4:
        _gather[4, QBLOCK, False, QUADS=True](op, tp, T, K, qp, smp)
    elif kind == Q8:
        _gather[8, QBLOCK, False, QUADS=True](op, tp, T, K, qp, smp)
    elif kind == Q8_SMALL:
        _gather[8, QBLOCK_SMALL, False, QUADS=True](op, tp, T, K, qp, smp)
    elif kind == Q4_FACTORED:
        _gather[4, QBLOCK, True, QUADS=True](op, tp, T, K, qp, smp)
    else:
        _gather[6, QBLOCK_SMALL, True, QUADS=True](op, tp, T, K, qp, smp)


@extensibility.register("maxkv.gather_quantized")
struct GatherQuantized:
    """`output[t] = w[tokens[t]]`: rows of a `[rows, K]` matrix held as a quantized
    copy in the tile layout `maxkv.linear_quantized` reads (`q`, `sm`), each
    value the one the matmul dequantizes there (an embedding gathered from the
    table its tied head reads).  A token outside `0 .. rows - 1` raises."""

    @staticmethod
    def execute[
        rows: Int, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        tokens: InputTensor[dtype=DType.int64, rank=1, ...],
        q: InputTensor[dtype=DType.uint8, rank=3, ...],
        sm: InputTensor[dtype=DType.float32, rank=4, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "maxkv.gather_quantized runs on CPU"
        comptime name = "maxkv.gather_quantized"
        var T = tokens.dim_size(0)
        var K = output.dim_size(1)
        if output.dim_size(0) != T:
            raise Error(name, ": output rows ", output.dim_size(0), " != tokens ", T)
        var kind = _check_quantized(name, K, rows, (rows + TILE - 1) // TILE, q, sm)
        var tp = tokens.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        for t in range(T):
            var token = Int(tp[unsafe_offset=t])
            if token < 0 or token >= rows:
                raise Error(name, ": token ", token, " is outside the table's ", rows, " rows")
        if T == 0:
            return
        var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var qp = _ptr(q)
        var smp = _ptr(sm)
        if kind >= INT8_COPY:
            _gather_int8(op, tp, T, K, qp, smp, kind - INT8_COPY)
        elif kind == Q4:
            _gather[4, QBLOCK, False](op, tp, T, K, qp, smp)
        elif kind == Q8:
            _gather[8, QBLOCK, False](op, tp, T, K, qp, smp)
        elif kind == Q8_SMALL:
            _gather[8, QBLOCK_SMALL, False](op, tp, T, K, qp, smp)
        elif kind == Q4_FACTORED:
            _gather[4, QBLOCK, True](op, tp, T, K, qp, smp)
        elif kind == BF16_FLOATS:
            _gather[HALF, 1, False](op, tp, T, K, qp, smp)
        elif kind == F16_FLOATS:
            _gather[HALF, 1, False, True](op, tp, T, K, qp, smp)
        else:
            _gather[6, QBLOCK_SMALL, True](op, tp, T, K, qp, smp)


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
