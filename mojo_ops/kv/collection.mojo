"""The opaque `ContinuousBatchingKVCacheCollection` graph value and its ctor.

Protocol (mirrors MAX 24.x `ContinuousBatchingKVCacheManager`):

1. The Python manager's `fetch()` hands the graph four tensors per device:
   `blocks` `[max_batch, 2, num_layers, max_seq_len, num_heads, head_width]`,
   `cache_lengths` uint32 `[batch]`, `lookup_table` uint32 `[batch]` (the cache
   slot of each sequence, in batch order) and the host tensor `max_lengths`
   uint32 `[num_steps, 2]` (row 0: max new tokens, max cache length).
2. `maxkv.kv_collection_ctor` (this file) wraps them, without copying, into a
   `ContinuousBatchingKVCacheCollection` that travels through the graph as an
   opaque value.
3. Every consumer op takes the collection and calls `view()`, which rebuilds
   MAX's own `kv_cache.types.ContinuousBatchingKVCacheCollection`, so kernels
   use the standard `get_key_cache(layer)` / `cache_length(b)` API.
"""

import extensibility
from extensibility import InputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from kv_cache.types import (
    ContinuousBatchingKVCacheCollection as MaxContinuousBatchingKVCacheCollection,
    KVCacheStaticParams,
)
from layout import Layout, LayoutTensor, RuntimeLayout, UNKNOWN_VALUE, lt_to_tt
from std.utils import IndexList

from .encoding import HeadCodec
from .kv_trait import MaxkvKVCollection


struct ContinuousBatchingKVCacheCollection[
    dtype_name: StaticString, num_heads: Int, head_dim: Int
](MaxkvKVCollection, TrivialRegisterPassable):
    """A borrowed view of the KV cache for the sequences of one batch.

    Parameters:
        dtype_name: Element type of the cache, spelled as `DType` prints it
            ("float32", "bfloat16", ...): MAX passes opaque-type parameters
            from Python as strings, not as `DType`.
        num_heads: Key/value heads held on this device.
        head_dim: Size of one head (values; a stored row is `head_width`
            elements of the encoding, `encoding.mojo`).

    The struct owns nothing: it holds untracked pointers into the manager's
    buffers (which outlive the graph execution) plus their runtime shape.
    """

    comptime dtype = DType._from_str(Self.dtype_name).value()
    comptime kv_params = KVCacheStaticParams(
        num_heads=Self.num_heads, head_size=Self.head_dim
    )
    comptime MaxCollection = MaxContinuousBatchingKVCacheCollection[
        Self.dtype, Self.kv_params, MutAnyOrigin, ImmutAnyOrigin, ImmutAnyOrigin
    ]
    comptime View = Self.MaxCollection
    comptime head_width = HeadCodec[Self.dtype, Self.head_dim].width
    """Storage elements per head row (`HeadCodec.width`: quantized rows carry scales)."""

    var blocks: UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var cache_lengths: UnsafePointer[UInt32, MutUntrackedOrigin]
    var lookup_table: UnsafePointer[UInt32, MutUntrackedOrigin]
    var blocks_shape: IndexList[6]
    var batch_size: Int
    var max_seq_length: UInt32
    """Most new tokens of any sequence in this step."""
    var max_cache_length: UInt32
    """Upper bound on any sequence's cache length + new tokens (MAX's meaning)."""

    def __init__(
        out self,
        blocks: UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin],
        cache_lengths: UnsafePointer[UInt32, MutUntrackedOrigin],
        lookup_table: UnsafePointer[UInt32, MutUntrackedOrigin],
        blocks_shape: IndexList[6],
        batch_size: Int,
        max_seq_length: UInt32,
        max_cache_length: UInt32,
    ):
        self.blocks = blocks
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self.blocks_shape = blocks_shape
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length
        self.max_cache_length = max_cache_length

    @always_inline
    def batch(self) -> Int:
        return self.batch_size

    @always_inline
    def max_new_tokens(self) -> UInt32:
        return self.max_seq_length

    @always_inline
    def max_context_length(self) -> UInt32:
        return self.max_cache_length

    @always_inline
    def num_layers(self) -> Int:
        return self.blocks_shape[2]

    @always_inline
    def max_cache_slots(self) -> Int:
        return self.blocks_shape[0]

    @always_inline
    def capacity(self) -> Int:
        """Tokens each cache slot can hold (the manager's `max_seq_len`)."""
        return self.blocks_shape[3]

    @always_inline
    def cache_length(self, batch_idx: Int) -> Int:
        """Tokens already cached for batch entry `batch_idx` (host memory on CPU)."""
        return Int(self.cache_lengths[unsafe_offset=batch_idx])

    @always_inline
    def row_ptr(
        self, kv_idx: Int, layer: Int, batch_idx: Int, token: Int
    ) -> UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin]:
        """The `[num_heads, head_dim]` row of token `token` of batch entry
        `batch_idx` (0 keys, 1 values) in `layer`: contiguous memory.

        No bounds checks: callers check `layer`, the slot and the token first.
        """
        var slot = Int(self.lookup_table[unsafe_offset=batch_idx])
        var row = ((slot * 2 + kv_idx) * self.num_layers() + layer) * self.capacity() + token
        return self.blocks.unsafe_offset(row * Self.num_heads * Self.head_width)

    def view(self) -> Self.MaxCollection:
        """Rebuilds MAX's `ContinuousBatchingKVCacheCollection` over the same memory."""
        comptime blocks_layout = Layout.row_major[6]()
        comptime vector_layout = Layout(UNKNOWN_VALUE)
        var batch = IndexList[1](self.batch_size)
        return {
            lt_to_tt(
                LayoutTensor[Self.dtype, blocks_layout, MutAnyOrigin](
                    self.blocks.unsafe_origin_cast[MutAnyOrigin](),
                    RuntimeLayout[blocks_layout].row_major(self.blocks_shape),
                )
            ),
            lt_to_tt(
                LayoutTensor[DType.uint32, vector_layout, ImmutAnyOrigin](
                    self.cache_lengths.as_imm().unsafe_origin_cast[ImmutAnyOrigin](),
                    RuntimeLayout[vector_layout].row_major(batch),
                )
            ),
            lt_to_tt(
                LayoutTensor[DType.uint32, vector_layout, ImmutAnyOrigin](
                    self.lookup_table.as_imm().unsafe_origin_cast[ImmutAnyOrigin](),
                    RuntimeLayout[vector_layout].row_major(batch),
                )
            ),
            self.max_seq_length,
            self.max_cache_length,
        }

    def check_extent(self, batch_idx: Int, end: Int) raises:
        if end > self.capacity():
            raise Error(
                "maxkv: sequence ", batch_idx, " needs ", end, " tokens, past max_seq_len ",
                self.capacity(),
            )

    def check_bounds(self) raises:
        """Raises if a lookup-table entry or a cache length is out of range.

        Reads `cache_lengths` and `lookup_table`, so it must only be called
        where they are host memory (CPU targets).  Guards against tensors
        built by hand, not by the manager.  The step's new tokens are checked
        once per step (`checks.check_rows`).
        """
        for b in range(self.batch_size):
            var slot = self.lookup_table[b]
            if Int(slot) >= self.max_cache_slots():
                raise Error(
                    "maxkv: lookup_table[", b, "] = ", slot,
                    " is out of range: the cache has ", self.max_cache_slots(), " slots",
                )
            self.check_extent(b, self.cache_length(b))


