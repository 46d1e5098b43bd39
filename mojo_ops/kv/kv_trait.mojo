"""What maxkv's ops need from a cache collection, whatever its layout.

Two collections conform: `ContinuousBatchingKVCacheCollection` (one slot of
`max_seq_len` tokens per sequence, `collection.mojo`) and
`PagedKVCacheCollection` (pages of `page_size` tokens found through a page
table, `paged_collection.mojo`).  Op bodies are written once, generic over
this trait; each collection gets a thin registration per op.
"""

from kv_cache.types import KVCollectionT


trait MaxkvKVCollection(TrivialRegisterPassable):
    """A maxkv cache collection: contiguous slots or pages.

    `view()` is MAX's own collection over the same memory (what MAX's
    kernels take); the other methods are what maxkv's checks and its own
    kernels use.  Lengths and tables are host memory on CPU only.
    """

    comptime View: KVCollectionT & Deinitable

    def view(self) -> Self.View:
        """MAX's collection over the same memory."""
        ...

    def batch(self) -> Int:
        """Sequences in this step."""
        ...

    def num_layers(self) -> Int:
        ...

    def capacity(self) -> Int:
        """Most tokens one sequence can hold (`max_seq_len`, or table width x page size)."""
        ...

    def cache_length(self, batch_idx: Int) -> Int:
        """Tokens already cached for batch entry `batch_idx` (host memory on CPU)."""
        ...

    def max_new_tokens(self) -> UInt32:
        """Most new tokens of any sequence in this step."""
        ...

    def max_context_length(self) -> UInt32:
        """Upper bound on any sequence's cache length + new tokens (MAX's `max_cache_length`)."""
        ...

    def check_extent(self, batch_idx: Int, end: Int) raises:
        """Raises unless tokens `[0, end)` of batch entry `batch_idx` have storage.

        Reads host memory: CPU targets only.
        """
        ...

    def row_ptr(
        self, kv_idx: Int, layer: Int, batch_idx: Int, token: Int
    ) -> UnsafePointer[Scalar[Self.View.dtype], MutUntrackedOrigin]:
        """The contiguous `[num_heads, head_width]` row of `token` of batch entry
        `batch_idx` (0 keys, 1 values) in `layer`: a head row of the cache's
        encoding each (`HeadCodec`, `encoding.mojo`).

        No bounds checks: callers run `check_extent` first.
        """
        ...
