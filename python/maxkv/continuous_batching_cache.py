"""Mirror of MAX 24.x's ``max.pipelines.kv_cache.continuous_batching_cache``.

Code written against that module can switch its import to this one.
"""

from .graph import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheType,
    FetchContinuousBatchingKVCacheCollection,
)
from .manager import ContinuousBatchingKVCacheManager
from .params import KVCacheParams

__all__ = [
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheManager",
    "ContinuousBatchingKVCacheType",
    "FetchContinuousBatchingKVCacheCollection",
    "KVCacheParams",
]
