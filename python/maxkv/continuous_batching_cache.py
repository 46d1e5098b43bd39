"""Mirror of MAX 24.x's ``max.pipelines.kv_cache.continuous_batching_cache``.

Code written against that module can switch its import to this one.
"""

from .cache.contiguous import ContinuousBatchingKVCacheManager
from .cache.params import KVCacheParams
from .graph.types import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheType,
    FetchContinuousBatchingKVCacheCollection,
)

__all__ = [
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheManager",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "KVCacheParams",
]
