"""maxkv: a continuous-batching KV cache for MAX graphs.

Python side: :class:`ContinuousBatchingKVCacheManager` (one slot per
sequence) or :class:`PagedKVCacheManager` (pages, TVM's design) owns the
cache and hands a graph four tensors per device; inside the graph,
:class:`FetchContinuousBatchingKVCacheCollection` (or
:class:`FetchPagedKVCacheCollection`) wraps them into one opaque collection
that maxkv's Mojo ops (:mod:`maxkv.ops`) consume.  Load :func:`kernels_path`
as a custom extension.
"""

from . import ops
from .graph import (
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
from .kernels import kernels_path, kernels_source_path
from .manager import ContinuousBatchingKVCacheManager, KVCacheInputs, KVCacheInputSymbols
from .paged_manager import PagedKVCacheManager
from .params import SUPPORTED_DTYPES, KVCacheParams

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheManager",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "KVCacheCollection",
    "KVCacheInputSymbols",
    "KVCacheInputs",
    "KVCacheParams",
    "PagedKVCacheCollection",
    "PagedKVCacheCollectionType",
    "PagedKVCacheManager",
    "__version__",
    "kernels_path",
    "kernels_source_path",
    "ops",
]
