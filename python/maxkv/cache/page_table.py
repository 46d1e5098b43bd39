"""One layer group's pages: the page pool, the window, and each sequence's row.

A :class:`PageTable` is vLLM's ``SingleTypeKVCacheManager`` over its
``BlockPool``: the pages buffer of the layers it serves (one per device),
the :class:`~maxkv.cache.page_pool.PagePool` that says which page is free,
held or cached, the :class:`~maxkv.cache.window.PageWindow` its layers
attend through, and each sequence's row of page ids.  It reserves pages for
a step (copying first a shared page the step writes into), gives back the
pages a window has passed, forks, truncates and builds the graph inputs.

With prefix caching it registers the pages it fills under the chained
hashes of their tokens (the manager hashes a sequence's tokens once for
every table), finds the pages of a prompt's prefix and takes them; with KV
tiers it offloads its registered pages to tiers of its own and loads them
back.  Swap copies its pages of a sequence to host memory and back.

It keeps no committed lengths and takes no lock: the manager that holds it
(:class:`~maxkv.PagedKVCacheManager`) passes each sequence's length and
calls it under its own lock, one protocol step at a time.  A plain paged
cache holds one table; a hybrid model's cache one per layer group.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from max.driver import Buffer, Device

from ..errors import CacheFullError
from ..tiers.blocks import BlockLayout
from ..tiers.store import TierConfig, TieredBlockStore
from .page_pool import PagePool
from .protocol import CacheDevice, device_inputs
from .spec import CacheSpec, KVCacheInputs
from .window import PageWindow

if TYPE_CHECKING:
    from ..events.log import GroupEvents
    from ..tiers.connector import TieredConnector

logger = logging.getLogger("maxkv.tiers")

__all__ = ["UNUSED_PAGE", "PageRow", "PageTable", "Prefix", "held_runs"]

#: Page-table entry of a page a sequence does not have (never a valid page id).
UNUSED_PAGE = 0xFFFFFFFF


@dataclass
class PageRow:
    """A sequence's row of one page table, in token order."""

    #: Its page ids; :data:`UNUSED_PAGE` for pages given back.
    pages: list[int] = field(default_factory=list)
    #: How many pages at its start it gave back (sliding window).
    given_back: int = 0

    @property
    def held(self) -> list[int]:
        """The pages it holds (those given back left out)."""
        return self.pages[self.given_back :]


class SwapState(Protocol):
    """What :meth:`PageTable.swap_in` reads of a swapped sequence's record."""

    tokens: list[int]
    salt: str | None
    hashes: list[bytes]


@dataclass
class ReservePlan:
    """What a step's reservation does to one sequence's row: the indices of the
    shared pages it writes into (copied first) and how many new pages it appends."""

    seq_id: int
    shared: list[int]
    new: int


def held_runs(held: list[bool]) -> list[int]:
    """Per page, how many pages in a row up to it (itself included) are held."""
    return list(itertools.accumulate(held, lambda run, h: run + 1 if h else 0, initial=0))[1:]


@dataclass
class Prefix:
    """A prefix a claim can reuse in one table: pages ``[start, start +
    len(pages))`` on the device, then ``in_tiers`` blocks from its tiers (the
    pages before ``start`` are outside its window)."""

    start: int
    pages: list[int]
    #: The hashes of every full page of the prompt (``tokens[:-1]``).
    hashes: list[bytes]
    in_tiers: int

    @property
    def reused(self) -> int:
        """Pages of the prompt the claim skips."""
        return self.start + len(self.pages) + self.in_tiers


