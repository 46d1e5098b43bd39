"""CacheBlend inside MAX's pipelines (``max serve``, ``max generate``): RAG prompts
whose retrieved chunks are reused wherever they stand in the prompt.

Turned on per server by :data:`BLEND_ENV` (``MAXKV_BLEND=1``).  A request's
prompt (a completion's text, or a chat's rendered template) is split at the
separator (:data:`SEPARATOR_ENV`, LMCache's ``blend_special_str``, default
``" # # "``) into a *prefix* (the system prompt), *chunks* and a *suffix*
(the question and the template's tail); the separators are not part of the
model's input.  Where each piece sits in a request's life:

1. **Tokenizer** (API server, :func:`encode_pieces`): each piece is tokenized
   on its own, so a chunk has the same token ids wherever it stands, and the
   context carries where chunks and suffix start (:class:`MaxkvTextContext`).
2. **Admission** (model worker, the KV adapter's ``alloc``,
   :meth:`ServeBlender.begin`): prefix caching reuses what it can, as for any
   request; each chunk past it is looked up by its content hash (and the
   request's ``cache_salt``) in the chunk store: host memory, then the disk
   and Redis tiers of :mod:`maxkv.tiers` (blocks signed and checked as pages
   are).  When at least :data:`MIN_TOKENS_ENV` tokens are found, the prompt
   up to the suffix is prefilled by CacheBlend (:class:`~maxkv.blend.
   BlendedPrefill` with :class:`~maxkv.blend.CacheBlendExecutor`: every token
   at the layers before the check layer, then the found chunks' most
   deviating tokens (:data:`RECOMPUTE_RATIO_ENV`) and every token not found)
   and committed; the request then continues as if those tokens had come from
   the prefix cache: MAX's own step computes the suffix and decodes.
   Blended KV is approximate: its pages never enter the prefix cache
   (:meth:`~maxkv.PagedKVCacheManager.mark_blended`).
3. **Commit** (``step``, :meth:`ServeBlender.after_step`): once a chunk not
   found is in the cache, its K/V are read from the pages and stored under
   its hash, with the position it was computed at (re-rotated where it is
   reused).  A chunk is so computed once, in the context of the request that
   first used it (as LMCache stores segments), and every replica sharing the
   Redis tier finds it.  With :data:`CHUNK_CONTEXT_ENV` ``=none`` a chunk is
   instead computed alone when first seen, at admission, so that no request's
   text shapes the KV another request reuses.
4. **Release**: the request's pending records are dropped.

Requests without a separator, and every request when :data:`BLEND_ENV` is not
set, are served exactly as before (a separator is then ordinary text).
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from max.pipelines.context import TextContext
from max.pipelines.context.exceptions import InputError

from ... import settings
from ...blend import BlendedPrefill, ChunkKVStore
from ...blend.store import CacheBlendRetrieverTask, StoredKV
from ...cache.protocol import KVCacheManagerBase
from ...models.config import DecoderConfig
from ...tiers.store import TierConfig
from .context import MaxkvTextContext, maxkv_context

logger = logging.getLogger("max.pipelines.maxkv")

#: ``1`` turns blending on for a server (both of its processes read it).
BLEND_ENV = settings.BLEND.name
#: What separates the prefix, the chunks and the suffix of a prompt.
SEPARATOR_ENV = settings.BLEND_SEPARATOR.name
#: LMCache's default ``blend_special_str``.
DEFAULT_SEPARATOR = settings.BLEND_SEPARATOR.default
#: Share of each found chunk's tokens recomputed after the check layer (LMCache's
#: ``blend_recompute_ratios``).
RECOMPUTE_RATIO_ENV = settings.BLEND_RECOMPUTE_RATIO.name
DEFAULT_RECOMPUTE_RATIO = settings.BLEND_RECOMPUTE_RATIO.default
#: Comma-separated layers where the deviation is measured (``blend_check_layers``).
CHECK_LAYERS_ENV = settings.BLEND_CHECK_LAYERS.name
DEFAULT_CHECK_LAYERS = settings.BLEND_CHECK_LAYERS.default
#: Fewest found tokens that make a request blend (``blend_min_tokens``); below it
#: the prompt is prefilled as usual (and its chunks stored).
MIN_TOKENS_ENV = settings.BLEND_MIN_TOKENS.name
DEFAULT_MIN_TOKENS = settings.BLEND_MIN_TOKENS.default
#: Most requests blended while one batch is built; the others wait for the next
#: batch.  A blended prefill runs while MAX builds the batch, before the batch
#: (and every decode row in it) runs: blending a burst of requests one or two
#: per batch gives each its first token sooner than blending them all first.
MAX_PER_BATCH_ENV = settings.BLEND_MAX_PER_BATCH.name
DEFAULT_MAX_PER_BATCH = settings.BLEND_MAX_PER_BATCH.default
#: What a stored chunk's KV was computed after: ``request`` (default), the prefix
#: and earlier chunks of the first request that used it, read back from its pages
#: at no extra cost (as LMCache stores segments); ``none``, the chunk alone at
#: positions 0.. when first seen (an extra prefill of the chunk), so that its KV
#: depends on its own tokens only and no request's text shapes what another gets.
CHUNK_CONTEXT_ENV = settings.BLEND_CHUNK_CONTEXT.name
CHUNK_CONTEXTS = settings.BLEND_CHUNK_CONTEXTS


@dataclass(frozen=True)
class BlendConfig:
    """A server's blending settings (:meth:`from_env`)."""

    separator: str = DEFAULT_SEPARATOR
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    check_layers: tuple[int, ...] = DEFAULT_CHECK_LAYERS
    min_tokens: int = DEFAULT_MIN_TOKENS
    max_per_batch: int = DEFAULT_MAX_PER_BATCH
    chunk_context: str = CHUNK_CONTEXTS[0]

    def __post_init__(self) -> None:
        if not self.separator:
            raise ValueError(f"{SEPARATOR_ENV} is empty: give the string that separates chunks")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"{RECOMPUTE_RATIO_ENV}={self.recompute_ratio}: expected 0 to 1")
        if not self.check_layers or any(layer < 0 for layer in self.check_layers):
            raise ValueError(f"{CHECK_LAYERS_ENV}={self.check_layers}: expected layer ids >= 0")
        if self.min_tokens < 0:
            raise ValueError(f"{MIN_TOKENS_ENV}={self.min_tokens}: expected a number of tokens")
        if self.max_per_batch < 1:
            raise ValueError(f"{MAX_PER_BATCH_ENV}={self.max_per_batch}: expected 1 or more")
        if self.chunk_context not in CHUNK_CONTEXTS:
            raise ValueError(
                f"{CHUNK_CONTEXT_ENV}={self.chunk_context!r}: expected one of "
                + ", ".join(CHUNK_CONTEXTS)
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BlendConfig | None:
        """The settings :data:`BLEND_ENV` and its companions ask for; ``None`` when
        blending is off.

        Raises:
            ValueError: For a value that is not one of the variable's.
        """
        if not settings.BLEND.read(environ):
            return None
        return cls(
            separator=settings.BLEND_SEPARATOR.read(environ),
            recompute_ratio=settings.BLEND_RECOMPUTE_RATIO.read(environ),
            check_layers=settings.BLEND_CHECK_LAYERS.read(environ),
            min_tokens=settings.BLEND_MIN_TOKENS.read(environ),
            max_per_batch=settings.BLEND_MAX_PER_BATCH.read(environ),
            chunk_context=settings.BLEND_CHUNK_CONTEXT.read(environ),
        )


def with_blend_starts(context: TextContext, starts: list[int]) -> MaxkvTextContext:
    """``context`` as a :class:`MaxkvTextContext` carrying ``starts``."""
    return maxkv_context(context, blend_starts=list(starts))


#: The starts :func:`encode_pieces` found for the request being tokenized.
blend_starts_var: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "maxkv_blend_starts", default=None
)


