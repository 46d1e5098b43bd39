"""Ops that write keys and values into the cache directly (either collection).

Bodies are generic over `MaxkvKVCollection` and use `row_ptr`, so the same
code writes a contiguous slot or a sequence's pages; `maxkv.<op>` registers
them for the contiguous collection and `maxkv.paged.<op>` for the paged one.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.algorithm.functional import elementwise
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level
from std.complex import ComplexSIMD
from std.sys import size_of
from layout import Coord

from .checks import check_layer, check_row_count
from .collection import ContinuousBatchingKVCacheCollection
from .encoding import HeadCodec
from .kv_trait import MaxkvKVCollection
from .paged_collection import PagedKVCacheCollection


@always_inline
def _copy_row[
    dst_dtype: DType, src_dtype: DType
](
    dst: UnsafePointer[Scalar[dst_dtype], MutUntrackedOrigin],
    src: UnsafePointer[Scalar[src_dtype], MutUntrackedOrigin],
    count: Int,
):
    """`count` values from `src` to `dst`, converted to `dst_dtype` (a float
    narrowing rounds to nearest even; the same dtype copies the bits)."""
    var i = 0
    while i + 16 <= count:
        dst.unsafe_store(i, src.unsafe_load[width=16](i).cast[dst_dtype]())
        i += 16
    while i < count:
        dst[unsafe_offset=i] = src[unsafe_offset=i].cast[dst_dtype]()
        i += 1


comptime _TOKENS_PER_WORKER = 128
"""Fewest tokens per worker thread of `store_kv`: a decode step's few tokens
are stored faster by one thread than split (each token is ~1 KB of copies)."""


@always_inline
def _rotate_heads[
    dst_dtype: DType, src_dtype: DType, head_dim: Int, interleaved: Bool
](
    dst: UnsafePointer[Scalar[dst_dtype], MutUntrackedOrigin],
    src: UnsafePointer[Scalar[src_dtype], MutUntrackedOrigin],
    heads: Int,
    freq: SIMD[DType.float32, head_dim],
):
    """`heads` heads of `head_dim` values, `src` to `dst`, rotated by `freq`
    (one position's `cos, sin` pairs).

    The arithmetic of MAX's `nn.fused_qk_rope.rope_value` (a `ComplexSIMD`
    product in float32) on the pairs `(x[2i], x[2i + 1])` (`interleaved`) or
    `(x[i], x[i + head_dim / 2])`, so the results are the same bits; they are
    encoded as `dst_dtype` head rows (`HeadCodec`: the cache's encoding, for keys).
    """
    comptime half = head_dim // 2
    comptime Half = SIMD[DType.float32, half]
    comptime Codec = HeadCodec[dst_dtype, head_dim]
    var f = freq.deinterleave()
    var f_re = rebind[Half](f[0])
    var f_im = rebind[Half](f[1])
    for h in range(heads):
        var x = src.unsafe_load[width=head_dim](h * head_dim).cast[DType.float32]()
        var re: Half
        var im: Half
        comptime if interleaved:
            var pairs = x.deinterleave()
            re = rebind[Half](pairs[0])
            im = rebind[Half](pairs[1])
        else:
            re = x.slice[half, offset=0]()
            im = x.slice[half, offset=half]()
        var r = ComplexSIMD(re, im) * ComplexSIMD(f_re, f_im)
        var out: SIMD[DType.float32, head_dim]
        comptime if interleaved:
            out = rebind[SIMD[DType.float32, head_dim]](r.re.interleave(r.im))
        else:
            out = rebind[SIMD[DType.float32, head_dim]](r.re.join(r.im))
        Codec.store(dst.unsafe_offset(h * Codec.width), out)


@always_inline
def _store_heads[
    dst_dtype: DType, src_dtype: DType, head_dim: Int
](
    dst: UnsafePointer[Scalar[dst_dtype], MutUntrackedOrigin],
    src: UnsafePointer[Scalar[src_dtype], MutUntrackedOrigin],
    heads: Int,
):
    """`heads` heads of `head_dim` values, `src` to `dst`, encoded as `dst_dtype`
    head rows (`HeadCodec`; a float encoding converts each value)."""
    comptime Codec = HeadCodec[dst_dtype, head_dim]
    for h in range(heads):
        var x = src.unsafe_load[width=head_dim](h * head_dim).cast[DType.float32]()
        Codec.store(dst.unsafe_offset(h * Codec.width), x)


def _store_rows[
    C: MaxkvKVCollection, dtype: DType, num_heads: Int, head_dim: Int, rope: Bool, interleaved: Bool
](
    q_out: UnsafePointer[Scalar[dtype], MutUntrackedOrigin],
    src: UnsafePointer[Scalar[dtype], MutUntrackedOrigin],
    offsets: UnsafePointer[UInt32, MutUntrackedOrigin],
    kv: C,
    layer: Int,
    tokens: Int,
    q_width: Int,
    freqs: UnsafePointer[Float32, MutUntrackedOrigin],
) raises:
    """Q of every token to `q_out`, its K and V to the cache (rotated with `rope`).

    Checks done by the caller.  Token `t` of batch entry `b` sits at position
    `cache_length[b] + t`; with `rope`, `freqs` row `position` holds that
    position's `cos, sin` pairs.  K and V are converted to the cache's
    encoding on the way (`C.View.dtype`; `dtype` is the model's).  Split over
    worker threads by tokens.
    """
    comptime cache_dtype = C.View.dtype
    comptime kv_width = num_heads * head_dim
    var width = q_width + 2 * kv_width
    var q_heads = q_width // head_dim
    var workers = max(1, min(parallelism_level(None), tokens // _TOKENS_PER_WORKER))

    def work(worker: Int) {imm}:
        var end = (worker + 1) * tokens // workers
        var b = 0
        for t in range(worker * tokens // workers, end):
            while Int(offsets[unsafe_offset=b + 1]) <= t:
                b += 1
            var position = kv.cache_length(b) + t - Int(offsets[unsafe_offset=b])
            var row = src.unsafe_offset(t * width)
            var k_dst = kv.row_ptr(0, layer, b, position).unsafe_bitcast[Scalar[cache_dtype]]()
            comptime if rope:
                var freq = freqs.unsafe_load[width=head_dim](position * head_dim)
                _rotate_heads[dtype, dtype, head_dim, interleaved](
                    q_out.unsafe_offset(t * q_width), row, q_heads, freq
                )
                _rotate_heads[cache_dtype, dtype, head_dim, interleaved](
                    k_dst, row.unsafe_offset(q_width), num_heads, freq
                )
            else:
                _copy_row(q_out.unsafe_offset(t * q_width), row, q_width)
                _store_heads[cache_dtype, dtype, head_dim](
                    k_dst, row.unsafe_offset(q_width), num_heads
                )
            _store_heads[cache_dtype, dtype, head_dim](
                kv.row_ptr(1, layer, b, position).unsafe_bitcast[Scalar[cache_dtype]](),
                row.unsafe_offset(q_width + kv_width),
                num_heads,
            )

    sync_parallelize(work, workers)


def _check_qkv[
    C: MaxkvKVCollection, //, num_heads: Int, head_dim: Int, target: StaticString
](
    name: StaticString,
    kv: C,
    output: OutputTensor[rank=2, ...],
    qkv: InputTensor[rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises -> Int:
    """Checks `store_kv`'s inputs against the cache; returns the layer."""
    var layer = Int(check_layer(kv, layer_idx))
    var tokens = qkv.dim_size(0)
    check_row_count[target](kv, input_row_offsets, tokens)
    var q_width = output.dim_size(1)
    if (
        output.dim_size(0) != tokens
        or qkv.dim_size(1) != q_width + 2 * num_heads * head_dim
        or q_width % head_dim != 0
    ):
        raise Error(
            name, ": qkv has ", qkv.dim_size(1), " columns; expected Q (", q_width,
            ") + 2 x ", num_heads * head_dim,
        )
    return layer


def store_kv[
    C: MaxkvKVCollection, dtype: DType, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=dtype, rank=2, ...],
    qkv: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Writes the K and V columns of a fused QKV projection into the cache; returns Q.

    `qkv` is `[total_tokens, (n_q_heads + 2 * num_heads) * head_dim]`: Q
    columns, then K, then V.  Token `t` of sequence `b` goes to position
    `cache_length[b] + t` of `layer_idx`; `output` is the Q columns.  On a GPU
    (`_store_rows_gpu`) the cache must keep the model's dtype.
    """
    var layer = _check_qkv[num_heads, head_dim, target](
        "maxkv.store_kv_ragged", kv, output, qkv, input_row_offsets, layer_idx
    )
    comptime if not is_cpu[target]():
        _store_rows_gpu[num_heads=num_heads, head_dim=head_dim, target=target](
            output, qkv, input_row_offsets, kv, layer, ctx
        )
        return
    _store_rows[num_heads=num_heads, head_dim=head_dim, rope=False, interleaved=False](
        output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        qkv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        input_row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        kv,
        layer,
        qkv.dim_size(0),
        output.dim_size(1),
        # No rotation: never read.
        qkv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Float32](),
    )


def _store_rows_gpu[
    C: MaxkvKVCollection, dtype: DType, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=dtype, rank=2, ...],
    qkv: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer: Int,
    ctx: DeviceContext,
) raises:
    """`store_kv` on a GPU: one thread per 16-byte vector of a token's Q, K or V
    columns (`elementwise`).  Checks done by the caller.

    The offsets and the cache's lengths and tables are device memory, read
    by each thread: its token's sequence is found by a binary search of the
    offsets.  The cache keeps the model's dtype (the graph function refuses
    other encodings off the CPU), so a vector is copied, not encoded.
    """
    comptime assert C.View.dtype == dtype, "on a GPU the cache keeps the model's dtype"
    comptime kv_width = num_heads * head_dim
    comptime element = size_of[dtype]()
    comptime vector = 16 // element
    comptime width = vector if head_dim % vector == 0 else 1
    var tokens = qkv.dim_size(0)
    var q_width = output.dim_size(1)
    var row = q_width + 2 * kv_width
    var per_token = row // width
    var batch = kv.batch()

    # Captured by value (the tensors too, whose pointers are device memory):
    # a GPU kernel cannot reach this function's stack.
    @always_inline
    @__copy_capture(kv, layer, qkv, output, input_row_offsets, q_width, row, per_token, batch)
    @parameter
    def store[w: Int, alignment: Int = 1](idx: Coord):
        var src = qkv.unsafe_ptr()
        var q_out = output.unsafe_ptr()
        var offsets = input_row_offsets.unsafe_ptr()
        var i = Int(idx[0].value())
        var t = i // per_token
        var col = (i % per_token) * width
        # Rows start at multiples of `width` elements of device allocations:
        # one aligned vector access each.
        var x = src.unsafe_load[width=width, alignment=width * element](t * row + col)
        if col < q_width:
            q_out.unsafe_store[alignment=width * element](t * q_width + col, x)
            return
        # The sequence of token t: the last b with offsets[b] <= t.
        var lo = 0
        var hi = batch - 1
        while lo < hi:
            var mid = (lo + hi + 1) // 2
            if Int(offsets[unsafe_offset=mid]) <= t:
                lo = mid
            else:
                hi = mid - 1
        var position = kv.cache_length(lo) + t - Int(offsets[unsafe_offset=lo])
        var c = col - q_width
        var kv_idx = 0 if c < kv_width else 1
        var dst = kv.row_ptr(kv_idx, layer, lo, position)
        dst.unsafe_store[alignment=width * element](
            c - kv_idx * kv_width, rebind[SIMD[C.View.dtype, width]](x)
        )

    if tokens > 0:
        elementwise[store, simd_width=1, target=target](tokens * per_token, ctx)


def store_kv_rope[
    C: MaxkvKVCollection,
    dtype: DType,
    num_heads: Int,
    head_dim: Int,
    interleaved: Bool,
    target: StaticString,
](
    output: OutputTensor[dtype=dtype, rank=2, ...],
    qkv: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`store_kv` with rotary embedding: Q and K are rotated as they are stored.

    The same values as `store_kv` followed by `fused_qk_rope` (MAX's kernel)
    in one pass over `qkv`: `freqs_cis` is `[max_positions, head_dim]` float32,
    row `p` holding `cos(p θ_0), sin(p θ_0), ...`; every new token's position
    must be below `max_positions`.
    """
    comptime assert is_cpu[target](), "maxkv.store_kv_rope_ragged runs on CPU"
    comptime assert head_dim % 2 == 0, "head_dim must be even"
    var layer = _check_qkv[num_heads, head_dim, target](
        "maxkv.store_kv_rope_ragged", kv, output, qkv, input_row_offsets, layer_idx
    )
    if freqs_cis.dim_size(1) != head_dim:
        raise Error(
            "maxkv.store_kv_rope_ragged: freqs_cis has ", freqs_cis.dim_size(1),
            " columns, not head_dim = ", head_dim,
        )
    for b in range(kv.batch()):
        var end = kv.cache_length(b) + Int(input_row_offsets[b + 1] - input_row_offsets[b])
        if end > freqs_cis.dim_size(0):
            raise Error(
                "maxkv.store_kv_rope_ragged: sequence ", b, " reaches position ", end - 1,
                "; freqs_cis has ", freqs_cis.dim_size(0), " positions",
            )
    _store_rows[num_heads=num_heads, head_dim=head_dim, rope=True, interleaved=interleaved](
        output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        qkv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        input_row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        kv,
        layer,
        qkv.dim_size(0),
        output.dim_size(1),
        freqs_cis.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
    )


def write_kv[
    C: MaxkvKVCollection, dtype: DType, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=DType.uint32, rank=1, ...],
    keys: InputTensor[dtype=dtype, rank=2, ...],
    values: InputTensor[dtype=dtype, rank=2, ...],
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Writes precomputed K and V rows (`[total_tokens, num_heads * head_dim]`) into
    the cache of `layer_idx`: token `t` of sequence `b` at `cache_length[b] + t`.

    For KV computed outside the model graph (CacheBlend); converted to the
    cache's encoding on the way.  Returns the rows written.
    """
    comptime assert is_cpu[target](), "maxkv.write_kv_ragged runs on CPU"
    comptime kv_width = num_heads * head_dim
    var layer = Int(check_layer(kv, layer_idx))
    var tokens = keys.dim_size(0)
    check_row_count[target](kv, input_row_offsets, tokens)
    if (
        values.dim_size(0) != tokens
        or keys.dim_size(1) != kv_width
        or values.dim_size(1) != kv_width
    ):
        raise Error("maxkv.write_kv_ragged: keys and values must be [total_tokens, ", kv_width, "]")
    var k_src = keys.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var v_src = values.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for b in range(kv.batch()):
        var start = Int(input_row_offsets[b])
        var cached = kv.cache_length(b)
        for t in range(Int(input_row_offsets[b + 1]) - start):
            var at = (start + t) * kv_width
            _store_heads[C.View.dtype, dtype, head_dim](
                kv.row_ptr(0, layer, b, cached + t), k_src.unsafe_offset(at), num_heads
            )
            _store_heads[C.View.dtype, dtype, head_dim](
                kv.row_ptr(1, layer, b, cached + t), v_src.unsafe_offset(at), num_heads
            )
    output[0] = UInt32(tokens)


def copy_tokens[
    C: MaxkvKVCollection, num_heads: Int, head_dim: Int, target: StaticString
](
    output: OutputTensor[dtype=DType.uint32, rank=1, ...],
    kv: C,
    token_range: InputTensor[dtype=DType.uint32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    """Copies tokens `[start, end)` of batch entry 0 into batch entry 1, all layers.

    The collection holds two sequences, `[source, destination]`; keys and
    values of every layer are copied, on the collection's device (CPU or
    GPU: one body, `elementwise` over the rows' vectors).  `token_range` is
    the host uint32 pair `(start, end)`.  On CPU the op checks that `end`
    does not pass the source's cache length, that both sequences have
    storage for `end` tokens and that no copied row is shared; on a GPU the
    lengths and tables are device memory, so the managers' bookkeeping
    checks the same before they call.  `output[0]` = tokens copied.
    """
    if kv.batch() != 2:
        raise Error("maxkv.copy_tokens: the collection must hold [source, destination]")
    if token_range.dim_size(0) != 2:
        raise Error("maxkv.copy_tokens: token_range must be (start, end)")
    var start = Int(token_range.unsafe_ptr()[unsafe_offset=0])
    var end = Int(token_range.unsafe_ptr()[unsafe_offset=1])
    if start > end:
        raise Error("maxkv.copy_tokens: start ", start, " is past end ", end)

    comptime if is_cpu[target]():
        if end > kv.cache_length(0):
            raise Error(
                "maxkv.copy_tokens: cannot copy tokens [", start, ", ", end,
                ") of a sequence of ", kv.cache_length(0),
            )
        kv.check_extent(0, end)
        kv.check_extent(1, end)
        for t in range(start, end):
            if kv.row_ptr(0, 0, 0, t) == kv.row_ptr(0, 0, 1, t):
                raise Error("maxkv.copy_tokens: source and destination share token ", t)

    var copied = UInt32(end - start)

    # Captured by value: a GPU kernel cannot reach this function's stack.
    @always_inline
    @__copy_capture(output, copied)
    @parameter
    def count[width: Int, alignment: Int = 1](idx: Coord):
        output[0] = copied

    elementwise[count, simd_width=1, target=target](1, ctx)
    if end == start:
        return
    # A work item is one vector of a row on a GPU (a thread each) and a
    # whole row on CPU (`elementwise` spreads the rows over the cores).  Rows
    # are [num_heads * head_dim] contiguous elements, so a vector never
    # straddles two rows (or two pages).
    comptime row = num_heads * HeadCodec[C.View.dtype, head_dim].width
    comptime element = size_of[C.View.dtype]()
    comptime vector = 16 // element  # 16 bytes: one vector access per thread
    comptime width = vector if row % vector == 0 else 1
    comptime per_item = row // width if is_cpu[target]() else 1
    comptime items_per_row = row // (width * per_item)
    var tokens = end - start

    @always_inline
    @__copy_capture(kv, start, tokens)
    @parameter
    def copy[w: Int, alignment: Int = 1](idx: Coord):
        var i = Int(idx[0].value())
        var t = start + (i // items_per_row) % tokens
        var job = i // (items_per_row * tokens)
        var kv_idx = job % 2
        var layer = job // 2
        var src = kv.row_ptr(kv_idx, layer, 0, t)
        var dst = kv.row_ptr(kv_idx, layer, 1, t)
        # On a GPU rows start at multiples of `row` elements of a device
        # allocation, so each vector is aligned to its own size (one 16-byte
        # access); CPU loads need no alignment.
        comptime align = element if is_cpu[target]() else width * element
        var first = (i % items_per_row) * per_item * width
        for v in range(per_item):
            var col = first + v * width
            dst.unsafe_store[alignment=align](
                col, src.unsafe_load[width=width, alignment=align](col)
            )

    elementwise[copy, simd_width=1, target=target](
        2 * kv.num_layers() * tokens * items_per_row, ctx
    )


# ----------------------------------------------------- contiguous collection


@extensibility.register("maxkv.store_kv_ragged")
struct StoreKVRagged:
    """See `store_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        qkv: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        store_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, qkv, input_row_offsets, kv, layer_idx, ctx
        )

@extensibility.register("maxkv.store_kv_rope_ragged")
struct StoreKVRopeRagged:
    """See `store_kv_rope`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        interleaved: Bool,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        qkv: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        store_kv_rope[num_heads=num_heads, head_dim=head_dim, interleaved=interleaved, target=target](
            output, qkv, input_row_offsets, kv, freqs_cis, layer_idx
        )


@extensibility.register("maxkv.copy_tokens")
struct CopyTokens:
    """See `copy_tokens`."""

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        token_range: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        copy_tokens[num_heads=num_heads, head_dim=head_dim, target=target](
            output, kv, token_range, ctx
        )


# ---------------------------------------------------------- paged collection


@extensibility.register("maxkv.paged.store_kv_ragged")
struct PagedStoreKVRagged:
    """See `store_kv`."""

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
        qkv: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        store_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, qkv, input_row_offsets, kv, layer_idx, ctx
        )

@extensibility.register("maxkv.paged.store_kv_rope_ragged")
struct PagedStoreKVRopeRagged:
    """See `store_kv_rope`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        interleaved: Bool,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        qkv: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        freqs_cis: InputTensor[dtype=DType.float32, rank=2, ...],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        store_kv_rope[num_heads=num_heads, head_dim=head_dim, interleaved=interleaved, target=target](
            output, qkv, input_row_offsets, kv, freqs_cis, layer_idx
        )


@extensibility.register("maxkv.paged.copy_tokens")
struct PagedCopyTokens:
    """See `copy_tokens`."""

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
        token_range: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        copy_tokens[num_heads=num_heads, head_dim=head_dim, target=target](
            output, kv, token_range, ctx
        )


@extensibility.register("maxkv.write_kv_ragged")
struct WriteKVRagged:
    """See `write_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        keys: InputTensor[dtype=dtype, rank=2, ...],
        values: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        write_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, keys, values, input_row_offsets, kv, layer_idx
        )


@extensibility.register("maxkv.paged.write_kv_ragged")
struct PagedWriteKVRagged:
    """See `write_kv`."""

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=DType.uint32, rank=1, ...],
        keys: InputTensor[dtype=dtype, rank=2, ...],
        values: InputTensor[dtype=dtype, rank=2, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        write_kv[num_heads=num_heads, head_dim=head_dim, target=target](
            output, keys, values, input_row_offsets, kv, layer_idx
        )
