"""maxkv's decode attention for CPU: one new token per sequence, FlashDecoding-style.

`flash_attention` (attention.mojo) calls `decode_attention` when every sequence
of the step has exactly one new token, the target is the CPU, the query heads
per KV head are at most `MAX_GROUP` and `head_dim` is a multiple of the SIMD
width; MAX's generic kernel runs otherwise.  The bounds checks (the step's
`check_rows`, the op's `check_layer` and `check_row_count`) have run before:
every row read here has storage.

The work is cut into items `(sequence b, context split [start, end))`, each
covering every KV head: a K or V row `[kv_heads, head_dim]` is contiguous in
both layouts, so an item streams its sequence's rows of one layer in order
(one item per (sequence, KV head) would read them with a stride and measured
about half the bandwidth here).  An item reads `BLOCK` K rows, then the same
V rows, SIMD over `head_dim`, for all the `group` query heads that share a KV
head at once (GQA: each K/V row is read from memory once), with an online
softmax (running max `m`, running sum `l`, rescaled accumulator).  Contexts are
cut into splits of `max(MIN_SPLIT, total tokens / (4 x workers))` tokens, so
one long sequence still keeps every worker busy; a sequence with several splits
leaves each split's `(m, l, acc)` in scratch memory and a second pass merges
them exactly:
`out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s`, `M = max_s m_s`.

Keys and values are read through `row_ptr`, so the body is generic over the
collection (contiguous slots or pages).  Math is float32 whatever the cache
dtype; the output is cast back to the query dtype.
"""

from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.runtime.asyncrt import parallelism_level
from std.math import exp
from std.memory import alloc, stack_allocation
from std.sys import simd_width_of

from .kv_trait import MaxkvKVCollection

comptime W = simd_width_of[DType.float32]()
"""float32 SIMD width of the target (16 with AVX-512)."""
comptime BLOCK = 64
"""Tokens per online-softmax block (their scores stay in L1)."""
comptime MAX_GROUP = 8
"""Most query heads per KV head this kernel takes (more: MAX's kernel)."""
comptime MIN_SPLIT = 256
"""Fewest tokens in one context split."""
comptime NEG = Float32(-1.0e30)
"""Running-max start and score padding: `exp(NEG - m)` is 0 for any real score `m`."""
comptime F32Ptr = UnsafePointer[Float32, MutUntrackedOrigin]


def decode_applies[
    head_dim: Int
](
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    batch: Int,
    q_heads: Int,
    kv_heads: Int,
) -> Bool:
    """Whether `decode_attention` takes this step (CPU only: reads host offsets)."""
    comptime if head_dim % W != 0:
        return False
    if q_heads % kv_heads != 0 or q_heads // kv_heads > MAX_GROUP or batch == 0:
        return False
    for b in range(batch):
        if Int(input_row_offsets[b + 1]) - Int(input_row_offsets[b]) != 1:
            return False
    return True


