"""A paged cache of layer groups: sliding-window layers give their pages back,
full-attention layers keep every token.

Hybrid models interleave layers that attend to a window of recent tokens
with layers that attend to all of them (Gemma 3: five sliding layers to one
full layer).  In one paged cache a page holds every layer's keys and values
of its tokens, so it lives as long as the full-attention layers need it.
:class:`HybridKVCacheManager` groups the layers by window (vLLM v1's
``HybridKVCacheCoordinator``, MAX's ``KVCacheGroupId``): it is the paged
manager (:class:`~maxkv.PagedKVCacheManager`) with a page table per group
(:class:`~maxkv.cache.page_table.PageTable`: pages buffer, page pool,
prefix registry, tiers, each sequence's row), the sliding groups giving
pages back as their window passes them
(:class:`~maxkv.cache.window.PageWindow`).  The sequence ids, each
sequence's record, the committed lengths and the lock are the manager's.

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
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from max.driver import Device
from max.engine import InferenceSession

from ..errors import ArgumentTypeError
from ..tiers.store import TierConfig
from ..validation import require_int
from .page_table import PageTable
from .paged import PagedKVCacheManager, _check_num_pages, _check_tiers
from .params import KVCacheParams
from .protocol import (
    CacheCapabilities,
    CacheDevice,
    KVCacheManagerBase,
    _max_cache_device,
    validate_sizes,
)
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


class HybridKVCacheManager(PagedKVCacheManager):
    """The paged cache with a page table per layer group (by sliding window).

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
            tiers of its own (keys naming the group's window), the host, disk
            and write-queue budgets split between the groups in proportion to
            their page sizes; the swap space is the manager's, whole.  ``None``:
            no tiers, default swap space.

    Raises:
        ArgumentTypeError: If an argument has the wrong type.
        ValueError: If a size is not positive, ``num_pages`` does not give
            one count per group, or the devices do not match ``params``.
    """

    #: Admission by pages, swap and KV tiers, in every group; no attention sinks or
    #: CacheBlend yet.
    capabilities = CacheCapabilities(pages=True, swap=True, tiers=True, events=True)

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
        page_size = require_int("page_size", page_size, 1)
        if isinstance(num_pages, (str, bytes)) or not isinstance(num_pages, Sequence):
            raise ArgumentTypeError(
                f"num_pages must be a sequence of ints, got {type(num_pages).__name__}"
            )
        if len(num_pages) != len(windows):
            raise ValueError(
                f"num_pages gives {len(num_pages)} counts for {len(windows)} layer groups "
                f"(windows {windows})"
            )
        pages = [_check_num_pages(n) for n in num_pages]
        _check_tiers(tiers, enable_prefix_caching)
        counts = [sum(1 for g, _ in layers if g == group) for group in range(len(windows))]
        specs = tuple(
            CacheSpec(params, count, "paged", page_size, group=g) for g, count in enumerate(counts)
        )
        validate_sizes(params, max_batch_size, max_seq_len, len(layers), devices)
        first = cache_device
        if first is None and session is not None:
            first = _max_cache_device(specs[0], devices, session)
        KVCacheManagerBase.__init__(
            self,
            HybridCacheSpec(specs, layers),
            max_batch_size,
            max_seq_len,
            devices,
            session,
            first,
        )
        group_tiers: list[TierConfig | None] = (
            [None] * len(windows) if tiers is None else list(_split_tiers(tiers, windows, counts))
        )
        tables = []
        for g, (window, spec) in enumerate(zip(windows, specs, strict=True)):
            work = self.cache_device if g == 0 or cache_device is not None else None
            if work is None:
                work = _max_cache_device(spec, self.devices, session)
            tables.append(
                PageTable(
                    spec, pages[g], self.max_seq_len, window, self.devices, work, group_tiers[g]
                )
            )
        self._layers = layers
        self._set_up(page_size, tables, enable_prefix_caching, tiers)

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
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.groups[g].window.window for g, _ in self._layers)

    def describe(self) -> str:
        """``hybrid paged cache, pages of T tokens: <per group> (M MiB, E KV), ...``."""
        groups = ", ".join(
            f"{g.num_layers} layers "
            f"{'of full attention' if g.window.window is None else f'of window {g.window.window}'}"
            f" in {g.num_pages} pages"
            for g in self.groups
        )
        prefix = "prefix caching on" if self.prefix_caching else "prefix caching off"
        tiers = self._describe_tiers()
        per_group = f"{tiers} (per group, {len(self.groups)} groups)" if tiers else ""
        return (
            f"hybrid paged cache, pages of {self.page_size} tokens: {groups} "
            f"({self.nbytes() / 2**20:.1f} MiB, {self.params.encoding} KV), {prefix}{per_group}"
        )

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
            self._increment(group.cache_device, [device[g] for device in split], prev_model_inputs)
            for g, group in enumerate(self.groups)
        ]
        return [
            tuple(b for inputs in device for b in inputs) for device in zip(*per_group, strict=True)
        ]
