"""maxkv: a continuous-batching KV cache for MAX graphs.

Python side: :class:`ContinuousBatchingKVCacheManager` owns the cache and
hands a graph four tensors per device; inside the graph,
:class:`FetchContinuousBatchingKVCacheCollection` wraps them into one opaque
:class:`ContinuousBatchingKVCacheCollection` that maxkv's Mojo ops
(:mod:`maxkv.ops`) consume.  Load :func:`kernels_path` as a custom extension.
"""

from . import ops
from .graph import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheType,
    FetchContinuousBatchingKVCacheCollection,
)
from .kernels import kernels_path, kernels_source_path
from .manager import ContinuousBatchingKVCacheManager, KVCacheInputs, KVCacheInputSymbols
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
    "KVCacheInputSymbols",
    "KVCacheInputs",
    "KVCacheParams",
    "__version__",
    "kernels_path",
    "kernels_source_path",
    "ops",
]
