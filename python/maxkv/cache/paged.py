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
from ..tiers.blocks import BlockLayout
from ..tiers.remote import redact_url
from ..tiers.store import TierConfig, TieredBlockStore
from ..validation import require_int
from .page_table import UNUSED_PAGE, PageRow, PageTable, ReservePlan
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
    #: A :class:`~maxkv.HybridKVCacheManager`'s: one per layer group (each with its
    #: pages and record); its own ``blocks`` are then empty.
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
    cache keeps of it besides its committed length (the protocol's, shared by the
    layer groups of a hybrid cache) and its pages (its row of the page table,
    :class:`~maxkv.cache.page_table.PageTable`).  A per-sequence feature is a field
    here; claim makes a fresh record, fork takes the parent's up to the fork, swap
    keeps a copy beside the page contents, release drops it."""

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


def held_runs(held: list[bool]) -> list[int]:
    """Per page, how many pages in a row up to it (itself included) are held."""
    return list(itertools.accumulate(held, lambda run, h: run + 1 if h else 0, initial=0))[1:]


@dataclass
class _Prefix:
    """A prefix a claim can reuse: pages ``[start, start + len(pages))`` on the
    device, then ``in_tiers`` blocks from the tiers (the pages before ``start``
    are outside the sliding window)."""

    start: int
    pages: list[int]
    #: The hashes of every full page of the prompt (``tokens[:-1]``).
    hashes: list[bytes]
    in_tiers: int

    @property
    def reused(self) -> int:
        """Pages of the prompt the claim skips."""
        return self.start + len(self.pages) + self.in_tiers


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

    capabilities = CacheCapabilities(pages=True, swap=True, sinks=True, blending=True, tiers=True)

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
        if tiers is not None and not isinstance(tiers, TierConfig):
            raise TypeError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        if tiers is not None and tiers.any_tier and not enable_prefix_caching:
            raise ValueError(
                "KV tiers keep pages under their prefix hash: they need enable_prefix_caching=True"
            )
        super().__init__(
            CacheSpec(params, num_layers, "paged", page_size),
            max_batch_size,
            max_seq_len,
            devices,
            session,
            cache_device,
        )
        self.page_size = page_size
        self.num_pages = require_int("num_pages", num_pages, 1)
        if self.num_pages >= UNUSED_PAGE:
            raise ValueError(f"num_pages must be below {UNUSED_PAGE}, got {num_pages}")
        self.max_pages_per_seq = math.ceil(self.max_seq_len / self.page_size)
        self._free_seq_ids: set[int] = set(range(self.max_batch_size))
        spec = self.spec
        assert isinstance(spec, CacheSpec)
        #: The pages, their pool, the window and each sequence's row.
        self.table = PageTable(
            spec, self.num_pages, self.max_seq_len, sliding_window, self.devices, self.cache_device
        )
        #: Which pages a sequence keeps (every page without a sliding window).
        self.window = self.table.window
        self._pool = self.table.pool
        self._pages = self.table.buffers
        #: Each claimed sequence's record.
        self._seqs: dict[int, _Sequence] = {}
        self._rotation = key_rotation
        self._prefix_caching = bool(enable_prefix_caching)
        self._tier_config = tiers if tiers is not None else TierConfig()
        self._swapped: dict[int, int] = {}  # live SwappedSequence.number -> bytes
        #: Prompt tokens loaded from the tiers instead of computed.
        self.tier_hit_tokens = 0
        self._connector: TieredConnector | None = None
        if tiers is not None and tiers.any_tier:
            from ..tiers.connector import PageBuffers, TieredConnector

            store = TieredBlockStore(self.block_layout(tiers.model_id), tiers)
            self._connector = TieredConnector(store, PageBuffers(self._pages))

    # ------------------------------------------------------------------ sizes

    def pages_shape(self, num_pages: int) -> list[int]:
        """Shape of one device's pages buffer: ``[num_pages, 2, num_layers,
        page_size, n_kv_heads_per_device, head_width]`` (axis 1: 0 keys, 1 values)."""
        spec = self.spec
        assert isinstance(spec, CacheSpec)  # one cache (a hybrid's groups are each one)
        return spec.allocated_shape(require_int("num_pages", num_pages, 1))

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

    # ------------------------------------------------------------ page state

    @property
    def nbytes_per_page(self) -> int:
        """Bytes one page takes on all devices together."""
        return self.estimated_memory_size(
            self.params, self.page_size, 1, self.num_layers, self.devices
        )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's: the sliding window pages are given back by (or ``None``)."""
        return (self.window.window,) * self.num_layers

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds (exact at every moment)."""
        with self._lock:
            return self._pool.free_count

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """The pages ``seq_id`` holds, in token order (its page-table row), with
        :data:`UNUSED_PAGE` in place of the pages it gave back (sliding window).

        Raises:
            ValueError: If ``seq_id`` is not claimed.
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            return tuple(self.table.rows[seq].pages)

    def page_refcount(self, page: int) -> int:
        """How many sequences hold ``page`` (0: free)."""
        with self._lock:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is out of range [0, {self.num_pages})")
            return self._pool.refcount(page)

    def page_is_cached(self, page: int) -> bool:
        """Whether ``page`` is registered in the prefix cache (and so read-only)."""
        with self._lock:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is out of range [0, {self.num_pages})")
            return self._pool.is_cached(page)

    def read_tokens(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """A copy of the K and V of ``seq_id``'s committed tokens ``[start, end)``.

        Between rounds; the cache must be in host memory (a CPU cache) in a
        float encoding (float32 or float16, whose values NumPy reads as they are).

        Returns:
            ``[2, num_layers, end - start, n_kv_heads, head_dim]`` (axis 0: keys,
            values) in the cache's dtype, from device 0.

        Raises:
            ValueError: For a range outside the committed tokens, a page given
                back (sliding window), a cache off the host or a quantized one.
        """
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
        registered as usual.  Call it before the commit of those tokens.

        Raises:
            ValueError: If ``seq_id`` is not claimed or ``position`` is negative.
        """
        position = require_int("position", position, 0)
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            current = self._seqs[seq].blended_from
            self._seqs[seq].blended_from = position if current is None else min(current, position)

    def units_for(self, tokens: int) -> int:
        """Pages a sequence of ``tokens`` tokens holds at most: all of them while a
        step computes them at once (with a sliding window, fewer once committed:
        :meth:`PageWindow.live_pages <maxkv.cache.window.PageWindow.live_pages>`)."""
        return self._pages_for(tokens)

    def _pages_for(self, tokens: int) -> int:
        return self.table.pages_for(tokens)

    @property
    def free_units(self) -> int:
        """Free pages (cached ones included: they are evictable)."""
        return self.free_pages

    @property
    def total_units(self) -> int:
        """Pages in the cache."""
        return self.num_pages

    def units_held(self, seq_id: int) -> list[int]:
        """The pages ``seq_id`` holds (those its window gave back left out)."""
        return [p for p in self.pages(seq_id) if p != UNUSED_PAGE]

    @property
    def longest_sequence(self) -> int:
        """``max_seq_len``, or the tokens all pages hold if fewer (a sliding window
        gives pages back as it goes: then any length)."""
        if self.window.slides:
            return self.max_seq_len
        return min(self.max_seq_len, self.num_pages * self.page_size)

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
        tiers = self.tiers
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

    def _prefix_plan(self, tokens: list[int], salt: str | None, *, tiers: bool = True) -> _Prefix:
        """The longest page-aligned prefix of ``tokens[:-1]`` a claim can reuse now.

        Held from its start: registered device pages, then blocks a tier holds
        (not asked if not ``tiers``).  With a sliding window, also a prefix
        whose early pages are gone but whose last ``window - 1`` tokens' pages
        are on the device (vLLM's sliding-window hit rule, searched from the
        right); the longer one wins."""
        hashes, found, runs = self._lookup(tokens, salt)
        pages: list[int] = []
        for page in found:
            if page is None:
                break
            pages.append(page)
        in_tiers = 0
        if tiers and self._connector is not None and len(pages) < len(hashes):
            from ..tiers.connector import LEAF

            held = self._connector.lookup(hashes[len(pages) :])[LEAF]
            while in_tiers < len(held) and held[in_tiers]:
                in_tiers += 1
        best = _Prefix(0, pages, hashes, in_tiers)
        if self.window.slides:
            for m in range(len(hashes), best.reused, -1):
                plan = self._prefix_at(hashes, found, runs, m)
                if plan is not None:
                    return plan
        return best

    def _lookup(
        self, tokens: list[int], salt: str | None
    ) -> tuple[list[bytes], list[int | None], list[int]]:
        """The hashes of the full pages of ``tokens[:-1]``, the device page registered
        under each, and per page how many pages in a row up to it are registered."""
        hashes = block_hashes(tokens[:-1], self.page_size, root_hash(salt))
        found = [self._pool.lookup(block) for block in hashes]
        return hashes, found, held_runs([page is not None for page in found])

    def _held(self, hashes: list[bytes], found: list[int | None]) -> list[bool]:
        """Per full page of a prompt (:meth:`_lookup`): whether the device or a KV tier
        holds its block (the tiers asked once, for the pages the device lacks)."""
        held = [page is not None for page in found]
        ask = [i for i, on_device in enumerate(held) if not on_device]
        if self._connector is not None and ask:
            from ..tiers.connector import LEAF

            in_tiers = self._connector.lookup([hashes[i] for i in ask])[LEAF]
            for i, there in zip(ask, in_tiers, strict=True):
                held[i] = bool(there)
        return held

    def _prefix_fits(self, runs: list[int], m: int) -> bool:
        """Whether reusing exactly ``m`` pages gives this cache's layers all they need
        of them (the pages of the window, or all ``m``); ``runs``: per page, how many
        pages in a row up to it are held (:func:`held_runs`)."""
        return m == 0 or runs[m - 1] >= m - self.window.first_live_page(m * self.page_size)

    def _prefix_at(
        self, hashes: list[bytes], found: list[int | None], runs: list[int], m: int
    ) -> _Prefix | None:
        """Reusing exactly ``m`` pages (:meth:`_prefix_fits`; else ``None``): device
        pages from the first page needed, then blocks loaded from the tiers.  With
        ``runs`` of the device's pages alone (:meth:`_lookup`) every page is on the
        device; with those of :meth:`_held` the tiers give the rest, and a block
        whose page is on the device after all is shared, not copied (the registry
        gives the registered page back)."""
        if not self._prefix_fits(runs, m):
            return None
        if m == 0:
            return _Prefix(0, [], hashes, 0)
        start = self.window.first_live_page(m * self.page_size)
        pages: list[int] = []
        for page in found[start:m]:
            if page is None:
                break
            pages.append(page)
        return _Prefix(start, pages, hashes, m - start - len(pages))

    def pages_to_claim(self, prompt: Sequence[int], *, salt: str | None = None) -> int:
        """Free pages :meth:`claim_prefix` and a first step over all of ``prompt`` would
        take now: its pages, less the cached ones other sequences hold and those
        before its window (free cached pages and pages loaded from the tiers come
        from the free pages too)."""
        with self._lock:
            tokens = self._prompt(prompt)
            held = start = 0
            if self._prefix_caching:
                plan = self._prefix_plan(tokens, salt, tiers=False)
                held = sum(1 for p in plan.pages if self._pool.refcount(p) > 0)
                start = plan.start
            return self._pages_for(len(tokens)) - start - held

    @property
    def host_pages(self) -> bool:
        """Whether the pages are in host memory (a CPU cache: attention sinks rotate keys
        there; tiers and swap copy a GPU cache's pages through staging memory)."""
        return all(b.is_host for b in self._pages)

    def prefix_hits(self, prompt: Sequence[int], *, salt: str | None = None) -> tuple[int, int]:
        """Pages of ``prompt``'s prefix :meth:`claim_prefix` would reuse now: ``(on the
        device, then from the KV tiers)`` (no change; MAX's ``PrefixCacheHits``).  The
        pages before a sliding window, which a claim does not need, count as on the
        device."""
        with self._lock:
            self._require_prefix_caching("prefix_hits")
            plan = self._prefix_plan(self._prompt(prompt), salt)
            return plan.start + len(plan.pages), plan.in_tiers

    def prefetch(self, prompt: Sequence[int], *, salt: str | None = None) -> None:
        """A request arrived: the blocks of its prefix that only the disk or Redis tier
        holds start coming into host memory, on the tiers' thread, so that
        :meth:`claim_prefix` reads them from memory (no-op without tiers)."""
        if self._connector is None or not self._prefix_caching:
            return
        with self._lock:
            plan = self._prefix_plan(self._prompt(prompt), salt, tiers=False)
        if plan.start == 0:
            self._connector.store.prefetch(plan.hashes[len(plan.pages) :], tenant=salt)

    def _storage_find_prefix(self, tokens: list[int], salt: str | None) -> int:
        return self._prefix_plan(tokens, salt).reused * self.page_size

    def _storage_claim_prefix(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        plan = self._prefix_plan(tokens, salt)
        (seq_id,) = self._storage_claim(1)
        return seq_id, self._adopt_prefix(seq_id, tokens, salt, plan)

    def _adopt_prefix(self, seq_id: int, tokens: list[int], salt: str | None, plan: _Prefix) -> int:
        """``seq_id`` (claimed, empty) takes the prefix ``plan`` reuses; returns its tokens."""
        pages = plan.pages
        self._pool.share(pages)
        on_device = plan.start + len(pages)
        if self._connector is not None and pages:
            self._connector.touch(plan.hashes[plan.start : on_device])
        if plan.in_tiers:
            pages += self._load_from_tiers(plan.hashes[on_device : on_device + plan.in_tiers], salt)
        reused = plan.start + len(pages)
        self.tier_hit_tokens += (reused - on_device) * self.page_size
        cached = reused * self.page_size
        state = self._seqs[seq_id]
        self.table.add(seq_id, PageRow([UNUSED_PAGE] * plan.start + pages, plan.start))
        state.tokens = tokens[:cached]
        state.salt = salt
        state.hashes = plan.hashes[:reused]
        self._lengths[seq_id] = cached
        self._give_back(seq_id)
        return cached

    def _load_from_tiers(self, hashes: list[bytes], salt: str | None) -> list[int]:
        """Loads the blocks of ``hashes`` (of the tenant ``salt``) into fresh, registered
        pages, in order, up to the first one no tier can give (or the last free page);
        a block registered on the device is shared instead; returns the pages."""
        from ..tiers.connector import LEAF, KVLoadFailed, KVLoadRefused

        assert self._connector is not None
        loaded: list[int] = []
        for block in hashes:
            registered = self._pool.lookup(block)
            if registered is not None:  # on the device after all (a hybrid cache's plan)
                self._pool.share([registered])
                loaded.append(registered)
                continue
            if self._pool.free_count == 0:
                break
            (page,) = self._pool.allocate(1)
            try:
                self._connector.load({LEAF: [page]}, {LEAF: [block]}, tenant=salt)
            except (KVLoadRefused, KVLoadFailed):
                self._pool.free([page])
                break
            except Exception:  # a tier's own failure: recompute, never fail the claim
                logger.exception("maxkv: loading block %s from the KV tiers failed", block.hex())
                self._pool.free([page])
                break
            registered = self._pool.register(page, block)
            if registered != page:
                self._pool.share([registered])
                self._pool.free([page])
            loaded.append(registered)
        return loaded

    def _storage_prefix_counters(self) -> tuple[int, int]:
        return self._pool.counters.evictions, self._pool.cached_count

    def _storage_reset_prefix_cache(self) -> None:
        self._pool.reset_cache()
        if self._connector is not None:
            self._connector.reset_prefix_cache()

    def _on_commit(self, tokens: Mapping[int, list[int]]) -> None:
        """Registers the pages the committed tokens filled (prefix caching)."""
        if not self._prefix_caching:
            return
        # Per tenant (salt): each one's pages are signed with its own key.
        new_blocks: dict[str | None, tuple[list[int], list[bytes]]] = {}
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
            pages = self.table.rows[seq_id].pages
            for block in block_hashes(exact, self.page_size, parent, start):
                index = len(hashes)
                page = pages[index]
                registered = self._pool.register(page, block)
                if registered != page:  # the same content is cached already: share it
                    self._pool.share([registered])
                    pages[index] = registered
                    self._pool.free([page])
                else:
                    new_pages, new_hashes = new_blocks.setdefault(state.salt, ([], []))
                    new_pages.append(page)
                    new_hashes.append(block)
                hashes.append(block)
        if self._connector is not None:
            from ..tiers.connector import LEAF

            for salt, (new_pages, new_hashes) in new_blocks.items():
                self._connector.offload({LEAF: new_pages}, {LEAF: new_hashes}, tenant=salt)

    # ------------------------------------------------------------- tiers

    def block_layout(self, model_id: str) -> BlockLayout:
        """What one page is outside the device, for the model ``model_id``."""
        p = self.params
        return BlockLayout(
            model_id=model_id or "unnamed",
            kind="page",
            num_layers=self.num_layers,
            n_kv_heads=p.n_kv_heads,
            head_dim=p.head_width,  # a stored head row (quantized: with its scales)
            dtype=p.row_format,
            page_size=self.page_size,
            devices=p.n_devices,
        )

    @property
    def tiers(self) -> TieredBlockStore | None:
        """The KV tiers (host, disk, Redis) this cache offloads to; ``None`` without."""
        return self._connector.store if self._connector is not None else None

    @property
    def connector(self) -> TieredConnector | None:
        """The tiers behind MAX's ``KVConnector`` protocol; ``None`` without tiers."""
        return self._connector

    def close(self) -> None:
        """Finishes the tiers' queued writes and stops their thread (no-op without tiers)."""
        if self._connector is not None:
            self._connector.shutdown()

    # -------------------------------------------------------------- swap

    @property
    def swapped_bytes(self) -> int:
        """Host memory held by sequences swapped out and not swapped in yet."""
        with self._lock:
            return sum(self._swapped.values())

    def swap_out(self, seq_id: int) -> SwappedSequence:
        """Preemption by swap, between rounds: moves ``seq_id`` to host memory.

        Copies its pages to host memory and releases it (``seq_id`` and its
        pages are free; registered pages stay findable on the device until
        evicted).  :meth:`swap_in` continues it.

        Raises:
            ValueError: If ``seq_id`` is not claimed, or the cache is not in
                host memory.
            CacheFullError: If the swap space (``TierConfig.swap_bytes``)
                cannot take it (nothing changes).
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            swapped = self._swap_capture(seq)
            self.release(seq)
            return swapped

    def _swap_capture(self, seq: int) -> SwappedSequence:
        """:meth:`swap_out` less the release: ``seq``'s pages copied to host memory
        and its record frozen, the swap space taken (``CacheFullError`` if it
        cannot, nothing changed)."""
        from ..tiers.connector import PageBuffers

        io = PageBuffers(self._pages)
        row = self.table.rows[seq]
        held = row.held
        nbytes = len(held) * io.page_nbytes
        budget = self._tier_config.swap_bytes
        if self.swapped_bytes + nbytes > budget:
            raise CacheFullError(
                f"swap space full: seq_id {seq} needs {nbytes} bytes, "
                f"{budget - self.swapped_bytes} of {budget} are free"
            )
        if held:
            blocks = io.read_pages(held)
        else:
            blocks = np.zeros((0, *self.block_layout("").page_shape()), np.float32)
        swapped = SwappedSequence(
            self._lengths[seq], blocks, self._seqs[seq].copy(), first_page=row.given_back
        )
        self._swapped[swapped.number] = nbytes
        return swapped

    def swap_in_pages(self, swapped: SwappedSequence) -> int:
        """Free pages :meth:`swap_in` would take now: its pages the device no longer
        has cached, plus the cached ones nobody holds (they leave the free queue)."""
        with self._lock:
            cached = self._swap_in_hits(swapped)
            return cached.count(None) + self._free_hits(cached)

    def _swap_in_hits(self, swapped: SwappedSequence) -> list[int | None]:
        """Per page of ``swapped``: the device page registered under its hash, if any."""
        hashes = swapped.state.hashes[swapped.first_page :]
        return [
            self._pool.lookup(hashes[i]) if i < len(hashes) else None
            for i in range(len(swapped.blocks))
        ]

    def _free_hits(self, cached: list[int | None]) -> int:
        return sum(1 for p in {p for p in cached if p is not None} if self._pool.refcount(p) == 0)

    def swap_in(self, swapped: SwappedSequence) -> int:
        """Continues a sequence :meth:`swap_out` moved to host memory; returns its new id.

        Its full pages still cached on the device are shared, the others
        written back from host memory; nothing is recomputed.

        Raises:
            ValueError: If ``swapped`` was swapped in already (or is not from
                this manager).
            CacheFullError: If no sequence id or not enough pages are free
                (nothing changes; ``swapped`` stays valid).
        """
        with self._lock:
            cached = self._swap_in_check(swapped)
            (seq,) = self._storage_claim(1)
            self._swap_in_apply(seq, swapped, cached)
            return seq

    def _swap_in_check(self, swapped: SwappedSequence) -> list[int | None]:
        """:meth:`swap_in`'s checks, before any change: per page of ``swapped``, the
        device page still registered under its hash (``None``: written back).

        Raises:
            ValueError: If ``swapped`` is not one of this cache's, waiting.
            CacheFullError: If no sequence id is free or its pages do not fit now.
        """
        if swapped.groups or swapped.number not in self._swapped:
            raise ValueError("this sequence was swapped in already, or by another manager")
        if self._free_ids() == 0:
            raise CacheFullError("no free sequence id to swap in to")
        cached = self._swap_in_hits(swapped)
        new = cached.count(None)
        available = self._pool.free_count - self._free_hits(cached)
        if new > available:
            raise CacheFullError(
                f"swap in needs {new} new pages of {self.page_size} tokens, {available} are free"
            )
        return cached

    def _swap_in_apply(self, seq: int, swapped: SwappedSequence, cached: list[int | None]) -> None:
        """:meth:`swap_in` into the claimed ``seq``, after :meth:`_swap_in_check`."""
        from ..tiers.connector import PageBuffers

        self._pool.share([p for p in cached if p is not None])
        fresh = iter(self._pool.allocate(cached.count(None)))
        io = PageBuffers(self._pages)
        hashes = swapped.state.hashes[swapped.first_page :]
        pages = [UNUSED_PAGE] * swapped.first_page
        written: list[tuple[int, int]] = []  # (page, block index)
        for i, hit in enumerate(cached):
            if hit is not None:
                pages.append(hit)
                continue
            page = next(fresh)
            written.append((page, i))
            if i < len(hashes):
                self._pool.register(page, hashes[i])
            pages.append(page)
        if written:  # one batch of copies
            io.write_pages([page for page, _ in written], swapped.blocks[[i for _, i in written]])
        self._seqs[seq] = swapped.state.copy()
        self.table.add(seq, PageRow(pages, swapped.first_page))
        self._lengths[seq] = swapped.length
        del self._swapped[swapped.number]

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
            self.table.add(seq_id)

    def _storage_release(self, seq_id: int) -> None:
        del self._seqs[seq_id]
        self.table.drop(seq_id)
        self._free_seq_ids.add(seq_id)

    def _storage_reserve(self, seq_ids: list[int], totals: list[int]) -> None:
        # Plan first (nothing changes if the pages do not suffice), then act.
        plans, needed = self._reserve_plan(seq_ids, totals)
        error = self.table.no_room(needed)
        if error is not None:
            raise error
        self._reserve_apply(plans)

    def _reserve_plan(self, seq_ids: list[int], totals: list[int]) -> tuple[list[ReservePlan], int]:
        """:meth:`PageTable.reserve_plan` at the sequences' committed lengths."""
        return self.table.reserve_plan(seq_ids, [self._lengths[s] for s in seq_ids], totals)

    def _reserve_apply(self, plans: list[ReservePlan]) -> None:
        self.table.reserve_apply(plans, [self._lengths[plan.seq_id] for plan in plans])

    def _storage_inputs(
        self, seq_ids: list[int], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[CacheInputs]:
        return [*self.table.seq_inputs(seq_ids, lengths, max_lengths)]

    def _storage_room(self, seq_id: int) -> int:
        return self.table.room(seq_id)

    def _storage_committed(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._give_back(seq_id)
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

    def _give_back(self, seq_id: int) -> None:
        """Frees the pages of ``seq_id`` that are wholly before its window now."""
        self.table.give_back(seq_id, self._lengths[seq_id])

    def _check_window(self, seq_id: int, length: int, what: str) -> None:
        """Raises if a sequence ``seq_id`` cut to ``length`` tokens would attend to
        positions whose pages it gave back."""
        self.table.check_window(seq_id, length, what)

    def _storage_truncate(self, seq_id: int, length: int) -> None:
        self._check_window(seq_id, length, "cannot pop_n")
        stream = self._seqs[seq_id].sinks
        if stream is not None and length <= stream.sink_pages * self.page_size:
            stream.evicted = 0  # what is left is the sequence's first tokens again
        self.table.truncate(seq_id, length)
        if self._prefix_caching:
            del self._seqs[seq_id].tokens[length:]
            del self._seqs[seq_id].hashes[length // self.page_size :]

    def _storage_fork(self, parent: int, child: int, fork_pos: int) -> None:
        full = fork_pos // self.page_size
        partial = fork_pos % self.page_size
        self._check_window(parent, fork_pos, "cannot fork")
        if partial and self._pool.free_count < 1:
            raise CacheFullError(
                f"cannot fork seq_id {parent} at {fork_pos}: its partial page needs a copy "
                "and no page is free"
            )
        self.table.fork(parent, child, fork_pos)
        state, child_state = self._seqs[parent], self._seqs[child]
        stream = state.sinks
        if stream is not None:
            evicted = stream.evicted if fork_pos > stream.sink_pages * self.page_size else 0
            child_state.sinks = _Sinks(stream.window, stream.sink_pages, evicted)
        if self._prefix_caching:
            child_state.tokens = state.tokens[:fork_pos]
            child_state.salt = state.salt
            child_state.hashes = state.hashes[:full]
        if state.blended_from is not None and state.blended_from < fork_pos:
            child_state.blended_from = state.blended_from
