"""maxkv's manager behind MAX's KV-manager interface (``PagedKVCacheManagerInterface``).

MAX's schedulers (``max generate``'s loop, ``max serve``'s batch constructor)
drive a KV manager through one protocol; this adapter maps it onto maxkv's
step protocol (:mod:`maxkv.manager`), one request to one slot:

==========================  ===============================================
MAX calls                   maxkv does
==========================  ===============================================
``claim(ctx)``              records the request (takes no slot yet: MAX
                            calls ``claim`` outside its retry handling)
``alloc(ctx)``              takes a free slot (``claim(1)``) on first use;
                            ``InsufficientBlocksError`` when none is free or
                            the request would pass ``max_seq_len`` (MAX
                            requeues the request and retries)
``runtime_inputs(batches)`` ``fetch(slots, 1, active_lengths=...)``: the
                            per-device 4-tuples the model graph takes
``step(ctx)``               ``step({slot: newly processed tokens})``
``release(ctx)``            ``release(slot)``
==========================  ===============================================

Prefix caching, KV transfers (host/disk tiers, disaggregation) and data
parallelism are not supported: their queries answer "none", transfers are
no-ops, and a replica other than 0 is refused.

Set ``MAXKV_EVENT_LOG=FILE`` to append one JSON line per ``alloc`` (slot
taken) and ``release`` (slot freed) with the slots still free: a way to see
slot use inside ``max serve``'s model worker process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from max.pipelines.kv_cache import BlockCount, ByteCount, PagedKVCacheManagerInterface
from max.pipelines.kv_cache.kv_connector import CompletedTransfer
from max.pipelines.kv_cache.paged_kv_cache import InsufficientBlocksError
from max.pipelines.kv_cache.paged_kv_cache._common import PrefixCacheHits

from ..manager import ContinuousBatchingKVCacheManager, KVCacheInputs


class MaxkvKVManager(PagedKVCacheManagerInterface):
    """MAX's KV-manager interface over a :class:`ContinuousBatchingKVCacheManager`.

    Args:
        manager: The maxkv manager holding the cache (one slot per request).
        params: MAX's KV cache parameters of the model (the schedulers read
            ``params.page_size`` and a few other fields).
    """

    def __init__(self, manager: ContinuousBatchingKVCacheManager, params: Any) -> None:
        self.manager = manager
        self.params = params
        self._lock = threading.Lock()
        #: request id -> slot (None until ``alloc`` takes one).
        self._slots: dict[Any, int | None] = {}
        #: request id -> tokens committed to the slot.
        self._committed: dict[Any, int] = {}
        self._event_log = os.environ.get("MAXKV_EVENT_LOG")

    def _event(self, event: str, ctx: Any, slot: int) -> None:
        if self._event_log:
            record = {
                "event": event,
                "request": str(ctx.request_id),
                "slot": slot,
                "free": self.manager.slots_remaining,
                "time": time.time(),
            }
            with open(self._event_log, "a") as log:
                log.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------ lifecycle

    def claim(self, ctx: Any, replica_idx: int = 0) -> None:
        """Records the request; its slot is taken by :meth:`alloc`."""
        if replica_idx != 0:
            raise ValueError("maxkv: data parallelism (replica_idx > 0) is not supported")
        with self._lock:
            if ctx.request_id in self._slots:
                raise ValueError(f"maxkv: request {ctx.request_id} is already claimed")
            self._slots[ctx.request_id] = None
            self._committed[ctx.request_id] = 0

    def alloc(self, ctx: Any) -> Any:
        """Gives the request a slot (once) and checks that this step fits in it.

        Raises:
            InsufficientBlocksError: No slot is free, or the request's tokens
                would pass the slots' ``max_seq_len``.
        """
        need = ctx.tokens.processed_length + ctx.tokens.active_length
        if need > self.manager.max_seq_len:
            raise InsufficientBlocksError(
                f"maxkv: request {ctx.request_id} needs {need} cache positions, past the "
                f"slots' max_seq_len {self.manager.max_seq_len} (--max-length)"
            )
        with self._lock:
            if ctx.request_id not in self._slots:
                raise ValueError(f"maxkv: request {ctx.request_id} was not claimed")
            if self._slots[ctx.request_id] is None:
                if self.manager.slots_remaining == 0:
                    raise InsufficientBlocksError(
                        f"maxkv: all {self.manager.max_cache_batch_size} slots are in use "
                        "(--max-batch-size)"
                    )
                (slot,) = self.manager.claim(1)
                self._slots[ctx.request_id] = slot
                self._event("alloc", ctx, slot)
        return CompletedTransfer()

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[Any]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: Any = None,
    ) -> list[KVCacheInputs]:
        """``fetch`` of the batch's slots for one step: maxkv's per-device 4-tuples."""
        del max_cache_length, batch_characteristics
        if len(batches) != 1:
            raise ValueError("maxkv: data parallelism (several replica batches) is not supported")
        (batch,) = batches
        if not batch:
            return []
        slots = [self._slot(ctx) for ctx in batch]
        return self.manager.fetch(slots, 1, active_lengths=[c.tokens.active_length for c in batch])

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[Any]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: Any = None,
    ) -> tuple[KVCacheInputs, ...]:
        return tuple(self.runtime_inputs(batches))

    def step(self, ctx: Any) -> None:
        """Commits the tokens the request processed since the last ``step``."""
        with self._lock:
            slot = self._slot(ctx)
            new = ctx.tokens.processed_length - self._committed[ctx.request_id]
            if new < 0:
                raise ValueError(
                    f"maxkv: request {ctx.request_id} went back from "
                    f"{self._committed[ctx.request_id]} to {ctx.tokens.processed_length} tokens"
                )
            self.manager.step({slot: new})
            self._committed[ctx.request_id] += new

    def release(self, ctx: Any) -> None:
        """Frees the request's slot (if it took one) and forgets the request."""
        with self._lock:
            if ctx.request_id not in self._slots:
                raise ValueError(f"maxkv: request {ctx.request_id} is not claimed")
            slot = self._slots.pop(ctx.request_id)
            del self._committed[ctx.request_id]
            if slot is not None:
                self.manager.release(slot)
                self._event("release", ctx, slot)

    def contains(self, ctx: Any) -> bool:
        with self._lock:
            return ctx.request_id in self._slots

    def slot_of(self, ctx: Any) -> int | None:
        """The slot a request holds (``None`` before :meth:`alloc`)."""
        with self._lock:
            return self._slots.get(ctx.request_id)

    def _slot(self, ctx: Any) -> int:
        slot = self._slots.get(ctx.request_id)
        if slot is None:
            raise ValueError(f"maxkv: request {ctx.request_id} holds no slot (alloc first)")
        return slot

    # ------------------------------------------------------------ occupancy

    def block_count(self, replica_idx: int = 0) -> Any:
        """Slots as blocks: free and total."""
        total = self.manager.max_cache_batch_size
        return BlockCount(free=self.manager.slots_remaining, total=total)

    def num_req_blocks(self, ctx: Any) -> int:
        return 1 if self.slot_of(ctx) is not None else 0

    def get_req_blocks_per_leaf(self, ctx: Any) -> dict[str, list[int]]:
        slot = self.slot_of(ctx)
        return {"0": [] if slot is None else [slot]}

    @property
    def effective_max_seq_length(self) -> int | None:
        return self.manager.max_seq_len

    # ------------------------------------- prefix caching, tiers, transfers: none

    def get_prefix_cache_hit_counts(self, ctx: Any) -> list[Any]:
        return [PrefixCacheHits()]

    def alloc_dummy(self, ctx: Any, replica_idx: int = 0) -> None:
        raise NotImplementedError("maxkv: data-parallel padding requests are not supported")

    def host_byte_count(self) -> Any:
        return ByteCount(free=0, total=0)

    def disk_byte_count(self) -> Any:
        return ByteCount(free=0, total=0)

    def poll_transfers(self) -> None:
        pass

    def pending_transfers_exist(self, replica_idx: int = 0) -> bool:
        return False

    def take_metrics_aggregated(self) -> Any:
        from max.nn.kv_cache.metrics import KVCacheMetrics

        return KVCacheMetrics()

    def get_metrics_aggregated(self) -> Any:
        from max.nn.kv_cache.metrics import KVCacheMetrics

        return KVCacheMetrics()

    def reset_prefix_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_device_buffer(self, replica_idx: int) -> Any:
        raise NotImplementedError("maxkv: the cache is not a MAX KV buffer")