class PageTable:
    """The pages of one layer group and which sequence holds which.

    Args:
        spec: The group's cache (a paged :class:`~maxkv.cache.spec.CacheSpec`).
        num_pages: Pages in its pool.
        max_seq_len: Most tokens one sequence holds (the rows' width).
        window: Its layers' sliding window, or ``None`` (every token).
        devices: One device per ``spec.params.n_devices``.
        cache_device: Its device work (zero fill, copies).
        tiers: Its KV tiers (``None`` or a config without any tier: none).
    """

    def __init__(
        self,
        spec: CacheSpec,
        num_pages: int,
        max_seq_len: int,
        window: int | None,
        devices: Sequence[Device],
        cache_device: CacheDevice,
        tiers: TierConfig | None = None,
    ) -> None:
        assert spec.page_size is not None
        self.spec = spec
        self.page_size = spec.page_size
        self.num_pages = num_pages
        self.max_pages_per_seq = math.ceil(max_seq_len / self.page_size)
        #: Which pages a sequence keeps (every page without a sliding window).
        self.window = PageWindow(window, self.page_size)
        self.pool = PagePool(num_pages)
        self.devices = list(devices)
        self.cache_device = cache_device
        #: One pages buffer per device, ``spec.allocated_shape(num_pages)``.
        self.buffers: list[Buffer] = cache_device.zeros(
            spec.allocated_shape(num_pages), spec.params.cache_dtype
        )
        self.rows: dict[int, PageRow] = {}
        #: Prompt tokens loaded from its tiers instead of computed.
        self.tier_hit_tokens = 0
        self.connector: TieredConnector | None = None
        #: Where it announces its registered pages and their evictions (KV events).
        self.events: GroupEvents | None = None
        if tiers is not None and tiers.any_tier:
            from ..tiers.connector import PageBuffers, TieredConnector

            store = TieredBlockStore(self.block_layout(tiers.model_id), tiers)
            self.connector = TieredConnector(store, PageBuffers(self.buffers))

    # ---------------------------------------------------- what it is

    @property
    def num_layers(self) -> int:
        """Layers whose keys and values its pages hold."""
        return self.spec.num_layers

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds (cached ones included: they are evictable)."""
        return self.pool.free_count

    @property
    def nbytes_per_page(self) -> int:
        """Bytes one page takes on all devices together."""
        p = self.spec.params
        return self.page_size * p.token_bytes(self.num_layers) * len(self.devices)

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """``seq_id``'s row (:data:`UNUSED_PAGE` for the pages given back)."""
        return tuple(self.rows[seq_id].pages)

    def page_refcount(self, page: int) -> int:
        """How many sequences hold ``page`` (0: free)."""
        return self.pool.refcount(page)

    def block_layout(self, model_id: str) -> BlockLayout:
        """What one of its pages is outside the device, for the model ``model_id``."""
        p = self.spec.params
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

    def announce_to(self, events: GroupEvents) -> None:
        """Announces from now on its registered pages (and their evictions) to
        ``events``, and its tiers' blocks in their own media."""
        self.events = events
        self.pool.on_evict = events.removed
        if self.connector is not None:
            self.connector.store.announce_to(events)

    def _announce(
        self, index: int, hashes: Sequence[bytes], tokens: Sequence[int], salt: str | None
    ) -> None:
        """Announces the page of a sequence's block ``index`` newly registered (its
        chained ``hashes`` and its ``tokens`` from the sequence's start)."""
        if self.events is not None:
            start = index * self.page_size
            self.events.stored(
                hashes[index],
                hashes[index - 1] if index else None,
                tokens[start : start + self.page_size],
                salt,
            )

    @property
    def tiers(self) -> TieredBlockStore | None:
        """Its KV tiers; ``None`` without."""
        return self.connector.store if self.connector is not None else None

    # ------------------------------------------------------------ rows

    def add(self, seq_id: int, row: PageRow | None = None) -> None:
        """``seq_id`` gets a row (empty, or ``row``'s pages, already held)."""
        self.rows[seq_id] = row if row is not None else PageRow()

    def drop(self, seq_id: int) -> None:
        """``seq_id`` lets go of its pages, last first (a sequence's prefix outlives
        its tail in the prefix cache), and of its row."""
        row = self.rows.pop(seq_id)
        self.pool.free(reversed(row.held))

    def pages_for(self, tokens: int) -> int:
        """Pages ``tokens`` tokens fill."""
        return math.ceil(tokens / self.page_size)

    def room(self, seq_id: int) -> int:
        """Tokens ``seq_id``'s pages hold."""
        return len(self.rows[seq_id].pages) * self.page_size

    def shared(self, page: int) -> bool:
        """Whether writing into ``page`` needs a copy first: held twice, or cached."""
        return self.pool.refcount(page) > 1 or self.pool.is_cached(page)

    # ------------------------------------------------ step 2: reserve

    def reserve_plan(
        self, seq_ids: Sequence[int], lengths: Sequence[int], totals: Sequence[int]
    ) -> tuple[list[ReservePlan], int]:
        """Per sequence of ``lengths`` committed tokens, what a step up to ``totals``
        takes (:class:`ReservePlan`); and how many free pages all that takes."""
        plans = []
        needed = 0
        for seq_id, length, total in zip(seq_ids, lengths, totals, strict=True):
            held = self.rows[seq_id].pages
            last = self.pages_for(total)
            written = range(length // self.page_size, min(last, len(held)))
            shared = [i for i in written if self.shared(held[i])]
            new = max(0, last - len(held))
            plans.append(ReservePlan(seq_id, shared, new))
            needed += len(shared) + new
        return plans, needed

    def reserve_apply(self, plans: Sequence[ReservePlan], lengths: Sequence[int]) -> None:
        """Applies :meth:`reserve_plan`'s plans (the free pages are there)."""
        for plan, length in zip(plans, lengths, strict=True):
            for index in plan.shared:
                self.copy_on_write(plan.seq_id, index, length)
            self.rows[plan.seq_id].pages += self.pool.allocate(plan.new)

    def no_room(self, needed: int, what: str = "") -> CacheFullError | None:
        """The error of a step that needs ``needed`` free pages, if they are not free."""
        if needed <= self.pool.free_count:
            return None
        return CacheFullError(
            f"out of pages{what}: this step needs {needed} new pages of {self.page_size} "
            f"tokens, {self.pool.free_count} of {self.num_pages} are free"
        )

    # ------------------------------------------------ step 4: commit

    def give_back(self, seq_id: int, length: int) -> None:
        """Frees the pages of ``seq_id`` (of ``length`` committed tokens) wholly before
        its window (the oldest first, so that the prefix cache evicts them first)."""
        first = self.window.first_live_page(length)
        row = self.rows[seq_id]
        if first <= row.given_back:
            return
        self.pool.free(row.pages[row.given_back : first])
        row.pages[row.given_back : first] = [UNUSED_PAGE] * (first - row.given_back)
        row.given_back = first

    # --------------------------------------------- between rounds

    def check_window(self, seq_id: int, length: int, what: str) -> None:
        """Raises if ``seq_id`` cut to ``length`` tokens would attend to positions
        whose pages it gave back."""
        gone = self.rows[seq_id].given_back
        if self.window.first_live_page(length) < gone:
            raise ValueError(
                f"{what}: at {length} tokens seq_id {seq_id}'s sliding window of "
                f"{self.window.window} tokens reaches back to position "
                f"{self.window.first_needed_position(length)}, but its pages before "
                f"position {gone * self.page_size} were given back"
            )

    def truncate(self, seq_id: int, length: int) -> None:
        """``seq_id`` keeps the pages of its first ``length`` tokens
        (:meth:`check_window` first)."""
        held = self.rows[seq_id].pages
        keep = self.pages_for(length)
        self.pool.free(reversed(held[keep:]))
        del held[keep:]

    def fork(self, parent: int, child: int, fork_pos: int) -> None:
        """``child`` (an empty row) shares ``parent``'s full pages up to ``fork_pos``
        within its window and gets a copy of the partial page (a free page is there:
        :meth:`check_window`, and the caller's count of free pages, first)."""
        full, partial = divmod(fork_pos, self.page_size)
        start = self.window.first_live_page(fork_pos)
        parent_pages = self.rows[parent].pages
        shared = parent_pages[start:full]
        self.pool.share(shared)
        child_pages = [UNUSED_PAGE] * start + shared
        if partial:
            child_pages += self.pool.allocate(1)
        self.rows[child] = PageRow(child_pages, start)
        if partial:
            self.copy_between(parent_pages, child_pages, full * self.page_size, fork_pos)

    def copy_on_write(self, seq_id: int, index: int, length: int) -> None:
        """Gives ``seq_id`` (of ``length`` committed tokens) its own copy of its shared
        page ``index`` (a free page is there)."""
        held = self.rows[seq_id].pages
        old = held[index]
        start = index * self.page_size
        end = min(length, start + self.page_size)
        (new,) = self.pool.allocate(1)
        replaced = [*held[:index], new, *held[index + 1 :]]
        self.copy_between(held, replaced, start, end)
        held[index] = new
        self.pool.free([old])

    def copy_between(self, source: list[int], destination: list[int], start: int, end: int) -> None:
        """Copies tokens ``[start, end)`` from the page list ``source`` to ``destination``."""
        lengths = np.array([end, 0], dtype=np.uint32)
        max_lengths = np.array([[0, end]], dtype=np.uint32)
        inputs = self.inputs([source, destination], lengths, max_lengths)
        self.cache_device.copy_tokens(inputs, start, end)

    # ------------------------------------------------ prefix caching

    def lookup(self, hashes: list[bytes]) -> tuple[list[int | None], list[int]]:
        """The device page registered under each of ``hashes``, and per page how many
        pages in a row up to it are registered (:func:`held_runs`)."""
        found = [self.pool.lookup(block) for block in hashes]
        return found, held_runs([page is not None for page in found])

    def held(self, hashes: list[bytes], found: list[int | None]) -> list[bool]:
        """Per block of ``hashes`` (:meth:`lookup`'s ``found``): whether the device or
        a tier holds it (the tiers asked once, for the blocks the device lacks)."""
        held = [page is not None for page in found]
        ask = [i for i, on_device in enumerate(held) if not on_device]
        if self.connector is not None and ask:
            from ..tiers.connector import LEAF

            in_tiers = self.connector.lookup([hashes[i] for i in ask])[LEAF]
            for i, there in zip(ask, in_tiers, strict=True):
                held[i] = bool(there)
        return held

    def prefix_fits(self, runs: list[int], m: int) -> bool:
        """Whether reusing exactly ``m`` pages gives its layers all they need of them
        (the pages of the window, or all ``m``); ``runs``: per page, how many pages
        in a row up to it are held (:func:`held_runs`)."""
        return m == 0 or runs[m - 1] >= m - self.window.first_live_page(m * self.page_size)

    def prefix_at(
        self, hashes: list[bytes], found: list[int | None], runs: list[int], m: int
    ) -> Prefix | None:
        """Reusing exactly ``m`` pages (:meth:`prefix_fits`; else ``None``): device
        pages from the first page needed, then blocks loaded from the tiers.  With
        ``runs`` of the device's pages alone every page is on the device; with those
        of :meth:`held` the tiers give the rest, and a block whose page is on the
        device after all is shared, not copied."""
        if not self.prefix_fits(runs, m):
            return None
        if m == 0:
            return Prefix(0, [], hashes, 0)
        start = self.window.first_live_page(m * self.page_size)
        pages: list[int] = []
        for page in found[start:m]:
            if page is None:
                break
            pages.append(page)
        return Prefix(start, pages, hashes, m - start - len(pages))

    def adopt(self, seq_id: int, plan: Prefix, salt: str | None, tokens: Sequence[int]) -> int:
        """``seq_id`` (an empty row) takes the prefix ``plan`` reuses of the prompt
        ``tokens``, loading its tiers' blocks; returns the pages it reused (fewer
        where a tier failed)."""
        pages = list(plan.pages)
        self.pool.share(pages)
        on_device = plan.start + len(pages)
        if self.connector is not None and pages:
            self.connector.touch(plan.hashes[plan.start : on_device])
        if plan.in_tiers:
            pages += self.load_from_tiers(plan, on_device, salt, tokens)
        reused = plan.start + len(pages)
        self.tier_hit_tokens += (reused - on_device) * self.page_size
        self.rows[seq_id] = PageRow([UNUSED_PAGE] * plan.start + pages, plan.start)
        return reused

    def load_from_tiers(
        self, plan: Prefix, first: int, salt: str | None, tokens: Sequence[int]
    ) -> list[int]:
        """Loads ``plan``'s tier blocks, from its block ``first`` on (of the prompt
        ``tokens`` of the tenant ``salt``), into fresh, registered pages, in order,
        up to the first one no tier can give (or the last free page); a block
        registered on the device is shared instead; returns the pages."""
        from ..tiers.connector import LEAF, KVLoadFailed, KVLoadRefused

        assert self.connector is not None
        loaded: list[int] = []
        for index in range(first, first + plan.in_tiers):
            block = plan.hashes[index]
            registered = self.pool.lookup(block)
            if registered is not None:  # on the device after all (another table's plan)
                self.pool.share([registered])
                loaded.append(registered)
                continue
            if self.pool.free_count == 0:
                break
            (page,) = self.pool.allocate(1)
            try:
                self.connector.load({LEAF: [page]}, {LEAF: [block]}, tenant=salt)
            except (KVLoadRefused, KVLoadFailed):
                self.pool.free([page])
                break
            except Exception:  # a tier's own failure: recompute, never fail the claim
                logger.exception("maxkv: loading block %s from the KV tiers failed", block.hex())
                self.pool.free([page])
                break
            registered = self.pool.register(page, block)
            if registered != page:
                self.pool.share([registered])
                self.pool.free([page])
            else:
                self._announce(index, plan.hashes, tokens, salt)
                self.connector.store.announce_held([block])  # the tier copy it came from
            loaded.append(registered)
        return loaded

    def register(
        self,
        seq_id: int,
        index: int,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        salt: str | None,
    ) -> int | None:
        """Registers ``seq_id``'s page ``index`` under ``hashes[index]`` (its chained
        hashes, its committed ``tokens``, its tenant ``salt``); where the same
        content is cached already, the row takes that page instead.  Returns the
        page when it is newly registered (to offload), else ``None``."""
        pages = self.rows[seq_id].pages
        page = pages[index]
        if self.pool.is_cached(page):
            return None
        registered = self.pool.register(page, hashes[index])
        if registered == page:
            self._announce(index, hashes, tokens, salt)
            return page
        self.pool.share([registered])
        pages[index] = registered
        self.pool.free([page])
        return None

    def offload(self, pages: list[int], hashes: list[bytes], salt: str | None) -> None:
        """Hands newly registered ``pages`` (under ``hashes``) to its tiers."""
        if self.connector is not None and pages:
            from ..tiers.connector import LEAF

            self.connector.offload({LEAF: pages}, {LEAF: hashes}, tenant=salt)

    def reset_prefix_cache(self) -> None:
        """Forgets every registered page (and the tiers' index of this process); the
        manager announces it (``AllBlocksCleared``)."""
        self.pool.reset_cache()
        if self.connector is not None:
            self.connector.reset_prefix_cache()

    def close(self) -> None:
        """Finishes its tiers' queued writes and stops their thread."""
        if self.connector is not None:
            self.connector.shutdown()

    # ------------------------------------------------------- swap

    def capture(self, seq_id: int) -> tuple[np.ndarray, int]:
        """Copies of ``seq_id``'s held pages (``[pages, devices, 2, layers,
        page_size, heads, head_width]``) and the index of the first."""
        from ..tiers.connector import PageBuffers

        row = self.rows[seq_id]
        if row.held:
            return PageBuffers(self.buffers).read_pages(row.held), row.given_back
        return np.zeros((0, *self.block_layout("").page_shape()), np.float32), row.given_back

    def swap_nbytes(self, seq_id: int) -> int:
        """Host bytes :meth:`capture` of ``seq_id`` takes."""
        from ..tiers.connector import PageBuffers

        return len(self.rows[seq_id].held) * PageBuffers(self.buffers).page_nbytes

    def swap_in_hits(self, hashes: list[bytes], first_page: int, blocks: int) -> list[int | None]:
        """Per swapped page: the device page registered under its hash, if any."""
        hashes = hashes[first_page:]
        return [self.pool.lookup(hashes[i]) if i < len(hashes) else None for i in range(blocks)]

    def free_hits(self, cached: list[int | None]) -> int:
        """Free pages that sharing the ``cached`` hits takes out of the free queue."""
        return sum(1 for p in {p for p in cached if p is not None} if self.pool.refcount(p) == 0)

    def swap_in_shortfall(self, cached: list[int | None]) -> int:
        """Pages a swap-in with ``cached`` hits lacks now (0: it fits)."""
        return max(0, cached.count(None) - (self.pool.free_count - self.free_hits(cached)))

    def swap_in(
        self,
        seq_id: int,
        blocks: np.ndarray,
        first_page: int,
        cached: list[int | None],
        state: SwapState,
    ) -> None:
        """``seq_id`` (an empty row) gets its swapped pages back: the ``cached`` hits
        shared, the others written from ``blocks`` (and registered when full: the
        sequence's ``state`` has their hashes and tokens)."""
        from ..tiers.connector import PageBuffers

        self.pool.share([p for p in cached if p is not None])
        fresh = iter(self.pool.allocate(cached.count(None)))
        pages = [UNUSED_PAGE] * first_page
        written: list[tuple[int, int]] = []  # (page, block index)
        for i, hit in enumerate(cached):
            if hit is not None:
                pages.append(hit)
                continue
            page = next(fresh)
            written.append((page, i))
            index = first_page + i
            if index < len(state.hashes):
                self.pool.register(page, state.hashes[index])
                self._announce(index, state.hashes, state.tokens, state.salt)
            pages.append(page)
        if written:  # one batch of copies
            PageBuffers(self.buffers).write_pages(
                [page for page, _ in written], blocks[[i for _, i in written]]
            )
        self.rows[seq_id] = PageRow(pages, first_page)

    # ------------------------------------------------ graph inputs

    def inputs(
        self, page_lists: Sequence[list[int]], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[KVCacheInputs]:
        """One :class:`~maxkv.cache.spec.KVCacheInputs` per device for rows
        ``page_lists`` (a given-back entry points at a page the row holds: the
        window's mask keeps the kernels from reading it)."""
        table = np.full((len(page_lists), self.max_pages_per_seq), UNUSED_PAGE, dtype=np.uint32)
        for row, held in enumerate(page_lists):
            table[row, : len(held)] = held
            gone = held.count(UNUSED_PAGE)  # given back: all at the start
            if 0 < gone < len(held):
                table[row, :gone] = held[gone]
        return device_inputs(self.buffers, self.devices, lengths, table, max_lengths)

    def seq_inputs(
        self, seq_ids: Sequence[int], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[KVCacheInputs]:
        """:meth:`inputs` of the rows of ``seq_ids``."""
        return self.inputs([self.rows[s].pages for s in seq_ids], lengths, max_lengths)
