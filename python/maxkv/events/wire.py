"""vLLM's KV event wire format (``vllm/distributed/kv_events.py``, since vLLM's
switch of events from arrays to maps): what KV-aware routers read.

A batch is a msgpack **array** ``[ts, events, data_parallel_rank]``; each event
a msgpack **map** tagged ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) whose fields without a default are always present (nil
where unset) and whose fields with one are left out while at it.  The
structs below are vLLM's, field for field and in its order, so that
``msgspec.msgpack.Decoder(KVEventBatch)`` built from vLLM's own structs
decodes what :func:`encode_batch` writes, and the reverse.

Only the fields routers accept are declared: vllm-router rejects a batch
with a key it does not know.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "event_hash",
]

#: Where a block lives, in vLLM's words: the engine's own cache (its device pool,
#: whatever the device), host memory, and storage (disk, a shared store).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a map whose ``"type"`` is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks of ``block_size`` tokens are now cached and servable from ``medium``."""

    #: One per block, chained: block ``i``'s parent is block ``i - 1``.
    block_hashes: list[int | bytes]
    #: The parent of the first block (``None``: the first block of a sequence).
    parent_block_hash: int | bytes | None
    #: The blocks' tokens, ``len(block_hashes) * block_size`` of them.
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: Per block, what else its hash covers (``None`` entries: nothing).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    #: The layer group (a hybrid cache's); ``None`` for a single group.
    group_idx: int | None = None
    #: ``"full_attention"`` or ``"sliding_window"`` (with its window).
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer cached in ``medium``."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the engine's cache was dropped (a prefix cache reset)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(
    events: list[BlockStored | BlockRemoved | AllBlocksCleared],
    *,
    ts: float | None = None,
    data_parallel_rank: int = 0,
) -> bytes:
    """The msgpack payload of one batch (``ts`` default: now)."""
    stamp = time.time() if ts is None else float(ts)
    return _encoder.encode(KVEventBatch(stamp, list(events), data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back (raises ``msgspec.DecodeError`` / ``ValidationError`` if it is
    not a batch in this format)."""
    return _decoder.decode(payload)


def event_hash(block_hash: bytes) -> int:
    """A block's hash as events carry it: its last 8 bytes, an unsigned 64-bit int
    (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    if len(block_hash) < 8:
        raise ValueError(f"a block hash has at least 8 bytes, got {len(block_hash)}")
    return int.from_bytes(block_hash[-8:], "big")
