"""The paged KV cache manager: pages of ``page_size`` tokens, TVM's design (seed 004).

Every sequence holds a list of pages (its row of the page table); a page is
``[2, num_layers, page_size, n_kv_heads_per_device, head_dim]`` of one
``[num_pages, ...]`` buffer per device.  The step protocol is the one in
:mod:`maxkv.cache.protocol` (TVM's steps 1 to 4), shared with
:class:`~maxkv.ContinuousBatchingKVCacheManager`; a model moves from
contiguous to paged by changing the manager, not the graph code.  Where each
public method sits in that protocol:

1. ``claim`` / ``external_claim``: a sequence id, no pages yet.
2. ``fetch``: reserves the pages of all ``num_steps`` steps up front (TVM's
   ReserveExtraLengthForAppend), copying first any shared page the step will
   write into (copy-on-write), then builds the 4-tuple per device
   ``(pages, cache_lengths, page_table, max_lengths)``.  Out of pages:
   ``ValueError`` before any change.
3. The graph runs; ``increment_cache_lengths`` advances lengths on the
   device: the pages were reserved in step 2, so no allocation happens.
4. ``step`` commits tokens; ``release`` frees the sequence and drops its
   hold on each page.

Between rounds: ``fork(parent, fork_pos)`` shares the parent's full pages
(reference counts) and copies only the tokens of its partial last page into
one new page; ``pop_n`` drops tokens and frees the pages that become empty.
:attr:`PagedKVCacheManager.free_pages` is exact at every moment.

Prefix caching by page sharing (``enable_prefix_caching=True``, vLLM's and
MAX's scheme): when ``step`` commits the token ids that fill a page, the page
is registered under the chained hash of its tokens (the parent page's hash,
and a per-sequence salt before the first page).  ``claim_prefix(prompt,
salt=...)`` (step 1) maps the prompt to the longest run of registered pages
and shares them, without a copy.  A registered page is read-only: a sequence
that would write into it (after ``pop_n``) copies it first.  When its last
holder lets go it stays registered, and findable, until a new allocation
evicts it (least recently freed first, after every page without content).

KV tiers (``tiers=TierConfig(...)``, with prefix caching; on a GPU cache the
pages are copied through pinned host memory, :class:`~maxkv.tiers.connector.PageBuffers`): every
page ``step`` registers is offloaded, under its hash, to the host tier at
once and to the disk and Redis tiers by a background writer
(:mod:`maxkv.tiers`, MAX's ``KVConnector`` protocol).  ``claim_prefix``
continues past the pages found on the device with the blocks a tier holds,
loading them into fresh pages instead of recomputing them; a block that is
gone or fails its check ends the reused prefix there.

Sliding windows (``sliding_window=w``: every layer of the model attends to
at most its last ``w`` tokens): when ``step`` commits tokens, the pages
wholly before the first position a later token can attend to
(``length - w + 1``) go back to the pool, or to the prefix cache's queue if
registered (:class:`~maxkv.cache.window.PageWindow`); a sequence then holds
at most ``1 + ceil((w - 1) / page_size)`` pages while it decodes, however
long it runs.  Its page-table row keeps ``UNUSED_PAGE`` where pages were
given back (the graph inputs point those entries at a page it holds: the
window's mask keeps the kernels from using them).  ``claim_prefix`` reuses a
prefix whose early pages are gone when the pages of its last ``w - 1``
tokens are still cached (vLLM's sliding-window hit rule); ``fork`` and
``pop_n`` refuse a position whose window would reach a page given back;
``swap_out`` and the tiers store the pages still held.

Attention sinks (TVM's ``EnableSlidingWindowForSeq``, StreamingLLM), per
sequence, between rounds: ``enable_attention_sinks(seq_id, window, sink)``
keeps the sequence's first ``sink`` tokens (in whole pages) and at least its
last ``window``; when ``step`` commits tokens past that, whole pages of the
oldest window tokens are dropped and the sequence's positions become places
in the cache, as StreamingLLM and TVM number them: the keys after the
dropped pages are rotated back by as many positions
(:class:`~maxkv.cache.rotation.KeyRotation`, given to the manager), and the
committed length the graph sees is what the cache holds.  Such a sequence
runs on past ``max_seq_len`` and the model's context with a cache that
never grows.

Preemption by swap, between rounds: ``swap_out`` copies a sequence's pages to
host memory (a ``swap_bytes`` budget) and releases them; ``swap_in`` claims a
sequence again with the same tokens, sharing the pages the device still has
cached and writing the others back, so nothing is recomputed.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from max.driver import Device
from max.dtype import DType
from max.engine import InferenceSession

from ..errors import ArgumentTypeError, CacheFullError
from ..events.log import EventSink, KVEventLog
from ..tiers.blocks import BlockLayout
from ..tiers.remote import redact_url
from ..tiers.store import TierConfig, TieredBlockStore
from ..validation import require_int
from .page_table import UNUSED_PAGE, PageTable, Prefix, held_runs
from .params import KVCacheParams
from .prefix import block_hashes, root_hash
from .protocol import (
    CacheCapabilities,
    CacheDevice,
    KVCacheManagerBase,
    validate_sizes,
)
from .rotation import KeyRotation
from .spec import CacheInputs, CacheSpec, kv_block_shape
from .window import PageWindow

if TYPE_CHECKING:
    from ..tiers.connector import TieredConnector

logger = logging.getLogger("maxkv.tiers")

__all__ = ["UNUSED_PAGE", "PagedKVCacheManager", "SwappedSequence"]

_swap_numbers = itertools.count()


@dataclass(frozen=True, eq=False)
class SwappedSequence:
    """A sequence :meth:`PagedKVCacheManager.swap_out` moved to host memory.

    Hand it to :meth:`PagedKVCacheManager.swap_in` (once) to continue it.
    """

    #: Committed tokens.
    length: int
    #: Its pages still held, ``[pages, devices, 2, num_layers, page_size, heads,
    #: head_dim]``, the first being page ``first_page`` of the sequence.
    blocks: np.ndarray = field(repr=False)
    #: A copy of its record as it was (its pages are ``blocks``).
    state: _Sequence = field(default_factory=lambda: _Sequence(), repr=False)
    #: The pages before this one were given back (sliding window).
    first_page: int = 0
    #: A cache of several page tables (:class:`~maxkv.HybridKVCacheManager`): one
    #: part per table, with that table's pages; its own ``blocks`` are then empty.
    groups: tuple[SwappedSequence, ...] = field(default=(), repr=False)
    number: int = field(default_factory=lambda: next(_swap_numbers))

    @property
    def nbytes(self) -> int:
        """Host memory it takes."""
        return int(self.blocks.nbytes) + sum(group.nbytes for group in self.groups)


@dataclass
class _Sinks:
    """A sequence with attention sinks: its first ``sink_pages`` pages, and at least
    its last ``window`` tokens; ``evicted`` tokens were dropped between them."""

    window: int
    sink_pages: int
    evicted: int = 0


@dataclass
class _Sequence:
    """One sequence's record in a paged cache (TVM's ``Sequence``): everything the
    cache keeps of it besides its committed length (the protocol's) and its pages
    (its row of each page table, :class:`~maxkv.cache.page_table.PageTable`).  A
    per-sequence feature is a field here; claim makes a fresh record, fork takes the
    parent's up to the fork, swap keeps a copy beside the page contents, release
    drops it."""

    #: Prefix caching: its committed token ids, its tenant's salt and the hashes of
    #: its full pages (empty without prefix caching).
    tokens: list[int] = field(default_factory=list)
    salt: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    #: Its attention sinks (:meth:`PagedKVCacheManager.enable_attention_sinks`).
    sinks: _Sinks | None = None
    #: Its KV is blended (CacheBlend: reused from elsewhere) from this position on
    #: (:meth:`PagedKVCacheManager.mark_blended`).
    blended_from: int | None = None

    def copy(self) -> _Sequence:
        """A deep copy (lists and sink state not shared)."""
        return _Sequence(
            list(self.tokens),
            self.salt,
            list(self.hashes),
            None if self.sinks is None else replace(self.sinks),
            self.blended_from,
        )


class PagedKVCacheManager(KVCacheManagerBase):
    """Owns the pages and which sequence holds which.

    Args:
        params: Dtype and head layout of the cache.
        page_size: Tokens per page.
        num_pages: Pages in the cache (all sequences together).
        max_batch_size: Sequence ids, ``[0, max_batch_size)``.
        max_seq_len: Most tokens one sequence can hold; the page table has
            ``ceil(max_seq_len / page_size)`` columns.
        num_layers: Transformer layers cached per page.
        devices: One device per ``params.n_devices``.
        session: The session that runs the model; compiles the increment
            and copy graphs (``None`` only with a ``cache_device``).
        enable_prefix_caching: Register full pages under the hash of their
            tokens and share them with later prompts (:meth:`claim_prefix`);
            :meth:`step` then needs the committed token ids.  Sharing needs
            no copy; a copy-on-write (after ``pop_n`` into a registered page)
            copies one page on the cache's device.
        cache_device: The device work (zero fill, increments, copies);
            default MAX's (:class:`~maxkv.cache.device.MaxCacheDevice`).
        tiers: KV tiers beyond the device (:class:`~maxkv.tiers.TierConfig`:
            host memory, disk, Redis; needs prefix caching),
            and the swap space budget.  ``None``: no tiers, and swap space
            of ``TierConfig().swap_bytes``.  Call :meth:`close` when done.
        sliding_window: The model's layers all attend to at most this many
            tokens (themselves included): pages wholly before every layer's
            window are given back as tokens are committed.  ``None`` (the
            default; also for a model where any layer attends to every
            token): pages are kept until the sequence is released.
        key_rotation: The model's RoPE (:class:`~maxkv.cache.rotation.KeyRotation`,
            e.g. ``DecoderConfig.key_rotation()``), which
            :meth:`enable_attention_sinks` needs to move keys to new positions.

    Raises:
        ArgumentTypeError: If an argument has the wrong type.
        ValueError: If a size is not positive, the number of devices
            differs from ``params.n_devices``, or tiers are asked for without
            prefix caching.
    """

    capabilities = CacheCapabilities(
        pages=True, swap=True, sinks=True, blending=True, tiers=True, events=True
    )

    def __init__(
        self,
        params: KVCacheParams,
        page_size: int,
        num_pages: int,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession | None,
        *,
        enable_prefix_caching: bool = False,
        cache_device: CacheDevice | None = None,
        tiers: TierConfig | None = None,
        sliding_window: int | None = None,
        key_rotation: KeyRotation | None = None,
    ) -> None:
        page_size = require_int("page_size", page_size, 1)
        if key_rotation is not None and not isinstance(key_rotation, KeyRotation):
            raise ArgumentTypeError(
                f"key_rotation must be a KeyRotation, got {type(key_rotation).__name__}"
            )
        if key_rotation is not None and key_rotation.num_layers != num_layers:
            raise ValueError(
                f"key_rotation has {key_rotation.num_layers} layers; the cache {num_layers}"
            )
        if key_rotation is not None and params.cache_dtype not in (DType.float32, DType.float16):
            raise ValueError(
                f"attention sinks rotate cached keys in NumPy, as values: keep the cache in "
                f"float16 or float32, not {params.encoding}"
            )
        PageWindow(sliding_window, page_size)  # checks the window before any allocation
        _check_tiers(tiers, enable_prefix_caching)
        super().__init__(
            CacheSpec(params, num_layers, "paged", page_size),
            max_batch_size,
            max_seq_len,
            devices,
            session,
            cache_device,
        )
        spec = self.spec
        assert isinstance(spec, CacheSpec)
        num_pages = _check_num_pages(num_pages)
        table = PageTable(
            spec,
            num_pages,
            self.max_seq_len,
            sliding_window,
            self.devices,
            self.cache_device,
            tiers,
        )
        self._set_up(page_size, [table], enable_prefix_caching, tiers, key_rotation)

    def _set_up(
        self,
        page_size: int,
        tables: list[PageTable],
        enable_prefix_caching: bool,
        tiers: TierConfig | None,
        key_rotation: KeyRotation | None = None,
    ) -> None:
        """The manager's state over its page ``tables`` (after the base's ``__init__``)."""
        self.page_size = page_size
        #: The page tables: one, or one per layer group (:class:`HybridKVCacheManager`).
        self.groups: list[PageTable] = tables
        #: The first table (the only one of a plain paged cache).
        self.table = tables[0]
        #: Which pages a sequence keeps, in the first table (every page without a
        #: sliding window).
        self.window = self.table.window
        self._pool = self.table.pool
        self._pages = self.table.buffers
        self.num_pages = sum(t.num_pages for t in tables)
        self.max_pages_per_seq = math.ceil(self.max_seq_len / self.page_size)
        self._free_seq_ids: set[int] = set(range(self.max_batch_size))
        #: Each claimed sequence's record.
        self._seqs: dict[int, _Sequence] = {}
        self._rotation = key_rotation
        self._prefix_caching = bool(enable_prefix_caching)
        self._tier_config = tiers if tiers is not None else TierConfig()
        self._swapped: dict[int, int] = {}  # live SwappedSequence.number -> bytes

    # ------------------------------------------------------------------ sizes

    def pages_shape(self, num_pages: int) -> list[int]:
        """Shape of one device's pages buffer: ``[num_pages, 2, num_layers,
        page_size, n_kv_heads_per_device, head_width]`` (axis 1: 0 keys, 1 values)."""
        return self.table.spec.allocated_shape(require_int("num_pages", num_pages, 1))

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        page_size: int,
        num_pages: int,
        num_layers: int,
        devices: Sequence[Device],
    ) -> int:
        """Bytes the pages take on all devices together (before allocating them)."""
        validate_sizes(params, 1, 1, num_layers, devices)
        require_int("page_size", page_size, 1)
        require_int("num_pages", num_pages, 1)
        return num_pages * page_size * params.token_bytes(num_layers) * len(devices)

    @property
    def copies_supported(self) -> bool:
        return all(t.cache_device.copies_supported for t in self.groups)

    def warm_up(self) -> None:
        for table in self.groups:
            table.cache_device.warm_up()

    def nbytes(self) -> int:
        """Bytes the pages of every table take on all devices."""
        return sum(t.nbytes_per_page * t.num_pages for t in self.groups)

    # ------------------------------------------------------------ page state

    @property
    def nbytes_per_page(self) -> int:
        """Bytes one page takes on all devices together (of the first table)."""
        return self.table.nbytes_per_page

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's: the sliding window pages are given back by (or ``None``)."""
        return (self.window.window,) * self.num_layers

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds, of every table (exact at every moment)."""
        with self._lock:
            return sum(t.pool.free_count for t in self.groups)

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """The pages ``seq_id`` holds, in token order (its page-table row), with
        :data:`UNUSED_PAGE` in place of the pages it gave back (sliding window);
        of the first table where there are several (:meth:`group_pages`: every one).

        Raises:
            ValueError: If ``seq_id`` is not claimed.
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            return self.table.pages(seq)

    def group_pages(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """Per table (layer group), ``seq_id``'s page-table row (see :meth:`pages`)."""
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            return tuple(t.pages(seq) for t in self.groups)

    def held_bytes(self, seq_id: int) -> int:
        """Bytes of the pages ``seq_id`` holds in every table."""
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            return sum(len(t.rows[seq].held) * t.nbytes_per_page for t in self.groups)

    def page_refcount(self, page: int) -> int:
        """How many sequences hold ``page`` of the first table (0: free)."""
        with self._lock:
            if not 0 <= page < self.table.num_pages:
                raise ValueError(f"page {page} is out of range [0, {self.table.num_pages})")
            return self._pool.refcount(page)

    def page_is_cached(self, page: int) -> bool:
        """Whether ``page`` of the first table is registered in the prefix cache (and
        so read-only)."""
        with self._lock:
            if not 0 <= page < self.table.num_pages:
                raise ValueError(f"page {page} is out of range [0, {self.table.num_pages})")
            return self._pool.is_cached(page)

    def read_tokens(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """A copy of the K and V of ``seq_id``'s committed tokens ``[start, end)``
        (capability ``blending``).

        Between rounds; the cache must be in host memory (a CPU cache) in a
        float encoding (float32 or float16, whose values NumPy reads as they are).

        Returns:
            ``[2, num_layers, end - start, n_kv_heads, head_dim]`` (axis 0: keys,
            values) in the cache's dtype, from device 0.

        Raises:
            ValueError: For a range outside the committed tokens, a page given
                back (sliding window), a cache off the host or a quantized one.
        """
        if not self.capabilities.blending:
            self._unsupported("blending", "read_tokens")
        if self.params.cache_dtype not in (DType.float32, DType.float16):
            raise ValueError(f"read_tokens reads float caches, not {self.params.encoding}")
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            length = int(self._lengths[seq])
            if not 0 <= start <= end <= length:
                raise ValueError(
                    f"tokens [{start}, {end}) are outside seq_id {seq}'s {length} committed"
                )
            pages = self.table.rows[seq].pages
            buffer = self._pages[0]
            if not buffer.is_host:
                raise ValueError("read_tokens needs the pages in host memory (a CPU cache)")
            view = buffer.to_numpy()
            rows = []
            for first in range(start - start % self.page_size, end, self.page_size):
                page = pages[first // self.page_size]
                if page == UNUSED_PAGE:
                    raise ValueError(f"seq_id {seq} gave back the page of token {first}")
                lo, hi = max(start, first) - first, min(end, first + self.page_size) - first
                rows.append(view[page, :, :, lo:hi])
            if not rows:
                heads, width = self.pages_shape(1)[4:]
                return np.zeros(kv_block_shape(self.num_layers, 0, heads, width), view.dtype)
            return np.concatenate(rows, axis=2)

    def blended_position(self, seq_id: int) -> int | None:
        """Where ``seq_id``'s blended KV starts (:meth:`mark_blended`), or
        ``None`` when all of it is exact."""
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            return self._seqs[seq].blended_from

    def mark_blended(self, seq_id: int, position: int) -> None:
        """Marks ``seq_id``'s KV from ``position`` on as approximate (a CacheBlend
        prefill reused it from elsewhere): pages holding any of it are never
        registered in the prefix cache, so no other prompt takes them for the
        exact KV of their tokens.  Pages wholly before ``position`` are
        registered as usual.  Call it before the commit of those tokens
        (capability ``blending``).

        Raises:
            ValueError: If ``seq_id`` is not claimed or ``position`` is negative.
        """
        if not self.capabilities.blending:
            self._unsupported("blending", "mark_blended")
        position = require_int("position", position, 0)
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            current = self._seqs[seq].blended_from
            self._seqs[seq].blended_from = position if current is None else min(current, position)

    # ------------------------------------------------------------ occupancy

    @property
    def _bounding(self) -> PageTable:
        """The table whose pages bound how many tokens fit: the full-attention one
        (the smallest when every table slides).  Its pages are the cache's units."""
        full = [t for t in self.groups if not t.window.slides]
        return min(full or self.groups, key=lambda t: t.num_pages)

    def units_for(self, tokens: int) -> int:
        """Pages a sequence of ``tokens`` tokens holds at most in the bounding table:
        all of them while a step computes them at once (with a sliding window, fewer
        once committed: :meth:`PageWindow.live_pages
        <maxkv.cache.window.PageWindow.live_pages>`)."""
        return self._pages_for(tokens)

    def _pages_for(self, tokens: int) -> int:
        return self.table.pages_for(tokens)

    @property
    def free_units(self) -> int:
        """Free pages of the bounding table (cached ones included: evictable)."""
        return self._bounding.free_pages

    @property
    def total_units(self) -> int:
        """Pages of the bounding table."""
        return self._bounding.num_pages

    def units_held(self, seq_id: int) -> list[int]:
        """The pages ``seq_id`` holds in the bounding table (those its window gave back
        left out; :meth:`group_pages` has every table's)."""
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            return list(self._bounding.rows[seq].held)

    @property
    def longest_sequence(self) -> int:
        """``max_seq_len``, or the tokens a full-attention table's pages hold if fewer
        (sliding tables give pages back as they go: then any length)."""
        full = [t.num_pages for t in self.groups if not t.window.slides]
        return min([self.max_seq_len, *(n * self.page_size for n in full)])

    def describe(self) -> str:
        """``paged cache: N pages of T tokens (M MiB, E KV), ...``: pages, size,
        encoding, the window's pages given back, prefix caching, the KV tiers."""
        size = self.estimated_memory_size(
            self.params, self.page_size, self.num_pages, self.num_layers, self.devices
        )
        prefix = "prefix caching on" if self.prefix_caching else "prefix caching off"
        where = self._describe_tiers()
        window = self.window.window
        given_back = "" if window is None else f", pages before its {window}-token window freed"
        return (
            f"paged cache: {self.num_pages} pages of {self.page_size} tokens "
            f"({size / 2**20:.1f} MiB, {self.params.encoding} KV){given_back}, {prefix}{where}"
        )

    def _describe_tiers(self) -> str:
        """``, KV tiers: host ..., disk ..., Redis ...`` (empty without tiers)."""
        tiers = self.table.tiers
        if tiers is None:
            return ""
        c = tiers.config
        parts = [f"host {c.host_bytes / 2**30:.1f} GiB"]
        if c.disk_dir is not None:
            parts.append(f"disk {c.disk_bytes / 2**30:.1f} GiB in {c.disk_dir}")
        if c.redis_url is not None:
            parts.append(f"Redis {redact_url(c.redis_url)}")
        if c.disk_dir is not None or c.redis_url is not None:
            parts.append(tiers.security)
        return ", KV tiers: " + ", ".join(parts)

    # ------------------------------------------------------ prefix caching

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching by page sharing is on."""
        return self._prefix_caching

    @property
    def prefix_block_size(self) -> int:
        """A prefix is reused in whole pages."""
        self._require_prefix_caching("prefix_block_size")
        return self.page_size

    def _lookup(self, tokens: list[int], salt: str | None) -> tuple[list[bytes], list[_Found]]:
        """The hashes of the full pages of ``tokens[:-1]`` (hashed once), and per table
        the device page registered under each and its runs (:meth:`PageTable.lookup`)."""
        hashes = block_hashes(tokens[:-1], self.page_size, root_hash(salt))
        return hashes, [t.lookup(hashes) for t in self.groups]

    def _prefix_plan(
        self, tokens: list[int], salt: str | None, *, tiers: bool = True
    ) -> tuple[int, list[Prefix]]:
        """The most pages of ``tokens[:-1]`` a claim can reuse now in every table (from
        the devices, then from the KV tiers unless not ``tiers``), and each table's
        plan for them."""
        return self._longest(*self._lookup(tokens, salt), tiers=tiers)

    def _longest(
        self, hashes: list[bytes], looks: list[_Found], *, tiers: bool
    ) -> tuple[int, list[Prefix]]:
        """:meth:`_prefix_plan` over :meth:`_lookup`'s answer: the longest ``m`` that
        every table's layers get what they need of (:meth:`PageTable.prefix_fits`)."""
        runs = [
            held_runs(t.held(hashes, found)) if tiers else device_runs
            for t, (found, device_runs) in zip(self.groups, looks, strict=True)
        ]
        for m in range(len(hashes), 0, -1):
            if all(t.prefix_fits(r, m) for t, r in zip(self.groups, runs, strict=True)):
                plans = [
                    t.prefix_at(hashes, found, r, m)
                    for t, (found, _), r in zip(self.groups, looks, runs, strict=True)
                ]
                return m, [plan for plan in plans if plan is not None]
        return 0, [Prefix(0, [], hashes, 0) for _ in self.groups]

    def pages_to_claim(self, prompt: Sequence[int], *, salt: str | None = None) -> int:
        """Free pages of every table :meth:`claim_prefix` and a first step over all of
        ``prompt`` would take now: its pages, less the cached ones other sequences
        hold and those before a window (free cached pages and pages loaded from the
        tiers come from the free pages too)."""
        with self._lock:
            tokens = self._prompt(prompt)
            plans = [Prefix(0, [], [], 0) for _ in self.groups]
            if self._prefix_caching:
                _, plans = self._prefix_plan(tokens, salt, tiers=False)
            return sum(
                t.pages_for(len(tokens))
                - plan.start
                - sum(1 for p in plan.pages if t.pool.refcount(p) > 0)
                for t, plan in zip(self.groups, plans, strict=True)
            )

    @property
    def host_pages(self) -> bool:
        """Whether the pages are in host memory (a CPU cache: attention sinks rotate keys
        there; tiers and swap copy a GPU cache's pages through staging memory)."""
        return all(b.is_host for t in self.groups for b in t.buffers)

    def prefix_hits(self, prompt: Sequence[int], *, salt: str | None = None) -> tuple[int, int]:
        """Pages of ``prompt``'s prefix :meth:`claim_prefix` would reuse now: ``(on the
        device, then from the KV tiers)`` (no change; MAX's ``PrefixCacheHits``).  The
        pages before a sliding window, which a claim does not need, count as on the
        device."""
        with self._lock:
            self._require_prefix_caching("prefix_hits")
            hashes, looks = self._lookup(self._prompt(prompt), salt)  # hashed once
            on_device, _ = self._longest(hashes, looks, tiers=False)
            reused, _ = self._longest(hashes, looks, tiers=True)
            return on_device, max(0, reused - on_device)

    def prefetch(self, prompt: Sequence[int], *, salt: str | None = None) -> None:
        """A request arrived: the blocks of its prefix that only the disk or Redis tier
        holds start coming into host memory, on the tiers' thread, so that
        :meth:`claim_prefix` reads them from memory (no-op without tiers)."""
        if not self._prefix_caching or all(t.connector is None for t in self.groups):
            return
        with self._lock:
            _, plans = self._prefix_plan(self._prompt(prompt), salt, tiers=False)
        for table, plan in zip(self.groups, plans, strict=True):
            if table.connector is not None and plan.start == 0:
                table.connector.store.prefetch(plan.hashes[len(plan.pages) :], tenant=salt)

    @property
    def tier_hit_tokens(self) -> int:
        """Prompt tokens loaded from the tiers instead of computed (the bounding
        table's count: every token of the prefix)."""
        return self._bounding.tier_hit_tokens

    def _storage_find_prefix(self, tokens: list[int], salt: str | None) -> int:
        return self._prefix_plan(tokens, salt)[0] * self.page_size

    def _storage_claim_prefix(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        _, plans = self._prefix_plan(tokens, salt)
        (seq_id,) = self._storage_claim(1)
        reused = {
            t.adopt(seq_id, plan, salt, tokens) for t, plan in zip(self.groups, plans, strict=True)
        }
        if len(reused) > 1:
            # A tier could not give a table a block (gone, refused, no free page): every
            # table starts again from what the devices hold now, the loaded blocks
            # included (they are registered pages now).
            for table in self.groups:
                table.drop(seq_id)
            _, plans = self._prefix_plan(tokens, salt, tiers=False)
            reused = {
                t.adopt(seq_id, p, salt, tokens) for t, p in zip(self.groups, plans, strict=True)
            }
        (pages,) = reused
        cached = pages * self.page_size
        state = self._seqs[seq_id]
        state.tokens = tokens[:cached]
        state.salt = salt
        state.hashes = plans[0].hashes[:pages]
        self._lengths[seq_id] = cached
        for table in self.groups:
            table.give_back(seq_id, cached)
        return seq_id, cached

    def _storage_prefix_counters(self) -> tuple[int, int]:
        return (
            sum(t.pool.counters.evictions for t in self.groups),
            sum(t.pool.cached_count for t in self.groups),
        )

    def _storage_reset_prefix_cache(self) -> None:
        for table in self.groups:
            table.reset_prefix_cache()
        if self._lock.events is not None:
            self._lock.events.cleared()

    def attach_kv_events(self, sink: EventSink) -> KVEventLog:
        """From now on, announces the blocks of its prefix cache, on the device and
        in its tiers, to ``sink`` as KV events in vLLM's format (one batch per
        protocol call that made any; :mod:`maxkv.events.log` says which).

        Args:
            sink: Takes each batch's events: e.g.
                :meth:`maxkv.events.ZmqEventPublisher.publish`.

        Returns:
            The :class:`~maxkv.events.log.KVEventLog` (what it announced, per group).

        Raises:
            ValueError: If prefix caching is off (no block is ever announced), or
                events are attached already.
        """
        with self._lock:
            self._require_prefix_caching("attach_kv_events")
            if self._lock.events is not None:
                raise ValueError("KV events are attached to this cache already")
            log = KVEventLog(sink)
            for index, table in enumerate(self.groups):
                table.announce_to(log.group(index, self.page_size, table.window.window))
            self._lock.events = log
            return log

    def _on_commit(self, tokens: Mapping[int, list[int]]) -> None:
        """Registers the pages the committed tokens filled, in every table (prefix
        caching), and offloads the new ones to the tables' tiers."""
        if not self._prefix_caching:
            return
        # Per table and tenant (salt): each one's pages are signed with its own key.
        new_blocks: list[dict[str | None, tuple[list[int], list[bytes]]]] = [
            {} for _ in self.groups
        ]
        for seq_id, ids in tokens.items():
            state = self._seqs[seq_id]
            if state.sinks is not None and state.sinks.evicted:
                continue  # its pages hold moved keys: not the prefix their tokens hash to
            held_tokens = state.tokens
            held_tokens.extend(ids)
            blended = state.blended_from
            exact = held_tokens[: len(held_tokens) if blended is None else blended]
            hashes = state.hashes
            parent = hashes[-1] if hashes else root_hash(state.salt)
            start = len(hashes) * self.page_size
            for block in block_hashes(exact, self.page_size, parent, start):
                index = len(hashes)
                hashes.append(block)
                for table, new in zip(self.groups, new_blocks, strict=True):
                    page = table.register(seq_id, index, hashes, exact, state.salt)
                    if page is not None:
                        new_pages, new_hashes = new.setdefault(state.salt, ([], []))
                        new_pages.append(page)
                        new_hashes.append(block)
        for table, new in zip(self.groups, new_blocks, strict=True):
            for salt, (new_pages, new_hashes) in new.items():
                table.offload(new_pages, new_hashes, salt)

    # ------------------------------------------------------------- tiers

    def block_layout(self, model_id: str) -> BlockLayout:
        """What one page is outside the device, for the model ``model_id``."""
        return self.table.block_layout(model_id)

    @property
    def tiers(self) -> TieredBlockStore | None:
        """The KV tiers (host, disk, Redis) this cache offloads to; ``None`` without
        (a hybrid cache's: those of its first table; every table has its own)."""
        return self.table.tiers

    @property
    def connector(self) -> TieredConnector | None:
        """The tiers behind MAX's ``KVConnector`` protocol; ``None`` without tiers (a
        hybrid cache's: its first table's; :attr:`connectors` has every table's)."""
        return self.table.connector

    @property
    def connectors(self) -> list[TieredConnector]:
        """Every page table's tiers (none without tiers)."""
        return [t.connector for t in self.groups if t.connector is not None]

    def close(self) -> None:
        """Finishes the tiers' queued writes and stops their thread (no-op without tiers)."""
        for table in self.groups:
            table.close()

    # -------------------------------------------------------------- swap

    @property
    def swapped_bytes(self) -> int:
        """Host memory held by sequences swapped out and not swapped in yet."""
        with self._lock:
            return sum(self._swapped.values())

    def swap_out(self, seq_id: int) -> SwappedSequence:
        """Preemption by swap, between rounds: moves ``seq_id`` to host memory.

        Copies its pages (of every table) to host memory and releases it
        (``seq_id`` and its pages are free; registered pages stay findable on
        the device until evicted).  :meth:`swap_in` continues it.

        Raises:
            ValueError: If ``seq_id`` is not claimed, or the cache is not in
                host memory.
            CacheFullError: If the swap space (``TierConfig.swap_bytes``)
                cannot take it (nothing changes).
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            nbytes = sum(t.swap_nbytes(seq) for t in self.groups)
            budget = self._tier_config.swap_bytes
            if self.swapped_bytes + nbytes > budget:
                raise CacheFullError(
                    f"swap space full: seq_id {seq} needs {nbytes} bytes, "
                    f"{budget - self.swapped_bytes} of {budget} are free"
                )
            parts = [t.capture(seq) for t in self.groups]
            state = self._seqs[seq].copy()
            length = self._lengths[seq]
            if len(parts) == 1:
                ((blocks, first),) = parts
                swapped = SwappedSequence(length, blocks, state, first)
            else:
                groups = tuple(SwappedSequence(length, b, state, f) for b, f in parts)
                swapped = SwappedSequence(length, np.zeros((0,), np.float32), state, 0, groups)
            self._swapped[swapped.number] = nbytes
            self.release(seq)
            return swapped

    def _swap_parts(self, swapped: SwappedSequence) -> list[SwappedSequence]:
        """Per table, the part of ``swapped`` it holds the pages of."""
        if not isinstance(swapped, SwappedSequence):
            raise ArgumentTypeError(
                f"swapped must be a SwappedSequence, got {type(swapped).__name__}"
            )
        parts = list(swapped.groups) if swapped.groups else [swapped]
        if len(parts) != len(self.groups):
            raise ValueError(
                "this sequence was swapped out of another manager (not one with "
                f"{len(self.groups)} layer groups)"
            )
        return parts

    def _swap_hits(self, swapped: SwappedSequence) -> list[list[int | None]]:
        return [
            t.swap_in_hits(swapped.state.hashes, part.first_page, len(part.blocks))
            for t, part in zip(self.groups, self._swap_parts(swapped), strict=True)
        ]

    def swap_in_pages(self, swapped: SwappedSequence) -> int:
        """Free pages :meth:`swap_in` would take now: its pages the devices no longer
        have cached, plus the cached ones nobody holds (they leave the free queue)."""
        with self._lock:
            return sum(
                cached.count(None) + t.free_hits(cached)
                for t, cached in zip(self.groups, self._swap_hits(swapped), strict=True)
            )

    def swap_in(self, swapped: SwappedSequence) -> int:
        """Continues a sequence :meth:`swap_out` moved to host memory; returns its new id.

        Its full pages still cached on the device are shared, the others
        written back from host memory, in every table; nothing is recomputed.

        Raises:
            ValueError: If ``swapped`` was swapped in already (or is not from
                this manager).
            CacheFullError: If no sequence id or not enough pages are free
                (nothing changes; ``swapped`` stays valid).
        """
        with self._lock:
            parts = self._swap_parts(swapped)
            if swapped.number not in self._swapped:
                raise ValueError("this sequence was swapped in already, or by another manager")
            if self._free_ids() == 0:
                raise CacheFullError("no free sequence id to swap in to")
            hits = self._swap_hits(swapped)
            for index, (table, cached) in enumerate(zip(self.groups, hits, strict=True)):
                short = table.swap_in_shortfall(cached)
                if short:
                    available = cached.count(None) - short
                    where = "" if len(self.groups) == 1 else f" in layer group {index}"
                    raise CacheFullError(
                        f"swap in needs {cached.count(None)} new pages of {self.page_size} "
                        f"tokens{where}, {available} are free"
                    )
            (seq,) = self._storage_claim(1)
            for table, part, cached in zip(self.groups, parts, hits, strict=True):
                table.swap_in(seq, part.blocks, part.first_page, cached, swapped.state)
            self._seqs[seq] = swapped.state.copy()
            self._lengths[seq] = swapped.length
            del self._swapped[swapped.number]
            return seq

    # ------------------------------------------------------- storage hooks

    def _free_ids(self) -> int:
        return len(self._free_seq_ids)

    def _storage_claim(self, n: int) -> list[int]:
        seq_ids = sorted(self._free_seq_ids)[:n]
        self._storage_claim_ids(seq_ids)
        return seq_ids

    def _storage_claim_ids(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._free_seq_ids.remove(seq_id)
            self._seqs[seq_id] = _Sequence()
            for table in self.groups:
                table.add(seq_id)

    def _storage_release(self, seq_id: int) -> None:
        del self._seqs[seq_id]
        for table in self.groups:
            table.drop(seq_id)
        self._free_seq_ids.add(seq_id)

    def _storage_reserve(self, seq_ids: list[int], totals: list[int]) -> None:
        # Plan first in every table (nothing changes if one lacks pages), then act.
        lengths = [self._lengths[s] for s in seq_ids]
        plans = [t.reserve_plan(seq_ids, lengths, totals) for t in self.groups]
        for index, (table, (_, needed)) in enumerate(zip(self.groups, plans, strict=True)):
            if needed <= table.free_pages:
                continue
            window = table.window.window
            what = (
                ""
                if len(self.groups) == 1
                else f" in layer group {index} ("
                f"{'full attention' if window is None else f'window {window}'})"
            )
            error = table.no_room(needed, what)
            if error is not None:
                raise error
        for table, (plan, _) in zip(self.groups, plans, strict=True):
            table.reserve_apply(plan, lengths)

    def _storage_inputs(
        self, seq_ids: list[int], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[CacheInputs]:
        per_table = [t.seq_inputs(seq_ids, lengths, max_lengths) for t in self.groups]
        if len(per_table) == 1:
            return [*per_table[0]]
        return [
            tuple(b for inputs in device for b in inputs) for device in zip(*per_table, strict=True)
        ]

    def _storage_room(self, seq_id: int) -> int:
        return min(t.room(seq_id) for t in self.groups)

    def _storage_committed(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            for table in self.groups:
                table.give_back(seq_id, self._lengths[seq_id])
            self._slide(seq_id)

    # ------------------------------------------------------ attention sinks

    def enable_attention_sinks(self, seq_id: int, window: int, sink: int = 0) -> None:
        """Between rounds: ``seq_id`` keeps its first ``sink`` tokens and at least its
        last ``window`` tokens, with StreamingLLM's positions (TVM's
        ``EnableSlidingWindowForSeq``).

        The sinks are kept in whole pages: the first ``ceil(sink / page_size)``
        pages.  Whenever committed tokens take the window past ``window +
        page_size - 1`` tokens, its oldest whole pages are dropped and the
        keys after them rotated back by the tokens dropped, so that every
        token's position is its place in the cache; the sequence's committed
        length (what the graph and :attr:`cache_lengths` see) is what the
        cache holds, at most ``sink pages + window + page_size - 1`` tokens
        between steps.  A step's new tokens all see the cache as it was
        before the step.  With prefix caching, pages are registered until
        the first drop.  Needs ``key_rotation`` and a cache in host memory.

        Raises:
            ValueError: If ``seq_id`` is not claimed or has sinks already,
                ``window < 1``, ``sink < 0``, the model's layers slide already
                (``sliding_window``), no ``key_rotation`` was given, or the
                cache is not in host memory.
        """
        if not self.capabilities.sinks:
            self._unsupported("sinks", "enable_attention_sinks")
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            window = require_int("window", window, 1)
            sink = require_int("sink", sink, 0)
            if self.window.slides:
                raise ValueError(
                    "the model's layers slide already (sliding_window): attention sinks "
                    "are for a cache that keeps every token"
                )
            if self._rotation is None:
                raise ValueError(
                    "attention sinks move keys to new positions: give the manager the "
                    "model's key_rotation"
                )
            if not self.host_pages:
                raise ValueError("attention sinks rotate keys on the host: a CPU cache only")
            if self._seqs[seq].sinks is not None:
                raise ValueError(f"seq_id {seq} has a sliding window already")
            self._seqs[seq].sinks = _Sinks(window, math.ceil(sink / self.page_size))
            self._slide(seq)

    def attention_sinks_of(self, seq_id: int) -> tuple[int, int, int] | None:
        """``(window, sink tokens kept, tokens dropped so far)`` of a sequence with
        attention sinks, else ``None``."""
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            stream = self._seqs[seq].sinks
            if stream is None:
                return None
            return stream.window, stream.sink_pages * self.page_size, stream.evicted

    def sliding_window_of(self, seq_id: int) -> tuple[int, int, int] | None:
        """The older name of :meth:`attention_sinks_of`."""
        return self.attention_sinks_of(seq_id)

    def _slide(self, seq_id: int) -> None:
        """Drops the whole pages of ``seq_id``'s oldest window tokens past its window
        and moves the keys after them back (a sequence with attention sinks).  With
        no free page for a copy-on-write it waits for a later commit."""
        stream = self._seqs[seq_id].sinks
        if stream is None:
            return
        length = self._lengths[seq_id]
        first = stream.sink_pages
        sinks = first * self.page_size
        drop = (length - sinks - stream.window) // self.page_size
        if drop <= 0:
            return
        held = self.table.rows[seq_id].pages
        moved = range(first + drop, self._pages_for(length))
        shared = [i for i in moved if self.table.shared(held[i])]
        if len(shared) > self._pool.free_count:
            return
        for index in shared:  # the keys change: this sequence's own copy
            self.table.copy_on_write(seq_id, index, length)
        self._pool.free(held[first : first + drop])
        del held[first : first + drop]
        shift = drop * self.page_size
        pages = np.array(held[first : first + len(moved)], dtype=np.int64)
        assert self._rotation is not None
        for buffer in self._pages:
            keys = buffer.to_numpy()[:, 0]  # [pages, layers, page_size, heads, head_dim]
            for layer in range(self.num_layers):
                block = keys[pages, layer]
                self._rotation.shift(block, layer, -shift)
                keys[pages, layer] = block
        self._lengths[seq_id] = length - shift
        stream.evicted += shift
        if self._prefix_caching:
            del self._seqs[seq_id].hashes[first:]
            del self._seqs[seq_id].tokens[sinks:]

    def _storage_truncate(self, seq_id: int, length: int) -> None:
        for table in self.groups:
            table.check_window(seq_id, length, "cannot pop_n")
        stream = self._seqs[seq_id].sinks
        if stream is not None and length <= stream.sink_pages * self.page_size:
            stream.evicted = 0  # what is left is the sequence's first tokens again
        for table in self.groups:
            table.truncate(seq_id, length)
        if self._prefix_caching:
            del self._seqs[seq_id].tokens[length:]
            del self._seqs[seq_id].hashes[length // self.page_size :]

    def _storage_fork(self, parent: int, child: int, fork_pos: int) -> None:
        for table in self.groups:
            table.check_window(parent, fork_pos, "cannot fork")
        if fork_pos % self.page_size and any(t.pool.free_count < 1 for t in self.groups):
            raise CacheFullError(
                f"cannot fork seq_id {parent} at {fork_pos}: its partial page needs a copy "
                + (
                    "and no page is free"
                    if len(self.groups) == 1
                    else "in every layer group and a group has no free page"
                )
            )
        for table in self.groups:
            table.fork(parent, child, fork_pos)
        state, child_state = self._seqs[parent], self._seqs[child]
        stream = state.sinks
        if stream is not None:
            evicted = stream.evicted if fork_pos > stream.sink_pages * self.page_size else 0
            child_state.sinks = _Sinks(stream.window, stream.sink_pages, evicted)
        if self._prefix_caching:
            child_state.tokens = state.tokens[:fork_pos]
            child_state.salt = state.salt
            child_state.hashes = state.hashes[: fork_pos // self.page_size]
        if state.blended_from is not None and state.blended_from < fork_pos:
            child_state.blended_from = state.blended_from


#: Per table, :meth:`PageTable.lookup`'s answer for a prompt's hashes.
_Found = tuple[list[int | None], list[int]]


def _check_tiers(tiers: TierConfig | None, enable_prefix_caching: bool) -> None:
    if tiers is not None and not isinstance(tiers, TierConfig):
        raise TypeError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
    if tiers is not None and tiers.any_tier and not enable_prefix_caching:
        raise ValueError(
            "KV tiers keep pages under their prefix hash: they need enable_prefix_caching=True"
        )


def _check_num_pages(num_pages: int) -> int:
    num_pages = require_int("num_pages", num_pages, 1)
    if num_pages >= UNUSED_PAGE:
        raise ValueError(f"num_pages must be below {UNUSED_PAGE}, got {num_pages}")
    return num_pages