@extensibility.register("maxkv.kv_collection_ctor")
struct KVCollectionCtor:
    """Wraps the manager's four tensors into a `ContinuousBatchingKVCacheCollection`.

    On CPU it also checks every lookup-table entry and cache length against
    the blocks' shape and raises instead of handing out an out-of-bounds view.
    """

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        blocks: InputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=1, ...],
        max_lengths: InputTensor[dtype=DType.uint32, rank=2, ...],
    ) raises -> ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim]:
        comptime Collection = ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim]
        comptime assert Collection.dtype == dtype, "blocks dtype differs from dtype_name"
        if blocks.dim_size(4) != num_heads or blocks.dim_size(5) != Collection.head_width:
            raise Error("maxkv: blocks' last two dims must be [num_heads, head_width]")
        if lookup_table.dim_size(0) != cache_lengths.dim_size(0):
            raise Error("maxkv: cache_lengths and lookup_table differ in length")
        if max_lengths.dim_size(0) < 1 or max_lengths.dim_size(1) != 2:
            raise Error("maxkv: max_lengths must have shape [num_steps >= 1, 2]")
        # max_lengths row 0 is (max new tokens, max cache length before this
        # step); MAX's kernels size attention by the longest *full* context, so
        # the view gets their sum, an upper bound on every cache_length + new.
        var max_new_tokens = UInt32(max_lengths[0, 0])
        var max_cached = UInt32(max_lengths[0, 1])
        var shape = IndexList[6]()
        for i in range(6):
            shape[i] = blocks.dim_size(i)
        var collection = Collection(
            blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().bitcast[
                Scalar[Collection.dtype]
            ](),
            cache_lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            lookup_table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            shape,
            cache_lengths.dim_size(0),
            max_new_tokens,
            max_new_tokens + max_cached,
        )
        comptime if is_cpu[target]():
            collection.check_bounds()
        return collection
