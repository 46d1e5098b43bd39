"""What a cache tells KV-aware routers: its blocks as KV events, when they become
servable from a medium and when they stop being so.

A :class:`KVEventLog` is attached to a manager
(:meth:`~maxkv.PagedKVCacheManager.attach_kv_events`).  The manager's page tables
announce through it, each with its own :class:`GroupEvents` (its layer group's
index, kind and window):

- **stored**, medium ``"GPU"`` (the engine's own pool, whatever the device):
  a page registered in the prefix cache (its tokens committed, or loaded from a
  tier, or swapped back in).  Blended (CacheBlend) pages are never registered,
  so never announced.
- **removed**, medium ``"GPU"``: a registered page whose content is dropped to
  reuse the page (eviction).  A page a window or attention sinks gave back stays
  registered, and servable, until then.
- **stored / removed** in a tier (``"CPU"``: the host tier; ``"STORAGE"``: the
  disk tier): a block this process put there or read into it, and dropped from
  it (evicted, invalid), as the tier does it (under the tier's lock).  Only
  blocks whose tokens this process knows (it announced them on the device
  first) are announced.  The Redis tier's blocks are not: they are every
  replica's, and Redis evicts them without telling anyone.
- **cleared**: :meth:`~maxkv.KVCacheManagerBase.reset_prefix_cache`.

Events wait in the log until the manager's protocol call that made them ends;
then they go to the sink as one batch (``[ts, events, rank]``), in order.
Events a tier's thread makes go with the next call's batch.  The log keeps,
per block it announced, its parent, tokens and salt until no medium holds it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    event_hash,
)

__all__ = ["DEVICE", "DISK", "HOST", "EventSink", "GroupEvents", "KVEventLog"]

#: Where a block is, as a cache says it; events carry the medium of :data:`WIRE_MEDIUM`.
DEVICE = "device"
HOST = "host"
DISK = "disk"
#: The medium events carry for each place.
WIRE_MEDIUM = {DEVICE: MEDIUM_GPU, HOST: MEDIUM_CPU, DISK: MEDIUM_STORAGE}

logger = logging.getLogger("maxkv.events")

Event = BlockStored | BlockRemoved | AllBlocksCleared
#: Where a log's batches go: e.g. :meth:`~maxkv.events.ZmqEventPublisher.publish`.
EventSink = Callable[[list[Event]], object]

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclass
class _Block:
    parent: bytes | None
    tokens: tuple[int, ...]
    salt: str | None
    #: The places that hold it (as announced): :data:`DEVICE`, :data:`HOST`, ...
    places: set[str] = field(default_factory=set)

    def in_medium(self, medium: str) -> bool:
        return any(WIRE_MEDIUM[p] == medium for p in self.places)


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    """An announcement that fails is logged and counted (``events_lost``), never
    raised into the cache's step."""

    @functools.wraps(method)
    def announce(self: GroupEvents, *args: object, **kwargs: object) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception:
            self.log.events_lost += 1
            logger.exception("maxkv: a KV event could not be recorded")

    return announce


class KVEventLog:
    """A manager's events, batched per protocol call, to ``sink``.

    Thread-safe: a tier's thread may announce while the model's thread steps.
    """

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._groups: list[GroupEvents] = []
        #: Events handed to the sink, and those it raised on (cumulative).
        self.events_sent = 0
        self.events_lost = 0

    def group(self, index: int, block_size: int, window: int | None) -> GroupEvents:
        """The announcer of layer group ``index`` (blocks of ``block_size`` tokens;
        ``window``: its layers' sliding window, ``None`` for full attention)."""
        events = GroupEvents(self, index, block_size, window)
        self._groups.append(events)
        return events

    def cleared(self) -> None:
        """Every block of every medium is gone (a prefix cache reset): what was
        waiting is superseded."""
        with self._lock:
            self._pending = [AllBlocksCleared()]
            for group in self._groups:
                group._blocks.clear()

    def flush(self) -> None:
        """Hands the waiting events to the sink as one batch (none waiting: nothing).

        A sink that raises loses that batch (logged): events never fail a step.
        """
        if not self._pending:  # most calls: nothing to send, no lock taken
            return
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return
        self.events_sent += len(events)
        try:
            self.sink(events)
        except Exception:
            self.events_lost += len(events)
            logger.exception("maxkv: a batch of %d KV events could not be sent", len(events))

    def _add(self, event: Event) -> None:
        # Under self._lock.  Blocks that continue the chain of the last event of the
        # same group and medium join it (one BlockStored per run, as vLLM sends).
        if self._pending and isinstance(event, BlockStored):
            last = self._pending[-1]
            if (
                isinstance(last, BlockStored)
                and last.medium == event.medium
                and last.group_idx == event.group_idx
                and event.parent_block_hash == last.block_hashes[-1]
            ):
                last.block_hashes.extend(event.block_hashes)
                last.token_ids.extend(event.token_ids)
                assert last.extra_keys is not None and event.extra_keys is not None
                last.extra_keys.extend(event.extra_keys)
                return
        if self._pending and isinstance(event, BlockRemoved):
            last = self._pending[-1]
            if (
                isinstance(last, BlockRemoved)
                and last.medium == event.medium
                and last.group_idx == event.group_idx
            ):
                last.block_hashes.extend(event.block_hashes)
                return
        self._pending.append(event)


