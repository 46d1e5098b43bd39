"""KV events in vLLM's wire format: which blocks a server's cache holds, for
KV-aware routers (vllm-router's ``kv_aware`` policy, Dynamo's indexer, llm-d).

:mod:`maxkv.events.wire` is the format (msgspec structs, vLLM's field for
field); :mod:`maxkv.events.log` what a cache announces; :mod:`maxkv.events.publisher`
the ZMQ publisher with replay (it needs pyzmq: ``pip install "maxkv[events]"``;
imported when first named, so the caches need no ZMQ).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .publisher import EventPublisherStats, ZmqEventPublisher
from .wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    event_hash,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisherStats",
    "KVEventBatch",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "event_hash",
]


def __getattr__(name: str) -> Any:
    if name in ("EventPublisherStats", "ZmqEventPublisher"):
        from . import publisher

        return getattr(publisher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
