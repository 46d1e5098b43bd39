"""maxkv inside a MAX graph: the opaque collection types, their fetchers, and the
KV-cache ops (public as :mod:`maxkv.ops`).

- :mod:`~maxkv.graph.types`: ``ContinuousBatchingKVCacheCollectionType`` and
  ``PagedKVCacheCollectionType``, their values, and the fetchers that build
  them from a step's four inputs.
- :mod:`~maxkv.graph.ops`: attention's cache ops over maxkv's Mojo kernels.
- :mod:`~maxkv.graph.checks`: the graph-build-time checks of both.
"""

from .types import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheType,
    FetchContinuousBatchingKVCacheCollection,
    FetchPagedKVCacheCollection,
    KVCacheCollection,
    PagedKVCacheCollection,
    PagedKVCacheCollectionType,
)

__all__ = [
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "KVCacheCollection",
    "PagedKVCacheCollection",
    "PagedKVCacheCollectionType",
]
