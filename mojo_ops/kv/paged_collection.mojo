"""The opaque `PagedKVCacheCollection` graph value and its ctor (TVM's design).

Protocol (`maxkv.PagedKVCacheManager`, steps written in `maxkv/cache/protocol.py`):

1. `fetch()` hands the graph four tensors per device: `pages`
   `[num_pages, 2, num_layers, page_size, num_heads, head_width]`,
   `cache_lengths` uint32 `[batch]`, `page_table` uint32
   `[batch, max_pages_per_seq]` (entry `[b, i]` is the page holding tokens
   `i * page_size ..` of sequence `b`; unused entries are `0xFFFFFFFF`) and
   the host tensor `max_lengths` uint32 `[num_steps, 2]`.
2. `maxkv.paged.kv_collection_ctor` (this file) wraps them, without copying,
   into a `PagedKVCacheCollection`; on CPU it checks that every page a
   sequence's cached tokens sit in is a real page.
3. Ops call `view()`, MAX's own `kv_cache.types.PagedKVCacheCollection`, or
   `row_ptr()` for maxkv's own kernels; the pages of the step's new tokens
   are checked once per step (`checks.check_rows`) before any op writes.
"""

import extensibility
from extensibility import InputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from kv_cache.types import (
    PagedKVCacheCollection as MaxPagedKVCacheCollection,
    KVCacheStaticParams,
)
from layout import Layout, LayoutTensor, RuntimeLayout, UNKNOWN_VALUE, lt_to_tt
from std.utils import IndexList

from .encoding import HeadCodec
from .kv_trait import MaxkvKVCollection


