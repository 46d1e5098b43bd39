"""maxkv's CPU attention over the cache: FlashDecoding-style, ragged, any cache encoding.

`flash_attention` (attention.mojo) calls `cpu_attention` on the CPU when every
sequence of the step has 1 to `MAX_VERIFY` new tokens (a decode step, or one
that verifies speculative drafts), and for every step when the cache's
encoding differs from the model's dtype (MAX's CPU
kernel takes only a cache in the query's dtype); MAX's generic kernel runs
the other steps.  `cpu_attention_applies` says whether the shapes suit it:
`head_dim` a multiple of the SIMD width and whole groups of query heads per
KV head.  The bounds checks (the step's `check_rows`, the op's `check_layer`
and `check_row_count`) have run before: every row read here has storage.

Sequence `b` brings `n_b` new tokens at positions `cache_length(b) ..`; new
token `t` at position `p` attends to positions `lo .. p` (causal: `lo = 0`,
or `p - window + 1` with a sliding window) or, with `null_mask`, to all
`cache_length(b) + n_b` tokens.

The work is cut into items, each covering every KV head of one sequence: a
K or V row `[kv_heads, head_dim]` is contiguous in both layouts, so an item
streams its sequence's rows of one layer in order (one item per (sequence,
KV head) would read them with a stride and measured about half the bandwidth
here).  A sequence with more than `MAX_VERIFY` new tokens gets an item per
block of `QB` query tokens; a decoding sequence (one new token) gets an item
per context split; a sequence verifying speculative drafts (2 to
`MAX_VERIFY` new tokens) gets an item per token, each a decode item over the
keys that token sees.  An item reads `BLOCK` K rows, then the same V rows, SIMD over
`head_dim`, for all the query rows (its tokens x the `group` query heads
that share a KV head) at once, so each K/V row is read from memory once per
item and converted from the cache's encoding to float32 in the inner loop
(no converted copy of the cache is made; a quantized encoding's rows are
stored rotated, so each query row is rotated before and each output row
after: `HeadCodec.rotate`); an online softmax (running max
`m`, running sum `l`, rescaled accumulator) keeps the state.  A decoding
item with several query heads per KV head takes each KV head in turn
(`_decode_rows`): its query rows and accumulators stay in registers for
the block, a head row is decoded once for all of them, and `W` scores are
finished together instead of one horizontal sum each.  Decode
contexts are cut into splits of `max(MIN_SPLIT, total tokens / (4 x
workers))` tokens, so one long sequence still keeps every worker busy; a
sequence with several splits leaves each split's `(m, l, acc)` in scratch
memory and a second pass merges them exactly:
`out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s`, `M = max_s m_s`.

Keys and values are read through `row_ptr`, so the body is generic over the
collection (contiguous slots or pages).  Math is float32 whatever the cache
encoding; the output is cast back to the query dtype.
"""

from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.runtime.asyncrt import parallelism_level
from std.math import exp
from std.memory import alloc
from std.sys import simd_width_of, size_of
from std.sys.intrinsics import PrefetchOptions, prefetch

from .encoding import HeadCodec
from .kv_trait import MaxkvKVCollection

comptime W = simd_width_of[DType.float32]()
"""float32 SIMD width of the target (16 with AVX-512)."""
comptime BLOCK = 64
"""Tokens per online-softmax block (their scores stay in L1)."""
comptime QB = 4
"""Query tokens per item of a sequence with several new tokens."""
comptime MAX_VERIFY = 8
"""Most new tokens per sequence of a step this kernel takes over a cache in the
query's dtype: a decode step (1), or one verifying speculative drafts (the
pending token and its drafts), whose few query rows against a long context
MAX's generic kernel, made for prefill, runs several times slower."""
comptime MAX_GROUP = 8
"""Most query heads per KV head a decode step takes here (more: MAX's kernel)."""
comptime MIN_SPLIT = 256
"""Fewest tokens in one context split."""
comptime NEG = Float32(-1.0e30)
"""Running-max start and score padding: `exp(NEG - m)` is 0 for any real score `m`."""
comptime SKIP = Float32(-80.0)
"""A score this far below the running max has probability 0 (`e^-80` is
1.8e-35: below it, probabilities and their products turn subnormal)."""
comptime F32Ptr = UnsafePointer[Float32, MutUntrackedOrigin]
comptime IntPtr = UnsafePointer[Int, MutUntrackedOrigin]