def decode_attention[
    kv_heads: Int, head_dim: Int, C: MaxkvKVCollection, dtype: DType
](
    output: OutputTensor[dtype=dtype, rank=3, ...],
    q: InputTensor[dtype=dtype, rank=3, ...],
    kv: C,
    layer: Int,
    scale: Float32,
    window: Int,
) raises:
    """`output[b, :, :]` = attention of `q[b]` over the `cache_length(b) + 1`
    cached tokens of sequence `b` in `layer` (the new token's K/V included),
    or with `window > 0` over the last `window` of them (a sliding window:
    positions `cache_length(b) + 1 - window .. cache_length(b)`).

    `q` and `output` are `[batch, q_heads, head_dim]`; `decode_applies` was true.
    """
    var batch = kv.batch()
    var q_heads = q.dim_size(1)
    var group = q_heads // kv_heads
    var qp = q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var workers = max(1, parallelism_level(None))

    # lo[b]: the first position sequence b's new token sees.
    var lo = alloc[Int](batch).unsafe_origin_cast[MutUntrackedOrigin]()
    for b in range(batch):
        lo[unsafe_offset=b] = max(0, kv.cache_length(b) + 1 - window) if window > 0 else 0
    # Plan: the split length keeps about 4 items per worker, never below MIN_SPLIT.
    var total = 0
    for b in range(batch):
        total += kv.cache_length(b) + 1 - lo[unsafe_offset=b]
    var split = max(MIN_SPLIT, (total + 4 * workers - 1) // (4 * workers))
    split = (split + BLOCK - 1) // BLOCK * BLOCK
    # first[b]: the first item of sequence b; its items are its context splits.
    var first = alloc[Int](batch + 1).unsafe_origin_cast[MutUntrackedOrigin]()
    var items = 0
    for b in range(batch):
        first[unsafe_offset=b] = items
        items += (kv.cache_length(b) + 1 - lo[unsafe_offset=b] + split - 1) // split
    first[unsafe_offset=batch] = items
    var merged = items > batch
    # Per split item: m [q_heads], l [q_heads], acc [q_heads, head_dim].
    var part_size = q_heads * (head_dim + 2)
    var scratch = alloc[Float32](items * part_size if merged else 1).unsafe_origin_cast[
        MutUntrackedOrigin
    ]()

    def run_item(b: Int, s: Int, buf: F32Ptr) {imm}:
        """Split `s` of sequence `b`, all heads; `buf` is this task's work memory."""
        var qbuf = buf
        var acc = buf.unsafe_offset(q_heads * head_dim)
        var scores = buf.unsafe_offset(2 * q_heads * head_dim)
        var m = scores.unsafe_offset(q_heads * BLOCK)
        var l = m.unsafe_offset(q_heads)
        var count = first[unsafe_offset=b + 1] - first[unsafe_offset=b]
        var start = lo[unsafe_offset=b] + s * split
        var end = min(kv.cache_length(b) + 1, start + split)
        var src = qp.unsafe_offset(b * q_heads * head_dim)
        for qh in range(q_heads):
            comptime for d in range(0, head_dim, W):
                var at = qh * head_dim + d
                qbuf.unsafe_store(at, src.unsafe_load[width=W](at).cast[DType.float32]() * scale)
                acc.unsafe_store(at, SIMD[DType.float32, W](0))
            m[unsafe_offset=qh] = NEG
            l[unsafe_offset=qh] = 0
        var t = start
        while t < end:
            var n = min(BLOCK, end - t)
            # Scores: each K row ([kv_heads, head_dim], contiguous) read once.
            for j in range(n):
                var k_row = kv.row_ptr(0, layer, b, t + j)
                for h in range(kv_heads):
                    var k = k_row.unsafe_offset(h * head_dim)
                    for g in range(group):
                        var qh = h * group + g
                        var dot = SIMD[DType.float32, W](0)
                        comptime for d in range(0, head_dim, W):
                            dot = qbuf.unsafe_load[width=W](qh * head_dim + d).fma(
                                k.unsafe_load[width=W](d).cast[DType.float32](), dot
                            )
                        scores[unsafe_offset=qh * BLOCK + j] = dot.reduce_add()
            # Online softmax: scores become probabilities against the new max.
            for qh in range(q_heads):
                var row = scores.unsafe_offset(qh * BLOCK)
                for j in range(n, BLOCK):
                    row[unsafe_offset=j] = NEG
                var block_max = SIMD[DType.float32, W](NEG)
                comptime for j in range(0, BLOCK, W):
                    block_max = max(block_max, row.unsafe_load[width=W](j))
                var m_old = m[unsafe_offset=qh]
                var m_new = max(m_old, block_max.reduce_max())
                var sum = SIMD[DType.float32, W](0)
                comptime for j in range(0, BLOCK, W):
                    var p = exp(row.unsafe_load[width=W](j) - m_new)
                    row.unsafe_store(j, p)
                    sum += p
                var alpha = exp(m_old - m_new)
                l[unsafe_offset=qh] = l[unsafe_offset=qh] * alpha + sum.reduce_add()
                m[unsafe_offset=qh] = m_new
                if alpha != 1:
                    comptime for d in range(0, head_dim, W):
                        var a = acc.unsafe_offset(qh * head_dim + d)
                        a.unsafe_store(0, a.unsafe_load[width=W](0) * alpha)
            # Values: each V row read once, into every query head of its group.
            for j in range(n):
                var v_row = kv.row_ptr(1, layer, b, t + j)
                for h in range(kv_heads):
                    var v = v_row.unsafe_offset(h * head_dim)
                    for g in range(group):
                        var qh = h * group + g
                        var p = SIMD[DType.float32, W](scores[unsafe_offset=qh * BLOCK + j])
                        comptime for d in range(0, head_dim, W):
                            var a = acc.unsafe_offset(qh * head_dim + d)
                            a.unsafe_store(
                                0,
                                p.fma(
                                    v.unsafe_load[width=W](d).cast[DType.float32](),
                                    a.unsafe_load[width=W](0),
                                ),
                            )
            t += n
        if count == 1:
            var dst = op.unsafe_offset(b * q_heads * head_dim)
            for qh in range(q_heads):
                var inv = 1 / l[unsafe_offset=qh]
                comptime for d in range(0, head_dim, W):
                    var at = qh * head_dim + d
                    dst.unsafe_store(at, (acc.unsafe_load[width=W](at) * inv).cast[dtype]())
        else:
            var part = scratch.unsafe_offset((first[unsafe_offset=b] + s) * part_size)
            for qh in range(q_heads):
                part[unsafe_offset=qh] = m[unsafe_offset=qh]
                part[unsafe_offset=q_heads + qh] = l[unsafe_offset=qh]
            var dst = part.unsafe_offset(2 * q_heads)
            for at in range(0, q_heads * head_dim, W):
                dst.unsafe_store(at, acc.unsafe_load[width=W](at))

    # Items in (sequence, split) order, a contiguous range per task.
    var tasks = max(1, min(items, 4 * workers))
    var buf_size = q_heads * (2 * head_dim + BLOCK + 2)

    def work(task: Int) {imm}:
        var lo = task * items // tasks
        var hi = (task + 1) * items // tasks
        var buf = alloc[Float32](buf_size).unsafe_origin_cast[MutUntrackedOrigin]()
        var b = 0
        for i in range(lo, hi):
            while first[unsafe_offset=b + 1] <= i:
                b += 1
            run_item(b, i - first[unsafe_offset=b], buf)
        buf.unsafe_free()

    sync_parallelize(work, tasks)

    if merged:
        var merge_tasks = max(1, min(batch, workers))

        def merge(task: Int) {imm}:
            var out = alloc[Float32](head_dim).unsafe_origin_cast[MutUntrackedOrigin]()
            for b in range(task * batch // merge_tasks, (task + 1) * batch // merge_tasks):
                var lo = first[unsafe_offset=b]
                var hi = first[unsafe_offset=b + 1]
                if hi - lo == 1:
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
                    var dst = op.unsafe_offset((b * q_heads + qh) * head_dim)
                    comptime for d in range(0, head_dim, W):
                        dst.unsafe_store(d, (out.unsafe_load[width=W](d) * inv).cast[dtype]())
            out.unsafe_free()

        sync_parallelize(merge, merge_tasks)
    first.unsafe_free()
    lo.unsafe_free()
    scratch.unsafe_free()
