"""maxkv's managers behind MAX's KV-manager interface (``PagedKVCacheManagerInterface``).

MAX's schedulers (``max generate``'s loop, ``max serve``'s batch constructor,
with its chunked prefill and preemption) drive a KV manager through one
protocol; this adapter maps it onto maxkv's step protocol
(:mod:`maxkv.cache.protocol`), one request to one maxkv sequence, over either
manager (:class:`~maxkv.PagedKVCacheManager` by default, or the contiguous
:class:`~maxkv.ContinuousBatchingKVCacheManager`):

==========================  ===============================================
MAX calls                   maxkv does
==========================  ===============================================
``claim(ctx)``              records the request (no sequence yet: MAX calls
                            ``claim`` outside its retry handling)
``alloc(ctx)``              first call: ``claim_prefix(prompt, salt=
                            ctx.cache_salt)`` with prefix caching (the
                            request skips its cached tokens and
                            ``ctx.cached_prefix_length`` is set, as MAX's
                            own manager does), else ``claim(1)``; every call:
                            ``reserve`` the pages of this step (its chunk
                            or decode token).  No room:
                            ``InsufficientBlocksError``, with nothing taken
                            and the request as it was (MAX requeues or
                            preempts, and retries).  Also when a request
                            still prefilling will cache pages of this
                            prompt: it waits a batch and reuses them
                            instead of computing them twice.  With
                            CacheBlend (``MAXKV_BLEND``): the prompt up to
                            its question is blended from stored chunks
                            (``ServeBlender``) and skipped like a cached
                            prefix; a request waits a batch for another
                            computing one of its chunks, or when one was
                            blended while this batch was built.  A
                            request's later choices (``n``, ``best_of``;
                            ``ctx.fork_of``) fork its first choice's
                            sequence once its prompt is computed (they
                            wait a batch until then) and recompute the
                            prompt's last token only.  A request asking
                            for its prompt's log probabilities (``echo``)
                            computes its prompt whole
``runtime_inputs(batches)`` ``fetch(seq_ids, 1, active_lengths=...)``: the
                            per-device 4-tuples the model graph takes
``step(ctx)``               ``step({seq_id: newly processed tokens},
                            tokens=...)``: full pages enter the prefix cache;
                            rows of rejected speculative drafts
                            (:meth:`runtime_inputs_with_drafts`) are never
                            committed, and their pages go back; chunks
                            no tier held are stored once committed
``release(ctx)``            ``release(seq_id)``: pages return to the pool
                            (cached ones stay findable until evicted)
==========================  ===============================================

MAX's occupancy and prefix-cache queries are answered from the manager:
``block_count`` (free and total pages, or slots), ``num_req_blocks``,
``get_prefix_cache_hit_counts``, and the metrics MAX's scheduler logs per
batch (``input_tokens``, ``cache_tokens``).  KV transfers to other tiers
and data parallelism are not supported: transfers are no-ops and a replica
other than 0 is refused.

Set ``MAXKV_EVENT_LOG=FILE`` to append one JSON line per ``alloc`` that
starts a sequence and per ``release``, with the cache's free units (pages or
slots) after it and the request's tokens (prompt and generated): a way to see
cache use inside ``max serve``'s model worker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from max.nn.kv_cache.metrics import KVCacheMetrics
from max.pipelines.kv_cache import BlockCount, ByteCount, PagedKVCacheManagerInterface
from max.pipelines.kv_cache.kv_connector import CompletedTransfer
from max.pipelines.kv_cache.paged_kv_cache import InsufficientBlocksError
from max.pipelines.kv_cache.paged_kv_cache._common import PrefixCacheHits

from ... import settings
from ...cache.prefix import common_prefix_length
from ...cache.protocol import KVCacheManagerBase
from ...cache.spec import CacheInputs
from ...errors import CacheFullError
from .blending import ServeBlender
from .context import wants_prompt_logprobs

if TYPE_CHECKING:
    from ...events.publisher import ZmqEventPublisher


class MaxkvKVManager(PagedKVCacheManagerInterface):
    """MAX's KV-manager interface over a maxkv manager.

    Args:
        manager: The maxkv manager holding the cache; with prefix caching on,
            requests reuse cached prefixes.
        params: MAX's KV cache parameters of the model (the schedulers read
            ``params.page_size`` and a few other fields).
        sinks: ``(window, sinks)``: every request's sequence keeps its
            first ``sinks`` tokens and its last ``window``
            (:meth:`PagedKVCacheManager.enable_attention_sinks`); its cache
            positions then lag its tokens, which maxkv's graph reads from
            the cache.
        blender: CacheBlend of requests with chunks, or ``None``.
        events: The KV event publisher the manager announces its blocks to (closed
            with the adapter), or ``None``.
    """

    def __init__(
        self,
        manager: KVCacheManagerBase,
        params: Any,
        *,
        sinks: tuple[int, int] | None = None,
        blender: ServeBlender | None = None,
        events: ZmqEventPublisher | None = None,
    ) -> None:
        if sinks is not None and not manager.capabilities.sinks:
            raise ValueError(
                f"maxkv: attention sinks need the paged cache, not {type(manager).__name__}"
            )
        if blender is not None and not manager.capabilities.blending:
            raise ValueError(
                f"maxkv: CacheBlend (MAXKV_BLEND) needs the paged cache, not "
                f"{type(manager).__name__}"
            )
        #: CacheBlend of requests with chunks (``MAXKV_BLEND``), or ``None``.
        self.blender = blender
        self.events = events
        self.manager = manager
        self.params = params
        #: Attention sinks of every request: ``(window, sink tokens)``, or ``None``.
        self.sinks = sinks
        self._lock = threading.Lock()
        #: request id -> maxkv sequence id (None until ``alloc`` starts one).
        self._seqs: dict[Any, int | None] = {}
        #: request id -> tokens committed to its sequence.
        self._committed: dict[Any, int] = {}
        #: Requests whose prompt is not all in the cache yet: id -> (salt, prompt).
        self._prefilling: dict[Any, tuple[str | None, list[int]]] = {}
        #: Claimed requests by the text of their id (what a choice's ``fork_of`` names).
        self._ids: dict[str, Any] = {}
        #: Claimed requests' prompts (a choice forks one only with its own prompt).
        self._prompts: dict[Any, np.ndarray] = {}
        self._metrics = KVCacheMetrics()
        self._event_log = settings.EVENT_LOG.read()

    # ------------------------------------------------------------ lifecycle

    def claim(self, ctx: Any, replica_idx: int = 0) -> None:
        """Records the request; its sequence starts in :meth:`alloc`."""
        if replica_idx != 0:
            raise ValueError("maxkv: data parallelism (replica_idx > 0) is not supported")
        with self._lock:
            if ctx.request_id in self._seqs:
                raise ValueError(f"maxkv: request {ctx.request_id} is already claimed")
            self._seqs[ctx.request_id] = None
            self._committed[ctx.request_id] = 0
            self._ids[str(ctx.request_id)] = ctx.request_id
            self._prompts[ctx.request_id] = ctx.tokens.prompt

    def alloc(self, ctx: Any) -> Any:
        """Starts the request's sequence (once, reusing its cached prefix) and
        reserves the room of its next step.

        Raises:
            InsufficientBlocksError: No sequence id or too few pages are free,
                or the request would pass ``max_seq_len``; the request and
                the cache are left as they were.
        """
        tokens = ctx.tokens
        with self._lock:
            if ctx.request_id not in self._seqs:
                raise ValueError(f"maxkv: request {ctx.request_id} was not claimed")
            seq = self._seqs[ctx.request_id]
            # Cache positions: the request's tokens, or (attention sinks) what its cache holds.
            held = tokens.processed_length if seq is None else self.manager.cache_lengths[seq]
            need = held + tokens.active_length
            if need > self.manager.max_seq_len:
                raise InsufficientBlocksError(
                    f"maxkv: request {ctx.request_id} needs {need} cache positions, past "
                    f"max_seq_len {self.manager.max_seq_len} (--max-length)"
                )
            started = seq is None
            cached = 0
            if seq is None:
                if tokens.processed_length:
                    raise ValueError(
                        f"maxkv: request {ctx.request_id} has {tokens.processed_length} "
                        "processed tokens but no cache sequence"
                    )
                seq, cached = self._start(ctx, need)
            try:
                self.manager.reserve({seq: self.manager.cache_lengths[seq] + tokens.active_length})
            except CacheFullError as error:
                if started:
                    self.manager.release(seq)
                    if cached:
                        tokens.rewind_processing(cached)
                raise InsufficientBlocksError(f"maxkv: {error}") from error
            if started and self.blender is not None and not wants_prompt_logprobs(ctx):
                blended = self.blender.begin(ctx, self.manager, seq, cached)
                if blended:  # committed as a cached prefix is: the request skips them
                    ids = ctx.tokens.all[cached : cached + blended].tolist()
                    known = {seq: ids} if self.manager.prefix_caching else None
                    self.manager.step({seq: blended}, tokens=known)
                    tokens.skip_processing(blended)
            if started:
                self._seqs[ctx.request_id] = seq
                self._committed[ctx.request_id] = self.manager.cache_lengths[seq]
                if self.manager.prefix_caching and tokens.processed_length < tokens.prompt_length:
                    prompt = tokens.prompt.tolist()
                    # Pages of blended KV are never cached: nobody waits for them.
                    exact = self.manager.blended_position(seq)
                    prompt = prompt if exact is None else prompt[:exact]
                    self._prefilling[ctx.request_id] = (ctx.cache_salt, prompt)
                ctx.cached_prefix_length = cached
                self._metrics.cache_tokens += cached
                self._event("alloc", ctx, seq)
            self._metrics.input_tokens += tokens.active_length
        return CompletedTransfer()

    def _start(self, ctx: Any, length: int) -> tuple[int, int]:
        """Claims a sequence for a fresh request; skips its cached prompt tokens.

        Raises:
            InsufficientBlocksError: No sequence id is free, or another request
                is prefilling pages of this prompt that are not cached yet, or
                the choice this one forks has not computed its prompt yet.
        """
        try:
            if wants_prompt_logprobs(ctx):  # every prompt row is computed
                (seq,), cached = self.manager.claim(1), 0
                return self._started(ctx, seq, cached)
            forked = self._fork(ctx)
            if forked is not None:
                return self._started(ctx, *forked)
            if self.blender is not None and self.blender.batch_full(ctx):
                raise InsufficientBlocksError(
                    f"maxkv: request {ctx.request_id} waits for the next batch to blend "
                    f"(MAXKV_BLEND_MAX_PER_BATCH={self.blender.settings.max_per_batch})"
                )
            if self.blender is not None and (other := self.blender.computing(ctx)) is not None:
                raise InsufficientBlocksError(
                    f"maxkv: request {ctx.request_id} waits for request {other} to compute "
                    "a chunk they share (CacheBlend)"
                )
            if self.manager.prefix_caching and ctx.tokens.active_length > 1:
                prompt = ctx.tokens.all[:length].tolist()
                self._wait_for_shared_prefill(ctx, prompt)
                seq, cached = self.manager.claim_prefix(prompt, salt=ctx.cache_salt)
            else:
                (seq,), cached = self.manager.claim(1), 0
        except CacheFullError as error:
            raise InsufficientBlocksError(f"maxkv: {error} (--max-batch-size)") from error
        return self._started(ctx, seq, cached)

    def _started(self, ctx: Any, seq: int, cached: int) -> tuple[int, int]:
        if self.sinks is not None:
            self.manager.enable_attention_sinks(seq, *self.sinks)
        if cached:
            ctx.tokens.skip_processing(cached)
        return seq, cached

    def _fork(self, ctx: Any) -> tuple[int, int] | None:
        """A choice of a request with several (``n``, ``best_of``): its sequence
        forked from the first choice's once that one's prompt is in the cache, with
        every token but the prompt's last (recomputed: its logits draw this
        choice's first token); ``None`` when the first choice cannot be forked
        (ended, preempted, its prompt not this one's; or attention sinks, where
        cache positions lag tokens): the prompt is then computed as for any
        request, from the prefix cache where it holds it.

        Raises:
            InsufficientBlocksError: The first choice has not computed its prompt
                yet (it reached the worker first: the API server sends it first).
            CacheFullError: No sequence id or page for the fork.
        """
        source = getattr(ctx, "fork_of", None)
        if source is None or self.sinks is not None or not self.manager.copies_supported:
            return None
        first = self._ids.get(source)
        if first is None:  # gone
            return None
        prompt = ctx.tokens.prompt
        length = len(prompt) - 1
        seq = self._seqs.get(first)
        theirs = self._prompts.get(first)
        if theirs is None or len(theirs) != len(prompt) or not np.array_equal(theirs, prompt):
            return None
        if seq is None or self._committed[first] < length:
            raise InsufficientBlocksError(
                f"maxkv: choice {ctx.request_id} waits for choice {source} to compute the "
                f"prompt they share"
            )
        try:
            return self.manager.fork(seq, length), length
        except ValueError:  # (a window that gave the prompt's first pages back)
            return None

    def _wait_for_shared_prefill(self, ctx: Any, prompt: list[int]) -> None:
        """Defers a request whose prompt shares a page or more, beyond what is
        cached, with a request still prefilling: after that one's step the
        pages are cached, and this one reuses them (MAX requeues it now and
        retries with its next batch, which that request is ahead of)."""
        salt = ctx.cache_salt
        cached = self.manager.cached_prefix_length(prompt, salt=salt)
        page = self.manager.prefix_block_size
        for other, (other_salt, other_prompt) in self._prefilling.items():
            if other_salt != salt:
                continue
            shared = common_prefix_length(prompt[:-1], other_prompt)
            if shared - shared % page > cached:
                raise InsufficientBlocksError(
                    f"maxkv: request {ctx.request_id} waits for request {other} to cache "
                    f"the {shared} prompt tokens they share ({cached} cached now)"
                )

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[Any]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: Any = None,
    ) -> list[CacheInputs]:
        """``fetch`` of the batch's sequences for one step: maxkv's per-device 4-tuples."""
        del max_cache_length, batch_characteristics
        if len(batches) != 1:
            raise ValueError("maxkv: data parallelism (several replica batches) is not supported")
        (batch,) = batches
        if not batch:
            return []
        inputs, _ = self.runtime_inputs_with_drafts(batch, [[] for _ in batch])
        return inputs

    def room(self, ctx: Any) -> int:
        """Cache positions the request may take past its pending tokens this step
        (speculative drafts): what ``max_seq_len`` leaves."""
        seq = self._seq(ctx)
        held = int(self.manager.cache_lengths[seq])
        return self.manager.max_seq_len - held - int(ctx.tokens.active_length)

    def runtime_inputs_with_drafts(
        self, batch: Sequence[Any], drafts: Sequence[Sequence[int]]
    ) -> tuple[list[CacheInputs], bool]:
        """:meth:`runtime_inputs` for a step whose requests append ``drafts`` after
        their pending tokens; the drafts' pages are reserved here.  Returns the
        inputs and whether the drafts fit: where the free pages do not hold
        them, the step's inputs are those without drafts (drafts never take
        pages another request needs)."""
        if self.blender is not None:
            self.blender.batch_ran()
        seqs = [self._seq(ctx) for ctx in batch]
        active = [c.tokens.active_length for c in batch]
        if any(drafts):
            try:
                extended = [n + len(d) for n, d in zip(active, drafts, strict=True)]
                return self.manager.fetch(seqs, 1, active_lengths=extended), True
            except CacheFullError:
                pass
        return self.manager.fetch(seqs, 1, active_lengths=active), not any(drafts)

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[Any]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: Any = None,
    ) -> tuple[CacheInputs, ...]:
        return tuple(self.runtime_inputs(batches))

    def step(self, ctx: Any) -> None:
        """Commits the tokens the request processed since the last ``step`` (with
        their ids, which prefix caching records)."""
        with self._lock:
            seq = self._seq(ctx)
            start = self._committed[ctx.request_id]
            end = ctx.tokens.processed_length
            if end < start:
                raise ValueError(
                    f"maxkv: request {ctx.request_id} went back from {start} to {end} tokens"
                )
            ids = {seq: ctx.tokens.all[start:end].tolist()} if self.manager.prefix_caching else None
            self.manager.step({seq: end - start}, tokens=ids)
            self._committed[ctx.request_id] = end
            if end >= ctx.tokens.prompt_length:
                self._prefilling.pop(ctx.request_id, None)
            if self.blender is not None:
                self.blender.after_step(ctx, self.manager, seq)

    def release(self, ctx: Any) -> None:
        """Frees the request's sequence (if it started one) and forgets the request."""
        with self._lock:
            if ctx.request_id not in self._seqs:
                raise ValueError(f"maxkv: request {ctx.request_id} is not claimed")
            seq = self._seqs.pop(ctx.request_id)
            del self._committed[ctx.request_id]
            self._forget(ctx.request_id)
            self._prefilling.pop(ctx.request_id, None)
            if self.blender is not None:
                self.blender.forget(ctx)
            if seq is not None:
                self.manager.release(seq)
                self._event("release", ctx, seq)

    def _forget(self, request_id: Any) -> None:
        """Forgets what the choices of a released request looked it up by."""
        self._ids.pop(str(request_id), None)
        self._prompts.pop(request_id, None)

    def contains(self, ctx: Any) -> bool:
        with self._lock:
            return ctx.request_id in self._seqs

    def seq_of(self, ctx: Any) -> int | None:
        """The maxkv sequence a request holds (``None`` before :meth:`alloc`)."""
        with self._lock:
            return self._seqs.get(ctx.request_id)

    def _seq(self, ctx: Any) -> int:
        seq = self._seqs.get(ctx.request_id)
        if seq is None:
            raise ValueError(f"maxkv: request {ctx.request_id} holds no sequence (alloc first)")
        return seq

    # ------------------------------------------------------------ occupancy

    def block_count(self, replica_idx: int = 0) -> Any:
        """Free and total pages (paged), or slots (contiguous)."""
        return BlockCount(free=self.free_units, total=self.total_units)

    @property
    def free_units(self) -> int:
        """Free pages (paged, cached ones included: they are evictable) or slots."""
        return self.manager.free_units

    @property
    def total_units(self) -> int:
        return self.manager.total_units

    def num_req_blocks(self, ctx: Any) -> int:
        return len(self.get_req_blocks_per_leaf(ctx)["0"])

    def get_req_blocks_per_leaf(self, ctx: Any) -> dict[str, list[int]]:
        seq = self.seq_of(ctx)
        return {"0": [] if seq is None else self.manager.units_held(seq)}

    @property
    def effective_max_seq_length(self) -> int | None:
        return self.manager.longest_sequence

    # -------------------------------------------------------- prefix caching

    def get_prefix_cache_hit_counts(self, ctx: Any) -> list[Any]:
        """The request's cached prefix now, in MAX's pages (no change to anything)."""
        if not self.manager.prefix_caching or len(ctx.tokens) < 2:
            return [PrefixCacheHits()]
        tokens = ctx.tokens.all.tolist()
        m = self.manager
        if m.prefix_block_size == self.params.page_size:  # maxkv's pages are MAX's
            device, tiers = m.prefix_hits(tokens, salt=ctx.cache_salt)
            return [PrefixCacheHits(device_blocks=device, external_blocks=tiers)]
        cached = m.cached_prefix_length(tokens, salt=ctx.cache_salt)
        return [PrefixCacheHits(device_blocks=cached // self.params.page_size)]

    def reset_prefix_cache(self) -> None:
        if self.manager.prefix_caching:
            self.manager.reset_prefix_cache()

    def take_metrics_aggregated(self) -> Any:
        """The metrics since the last call (MAX's scheduler logs them per batch), then zero."""
        with self._lock:
            metrics, self._metrics = self._metrics, KVCacheMetrics()
        if self.blender is not None:
            self.blender.log_counters()
        return metrics

    def get_metrics_aggregated(self) -> Any:
        return self._metrics

    # ------------------------------------------- transfers and KV tiers
    # maxkv's tiers copy on the calling thread (a GPU cache's pages through
    # pinned memory, waited for): no transfer is ever pending; their disk and
    # Redis writes run on the store's own thread.

    def alloc_dummy(self, ctx: Any, replica_idx: int = 0) -> None:
        raise NotImplementedError("maxkv: data-parallel padding requests are not supported")

    def host_byte_count(self) -> Any:
        return self._byte_count("host_byte_count")

    def disk_byte_count(self) -> Any:
        return self._byte_count("disk_byte_count")

    def _byte_count(self, which: str) -> Any:
        """The tiers' bytes of every page table (a hybrid cache's layer groups) together."""
        counts = [getattr(c, which) for c in getattr(self.manager, "connectors", ())]
        return ByteCount(free=sum(c.free for c in counts), total=sum(c.total for c in counts))

    def poll_transfers(self) -> None:
        pass

    def pending_transfers_exist(self, replica_idx: int = 0) -> bool:
        return False

    def shutdown(self) -> None:
        """Finishes the KV tiers' queued writes (Redis, disk) and stops their thread."""
        self.manager.close()
        if self.blender is not None:
            self.blender.close()
        if self.events is not None:
            self.events.close()

    def get_device_buffer(self, replica_idx: int) -> Any:
        raise NotImplementedError("maxkv: the cache is not a MAX KV buffer")

    # -------------------------------------------------------------- events

    def _event(self, event: str, ctx: Any, seq: int) -> None:
        if self._event_log:
            record = {
                "event": event,
                "request": str(ctx.request_id),
                "seq_id": seq,
                "free": self.free_units,
                "total": self.total_units,
                "cached_prefix": ctx.cached_prefix_length if event == "alloc" else None,
                "tokens": len(ctx.tokens),
                "time": time.time(),
            }
            with open(self._event_log, "a") as log:
                log.write(json.dumps(record) + "\n")
