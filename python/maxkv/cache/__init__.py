"""The KV cache's bookkeeping: which sequence holds which storage, on the host.

- :mod:`~maxkv.cache.params`: :class:`KVCacheParams` (dtype, heads, devices).
- :mod:`~maxkv.cache.spec`: :class:`CacheSpec`, a cache described without a
  manager (graph inputs, collection fetcher), and :class:`KVCacheInputs`.
- :mod:`~maxkv.cache.protocol`: the step protocol both managers follow
  (TVM's steps, written once), validation, the lock.
- :mod:`~maxkv.cache.contiguous`: :class:`ContinuousBatchingKVCacheManager`,
  one slot per sequence (MAX 24.x's design).
- :mod:`~maxkv.cache.paged`: :class:`PagedKVCacheManager`, pages (TVM's design),
  given back outside a sliding window (:mod:`~maxkv.cache.window`).
- :mod:`~maxkv.cache.hybrid`: :class:`HybridKVCacheManager`, layer groups by
  sliding window, each a paged cache of its own (hybrid models: Gemma 3).
- :mod:`~maxkv.cache.page_pool`: reference-counted pages and the prefix
  cache over them; :mod:`~maxkv.cache.prefix`: the chained block hashes and
  the contiguous cache's prefix index.
- :mod:`~maxkv.cache.device`: the device work (zero fill, length increments,
  token copies) as MAX graphs; a manager is given it (a ``CacheDevice``).
"""

from ..errors import ArgumentTypeError, CacheFullError
from .contiguous import ContinuousBatchingKVCacheManager
from .hybrid import HybridKVCacheManager
from .paged import UNUSED_PAGE, PagedKVCacheManager
from .params import SUPPORTED_DTYPES, KVCacheParams
from .prefix import PrefixCacheStats
from .protocol import CacheDevice, KVCacheManagerBase
from .spec import (
    CACHE_KINDS,
    CacheInputs,
    CacheKind,
    CacheSpec,
    HybridCacheSpec,
    KVCacheInputs,
    KVCacheInputSymbols,
)

__all__ = [
    "CACHE_KINDS",
    "SUPPORTED_DTYPES",
    "UNUSED_PAGE",
    "ArgumentTypeError",
    "CacheDevice",
    "CacheFullError",
    "CacheInputs",
    "CacheKind",
    "CacheSpec",
    "ContinuousBatchingKVCacheManager",
    "HybridCacheSpec",
    "HybridKVCacheManager",
    "KVCacheInputSymbols",
    "KVCacheInputs",
    "KVCacheManagerBase",
    "KVCacheParams",
    "PagedKVCacheManager",
    "PrefixCacheStats",
]