class GroupEvents:
    """One layer group's (one page table's) announcements through its log."""

    def __init__(self, log: KVEventLog, index: int, block_size: int, window: int | None) -> None:
        self.log = log
        self.index = index
        self.block_size = block_size
        self.window = window
        self._blocks: dict[bytes, _Block] = {}

    @_never_raises
    def stored(
        self,
        block: bytes,
        parent: bytes | None,
        tokens: Sequence[int],
        salt: str | None,
        place: str = DEVICE,
    ) -> None:
        """``block`` (chained to ``parent``, ``None`` for a sequence's first block;
        holding ``tokens``; of the tenant ``salt``) is servable from ``place``."""
        assert len(tokens) == self.block_size, (len(tokens), self.block_size)
        with self.log._lock:
            known = self._blocks.get(block)
            if known is None:
                known = self._blocks[block] = _Block(parent, tuple(tokens), salt)
            self._store(block, known, place)

    @_never_raises
    def stored_again(self, blocks: Sequence[bytes], place: str) -> None:
        """``blocks`` are servable from ``place`` too (a tier): those this log
        announced somewhere are announced there; the others are unknown here."""
        with self.log._lock:
            for block in blocks:
                known = self._blocks.get(block)
                if known is not None:
                    self._store(block, known, place)

    @_never_raises
    def removed(self, blocks: Sequence[bytes], place: str = DEVICE) -> None:
        """``blocks`` are no longer servable from ``place`` (those announced there)."""
        medium = WIRE_MEDIUM[place]
        with self.log._lock:
            gone: list[int | bytes] = []
            for block in blocks:
                known = self._blocks.get(block)
                if known is None or place not in known.places:
                    continue
                known.places.discard(place)
                if not known.in_medium(medium):
                    gone.append(event_hash(block))
                if not known.places:
                    del self._blocks[block]
            if gone:
                self.log._add(BlockRemoved(gone, medium, self.index))

    def stored_in(self, place: str) -> Callable[[list[bytes]], None]:
        """What a tier calls with the blocks it takes."""
        return lambda blocks: self.stored_again(blocks, place)

    def evicted_from(self, place: str) -> Callable[[list[bytes]], None]:
        """What a tier (or the page pool) calls with the blocks it lets go."""
        return lambda blocks: self.removed(blocks, place)

    def _store(self, block: bytes, known: _Block, place: str) -> None:
        if place in known.places:
            return
        medium = WIRE_MEDIUM[place]
        already = known.in_medium(medium)
        known.places.add(place)
        if already:
            return
        first = known.parent is None
        self.log._add(
            BlockStored(
                block_hashes=[event_hash(block)],
                parent_block_hash=None if known.parent is None else event_hash(known.parent),
                token_ids=list(known.tokens),
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                # vLLM's: the salt is an extra key of a sequence's first block.
                extra_keys=[(known.salt,) if first and known.salt is not None else None],
                group_idx=self.index,
                kv_cache_spec_kind=FULL_ATTENTION if self.window is None else SLIDING_WINDOW,
                kv_cache_spec_sliding_window=self.window,
            )
        )
