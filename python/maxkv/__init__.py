"""maxkv: a continuous-batching KV cache for MAX graphs.

Python side: :class:`ContinuousBatchingKVCacheManager` (one slot per
sequence) or :class:`PagedKVCacheManager` (pages, TVM's design) owns the
cache and hands a graph four tensors per device; inside the graph,
:class:`FetchContinuousBatchingKVCacheCollection` (or
:class:`FetchPagedKVCacheCollection`) wraps them into one opaque collection
that maxkv's Mojo ops (:mod:`maxkv.ops`) consume.  Load :func:`kernels_path`
as a custom extension.  :class:`HybridKVCacheManager` groups the layers of a
model with sliding-window and full-attention layers (Gemma 3): the paged
manager with a page table and a collection per group.

The packages, bottom to top: :mod:`maxkv.cache` (the managers' bookkeeping),
:mod:`maxkv.graph` (collection types and KV-cache ops), :mod:`maxkv.cpu`
(the model graph's CPU kernels), :mod:`maxkv.models` (the model families,
loading, references), :mod:`maxkv.serving` (the scheduler, MAX's pipelines) and
:mod:`maxkv.blend` (CacheBlend).
"""

from . import ops
from .cache import (
    SUPPORTED_DTYPES,
    ArgumentTypeError,
    CacheFullError,
    CacheSpec,
    ContinuousBatchingKVCacheManager,
    HybridKVCacheManager,
    KVCacheInputs,
    KVCacheInputSymbols,
    KVCacheParams,
    PagedKVCacheManager,
)
from .graph.types import (
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

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "ArgumentTypeError",
    "CacheFullError",
    "CacheSpec",
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheManager",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "FetchPagedKVCacheCollection",
    "HybridKVCacheManager",
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