comptime ACC_VECTORS = 16 if W >= 16 else 8
"""float32 vectors of query rows (or accumulators) a decode item keeps in
registers at once: half of AVX-512's 32 registers, or of AVX2's 16."""


def rows_at_once[head_dim: Int]() -> Int:
    """Query rows of one KV head a decode item runs together (`_decode_rows`)."""
    return max(1, min(MAX_GROUP, ACC_VECTORS // (head_dim // W)))


@always_inline
def _prefetch_bytes[n: Int](p: UnsafePointer[UInt8, MutUntrackedOrigin]):
    """Asks for the cache lines of `p[0 : n]` (a prefetch faults on no address)."""
    comptime for o in range(0, n + 63, 64):
        prefetch[PrefetchOptions().for_read().high_locality().to_data_cache()](
            p.unsafe_offset(min(o, n - 1))
        )


@always_inline
def _row_ptrs[C: MaxkvKVCollection](
    kv: C,
    layer: Int,
    b: Int,
    t: Int,
    n: Int,
    k_rows: UnsafePointer[UnsafePointer[Scalar[C.View.dtype], MutUntrackedOrigin], MutUntrackedOrigin],
    v_rows: UnsafePointer[UnsafePointer[Scalar[C.View.dtype], MutUntrackedOrigin], MutUntrackedOrigin],
):
    """`k_rows[j]` / `v_rows[j]`: the K and V rows of token `t + j` of sequence `b`, `j < n`."""
    for j in range(n):
        k_rows[unsafe_offset=j] = kv.row_ptr(0, layer, b, t + j)
        v_rows[unsafe_offset=j] = kv.row_ptr(1, layer, b, t + j)


def _pow2_at_least(n: Int) -> Int:
    """The smallest power of two >= `n` (n >= 1)."""
    var p = 1
    while p < n:
        p *= 2
    return p


@always_inline
def _lane_sums[N: Int](x: SIMD[DType.float32, N]) -> SIMD[DType.float32, W]:
    """Lane `i`: the sum of lanes `i * N / W ..< (i + 1) * N / W` of `x`.

    `x` holds `W` vectors of `W` partial sums back to back; the result holds
    their `W` totals, by `log2(W)` rounds of adding adjacent lanes (two
    shuffles and an add per result vector), not one horizontal sum each.
    """
    comptime if N == W:
        return rebind[SIMD[DType.float32, W]](x)
    else:
        var pairs = x.deinterleave()
        return _lane_sums[N // 2](rebind[SIMD[DType.float32, N // 2]](pairs[0] + pairs[1]))


@always_inline
def _softmax_block(row: F32Ptr, n: Int, m: F32Ptr, l: F32Ptr, acc: F32Ptr, width: Int):
    """Online softmax of one query row over one block of keys.

    `row[0 : n]` holds the block's scores (`row[n : BLOCK]` is padding); they
    become probabilities against the new running max `m[0]`, their sum is
    added to `l[0]` and the accumulator row `acc[0 : width]` is rescaled.  A
    row with nothing visible in this block adds nothing (all zero).
    """
    for j in range(n, BLOCK):
        row[unsafe_offset=j] = NEG
    var block_max = SIMD[DType.float32, W](NEG)
    comptime for j in range(0, BLOCK, W):
        block_max = max(block_max, row.unsafe_load[width=W](j))
    var top = block_max.reduce_max()
    if top == NEG:
        comptime for j in range(0, BLOCK, W):
            row.unsafe_store(j, SIMD[DType.float32, W](0))
        return
    var m_old = m[unsafe_offset=0]
    var m_new = max(m_old, top)
    var sum = SIMD[DType.float32, W](0)
    comptime for j in range(0, BLOCK, W):
        var x = row.unsafe_load[width=W](j) - m_new
        # Below e^-80 a probability is 0: subnormal ones would slow every
        # multiply-add they enter, for nothing float32's sums can show.
        var p = x.lt(SKIP).select(SIMD[DType.float32, W](0), exp(max(x, SKIP)))
        row.unsafe_store(j, p)
        sum += p
    var alpha = exp(m_old - m_new)
    l[unsafe_offset=0] = l[unsafe_offset=0] * alpha + sum.reduce_add()
    m[unsafe_offset=0] = m_new
    if alpha != 1:
        for d in range(0, width, W):
            var a = acc.unsafe_offset(d)
            a.unsafe_store(0, a.unsafe_load[width=W](0) * alpha)


@always_inline
def _decode_rows[R: Int, head_dim: Int, dtype: DType](
    k_rows: UnsafePointer[UnsafePointer[Scalar[dtype], MutUntrackedOrigin], MutUntrackedOrigin],
    v_rows: UnsafePointer[UnsafePointer[Scalar[dtype], MutUntrackedOrigin], MutUntrackedOrigin],
    n: Int,
    k_next: UnsafePointer[UnsafePointer[Scalar[dtype], MutUntrackedOrigin], MutUntrackedOrigin],
    v_next: UnsafePointer[UnsafePointer[Scalar[dtype], MutUntrackedOrigin], MutUntrackedOrigin],
    n_next: Int,
    head: Int,
    q: F32Ptr,
    acc: F32Ptr,
    scores: F32Ptr,
    m: F32Ptr,
    l: F32Ptr,
    work: F32Ptr,
):
    """One block of `n` keys for `R` query rows of one KV head of a decode item.

    `k_rows[j]` / `v_rows[j]` are key `j`'s K and V rows (`[kv_heads,
    width]`); `q` / `acc` the rows' (scaled, rotated) queries and
    accumulators (`[R, head_dim]`), `scores` their score rows (`[R, BLOCK]`),
    `m` / `l` their running max and sum; `work` holds `R x W x W` partial sums
    then `2 x BLOCK` scales.  The queries and the accumulators stay in
    registers across the block: each K and V head row is decoded once for
    the `R` rows, a score's dot product is left as `W` partial sums and `W`
    keys' sums are finished together (`_lane_sums`).
    """
    comptime Codec = HeadCodec[dtype, head_dim]
    comptime slice_bytes = Codec.width * size_of[dtype]()
    comptime P = _pow2_at_least(R)  # SIMD lengths are powers of two: rows R ..< P are unused
    var parts = work
    var k_scales = work.unsafe_offset(R * W * W)
    var v_scales = k_scales.unsafe_offset(BLOCK)
    var at = head * Codec.width
    comptime if Codec.row_scaled:
        for j in range(n):
            k_scales[unsafe_offset=j] = Codec.scale(k_rows[unsafe_offset=j].unsafe_offset(at))
            v_scales[unsafe_offset=j] = Codec.scale(v_rows[unsafe_offset=j].unsafe_offset(at))
        for j in range(n, BLOCK):
            k_scales[unsafe_offset=j] = 0
            v_scales[unsafe_offset=j] = 0
    # Scores, W keys at a time.
    var qv = SIMD[DType.float32, P * head_dim](0)
    comptime for i in range(R):
        qv = qv.insert[offset=i * head_dim](q.unsafe_load[width=head_dim](i * head_dim))
    for j0 in range(0, n, W):
        for jj in range(min(W, n - j0)):
            var j = j0 + jj
            if j < n_next:
                _prefetch_bytes[slice_bytes](k_next[unsafe_offset=j].unsafe_offset(at).unsafe_bitcast[UInt8]())
                _prefetch_bytes[slice_bytes](v_next[unsafe_offset=j].unsafe_offset(at).unsafe_bitcast[UInt8]())
            var key = Codec.load(k_rows[unsafe_offset=j].unsafe_offset(at))
            comptime for i in range(R):
                var dot = qv.slice[head_dim, offset=i * head_dim]() * key
                parts.unsafe_store((i * W + jj) * W, dot.reduce_add[W]())
        comptime for i in range(R):
            var sums = _lane_sums(parts.unsafe_load[width=W * W](i * W * W))
            comptime if Codec.row_scaled:
                sums *= k_scales.unsafe_load[width=W](j0)
            scores.unsafe_store(i * BLOCK + j0, sums)
    for i in range(R):
        var row = scores.unsafe_offset(i * BLOCK)
        _softmax_block(row, n, m.unsafe_offset(i), l.unsafe_offset(i), acc.unsafe_offset(i * head_dim), head_dim)
        comptime if Codec.row_scaled:  # fold each value's scale into its probability
            comptime for j in range(0, BLOCK, W):
                row.unsafe_store(j, row.unsafe_load[width=W](j) * v_scales.unsafe_load[width=W](j))
    # Values: the R accumulator rows in registers.
    var av = SIMD[DType.float32, P * head_dim](0)
    comptime for i in range(R):
        av = av.insert[offset=i * head_dim](acc.unsafe_load[width=head_dim](i * head_dim))
    for j in range(n):
        var value = Codec.load(v_rows[unsafe_offset=j].unsafe_offset(at))
        comptime for i in range(R):
            var p = SIMD[DType.float32, head_dim](scores[unsafe_offset=i * BLOCK + j])
            av = av.insert[offset=i * head_dim](p.fma(value, av.slice[head_dim, offset=i * head_dim]()))
    comptime for i in range(R):
        acc.unsafe_store(i * head_dim, av.slice[head_dim, offset=i * head_dim]())


@always_inline
def _visible_end[null_mask: Bool](cached: Int, new_tokens: Int, t: Int) -> Int:
    """One past the last position new token `t` of a sequence sees."""
    comptime if null_mask:
        return cached + new_tokens
    else:
        return cached + t + 1


@always_inline
def _visible_start(end: Int, window: Int) -> Int:
    """The first position a token seeing up to `end` (exclusive) sees."""
    return max(0, end - window) if window > 0 else 0


def cpu_attention_applies[
    head_dim: Int
](q_heads: Int, kv_heads: Int) -> Bool:
    """Whether `cpu_attention` takes these shapes."""
    comptime if head_dim % W != 0:
        return False
    return q_heads % kv_heads == 0


def is_decode_step(
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...], batch: Int
) -> Bool:
    """Whether every sequence of the step brings 1 to `MAX_VERIFY` new tokens
    (host offsets): a decode step, or one that verifies speculative drafts."""
    if batch == 0:
        return False
    for b in range(batch):
        var n = Int(input_row_offsets[b + 1]) - Int(input_row_offsets[b])
        if n < 1 or n > MAX_VERIFY:
            return False
    return True


def cpu_attention[
    kv_heads: Int, head_dim: Int, null_mask: Bool, C: MaxkvKVCollection, dtype: DType
](
    output: OutputTensor[dtype=dtype, rank=3, ...],
    q: InputTensor[dtype=dtype, rank=3, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer: Int,
    scale: Float32,
    window: Int,
) raises:
    """`output[r, :, :]` = attention of the query row `r` (token `t` of sequence
    `b`, `r = input_row_offsets[b] + t`) over the cached tokens it sees in
    `layer` (this step's K/V included): see the module's docstring.

    `q` and `output` are `[total_tokens, q_heads, head_dim]`;
    `cpu_attention_applies` was true.
    """
    comptime Codec = HeadCodec[C.View.dtype, head_dim]
    comptime R = rows_at_once[head_dim]()
    comptime RowPtrs = UnsafePointer[Codec.Ptr, MutUntrackedOrigin]
    comptime unrotate = Float32(1) / Float32(Codec.rotation_block)  # H H = rotation_block x I
    var batch = kv.batch()
    var q_heads = q.dim_size(1)
    var group = q_heads // kv_heads
    var qp = q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var workers = max(1, parallelism_level(None))

    # Per sequence: its first query row, new tokens, cache length.
    var row0 = alloc[Int](batch + 1).unsafe_origin_cast[MutUntrackedOrigin]()
    var cached = alloc[Int](batch).unsafe_origin_cast[MutUntrackedOrigin]()
    for b in range(batch + 1):
        row0[unsafe_offset=b] = Int(input_row_offsets[b])
    for b in range(batch):
        cached[unsafe_offset=b] = kv.cache_length(b)

    @always_inline
    def new_tokens(b: Int) {imm} -> Int:
        return row0[unsafe_offset=b + 1] - row0[unsafe_offset=b]

    @always_inline
    def visible_end(b: Int, t: Int) {imm} -> Int:
        """One past the last position token `t` of sequence `b` sees."""
        return _visible_end[null_mask](cached[unsafe_offset=b], new_tokens(b), t)

    @always_inline
    def visible_start(b: Int, t: Int) {imm} -> Int:
        """The first position token `t` of sequence `b` sees."""
        return _visible_start(visible_end(b, t), window)

    # Plan: a decoding sequence's split length keeps about 4 items per worker,
    # never below MIN_SPLIT.
    var total = 0
    for b in range(batch):
        if new_tokens(b) == 1:
            total += visible_end(b, 0) - visible_start(b, 0)
    var split = max(MIN_SPLIT, (total + 4 * workers - 1) // (4 * workers))
    split = (split + BLOCK - 1) // BLOCK * BLOCK
    # first[b]: the first item of sequence b: its context splits (one new
    # token) or its blocks of QB query tokens.
    var first = alloc[Int](batch + 1).unsafe_origin_cast[MutUntrackedOrigin]()
    var items = 0
    var merged = False
    for b in range(batch):
        first[unsafe_offset=b] = items
        var n = new_tokens(b)
        if n == 1:
            var splits = (visible_end(b, 0) - visible_start(b, 0) + split - 1) // split
            merged = merged or splits > 1
            items += splits
        elif n <= MAX_VERIFY:
            items += n  # verifying drafts: an item per token, each a decode over its keys
        else:
            items += (n + QB - 1) // QB
    first[unsafe_offset=batch] = items
    # Per split item: m [q_heads], l [q_heads], acc [q_heads, head_dim].
    var part_size = q_heads * (head_dim + 2)
    var scratch = alloc[Float32](items * part_size if merged else 1).unsafe_origin_cast[
        MutUntrackedOrigin
    ]()

    def run_item(b: Int, i: Int, buf: F32Ptr, k_rows: RowPtrs, v_rows: RowPtrs) {imm}:
        """Item `i` of sequence `b`, all heads; `buf`, `k_rows` and `v_rows`
        are this task's work memory."""
        comptime rows_max = QB
        var n_items = first[unsafe_offset=b + 1] - first[unsafe_offset=b]
        var decode = new_tokens(b) == 1
        # A sequence verifying drafts: item i is its token i alone, every key
        # it sees visible to its one query (as in a decode item).
        var single = decode or new_tokens(b) <= MAX_VERIFY
        # The item's query tokens [t0, t0 + nq) and key positions [start, end).
        var t0 = 0 if decode else (i if single else i * QB)
        var nq = 1 if single else min(QB, new_tokens(b) - t0)
        var start: Int
        var end: Int
        if decode:
            start = visible_start(b, 0) + i * split
            end = min(visible_end(b, 0), start + split)
        else:
            start = visible_start(b, t0)
            end = visible_end(b, t0 + nq - 1)
        var rows = nq * q_heads
        var qbuf = buf
        var acc = buf.unsafe_offset(rows_max * q_heads * head_dim)
        var scores = acc.unsafe_offset(rows_max * q_heads * head_dim)
        var m = scores.unsafe_offset(rows_max * q_heads * BLOCK)
        var l = m.unsafe_offset(rows_max * q_heads)
        var work = l.unsafe_offset(rows_max * q_heads)
        var src = qp.unsafe_offset((row0[unsafe_offset=b] + t0) * q_heads * head_dim)
        for r in range(rows):
            comptime for d in range(0, head_dim, W):
                var at = r * head_dim + d
                qbuf.unsafe_store(at, src.unsafe_load[width=W](at).cast[DType.float32]() * scale)
                acc.unsafe_store(at, SIMD[DType.float32, W](0))
            m[unsafe_offset=r] = NEG
            l[unsafe_offset=r] = 0
            comptime if Codec.rotated:  # keys are stored rotated: q . k = (H q) . (H k) / n
                var row = qbuf.unsafe_load[width=head_dim](r * head_dim)
                qbuf.unsafe_store(r * head_dim, Codec.rotate(row) * unrotate)
        var t = start
        # A decoding (or verifying) item of grouped queries: blocks of keys, each KV head's
        # query rows R at a time (`_decode_rows`); every key of the item is
        # visible.  The next block's row pointers are ready before a block
        # starts, so each head's pass asks for its slice of the next block as
        # it reads this one's (a pass reads its slice of each row with a
        # stride, which the hardware prefetchers follow badly).  With one
        # query head per KV head there is nothing to share a decoded row
        # with, and the per-head passes measured slower than the loop below,
        # which streams whole rows.
        var by_head = single and group > 1
        if by_head:
            _row_ptrs(kv, layer, b, t, min(BLOCK, end - t), k_rows, v_rows)
        var slot = 0
        while by_head and t < end:
            var n = min(BLOCK, end - t)
            var n_next = min(BLOCK, end - t - n)
            var k_cur = k_rows.unsafe_offset(slot * BLOCK)
            var v_cur = v_rows.unsafe_offset(slot * BLOCK)
            var k_next = k_rows.unsafe_offset((1 - slot) * BLOCK)
            var v_next = v_rows.unsafe_offset((1 - slot) * BLOCK)
            _row_ptrs(kv, layer, b, t + n, n_next, k_next, v_next)
            for h in range(kv_heads):
                var g = 0
                while g < group:
                    var r = h * group + g
                    var c = min(R, group - g)
                    comptime for cr in range(1, R + 1):
                        if c == cr:
                            _decode_rows[cr, head_dim, C.View.dtype](
                                k_cur,
                                v_cur,
                                n,
                                k_next,
                                v_next,
                                n_next if g == 0 else 0,
                                h,
                                qbuf.unsafe_offset(r * head_dim),
                                acc.unsafe_offset(r * head_dim),
                                scores.unsafe_offset(r * BLOCK),
                                m.unsafe_offset(r),
                                l.unsafe_offset(r),
                                work,
                            )
                    g += c
            slot = 1 - slot
            t += n
        while not by_head and t < end:
            var n = min(BLOCK, end - t)
            # Scores: each K row ([kv_heads, head_dim], contiguous) read and
            # decoded once, for every query row of its group.
            for j in range(n):
                var k_row = kv.row_ptr(0, layer, b, t + j)
                var seen = 0  # bit tq: token tq of the item sees position t + j
                for tq in range(nq):
                    var seen_end = visible_end(b, t0 + tq)
                    if _visible_start(seen_end, window) <= t + j and t + j < seen_end:
                        seen |= 1 << tq
                for h in range(kv_heads):
                    var k = k_row.unsafe_offset(h * Codec.width)
                    var k_scale = Codec.scale(k)
                    var key = Codec.load(k)
                    for tq in range(nq):
                        var sees = (seen >> tq) & 1 == 1
                        for g in range(group):
                            var r = tq * q_heads + h * group + g
                            var score = NEG
                            if sees:
                                var dot = SIMD[DType.float32, W](0)
                                comptime for d in range(0, head_dim, W):
                                    dot = qbuf.unsafe_load[width=W](r * head_dim + d).fma(
                                        key.slice[W, offset=d](), dot
                                    )
                                score = dot.reduce_add() * k_scale
                            scores[unsafe_offset=r * BLOCK + j] = score
            # Online softmax: scores become probabilities against the new max;
            # a row with nothing visible in this block adds nothing.
            for r in range(rows):
                _softmax_block(
                    scores.unsafe_offset(r * BLOCK),
                    n,
                    m.unsafe_offset(r),
                    l.unsafe_offset(r),
                    acc.unsafe_offset(r * head_dim),
                    head_dim,
                )
            # Values: each V row read and decoded once, into every query row of its group.
            for j in range(n):
                var v_row = kv.row_ptr(1, layer, b, t + j)
                for h in range(kv_heads):
                    var v = v_row.unsafe_offset(h * Codec.width)
                    var value = Codec.load(v)
                    var v_scale = Codec.scale(v)
                    for tq in range(nq):
                        for g in range(group):
                            var r = tq * q_heads + h * group + g
                            var p = SIMD[DType.float32, W](
                                scores[unsafe_offset=r * BLOCK + j] * v_scale
                            )
                            comptime for d in range(0, head_dim, W):
                                var a = acc.unsafe_offset(r * head_dim + d)
                                a.unsafe_store(
                                    0, p.fma(value.slice[W, offset=d](), a.unsafe_load[width=W](0))
                                )
            t += n
        comptime if Codec.rotated:  # so are values: sum p v = H (sum p H v) / n
            for r in range(rows):
                var row = acc.unsafe_load[width=head_dim](r * head_dim)
                acc.unsafe_store(r * head_dim, Codec.rotate(row) * unrotate)
        if n_items == 1 or not decode:
            var dst = op.unsafe_offset((row0[unsafe_offset=b] + t0) * q_heads * head_dim)
            for r in range(rows):
                var inv = 1 / l[unsafe_offset=r]
                comptime for d in range(0, head_dim, W):
                    var at = r * head_dim + d
                    dst.unsafe_store(at, (acc.unsafe_load[width=W](at) * inv).cast[dtype]())
        else:
            var part = scratch.unsafe_offset((first[unsafe_offset=b] + i) * part_size)
            for qh in range(q_heads):
                part[unsafe_offset=qh] = m[unsafe_offset=qh]
                part[unsafe_offset=q_heads + qh] = l[unsafe_offset=qh]
            var dst = part.unsafe_offset(2 * q_heads)
            for at in range(0, q_heads * head_dim, W):
                dst.unsafe_store(at, acc.unsafe_load[width=W](at))

    # Items in (sequence, item) order, a contiguous range per task.
    var tasks = max(1, min(items, 4 * workers))
    # qbuf, acc, scores, m, l, then `_decode_rows`' partial sums and scales.
    var buf_size = QB * q_heads * (2 * head_dim + BLOCK + 2) + R * W * W + 2 * BLOCK

    def work(task: Int) {imm}:
        var lo = task * items // tasks
        var hi = (task + 1) * items // tasks
        var buf = alloc[Float32](buf_size).unsafe_origin_cast[MutUntrackedOrigin]()
        var k_rows = alloc[Codec.Ptr](2 * BLOCK).unsafe_origin_cast[MutUntrackedOrigin]()
        var v_rows = alloc[Codec.Ptr](2 * BLOCK).unsafe_origin_cast[MutUntrackedOrigin]()
        var b = 0
        for i in range(lo, hi):
            while first[unsafe_offset=b + 1] <= i:
                b += 1
            run_item(b, i - first[unsafe_offset=b], buf, k_rows, v_rows)
        buf.unsafe_free()
        k_rows.unsafe_free()
        v_rows.unsafe_free()

    sync_parallelize(work, tasks)

    if merged:
        var merge_tasks = max(1, min(batch, workers))

        def merge(task: Int) {imm}:
            var out = alloc[Float32](head_dim).unsafe_origin_cast[MutUntrackedOrigin]()
            for b in range(task * batch // merge_tasks, (task + 1) * batch // merge_tasks):
                var lo = first[unsafe_offset=b]
                var hi = first[unsafe_offset=b + 1]
                if hi - lo == 1 or new_tokens(b) != 1:
                    continue
                for qh in range(q_heads):
                    var top = NEG
                    for i in range(lo, hi):
                        top = max(top, scratch[unsafe_offset=i * part_size + qh])
                    var denominator = Float32(0)
                    comptime for d in range(0, head_dim, W):
                        out.unsafe_store(d, SIMD[DType.float32, W](0))
                    for i in range(lo, hi):
                        var part = scratch.unsafe_offset(i * part_size)
                        var weight = exp(part[unsafe_offset=qh] - top)
                        denominator += weight * part[unsafe_offset=q_heads + qh]
                        var src = part.unsafe_offset(2 * q_heads + qh * head_dim)
                        comptime for d in range(0, head_dim, W):
                            out.unsafe_store(
                                d,
                                SIMD[DType.float32, W](weight).fma(
                                    src.unsafe_load[width=W](d), out.unsafe_load[width=W](d)
                                ),
                            )
                    var inv = 1 / denominator
                    var dst = op.unsafe_offset((row0[unsafe_offset=b] * q_heads + qh) * head_dim)
                    comptime for d in range(0, head_dim, W):
                        dst.unsafe_store(d, (out.unsafe_load[width=W](d) * inv).cast[dtype]())
            out.unsafe_free()

        sync_parallelize(merge, merge_tasks)
    first.unsafe_free()
    row0.unsafe_free()
    cached.unsafe_free()
    scratch.unsafe_free()
