"""A paged cache of layer groups: sliding-window layers give their pages back,
full-attention layers keep every token.

Hybrid models interleave layers that attend to a window of recent tokens
with layers that attend to all of them (Gemma 3: five sliding layers to one
full layer).  In one paged cache a page holds every layer's keys and values
of its tokens, so it lives as long as the full-attention layers need it.
:class:`HybridKVCacheManager` groups the layers by window (vLLM v1's
``HybridKVCacheCoordinator``, MAX's ``KVCacheGroupId``): each group is a
:class:`~maxkv.PagedKVCacheManager` of its own over its layers (pages
buffer, page pool, page tables, prefix registry), the sliding groups giving
pages back as their window passes them
(:class:`~maxkv.cache.window.PageWindow`).  The groups share the sequence
ids, the committed lengths and the lock.

The step protocol is :mod:`maxkv.cache.protocol`'s; each step runs in every
group, and a step that one group cannot take changes none:

1. ``claim`` / ``claim_prefix``: the same id in every group.  A cached prefix
   of ``m`` pages is reused when every group holds what its layers need of
   it: all ``m`` pages for the full-attention group, the pages of the last
   ``window - 1`` tokens for a sliding group (the longest ``m`` all accept).
2. ``reserve`` / ``fetch``: every group's pages, or ``CacheFullError`` with
   none taken.  The per-device graph inputs are the groups' 4-tuples one
   after the other (:class:`~maxkv.cache.spec.HybridCacheSpec`); the model
   graph builds one opaque collection per group.
3. ``increment_cache_lengths``: per group.
4. ``step`` / ``release``: every group commits (sliding groups give pages
   back), or frees.

Between rounds ``fork`` and ``pop_n`` apply to every group, refused in all
if one group's window would reach a page it gave back; ``swap_out`` copies
every group's live pages to host memory and ``swap_in`` writes them back
under one new id, in every group or in none.  With KV tiers every group
offloads its registered pages to tiers of its own (keys naming its window),
and a claim reuses ``m`` pages when each group gets what it needs of them
from its device pages and its tiers.  Attention sinks and CacheBlend are not
offered on a hybrid cache yet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from max.driver import Device
from max.engine import InferenceSession

from ..errors import ArgumentTypeError, CacheFullError
from ..tiers.store import TierConfig
from ..validation import require_int
from .paged import UNUSED_PAGE, PagedKVCacheManager, SwappedSequence, _Prefix, held_runs
from .params import KVCacheParams
from .protocol import CacheCapabilities, CacheDevice, KVCacheManagerBase
from .spec import CacheInputs, CacheSpec, HybridCacheSpec, split_inputs
from .window import PageWindow

__all__ = ["HybridKVCacheManager", "layer_groups"]


def _split_tiers(
    tiers: TierConfig, windows: Sequence[int | None], counts: Sequence[int]
) -> list[TierConfig]:
    """Each layer group's tiers: the model id naming the group (its window), the
    byte budgets split in proportion to its layers (its pages' size)."""
    total = sum(counts)

    def share(nbytes: int, count: int) -> int:
        return 0 if nbytes == 0 else max(1, nbytes * count // total)

    return [
        replace(
            tiers,
            model_id=f"{tiers.model_id}#window={window or 'none'}" if tiers.model_id else "",
            host_bytes=share(tiers.host_bytes, count),
            disk_bytes=share(tiers.disk_bytes, count),
            swap_bytes=share(tiers.swap_bytes, count),
            write_queue_bytes=share(tiers.write_queue_bytes, count),
        )
        for window, count in zip(windows, counts, strict=True)
    ]


def layer_groups(
    layer_windows: Sequence[int | None],
) -> tuple[tuple[int | None, ...], tuple[tuple[int, int], ...]]:
    """Groups layers by window: ``(each group's window, per layer (group, index
    in the group))``, groups in the order their first layer comes.

    Raises:
        ValueError: If there are no layers or a window is not a positive int.
    """
    if isinstance(layer_windows, (str, bytes)) or not isinstance(layer_windows, Sequence):
        raise ArgumentTypeError(
            f"layer_windows must be a sequence of ints or None, got {type(layer_windows).__name__}"
        )
    if not layer_windows:
        raise ValueError("layer_windows must name at least one layer")
    windows: list[int | None] = []
    counts: list[int] = []
    layers = []
    for window in layer_windows:
        if window is not None:
            window = require_int("layer window", window, 1)
        if window not in windows:
            windows.append(window)
            counts.append(0)
        group = windows.index(window)
        layers.append((group, counts[group]))
        counts[group] += 1
    return tuple(windows), tuple(layers)


class HybridKVCacheManager(KVCacheManagerBase):
    """Layer groups by sliding window, each a paged cache of its own.

    Args:
        params: Dtype and head layout of the cache (every layer's).
        page_size: Tokens per page (every group's).
        num_pages: Pages of each group, in :func:`layer_groups` order
            (:meth:`plan_pages` splits a memory budget).
        max_batch_size: Sequence ids, ``[0, max_batch_size)``.
        max_seq_len: Most tokens one sequence can hold.
        layer_windows: Per model layer, its sliding window or ``None``.
        devices: One device per ``params.n_devices``.
        session: Compiles each group's increment and copy graphs (``None``
            only with a ``cache_device``).
        enable_prefix_caching: Prefix caching by page sharing, in every group.
        cache_device: The device work of every group; default MAX's.
        tiers: KV tiers beyond the device and the swap space
            (:class:`~maxkv.tiers.TierConfig`, as for
            :class:`~maxkv.PagedKVCacheManager`): every group keeps its pages in
            tiers of its own (keys naming the group's window), the host, disk,
            swap and write-queue budgets split between the groups in proportion
            to their page sizes.  ``None``: no tiers, default swap space.

    Raises:
        ArgumentTypeError: If an argument has the wrong type.
        ValueError: If a size is not positive, ``num_pages`` does not give
            one count per group, or the devices do not match ``params``.
    """

    #: Admission by pages, swap and KV tiers, in every group; no attention sinks or
    #: CacheBlend yet.
    capabilities = CacheCapabilities(pages=True, swap=True, tiers=True)

    def __init__(
        self,
        params: KVCacheParams,
        page_size: int,
        num_pages: Sequence[int],
        max_batch_size: int,
        max_seq_len: int,
        layer_windows: Sequence[int | None],
        devices: Sequence[Device],
        session: InferenceSession | None,
        *,
        enable_prefix_caching: bool = False,
        cache_device: CacheDevice | None = None,
        tiers: TierConfig | None = None,
    ) -> None:
        windows, layers = layer_groups(layer_windows)
        if isinstance(num_pages, (str, bytes)) or not isinstance(num_pages, Sequence):
            raise ArgumentTypeError(
                f"num_pages must be a sequence of ints, got {type(num_pages).__name__}"
            )
        if len(num_pages) != len(windows):
            raise ValueError(
                f"num_pages gives {len(num_pages)} counts for {len(windows)} layer groups "
                f"(windows {windows})"
            )
        counts = [sum(1 for g, _ in layers if g == group) for group in range(len(windows))]
        if tiers is not None and not isinstance(tiers, TierConfig):
            raise TypeError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        group_tiers: list[TierConfig | None] = (
            [None] * len(windows) if tiers is None else list(_split_tiers(tiers, windows, counts))
        )
        #: The layer groups, in :func:`layer_groups` order.
        self.groups = [
            PagedKVCacheManager(
                params,
                page_size,
                pages,
                max_batch_size,
                max_seq_len,
                count,
                devices,
                session,
                enable_prefix_caching=enable_prefix_caching,
                cache_device=cache_device,
                sliding_window=window,
                tiers=one_group_tiers,
            )
            for window, pages, count, one_group_tiers in zip(
                windows, num_pages, counts, group_tiers, strict=True
            )
        ]
        spec = HybridCacheSpec(
            tuple(
                CacheSpec(params, count, "paged", page_size, group=g)
                for g, count in enumerate(counts)
            ),
            layers,
        )
        super().__init__(
            spec,
            max_batch_size,
            max_seq_len,
            devices,
            session,
            self.groups[0].cache_device,
        )
        self.page_size = self.groups[0].page_size
        self._layers = layers
        for group in self.groups:  # one set of ids, lengths and one lock
            group._lengths = self._lengths
            group._lock = self._lock

    # ------------------------------------------------------------ sizes

    @staticmethod
    def plan_pages(
        params: KVCacheParams,
        page_size: int,
        layer_windows: Sequence[int | None],
        devices: Sequence[Device],
        budget_bytes: int,
        max_batch_size: int,
        max_seq_len: int,
        step_tokens: int,
    ) -> list[int]:
        """Pages per group for ``budget_bytes`` of memory: each sliding group what
        ``max_batch_size`` sequences' windows hold while they decode, plus the pages
        of a step of ``step_tokens`` new tokens (a chunked prefill), and never more
        than their ``max_seq_len`` tokens; the full-attention group the rest.
        Without a full-attention group, the budget is split in proportion to the
        sliding groups' needs.

        Raises:
            ValueError: If the sliding groups' pages alone do not fit the budget.
        """
        windows, layers = layer_groups(layer_windows)
        counts = [sum(1 for g, _ in layers if g == group) for group in range(len(windows))]
        sizes = [
            PagedKVCacheManager.estimated_memory_size(params, page_size, 1, count, devices)
            for count in counts
        ]
        step_pages = math.ceil(step_tokens / page_size) + max_batch_size
        longest = max_batch_size * math.ceil(max_seq_len / page_size)
        wanted: list[int | None] = []
        for window in windows:
            bound = PageWindow(window, page_size).max_live_pages()
            wanted.append(
                None if bound is None else min(longest, max_batch_size * bound + step_pages)
            )
        sliding = sum(n * size for n, size in zip(wanted, sizes, strict=True) if n is not None)
        if sliding > budget_bytes and None in wanted:
            raise ValueError(
                f"the sliding-window layer groups need {sliding / 2**20:.1f} MiB for "
                f"{max_batch_size} sequences; the budget is {budget_bytes / 2**20:.1f} MiB"
            )
        if None not in wanted:
            scale = budget_bytes / sliding
            return [max(1, int(n * scale)) for n in wanted if n is not None]
        full = (budget_bytes - sliding) // sum(
            size for n, size in zip(wanted, sizes, strict=True) if n is None
        )
        return [int(full) if n is None else n for n in wanted]

    @property
    def num_pages(self) -> int:
        """Pages of every group together."""
        return sum(group.num_pages for group in self.groups)

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds, of every group together."""
        with self._lock:
            return sum(group.free_pages for group in self.groups)

    def nbytes(self) -> int:
        """Bytes the groups' pages take on all devices."""
        return sum(
            group.estimated_memory_size(
                group.params, group.page_size, group.num_pages, group.num_layers, group.devices
            )
            for group in self.groups
        )

    def held_bytes(self, seq_id: int) -> int:
        """Bytes of the pages ``seq_id`` holds in every group."""
        with self._lock:
            total = 0
            for group in self.groups:
                held = sum(1 for p in group.pages(seq_id) if p != UNUSED_PAGE)
                total += held * group.nbytes_per_page
            return total

    def group_pages(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """Per group, ``seq_id``'s page-table row (see :meth:`PagedKVCacheManager.pages`)."""
        with self._lock:
            return tuple(group.pages(seq_id) for group in self.groups)

    @property
    def _bounding(self) -> PagedKVCacheManager:
        """The group whose pages bound how many tokens fit: the full-attention one
        (the smallest when every group slides).  Its pages are the cache's units."""
        full = [g for g in self.groups if not g.window.slides]
        return min(full or self.groups, key=lambda g: g.num_pages)

    def units_for(self, tokens: int) -> int:
        """Pages of the full-attention group a sequence of ``tokens`` tokens holds at
        most (the sliding groups hold fewer: :meth:`plan_pages` sizes them for the
        batch's windows and one step; a step one of them has no room for raises
        ``CacheFullError``)."""
        return math.ceil(tokens / self.page_size)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.groups[g].window.window for g, _ in self._layers)

    @property
    def copies_supported(self) -> bool:
        return all(group.copies_supported for group in self.groups)

    def warm_up(self) -> None:
        for group in self.groups:
            group.warm_up()

    @property
    def free_units(self) -> int:
        """Free pages of the full-attention group (see :attr:`_bounding`)."""
        return self._bounding.free_pages

    @property
    def total_units(self) -> int:
        """Pages of the full-attention group (see :attr:`_bounding`)."""
        return self._bounding.num_pages

    def units_held(self, seq_id: int) -> list[int]:
        """The pages ``seq_id`` holds in the full-attention group (see
        :attr:`_bounding`; :meth:`group_pages` has every group's)."""
        with self._lock:
            return [p for p in self._bounding.pages(seq_id) if p != UNUSED_PAGE]

    @property
    def longest_sequence(self) -> int:
        """``max_seq_len``, or the tokens a full-attention group's pages hold if fewer
        (every group sliding: ``max_seq_len``)."""
        full = [g.num_pages for g in self.groups if not g.window.slides]
        return min([self.max_seq_len, *(n * self.page_size for n in full)])

    def describe(self) -> str:
        """``hybrid paged cache, pages of T tokens: <per group> (M MiB, E KV), ...``."""
        groups = ", ".join(
            f"{g.num_layers} layers "
            f"{'of full attention' if g.window.window is None else f'of window {g.window.window}'}"
            f" in {g.num_pages} pages"
            for g in self.groups
        )
        prefix = "prefix caching on" if self.prefix_caching else "prefix caching off"
        tiers = self.groups[0]._describe_tiers()
        per_group = f"{tiers} (per group, {len(self.groups)} groups)" if tiers else ""
        return (
            f"hybrid paged cache, pages of {self.page_size} tokens: {groups} "
            f"({self.nbytes() / 2**20:.1f} MiB, {self.params.encoding} KV), {prefix}{per_group}"
        )

    def pages_to_claim(self, prompt: Sequence[int], *, salt: str | None = None) -> int:
        """Free pages of every group together a claim of ``prompt`` and a first step
        over it would take now (each group's count; the step's ``reserve`` decides)."""
        with self._lock:
            return sum(group.pages_to_claim(prompt, salt=salt) for group in self.groups)

    # -------------------------------------------------------------- swap

    @property
    def swapped_bytes(self) -> int:
        """Host memory held by sequences swapped out and not swapped in yet."""
        with self._lock:
            return sum(group.swapped_bytes for group in self.groups)

    def swap_out(self, seq_id: int) -> SwappedSequence:
        """Preemption by swap, between rounds: every group's live pages of ``seq_id``
        go to host memory and ``seq_id`` is released (see
        :meth:`PagedKVCacheManager.swap_out`).

        Raises:
            ValueError: If ``seq_id`` is not claimed or the cache is not in host memory.
            CacheFullError: If a group's swap space cannot take it (nothing changes).
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            parts: list[SwappedSequence] = []
            try:
                for group in self.groups:
                    parts.append(group._swap_capture(seq))
            except CacheFullError:
                for group, part in zip(self.groups, parts, strict=False):
                    del group._swapped[part.number]
                raise
            length = self._lengths[seq]
            empty = np.zeros((0,), np.float32)
            self.release(seq)
            return SwappedSequence(length=length, blocks=empty, groups=tuple(parts))

    def swap_in_pages(self, swapped: SwappedSequence) -> int:
        """Free pages of every group together :meth:`swap_in` would take now."""
        with self._lock:
            self._check_swapped(swapped)
            return sum(
                g.swap_in_pages(part) for g, part in zip(self.groups, swapped.groups, strict=True)
            )

    def swap_in(self, swapped: SwappedSequence) -> int:
        """Continues a sequence :meth:`swap_out` moved to host memory, in every group
        under one new id; returns it.

        Raises:
            ValueError: If ``swapped`` is not one of this cache's, waiting.
            CacheFullError: If no id is free or a group's pages do not fit (nothing
                changes; ``swapped`` stays valid).
        """
        with self._lock:
            self._check_swapped(swapped)
            plans = [
                g._swap_in_check(part) for g, part in zip(self.groups, swapped.groups, strict=True)
            ]
            (seq,) = self._storage_claim(1)
            for group, part, plan in zip(self.groups, swapped.groups, plans, strict=True):
                group._swap_in_apply(seq, part, plan)
            return seq

    def _check_swapped(self, swapped: SwappedSequence) -> None:
        if not isinstance(swapped, SwappedSequence):
            raise ArgumentTypeError(
                f"swapped must be a SwappedSequence, got {type(swapped).__name__}"
            )
        if len(swapped.groups) != len(self.groups):
            raise ValueError(
                "this sequence was swapped out of another manager (not one with "
                f"{len(self.groups)} layer groups)"
            )

    # --------------------------------------------------- prefix caching

    @property
    def prefix_caching(self) -> bool:
        return self.groups[0].prefix_caching

    @property
    def prefix_block_size(self) -> int:
        self._require_prefix_caching("prefix_block_size")
        return self.page_size

    def prefix_hits(self, prompt: Sequence[int], *, salt: str | None = None) -> tuple[int, int]:
        """Pages of ``prompt``'s prefix :meth:`claim_prefix` would reuse now (no change):
        ``(on the device in every group, then with the KV tiers' blocks)``."""
        with self._lock:
            self._require_prefix_caching("prefix_hits")
            tokens = self._prompt(prompt)
            looks = [group._lookup(tokens, salt) for group in self.groups]  # hashed once
            on_device, _ = self._longest(looks, tiers=False)
            reused, _ = self._longest(looks, tiers=True)
            return on_device, reused - on_device

    def prefetch(self, prompt: Sequence[int], *, salt: str | None = None) -> None:
        """Every group's :meth:`PagedKVCacheManager.prefetch` (no-op without tiers)."""
        for group in self.groups:
            group.prefetch(prompt, salt=salt)

    @property
    def tier_hit_tokens(self) -> int:
        """Prompt tokens loaded from the tiers instead of computed (the full-attention
        group's count: every token of the prefix; else the first group's)."""
        full = [g for g in self.groups if not g.window.slides]
        return (full or self.groups)[0].tier_hit_tokens

    def close(self) -> None:
        """Finishes every group's queued tier writes and stops their threads."""
        for group in self.groups:
            group.close()

    def _prefix_plans(
        self, tokens: list[int], salt: str | None, *, tiers: bool = True
    ) -> tuple[int, list[_Prefix]]:
        """The most pages every group can reuse (from the device, then from its KV
        tiers unless not ``tiers``), and each group's plan for them."""
        return self._longest([group._lookup(tokens, salt) for group in self.groups], tiers)

    def _longest(
        self, looks: list[tuple[list[bytes], list[int | None], list[int]]], tiers: bool
    ) -> tuple[int, list[_Prefix]]:
        """:meth:`_prefix_plans` over each group's :meth:`PagedKVCacheManager._lookup`."""
        runs = [
            held_runs(g._held(hashes, found)) if tiers else device_runs
            for g, (hashes, found, device_runs) in zip(self.groups, looks, strict=True)
        ]
        for m in range(len(looks[0][0]), 0, -1):
            if all(g._prefix_fits(r, m) for g, r in zip(self.groups, runs, strict=True)):
                plans = [
                    g._prefix_at(hashes, found, r, m)
                    for g, (hashes, found, _), r in zip(self.groups, looks, runs, strict=True)
                ]
                return m, [plan for plan in plans if plan is not None]
        return 0, [_Prefix(0, [], look[0], 0) for look in looks]

    def _storage_find_prefix(self, tokens: list[int], salt: str | None) -> int:
        return self._prefix_plans(tokens, salt)[0] * self.page_size

    def _storage_claim_prefix(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        _, plans = self._prefix_plans(tokens, salt)
        (seq_id,) = self._storage_claim(1)
        cached = self._adopt(seq_id, tokens, salt, plans)
        if len(cached) > 1:
            # A tier could not give a group a block (gone, refused, no free page): every
            # group starts again from what the devices hold now, the loaded blocks
            # included (they are registered pages now).
            for group in self.groups:
                group._storage_release(seq_id)
            self._storage_claim_ids([seq_id])
            _, plans = self._prefix_plans(tokens, salt, tiers=False)
            cached = self._adopt(seq_id, tokens, salt, plans)
        (length,) = cached
        return seq_id, length

    def _adopt(
        self, seq_id: int, tokens: list[int], salt: str | None, plans: list[_Prefix]
    ) -> set[int]:
        """Every group's :meth:`PagedKVCacheManager._adopt_prefix`; the lengths they took."""
        return {
            g._adopt_prefix(seq_id, tokens, salt, plan)
            for g, plan in zip(self.groups, plans, strict=True)
        }

    def _storage_prefix_counters(self) -> tuple[int, int]:
        counters = [group._storage_prefix_counters() for group in self.groups]
        return sum(c[0] for c in counters), sum(c[1] for c in counters)

    def _storage_reset_prefix_cache(self) -> None:
        for group in self.groups:
            group._storage_reset_prefix_cache()

    def _on_commit(self, tokens: Mapping[int, list[int]]) -> None:
        for group in self.groups:
            group._on_commit(tokens)

    # ----------------------------------------------------- storage hooks

    def _free_ids(self) -> int:
        return self.groups[0]._free_ids()

    def _storage_claim(self, n: int) -> list[int]:
        seq_ids = self.groups[0]._storage_claim(n)
        for group in self.groups[1:]:
            group._storage_claim_ids(seq_ids)
        return seq_ids

    def _storage_claim_ids(self, seq_ids: list[int]) -> None:
        for group in self.groups:
            group._storage_claim_ids(seq_ids)

    def _storage_release(self, seq_id: int) -> None:
        for group in self.groups:
            group._storage_release(seq_id)

    def _storage_reserve(self, seq_ids: list[int], totals: list[int]) -> None:
        plans = [group._reserve_plan(seq_ids, totals) for group in self.groups]
        for index, (group, (_, needed)) in enumerate(zip(self.groups, plans, strict=True)):
            if needed > group._pool.free_count:
                window = group.window.window
                raise CacheFullError(
                    f"out of pages in layer group {index} ("
                    f"{'full attention' if window is None else f'window {window}'}): this step "
                    f"needs {needed} new pages of {self.page_size} tokens, "
                    f"{group._pool.free_count} of {group.num_pages} are free"
                )
        for group, (plan, _) in zip(self.groups, plans, strict=True):
            group._reserve_apply(plan)

    def _storage_inputs(
        self, seq_ids: list[int], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[CacheInputs]:
        per_group = [group._storage_inputs(seq_ids, lengths, max_lengths) for group in self.groups]
        return [
            tuple(b for inputs in device for b in inputs) for device in zip(*per_group, strict=True)
        ]

    def _storage_room(self, seq_id: int) -> int:
        return min(group._storage_room(seq_id) for group in self.groups)

    def _storage_truncate(self, seq_id: int, length: int) -> None:
        for group in self.groups:
            group._check_window(seq_id, length, "cannot pop_n")
        for group in self.groups:
            group._storage_truncate(seq_id, length)

    def _storage_fork(self, parent: int, child: int, fork_pos: int) -> None:
        for group in self.groups:
            group._check_window(parent, fork_pos, "cannot fork")
        if fork_pos % self.page_size and any(g._pool.free_count < 1 for g in self.groups):
            raise CacheFullError(
                f"cannot fork seq_id {parent} at {fork_pos}: its partial page needs a copy "
                "in every layer group and a group has no free page"
            )
        for group in self.groups:
            group._storage_fork(parent, child, fork_pos)

    def _storage_committed(self, seq_ids: list[int]) -> None:
        for group in self.groups:
            group._storage_committed(seq_ids)

    # ---------------------------------------------------------- protocol

    def increment_cache_lengths(
        self, kv_cache_inputs: Sequence[CacheInputs], prev_model_inputs: Any
    ) -> list[CacheInputs]:
        """Protocol step 3, per group (see
        :meth:`KVCacheManagerBase.increment_cache_lengths`); the inputs are the
        groups' 4-tuples one after the other, per device."""
        split = [
            split_inputs(inputs, len(self.groups), f"kv_cache_inputs[{i}] (one per layer group)")
            for i, inputs in enumerate(kv_cache_inputs)
        ]
        per_group = [
            group.increment_cache_lengths([device[g] for device in split], prev_model_inputs)
            for g, group in enumerate(self.groups)
        ]
        return [
            tuple(b for inputs in device for b in inputs) for device in zip(*per_group, strict=True)
        ]