struct PagedKVCacheCollection[
    dtype_name: StaticString, num_heads: Int, head_dim: Int, page_size: Int
](MaxkvKVCollection, TrivialRegisterPassable):
    """A borrowed view of the paged KV cache for the sequences of one batch.

    Parameters:
        dtype_name: Element type of the cache, as `DType` prints it.
        num_heads: Key/value heads held on this device.
        head_dim: Size of one head (values; a stored row is `head_width`
            elements of the encoding, `encoding.mojo`).
        page_size: Tokens per page.
    """

    comptime dtype = DType._from_str(Self.dtype_name).value()
    comptime kv_params = KVCacheStaticParams(
        num_heads=Self.num_heads, head_size=Self.head_dim
    )
    comptime MaxCollection = MaxPagedKVCacheCollection[
        Self.dtype,
        Self.kv_params,
        Self.page_size,
        MutAnyOrigin,
        ImmutAnyOrigin,
        ImmutAnyOrigin,
        MutAnyOrigin,
    ]
    comptime View = Self.MaxCollection
    comptime head_width = HeadCodec[Self.dtype, Self.head_dim].width
    """Storage elements per head row (`HeadCodec.width`: quantized rows carry scales)."""

    var pages: UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var cache_lengths: UnsafePointer[UInt32, MutUntrackedOrigin]
    var page_table: UnsafePointer[UInt32, MutUntrackedOrigin]
    var pages_shape: IndexList[6]
    var batch_size: Int
    var table_width: Int
    var max_seq_length: UInt32
    var max_cache_length: UInt32

    def __init__(
        out self,
        pages: UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin],
        cache_lengths: UnsafePointer[UInt32, MutUntrackedOrigin],
        page_table: UnsafePointer[UInt32, MutUntrackedOrigin],
        pages_shape: IndexList[6],
        batch_size: Int,
        table_width: Int,
        max_seq_length: UInt32,
        max_cache_length: UInt32,
    ):
        self.pages = pages
        self.cache_lengths = cache_lengths
        self.page_table = page_table
        self.pages_shape = pages_shape
        self.batch_size = batch_size
        self.table_width = table_width
        self.max_seq_length = max_seq_length
        self.max_cache_length = max_cache_length

    @always_inline
    def batch(self) -> Int:
        return self.batch_size

    @always_inline
    def num_pages(self) -> Int:
        return self.pages_shape[0]

    @always_inline
    def num_layers(self) -> Int:
        return self.pages_shape[2]

    @always_inline
    def capacity(self) -> Int:
        return self.table_width * Self.page_size

    @always_inline
    def cache_length(self, batch_idx: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=batch_idx])

    @always_inline
    def max_new_tokens(self) -> UInt32:
        return self.max_seq_length

    @always_inline
    def max_context_length(self) -> UInt32:
        return self.max_cache_length

    @always_inline
    def page(self, batch_idx: Int, index: Int) -> Int:
        """Entry `index` of batch entry `batch_idx`'s page table (unchecked)."""
        return Int(self.page_table[unsafe_offset=batch_idx * self.table_width + index])

    @always_inline
    def row_ptr(
        self, kv_idx: Int, layer: Int, batch_idx: Int, token: Int
    ) -> UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin]:
        var page = self.page(batch_idx, token // Self.page_size)
        var row = ((page * 2 + kv_idx) * self.num_layers() + layer) * Self.page_size
        row += token % Self.page_size
        return self.pages.unsafe_offset(row * Self.num_heads * Self.head_width)

    def check_extent(self, batch_idx: Int, end: Int) raises:
        if end > self.capacity():
            raise Error(
                "maxkv: sequence ", batch_idx, " needs ", end, " tokens; its page table holds ",
                self.table_width, " pages of ", Self.page_size,
            )
        for i in range((end + Self.page_size - 1) // Self.page_size):
            var page = self.page(batch_idx, i)
            if page >= self.num_pages():
                raise Error(
                    "maxkv: page_table[", batch_idx, ", ", i, "] = ", page,
                    " is not a page (the cache has ", self.num_pages(), "), yet sequence ",
                    batch_idx, " needs ", end, " tokens",
                )

    def view(self) -> Self.MaxCollection:
        """Rebuilds MAX's `PagedKVCacheCollection` over the same memory."""
        comptime pages_layout = Layout.row_major[6]()
        comptime vector_layout = Layout(UNKNOWN_VALUE)
        comptime table_layout = Layout.row_major[2]()
        return {
            lt_to_tt(
                LayoutTensor[Self.dtype, pages_layout, MutAnyOrigin](
                    self.pages.unsafe_origin_cast[MutAnyOrigin](),
                    RuntimeLayout[pages_layout].row_major(self.pages_shape),
                )
            ),
            lt_to_tt(
                LayoutTensor[DType.uint32, vector_layout, ImmutAnyOrigin](
                    self.cache_lengths.as_imm().unsafe_origin_cast[ImmutAnyOrigin](),
                    RuntimeLayout[vector_layout].row_major(IndexList[1](self.batch_size)),
                )
            ),
            lt_to_tt(
                LayoutTensor[DType.uint32, table_layout, ImmutAnyOrigin](
                    self.page_table.as_imm().unsafe_origin_cast[ImmutAnyOrigin](),
                    RuntimeLayout[table_layout].row_major(
                        IndexList[2](self.batch_size, self.table_width)
                    ),
                )
            ),
            self.max_seq_length,
            self.max_cache_length,
        }

    def check_bounds(self) raises:
        """Raises unless every sequence's cached tokens sit in real pages (CPU only)."""
        for b in range(self.batch_size):
            self.check_extent(b, self.cache_length(b))


@extensibility.register("maxkv.paged.kv_collection_ctor")
struct PagedKVCollectionCtor:
    """Wraps the paged manager's four tensors into a `PagedKVCacheCollection`.

    On CPU it checks the page table against the pages (see `check_bounds`)
    and raises instead of handing out an out-of-bounds view.
    """

    @staticmethod
    def execute[
        dtype: DType,
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        target: StaticString,
    ](
        pages: InputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        page_table: InputTensor[dtype=DType.uint32, rank=2, ...],
        max_lengths: InputTensor[dtype=DType.uint32, rank=2, ...],
    ) raises -> PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size]:
        comptime Collection = PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size]
        comptime assert Collection.dtype == dtype, "pages dtype differs from dtype_name"
        if (
            pages.dim_size(3) != page_size
            or pages.dim_size(4) != num_heads
            or pages.dim_size(5) != Collection.head_width
        ):
            raise Error("maxkv: pages' last three dims must be [page_size, num_heads, head_width]")
        if page_table.dim_size(0) != cache_lengths.dim_size(0):
            raise Error("maxkv: cache_lengths and page_table differ in batch size")
        if max_lengths.dim_size(0) < 1 or max_lengths.dim_size(1) != 2:
            raise Error("maxkv: max_lengths must have shape [num_steps >= 1, 2]")
        var max_new_tokens = UInt32(max_lengths[0, 0])
        var max_cached = UInt32(max_lengths[0, 1])
        var shape = IndexList[6]()
        for i in range(6):
            shape[i] = pages.dim_size(i)
        var collection = Collection(
            pages.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().bitcast[
                Scalar[Collection.dtype]
            ](),
            cache_lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            page_table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            shape,
            cache_lengths.dim_size(0),
            page_table.dim_size(1),
            max_new_tokens,
            max_new_tokens + max_cached,
        )
        comptime if is_cpu[target]():
            collection.check_bounds()
        return collection
