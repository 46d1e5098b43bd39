"""The continuous-batching KV cache manager: one slot per sequence.

Each sequence owns one *slot* of a preallocated cache: a ``[2, num_layers,
max_seq_len, n_kv_heads_per_device, head_dim]`` block per device.  A
sequence id *is* its slot index in ``[0, max_cache_batch_size)``, as in MAX
24.x.  The step protocol (claim, fetch, increment, step, release; fork and
pop_n between rounds) is written once in :mod:`maxkv.cache.protocol`; this module
adds the slots and, opt-in, prefix caching:

- :meth:`~ContinuousBatchingKVCacheManager.fork` copies the parent's first
  ``fork_pos`` tokens into a free slot on the device (one compiled graph,
  the ``maxkv.copy_tokens`` op), all layers, all devices.
- With ``enable_prefix_caching=True`` the manager records the token ids each
  slot holds (``step(..., tokens=...)``) and
  :meth:`~ContinuousBatchingKVCacheManager.claim_prefix` starts a new
  sequence with the longest prefix of its prompt that any slot holds, live
  or released (a released slot's KV is kept until the slot is reused, least
  recently released first): copied on the device into a free slot, or taken
  over in place when the source is the only free slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from max.driver import Device
from max.engine import InferenceSession

from ..events.log import EventSink, KVEventLog
from ..validation import require_int
from .params import KVCacheParams
from .prefix import PrefixIndex
from .protocol import (
    CacheCapabilities,
    CacheDevice,
    KVCacheManagerBase,
    device_inputs,
    validate_sizes,
)
from .spec import CacheInputs, CacheSpec

__all__ = ["ContinuousBatchingKVCacheManager"]


class ContinuousBatchingKVCacheManager(KVCacheManagerBase):
    """Owns the cache blocks and which sequence holds which slot.

    Args:
        params: Dtype and head layout of the cache.
        max_cache_batch_size: Number of slots (sequences cached at once).
        max_seq_len: Tokens one slot can hold (prompt plus generated tokens).
        num_layers: Transformer layers cached per slot.
        devices: One device per ``params.n_devices``; device *i* holds heads
            ``[i * n, (i + 1) * n)`` with ``n = params.n_kv_heads_per_device``.
        session: The session that runs the model; compiles the small graphs
            behind :meth:`increment_cache_lengths` and the copies (``None``
            only with a ``cache_device``).
        enable_prefix_caching: Record the token ids each slot holds and reuse
            prefixes in :meth:`claim_prefix` (then :meth:`step` needs the ids).
            Reuse copies rows on the cache's device (:attr:`copies_supported`).
        prefix_block_size: Tokens per hashed block (prefix caching).
        cache_device: The device work (zero fill, increments, copies);
            default MAX's (:class:`~maxkv.cache.device.MaxCacheDevice`).

    Raises:
        ArgumentTypeError: If an argument has the wrong type.
        ValueError: If a size is not positive, the number of devices differs
            from ``params.n_devices``, or prefix caching is asked of a cache
            that cannot copy rows.
    """

    capabilities = CacheCapabilities(events=True)
    _id_noun = "slots"
    _batch_arg = "max_cache_batch_size"

    def __init__(
        self,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession | None,
        *,
        enable_prefix_caching: bool = False,
        prefix_block_size: int = 16,
        cache_device: CacheDevice | None = None,
    ) -> None:
        super().__init__(
            CacheSpec(params, num_layers),
            max_cache_batch_size,
            max_seq_len,
            devices,
            session,
            cache_device,
        )
        if enable_prefix_caching:
            self._require_copies("prefix caching")
        self.max_cache_batch_size = self.max_batch_size
        self._free_slots: set[int] = set(range(self.max_cache_batch_size))
        self._prefix: PrefixIndex | None = (
            PrefixIndex(require_int("prefix_block_size", prefix_block_size, 1))
            if enable_prefix_caching
            else None
        )
        shape = self.block_shape(self.max_cache_batch_size)
        self._blocks = self.cache_device.zeros(shape, self.params.cache_dtype)

    # ------------------------------------------------------------------ sizes

    def block_shape(self, n_sequences: int) -> list[int]:
        """Shape of one device's blocks for ``n_sequences`` slots.

        ``[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device,
        head_width]``; axis 1 is 0 for keys, 1 for values.
        """
        n = require_int("n_sequences", n_sequences, 1)
        spec = self.spec
        assert isinstance(spec, CacheSpec)
        return spec.allocated_shape(n, self.max_seq_len)

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
    ) -> int:
        """Bytes the blocks take on all devices together (before allocating them)."""
        validate_sizes(
            params,
            max_cache_batch_size,
            max_seq_len,
            num_layers,
            devices,
            batch_arg="max_cache_batch_size",
        )
        tokens = max_cache_batch_size * max_seq_len
        return tokens * params.token_bytes(num_layers) * len(devices)

    def describe(self) -> str:
        """``contiguous cache: N slots x T tokens (M MiB, E KV), ...``."""
        size = self.estimated_memory_size(
            self.params, self.max_cache_batch_size, self.max_seq_len, self.num_layers, self.devices
        )
        prefix = "prefix caching on" if self.prefix_caching else "prefix caching off"
        return (
            f"contiguous cache: {self.max_cache_batch_size} slots x {self.max_seq_len} tokens "
            f"({size / 2**20:.1f} MiB, {self.params.encoding} KV), {prefix}"
        )

    @property
    def slots_remaining(self) -> int:
        """Slots that :meth:`claim` can still hand out."""
        with self._lock:
            return len(self._free_slots)

    # --------------------------------------------------------- prefix cache

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is enabled."""
        return self._prefix is not None

    @property
    def prefix_block_size(self) -> int:
        """Tokens per hashed block of the prefix cache."""
        if self._prefix is None:
            raise ValueError("prefix caching is not enabled (enable_prefix_caching=True)")
        return self._prefix.block_size

    def _storage_find_prefix(self, tokens: list[int], salt: str | None) -> int:
        return self._find_prefix(tokens, salt)[1]

    def _storage_claim_prefix(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        # Copy into a free slot, so that a released source keeps all it holds
        # for later prompts; take the source over in place when it is the
        # only free slot.
        assert self._prefix is not None
        source, cached = self._find_prefix(tokens, salt)
        spare = self._slot_order(exclude=source)[:1]
        if source is not None and source in self._free_slots and not spare:
            self._free_slots.remove(source)
            self._prefix.keep(source)
            self._prefix.truncate(source, cached)
            return source, cached
        (seq_id,) = spare
        self._free_slots.remove(seq_id)
        self._prefix.reuse(seq_id)
        if source is not None and cached:
            try:
                self._copy(source, seq_id, cached)
            except BaseException:
                self._storage_release(seq_id)
                raise
            self._prefix.copy(source, seq_id, cached)
        else:
            self._prefix.set_salt(seq_id, salt)
        return seq_id, cached

    def _storage_prefix_counters(self) -> tuple[int, int]:
        assert self._prefix is not None
        return self._prefix.stats.evictions, self._prefix.indexed_blocks

    def attach_kv_events(self, sink: EventSink) -> KVEventLog:
        """From now on, announces the blocks its prefix index finds (in live and
        released slots) to ``sink`` as KV events (:mod:`maxkv.events.log`): a block
        is stored when a first slot holds it, removed when the last one lets it go.

        Raises:
            ValueError: If prefix caching is off, or events are attached already.
        """
        with self._lock:
            self._require_prefix_caching("attach_kv_events")
            if self._lock.events is not None:
                raise ValueError("KV events are attached to this cache already")
            assert self._prefix is not None
            log = KVEventLog(sink)
            self._prefix.events = log.group(0, self._prefix.block_size, None)
            self._lock.events = log
            return log

    def _storage_reset_prefix_cache(self) -> None:
        # Released slots' records go; live sequences stay findable until released.
        assert self._prefix is not None
        for slot in self._prefix.released_lru():
            self._prefix.forget(slot)

    def _find_prefix(self, tokens: list[int], salt: str | None) -> tuple[int | None, int]:
        assert self._prefix is not None
        candidates = set(self._lengths) | set(self._prefix.released_lru())
        source, cached = self._prefix.longest_prefix(tokens[:-1], candidates, salt)
        if source is not None and source in self._lengths:
            cached = min(cached, self._lengths[source])  # only committed tokens
        return (source, cached) if cached else (None, 0)

    # ------------------------------------------------------- storage hooks

    def _free_ids(self) -> int:
        return len(self._free_slots)

    def _slot_order(self, exclude: int | None = None) -> list[int]:
        """Free slots in claiming order: with prefix caching, slots holding nothing
        first, then the least recently released."""
        if self._prefix is None:
            order = sorted(self._free_slots)
        else:
            released = [s for s in self._prefix.released_lru() if s in self._free_slots]
            kept = set(released)
            order = sorted(s for s in self._free_slots if s not in kept) + released
        return [s for s in order if s != exclude]

    def _storage_claim(self, n: int) -> list[int]:
        slots = self._slot_order()[:n]
        for slot in slots:
            self._free_slots.remove(slot)
            if self._prefix is not None:
                self._prefix.reuse(slot)
        return slots

    def _storage_claim_ids(self, seq_ids: list[int]) -> None:
        for slot in seq_ids:
            self._free_slots.remove(slot)
            if self._prefix is not None:
                self._prefix.reuse(slot)

    def _storage_release(self, seq_id: int) -> None:
        self._free_slots.add(seq_id)
        if self._prefix is not None:
            self._prefix.release(seq_id)

    def _storage_reserve(self, seq_ids: list[int], totals: list[int]) -> None:
        pass  # a slot already holds max_seq_len tokens

    def _storage_inputs(
        self, seq_ids: list[int], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[CacheInputs]:
        slots = np.array(seq_ids, dtype=np.uint32)
        return [*device_inputs(self._blocks, self.devices, lengths, slots, max_lengths)]

    def _storage_truncate(self, seq_id: int, length: int) -> None:
        if self._prefix is not None:
            self._prefix.truncate(seq_id, length)

    def _storage_fork(self, parent: int, child: int, fork_pos: int) -> None:
        self._copy(parent, child, fork_pos)
        if self._prefix is not None:
            self._prefix.copy(parent, child, fork_pos)

    def _on_commit(self, tokens: Mapping[int, list[int]]) -> None:
        if self._prefix is None:
            return
        for seq_id, ids in tokens.items():
            self._prefix.append(seq_id, ids)

    # -------------------------------------------------------------- copies

    def _copy(self, source: int, destination: int, length: int) -> None:
        """Copies ``source``'s first ``length`` tokens into ``destination`` on every device."""
        lengths = np.array([length, 0], dtype=np.uint32)
        max_lengths = np.array([[0, length]], dtype=np.uint32)
        slots = np.array([source, destination], dtype=np.uint32)
        inputs = device_inputs(self._blocks, self.devices, lengths, slots, max_lengths)
        self._copy_tokens(inputs, 0, length)
