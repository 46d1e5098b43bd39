"""One layer group's pages: the page pool, the window, and each sequence's row.

A :class:`PageTable` is vLLM's ``SingleTypeKVCacheManager`` over its
``BlockPool``: the pages buffer of the layers it serves (one per device),
the :class:`~maxkv.cache.page_pool.PagePool` that says which page is free,
held or cached, the :class:`~maxkv.cache.window.PageWindow` its layers
attend through, and each sequence's row of page ids.  It reserves pages for
a step (copying first a shared page the step writes into), gives back the
pages a window has passed, forks, truncates and builds the graph inputs.

It keeps no committed lengths and takes no lock: the manager that holds it
(:class:`~maxkv.PagedKVCacheManager`) passes each sequence's length and
calls it under its own lock, one protocol step at a time.  A plain paged
cache holds one table; a hybrid model's cache one per layer group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from max.driver import Buffer, Device

from ..errors import CacheFullError
from .page_pool import PagePool
from .protocol import CacheDevice, device_inputs
from .spec import CacheSpec, KVCacheInputs
from .window import PageWindow

__all__ = ["UNUSED_PAGE", "PageRow", "PageTable"]

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


@dataclass
class ReservePlan:
    """What a step's reservation does to one sequence's row: the indices of the
    shared pages it writes into (copied first) and how many new pages it appends."""

    seq_id: int
    shared: list[int]
    new: int


class PageTable:
    """The pages of one layer group and which sequence holds which.

    Args:
        spec: The group's cache (a paged :class:`~maxkv.cache.spec.CacheSpec`).
        num_pages: Pages in its pool.
        max_seq_len: Most tokens one sequence holds (the rows' width).
        window: Its layers' sliding window, or ``None`` (every token).
        devices: One device per ``spec.params.n_devices``.
        cache_device: Its device work (zero fill, copies).
    """

    def __init__(
        self,
        spec: CacheSpec,
        num_pages: int,
        max_seq_len: int,
        window: int | None,
        devices: Sequence[Device],
        cache_device: CacheDevice,
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