def split_prompt(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator``: prefix, chunks, suffix (one piece: no separator).

    Raises:
        InputError: For an empty chunk (two separators with nothing but
            whitespace between) or nothing after the last separator.
    """
    pieces = text.split(separator)
    if len(pieces) == 1:
        return pieces
    for i, chunk in enumerate(pieces[1:-1], start=1):
        if not chunk.strip():
            raise InputError(
                f"chunk {i} of the prompt is empty: two blend separators ({separator!r}) "
                "with nothing between them"
            )
    if not pieces[-1].strip():
        raise InputError(
            f"the prompt ends with the blend separator ({separator!r}): put the question "
            "after the last chunk"
        )
    return pieces


def piece_starts(lengths: Sequence[int]) -> list[int]:
    """Where pieces 1.. start when pieces of ``lengths`` tokens are concatenated."""
    return [int(x) for x in np.cumsum(lengths)[:-1]]


def checked_starts(starts: object, prompt_length: int) -> list[int] | None:
    """``starts`` if they are increasing ints in ``[0, prompt_length)`` (at least a
    chunk and the suffix), else ``None``."""
    if not isinstance(starts, list) or len(starts) < 2:
        return None
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
        return None
    bounds = [*starts, prompt_length]
    if starts[0] < 0 or any(later <= earlier for earlier, later in itertools.pairwise(bounds)):
        return None
    return list(starts)


@dataclass
class BlendCounters:
    """What blending did since the last :meth:`ServeBlender.take_counters`."""

    requests: int = 0
    blended: int = 0
    chunk_lookups: int = 0
    chunk_hits: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    chunks_stored: int = 0
    stored_bytes: int = 0

    def __bool__(self) -> bool:
        return any(dataclasses.astuple(self))


@dataclass
class _Pending:
    """Chunks of a request to store once its cache holds them: (start, end, key)."""

    salt: str | None
    chunks: list[tuple[int, int, str]] = field(default_factory=list)


class ServeBlender:
    """Blended prefill and the chunk store of one model worker.

    Args:
        settings: The server's :class:`BlendConfig`.
        config: The model's configuration.
        weights: Its weights (Hugging Face names).
        session: The worker's session.
        device: Its device (the CPU).
        tiers: The KV tiers' configuration (host budget, disk, Redis, secret):
            chunks live in tiers of the same settings as the pages.
        manager: The worker's cache (the blended KV's writer is compiled for it
            here, not in a request's time).
    """

    def __init__(
        self,
        settings: BlendConfig,
        config: DecoderConfig,
        weights: Mapping[str, np.ndarray],
        session: Any,
        device: Any,
        tiers: TierConfig,
        manager: KVCacheManagerBase,
    ) -> None:
        for layer in settings.check_layers:
            if layer >= config.num_hidden_layers:
                raise ValueError(
                    f"MAXKV_BLEND_CHECK_LAYERS: layer {layer}, but the model has "
                    f"{config.num_hidden_layers}"
                )
        self.settings = settings
        self.prefill = BlendedPrefill(config, weights, session, device)
        self.store = ChunkKVStore(self.prefill, tiers=tiers)
        self.prefill.graphs.writer(manager)
        self._counters = BlendCounters()
        self._pending: dict[Any, _Pending] = {}
        #: Requests blended since the last batch ran (:meth:`batch_ran`) and still held.
        self._blended_in_batch: set[Any] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ admission

    def batch_full(self, ctx: Any) -> bool:
        """Whether a request with chunks waits for the next batch: the batch being
        built holds :attr:`BlendConfig.max_per_batch` blended requests already.
        (They are in it: a request MAX hands back instead is released, and
        :meth:`forget` drops it.  So the batch is not empty, and MAX requeues the
        request rather than failing.)"""
        if getattr(ctx, "blend_starts", None) is None:
            return False
        with self._lock:
            return len(self._blended_in_batch) >= self.settings.max_per_batch

    def batch_ran(self) -> None:
        """A batch is about to run (its inputs are being built): the next batch
        may blend again."""
        with self._lock:
            self._blended_in_batch.clear()

    def computing(self, ctx: Any) -> Any | None:
        """Before a request starts: another request (its id) that is computing one of
        this request's chunks no tier holds yet, or ``None``.  The caller defers
        the request a batch, after which it blends that chunk instead of computing
        it a second time (a burst of requests over new chunks computes each once)."""
        starts = checked_starts(getattr(ctx, "blend_starts", None), ctx.tokens.prompt_length)
        if starts is None:
            return None
        with self._lock:
            owners = {
                key: rid
                for rid, pending in self._pending.items()
                if rid != ctx.request_id
                for _, _, key in pending.chunks
            }
        if not owners:
            return None
        ids = np.asarray(ctx.tokens.all[: starts[-1]], dtype=np.int64)
        for a, b in itertools.pairwise(starts):
            key = self.store.key(ids[a:b], salt=ctx.cache_salt)
            if key in owners and bytes.fromhex(key) not in self.store.tiers.host:
                return owners[key]
        return None

    def begin(self, ctx: Any, manager: KVCacheManagerBase, seq: int, cached: int) -> int:
        """At a request's first ``alloc``, after its pages are reserved: blends its
        prompt up to the suffix into ``seq`` (which holds its ``cached`` prefix)
        when enough of its chunks are found, and records the chunks to store.

        Returns:
            Tokens written past ``cached`` (0: none; the caller commits them and
            skips them as it skips a cached prefix).
        """
        starts = checked_starts(getattr(ctx, "blend_starts", None), ctx.tokens.prompt_length)
        if starts is None:
            if getattr(ctx, "blend_starts", None) is not None:
                logger.warning("maxkv blend: request %s: malformed chunk starts", ctx.request_id)
            return 0
        salt = ctx.cache_salt
        suffix = starts[-1]
        tokens = np.asarray(ctx.tokens.all[:suffix], dtype=np.int64)
        found: list[tuple[int, int, StoredKV]] = []
        pending = _Pending(salt)
        for a, b in itertools.pairwise(starts):
            key = self.store.key(tokens[a:b], salt=salt)
            kv = self.store.get(key, tenant=salt, tokens=b - a)  # checked, or None
            if kv is None:
                pending.chunks.append((a, b, key))
            elif b > cached:
                found.append((a, b, kv))
        with self._lock:
            c = self._counters
            c.requests += 1
            c.chunk_lookups += len(starts) - 1
            c.chunk_hits += len(starts) - 1 - len(pending.chunks)
        if self.settings.chunk_context == "none" and pending.chunks:
            try:
                found += self._store_alone(tokens, pending, cached)
            except Exception:  # prefilled as usual; nothing stored
                logger.exception("maxkv blend: request %s: storing chunks failed", ctx.request_id)
                return 0
        if pending.chunks:
            with self._lock:
                self._pending[ctx.request_id] = pending
        reused = sum(b - max(a, cached) for a, b, _ in found)
        if cached >= suffix or not found or reused < self.settings.min_tokens:
            return 0
        try:
            recomputed = self._blend(tokens, found, manager, seq, cached)
        except Exception:  # the request is then prefilled as usual, from ``cached``
            logger.exception("maxkv blend: request %s: blending failed", ctx.request_id)
            return 0
        with self._lock:
            self._blended_in_batch.add(ctx.request_id)
            c = self._counters
            c.blended += 1
            c.reused_tokens += reused
            c.recomputed_tokens += recomputed
        logger.debug(
            "maxkv blend: request %s: %d of %d chunks found, %d tokens reused, %d of %d "
            "recomputed past layer %d",
            ctx.request_id,
            len(found),
            len(starts) - 1,
            reused,
            recomputed,
            suffix - cached,
            self.settings.check_layers[0],
        )
        return suffix - cached

    def _store_alone(
        self, tokens: np.ndarray, pending: _Pending, cached: int
    ) -> list[tuple[int, int, StoredKV]]:
        """``MAXKV_BLEND_CHUNK_CONTEXT=none``: computes and stores each pending chunk
        alone (positions 0..); returns those past ``cached``, found now."""
        found: list[tuple[int, int, StoredKV]] = []
        stored = 0
        for a, b, key in pending.chunks:
            k, v = self.prefill.kv(tokens[a:b])
            self.store.put(key, k, v, 0, tenant=pending.salt)
            stored += int(k.nbytes + v.nbytes)
            if b > cached:
                found.append((a, b, (k, v, 0)))
        with self._lock:
            self._counters.chunks_stored += len(pending.chunks)
            self._counters.stored_bytes += stored
        pending.chunks = []
        return found

    def _blend(
        self,
        tokens: np.ndarray,
        found: list[tuple[int, int, StoredKV]],
        manager: KVCacheManagerBase,
        seq: int,
        cached: int,
    ) -> int:
        """Writes the blended KV of ``tokens[cached:]``; returns the tokens computed
        at the last layer."""
        segments: list[tuple[int, int, StoredKV | None]] = []
        for a, b, (k, v, origin) in found:
            skip = max(cached - a, 0)  # the part the prefix cache holds already
            kept = (k[:, skip:], v[:, skip:], origin + skip)
            segments.append((a + skip - cached, b - a - skip, kept))
        task = CacheBlendRetrieverTask(segments, len(tokens) - cached)
        executor = self.prefill.executor(self.settings.recompute_ratio, self.settings.check_layers)
        self.prefill.write(tokens, task, executor, manager, seq, start=cached)
        manager.mark_blended(seq, min(max(a, cached) for a, _, _ in found))
        computed = self.prefill.tokens_per_layer
        return computed[-1] if computed else 0

    # ------------------------------------------------------------- commit

    def after_step(self, ctx: Any, manager: KVCacheManagerBase, seq: int) -> None:
        """Stores the request's chunks that were not found once its cache holds them."""
        with self._lock:
            pending = self._pending.get(ctx.request_id)
        if pending is None:
            return
        held = int(manager.cache_lengths[seq])
        ready = [chunk for chunk in pending.chunks if chunk[1] <= held]
        if not ready:
            return
        stored, nbytes = 0, 0
        try:
            for a, b, key in ready:
                kv = manager.read_tokens(seq, a, b).astype(np.float32, copy=False)
                self.store.put(key, kv[0], kv[1], a, tenant=pending.salt)
                stored, nbytes = stored + 1, nbytes + int(kv.nbytes)
        except Exception:  # the chunks are computed again by a later request
            logger.exception("maxkv blend: request %s: storing chunks failed", ctx.request_id)
        with self._lock:
            pending.chunks = [c for c in pending.chunks if c not in ready]
            if not pending.chunks:
                self._pending.pop(ctx.request_id, None)
            self._counters.chunks_stored += stored
            self._counters.stored_bytes += nbytes

    def forget(self, ctx: Any) -> None:
        """The request ended (or MAX handed it back): its chunks still pending are
        not stored, and it no longer counts in the batch being built."""
        with self._lock:
            self._pending.pop(ctx.request_id, None)
            self._blended_in_batch.discard(ctx.request_id)

    # ------------------------------------------------------------- metrics

    def take_counters(self) -> BlendCounters:
        """The counters since the last call, then zero."""
        with self._lock:
            counters, self._counters = self._counters, BlendCounters()
        return counters

    def log_counters(self) -> None:
        """Logs what blending did since the last call (MAX's scheduler takes the KV
        metrics once per batch: this line follows its batch line), if anything."""
        c = self.take_counters()
        if not c:
            return
        stats = self.store.tiers.stats
        logger.info(
            "maxkv blend: %d requests with chunks, %d blended | chunk lookups %d, hits %d "
            "| tokens reused %d, recomputed %d | chunks stored %d (%.1f MiB) | store: "
            "%d in host memory, hits host %d / disk %d / redis %d",
            c.requests,
            c.blended,
            c.chunk_lookups,
            c.chunk_hits,
            c.reused_tokens,
            c.recomputed_tokens,
            c.chunks_stored,
            c.stored_bytes / 2**20,
            len(self.store),
            stats.host_hits,
            stats.disk_hits,
            stats.redis_hits,
        )

    def describe(self) -> str:
        s = self.settings
        return (
            f"CacheBlend on: separator {s.separator!r}, recompute ratio {s.recompute_ratio}, "
            f"check layers {','.join(map(str, s.check_layers))}, at least {s.min_tokens} "
            f"found tokens, {s.max_per_batch} per batch; chunks stored as computed "
            + ("in the first request that used them" if s.chunk_context == "request" else "alone")
            + f"; chunk store {self.store.tiers.security}"
        )

    def close(self) -> None:
        self.store.close()
