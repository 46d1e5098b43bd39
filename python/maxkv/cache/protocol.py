"""The step protocol of maxkv's KV cache managers, written once.

Two managers follow it: :class:`~maxkv.ContinuousBatchingKVCacheManager`
(one slot of ``max_seq_len`` tokens per sequence) and
:class:`~maxkv.PagedKVCacheManager` (pages of ``page_size`` tokens, TVM's
design).  A sequence id is an int in ``[0, max_batch_size)``.  In each round
of model forwarding (TVM's ``PagedAttentionKVCacheObj`` steps 1 to 4):

1. ``claim(n)`` / ``external_claim(ids)``: sequences get ids; lengths start at 0.
2. ``fetch(seq_ids, num_steps, active_lengths=...)``: the appended lengths of
   this round are set (TVM's ResetAppendLengths), room for the new tokens of
   all ``num_steps`` steps is reserved up front (ReserveExtraLengthForAppend:
   pages for the paged manager), and the per-device graph inputs are built
   (SyncAuxArrayToDevice): a 4-tuple per device.
3. The model graph runs: per layer it appends the new keys and values and
   computes attention (TVM's step 4).  Between the ``num_steps`` steps,
   ``increment_cache_lengths(inputs, prev_model_inputs)`` advances the
   inputs on the device (no host round trip, no allocation).
4. ``step({seq_id: new_tokens})`` commits the tokens written since ``fetch``;
   ``release(seq_id)`` frees the sequence.

A scheduler that must know before the round whether a step fits (MAX's
``alloc``) calls ``reserve({seq_id: total_tokens})`` between steps 1 and 2:
the room ``fetch`` would reserve, taken now; ``fetch`` then finds it there.

With prefix caching (``enable_prefix_caching=True``), step 1 is
``claim_prefix(prompt, salt=...)``: the new sequence starts holding the
longest cached prefix of its prompt (shared pages, or rows copied into its
slot), and step 4 records the committed token ids (``step(..., tokens=...)``)
so that later prompts find them.

Sequence operations happen between rounds: ``fork(parent, fork_pos)``
starts a new sequence holding the parent's first ``fork_pos`` tokens;
``pop_n(seq_id, n)`` drops a sequence's last ``n`` tokens.

Every public method checks its input before it changes any state or runs
any kernel, with the exceptions of :mod:`maxkv.errors`
(:class:`~maxkv.errors.ArgumentTypeError` for an argument of the wrong kind,
``ValueError`` for a wrong value, :class:`~maxkv.errors.CacheFullError` when
the input is fine but the cache has no room now), and holds one re-entrant
lock while it reads or changes the manager's state: the managers may be
called from many threads.  :meth:`KVCacheManagerBase.increment_cache_lengths`
only launches device work, so concurrent model steps are serialised on their
launch only.

The bookkeeping lives on the host; the little device work (filling the cache
with zeros, advancing lengths between steps, copying tokens) goes through
the :class:`CacheDevice` a manager is given: MAX graphs
(:class:`maxkv.cache.device.MaxCacheDevice`) unless another is passed.
"""

from __future__ import annotations

import threading
import types
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import TensorType

from ..errors import ArgumentTypeError, CacheFullError
from ..validation import require_int
from .params import KVCacheParams
from .prefix import PrefixCacheStats
from .spec import (
    CacheInputs,
    CacheSpec,
    HybridCacheSpec,
    KVCacheInputs,
    KVCacheInputSymbols,
    split_inputs,
)

if TYPE_CHECKING:
    from ..events.log import EventSink, KVEventLog
    from ..graph.types import FetchContinuousBatchingKVCacheCollection, FetchPagedKVCacheCollection
    from .paged import SwappedSequence

__all__ = [
    "CacheCapabilities",
    "CacheDevice",
    "CacheFullError",
    "KVCacheInputSymbols",
    "KVCacheInputs",
    "KVCacheManagerBase",
    "require_int",
    "validate_sizes",
]


class CacheDevice(Protocol):
    """What a manager does on its devices; everything else it keeps on the host.

    :class:`maxkv.cache.device.MaxCacheDevice` is MAX's (the default); tests
    give a NumPy one, so that the managers' bookkeeping runs without a MAX
    session.
    """

    @property
    def copies_supported(self) -> bool:
        """Whether :meth:`copy_tokens` can run on these devices."""

    def zeros(self, shape: Sequence[int], dtype: DType) -> list[Buffer]:
        """One zero-filled buffer per device, filled before this returns."""

    def increment(self, row_offsets: Buffer, cache_lengths: Sequence[Buffer]) -> list[Buffer]:
        """``cache_lengths[d] + diff(row_offsets)`` per device, on the devices."""

    def copy_tokens(self, inputs: Sequence[KVCacheInputs], start: int, end: int) -> None:
        """Copies tokens ``[start, end)`` of batch entry 0 into entry 1 of ``inputs``
        (per device, the 4-tuple of ``[source, destination]``), every layer."""

    def warm_up(self) -> None:
        """Prepares the device work now (compiles graphs) rather than on first use."""


class _CallLock:
    """A manager's re-entrant lock.  As its outermost holder lets go, the KV events
    the call made (:attr:`events`, when attached) go out as one batch."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.events: KVEventLog | None = None

    def __enter__(self) -> _CallLock:
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        try:
            if self._depth == 0 and self.events is not None:
                self.events.flush()
        finally:
            self._lock.release()


@dataclass(frozen=True)
class CacheCapabilities:
    """What a manager offers beyond the step protocol.

    The layers above the cache (schedulers, ``max serve``, CacheBlend) ask a
    manager's :attr:`KVCacheManagerBase.capabilities`, never its class.  The
    methods of a capability are declared on :class:`KVCacheManagerBase`; on a
    manager without it they raise ``ValueError`` naming the capability.
    """

    #: Admission by pages: :attr:`~KVCacheManagerBase.free_pages` and
    #: :meth:`~KVCacheManagerBase.pages_to_claim` (the scheduler's
    #: ``preemption="recompute"``).
    pages: bool = False
    #: Preemption by swap: :meth:`~KVCacheManagerBase.swap_out`,
    #: :meth:`~KVCacheManagerBase.swap_in`, :meth:`~KVCacheManagerBase.swap_in_pages`.
    swap: bool = False
    #: StreamingLLM attention sinks per sequence:
    #: :meth:`~KVCacheManagerBase.enable_attention_sinks`.
    sinks: bool = False
    #: CacheBlend: :meth:`~KVCacheManagerBase.read_tokens` and
    #: :meth:`~KVCacheManagerBase.mark_blended` (KV reused from elsewhere,
    #: never registered in the prefix cache).
    blending: bool = False
    #: KV tiers below the device (host memory, disk, Redis) behind prefix caching.
    tiers: bool = False
    #: KV events for KV-aware routers (:meth:`~KVCacheManagerBase.attach_kv_events`).
    events: bool = False

    def names(self) -> tuple[str, ...]:
        """The capabilities it has, by name (for messages and ``describe``)."""
        return tuple(name for name, on in vars(self).items() if on)


class KVCacheManagerBase(ABC):
    """What every maxkv manager shares: ids, lengths, validation, the lock,
    the increment graph and the protocol's public methods.

    Subclasses own the storage (slots or pages) through the ``_storage_*``
    hooks, each called with the lock held and after validation.
    """

    #: What this kind of manager offers beyond the step protocol.
    capabilities: ClassVar[CacheCapabilities] = CacheCapabilities()
    #: What an id stands for, in messages ("slots", "sequences").
    _id_noun = "sequences"
    #: The constructor argument that sizes the id space, in messages.
    _batch_arg = "max_batch_size"

    def __init__(
        self,
        spec: CacheSpec | HybridCacheSpec,
        max_batch_size: int,
        max_seq_len: int,
        devices: Sequence[Device],
        session: InferenceSession | None,
        cache_device: CacheDevice | None = None,
    ) -> None:
        validate_sizes(
            spec.params,
            max_batch_size,
            max_seq_len,
            spec.num_layers,
            devices,
            batch_arg=self._batch_arg,
        )
        if cache_device is None and session is None:
            raise ValueError("a session is needed unless a cache_device is given")
        #: What graphs need to know of this cache (:class:`~maxkv.cache.spec.CacheSpec`).
        self.spec = spec
        self.params = spec.params
        self.num_layers = spec.num_layers
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.devices = list(devices)
        self.session = session
        #: The device work (zero fill, increments, copies): MAX's unless given.
        self.cache_device: CacheDevice = (
            cache_device
            if cache_device is not None
            else _max_cache_device(_single(spec), devices, session)
        )
        self._lock = _CallLock()
        self._lengths: dict[int, int] = {}
        #: Lookups and hit tokens of prefix caching (evictions: the storage's).
        self._prefix_stats = PrefixCacheStats()

    # ------------------------------------------------------- storage hooks

    @abstractmethod
    def _free_ids(self) -> int:
        """How many new sequences can be claimed now."""

    @abstractmethod
    def _storage_claim(self, n: int) -> list[int]:
        """Takes ``n`` free ids (``n <= _free_ids()``)."""

    @abstractmethod
    def _storage_claim_ids(self, seq_ids: list[int]) -> None:
        """Takes the given free ids."""

    @abstractmethod
    def _storage_release(self, seq_id: int) -> None:
        """Frees a claimed id and its storage."""

    @abstractmethod
    def _storage_reserve(self, seq_ids: list[int], totals: list[int]) -> None:
        """Makes room for each sequence to hold ``totals`` tokens; raises
        ``ValueError`` (changing nothing) when that is impossible."""

    @abstractmethod
    def _storage_inputs(
        self, seq_ids: list[int], lengths: np.ndarray, max_lengths: np.ndarray
    ) -> list[CacheInputs]:
        """The per-device graph inputs of ``seq_ids`` (after ``_storage_reserve``)."""

    @abstractmethod
    def _storage_truncate(self, seq_id: int, length: int) -> None:
        """The sequence will hold ``length`` tokens (``pop_n``; ``_lengths`` still has
        the old length); raises ``ValueError`` (changing nothing) if it cannot."""

    def _storage_committed(self, seq_ids: list[int]) -> None:  # noqa: B027 (optional hook)
        """``step`` committed tokens of ``seq_ids`` (``_lengths`` is updated)."""

    @abstractmethod
    def _storage_fork(self, parent: int, child: int, fork_pos: int) -> None:
        """``child`` (claimed, empty) now holds ``parent``'s first ``fork_pos`` tokens."""

    # Prefix caching (called only when :attr:`prefix_caching` is on).

    def _storage_find_prefix(self, tokens: list[int], salt: str | None) -> int:
        """Tokens of ``tokens[:-1]`` the cache holds now, as a claim would reuse them."""
        raise NotImplementedError

    def _storage_claim_prefix(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        """Claims an id holding the longest cached prefix of ``tokens[:-1]``;
        ``(seq_id, cached tokens)``.  A free id exists."""
        raise NotImplementedError

    def _storage_prefix_counters(self) -> tuple[int, int]:
        """(evictions so far, blocks findable now)."""
        raise NotImplementedError

    def _storage_reset_prefix_cache(self) -> None:
        raise NotImplementedError

    def input_symbols(self) -> Sequence[tuple[TensorType, ...]]:
        """Graph input types of :meth:`fetch`'s 4-tuples, one per device
        (``self.spec.input_symbols(self.devices)``; the sizes are symbolic,
        so one compiled graph serves every manager of this spec)."""
        return self.spec.input_symbols(self.devices)

    def collection_fetcher(
        self,
    ) -> FetchContinuousBatchingKVCacheCollection | FetchPagedKVCacheCollection:
        """What turns one device's :meth:`fetch` inputs into the collection inside a graph."""
        from ..graph.types import collection_fetcher

        return collection_fetcher(_single(self.spec))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window past which this cache gives tokens back
        (``None``: it keeps them while the sequence lives).  A model may use the
        cache when each of its layers attends to no more than that."""
        return (None,) * self.num_layers

    def _storage_room(self, seq_id: int) -> int:
        """Tokens ``seq_id``'s storage has room for now (a slot: ``max_seq_len``)."""
        del seq_id
        return self.max_seq_len

    # ------------------------------------------------------------ occupancy
    # One vocabulary for schedulers and MAX's adapter, the same for every kind
    # of cache: a *unit* is what bounds how many sequences fit, a slot
    # (contiguous) or a page (paged; a hybrid cache's full-attention group,
    # whose pages bound how many tokens fit, the sliding groups being sized for
    # the batch's windows).  Raw page counts of every group are the ``pages``
    # capability's (:attr:`free_pages`).

    def units_for(self, tokens: int) -> int:
        """Units one sequence of ``tokens`` tokens holds at most: 1 (its slot), or
        its pages while a step computes them all at once."""
        del tokens
        return 1

    @property
    def free_units(self) -> int:
        """Units no sequence holds now: free slots, or free pages (cached pages of
        the prefix cache count: they are evictable)."""
        return self.max_batch_size - len(self.cache_lengths)

    @property
    def total_units(self) -> int:
        """Units of the whole cache: slots, or pages."""
        return self.max_batch_size

    def units_held(self, seq_id: int) -> list[int]:
        """The units ``seq_id`` holds: its slot, or its pages (those a sliding
        window gave back left out)."""
        return [seq_id]

    @property
    def longest_sequence(self) -> int:
        """The most tokens one sequence can hold: ``max_seq_len``, or fewer where the
        pages of full attention cannot hold that many."""
        return self.max_seq_len

    def prefix_hits(self, prompt: Sequence[int], *, salt: str | None = None) -> tuple[int, int]:
        """Blocks of :attr:`prefix_block_size` tokens of ``prompt``'s prefix that
        :meth:`claim_prefix` would reuse now: ``(in the cache, from the KV tiers)``
        (no change).

        Raises:
            ValueError: If prefix caching is off.
        """
        return self.cached_prefix_length(prompt, salt=salt) // self.prefix_block_size, 0

    def prefetch(self, prompt: Sequence[int], *, salt: str | None = None) -> None:  # noqa: B027
        """A request arrived: start bringing the blocks of its prefix that only slow
        KV tiers hold into host memory (a no-op without tiers)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Finishes background work (the KV tiers' queued writes); a no-op by default."""

    def describe(self) -> str:
        """One line on the cache (its layout, size, encoding), for logs."""
        return f"{type(self).__name__} ({self.params.encoding} KV)"

    # ------------------------------------------------------------ state

    @property
    def cache_lengths(self) -> Mapping[int, int]:
        """Committed tokens per claimed sequence id (a read-only snapshot)."""
        with self._lock:
            return types.MappingProxyType(dict(self._lengths))

    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is currently claimed."""
        with self._lock:
            return seq_id in self._lengths

    # ------------------------------------------------------- prefix caching

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (``enable_prefix_caching=True``)."""
        return False

    @property
    def prefix_block_size(self) -> int:
        """Tokens per hashed block: a prefix is reused in whole blocks (pages)."""
        raise ValueError("prefix caching is not enabled (enable_prefix_caching=True)")

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups, hit tokens, evictions and cached blocks so far (a copy).

        Raises:
            ValueError: If prefix caching is off.
        """
        with self._lock:
            self._require_prefix_caching("prefix_cache_stats")
            evictions, cached = self._storage_prefix_counters()
            s = self._prefix_stats
            return PrefixCacheStats(s.lookups, s.hit_tokens, evictions, cached)

    def cached_prefix_length(self, prompt: Sequence[int], *, salt: str | None = None) -> int:
        """Tokens of ``prompt`` that :meth:`claim_prefix` would reuse now (no change).

        Raises:
            ValueError: If prefix caching is off or the prompt is not a
                non-empty sequence of token ids.
        """
        with self._lock:
            self._require_prefix_caching("cached_prefix_length")
            return self._storage_find_prefix(self._prompt(prompt), _salt(salt))

    def claim_prefix(self, prompt: Sequence[int], *, salt: str | None = None) -> tuple[int, int]:
        """Protocol step 1 with prefix caching: claims a sequence for ``prompt``.

        The new sequence starts holding the longest prefix of ``prompt`` the
        cache holds (at most ``len(prompt) - 1`` tokens, so at least one token
        is left to compute; in whole pages on a paged cache), reused from a
        sequence whose ``salt`` is the same (``None`` matches ``None``).
        Prefill ``prompt[cached:]`` next.

        Returns:
            ``(seq_id, cached)``: the id and the prompt tokens already cached.

        Raises:
            ValueError: If prefix caching is off, the prompt is empty, not
                token ids, or longer than ``max_seq_len``, or ``salt`` is not
                a str; :class:`CacheFullError` if no sequence can be claimed.
        """
        with self._lock:
            self._require_prefix_caching("claim_prefix")
            tokens = self._prompt(prompt)
            salt = _salt(salt)
            if len(tokens) > self.max_seq_len:
                raise ValueError(
                    f"prompt of {len(tokens)} tokens is longer than max_seq_len {self.max_seq_len}"
                )
            if self._free_ids() == 0:
                raise CacheFullError(
                    f"cannot claim: all {self.max_batch_size} {self._id_noun} are in use"
                )
            seq_id, cached = self._storage_claim_prefix(tokens, salt)
            self._lengths[seq_id] = cached
            self._prefix_stats.lookups += 1
            self._prefix_stats.hit_tokens += cached
            return seq_id, cached

    def reset_prefix_cache(self) -> None:
        """Forgets the cached prefixes (no later claim reuses them); sequences keep their KV.

        With KV tiers (paged), the host and disk tiers are cleared too; the Redis
        tier is shared with other processes and keeps its blocks.

        Raises:
            ValueError: If prefix caching is off.
        """
        with self._lock:
            self._require_prefix_caching("reset_prefix_cache")
            self._storage_reset_prefix_cache()

    def _require_prefix_caching(self, what: str) -> None:
        if not self.prefix_caching:
            raise ValueError(f"{what} needs enable_prefix_caching=True (prefix caching is off)")

    def _prompt(self, prompt: Sequence[int]) -> list[int]:
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise ArgumentTypeError(
                f"prompt must be a sequence of token ids, got {type(prompt).__name__}"
            )
        tokens = [require_int("prompt token", t, 0) for t in prompt]
        if not tokens:
            raise ValueError("prompt must not be empty")
        return tokens

    # ------------------------------------------------------------ protocol

    def claim(self, n: int) -> list[int]:
        """Protocol step 1: claims ``n`` new sequences and returns their ids.

        Raises:
            ValueError: If ``n`` is not a positive int or more sequences than
                can be claimed now.
        """
        with self._lock:
            count = require_int("n", n, 1)
            free = self._free_ids()
            if count > free:
                raise CacheFullError(
                    f"cannot claim {count} sequences: only {free} of {self.max_batch_size} "
                    f"{self._id_noun} are free"
                )
            seq_ids = self._storage_claim(count)
            for seq_id in seq_ids:
                self._lengths[seq_id] = 0
            return seq_ids

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Protocol step 1, with ids chosen by the caller.

        Raises:
            ValueError: If ``seq_ids`` is empty, repeats an id, or names an
                id out of range or already claimed.
        """
        with self._lock:
            ids = self._validate_ids(seq_ids, must_be_claimed=False)
            self._storage_claim_ids(ids)
            for seq_id in ids:
                self._lengths[seq_id] = 0

    def reserve(self, totals: Mapping[int, int]) -> None:
        """Between protocol steps 1 and 2: room for each sequence to hold ``totals[seq_id]`` tokens.

        What :meth:`fetch` reserves for its round (pages on a paged cache,
        with copy-on-write of any shared page those tokens land in), taken
        ahead so that a scheduler learns now whether the step fits; a later
        ``fetch`` within these totals needs nothing more.  A contiguous slot
        always has room up to ``max_seq_len``.

        Raises:
            ValueError: On an unknown id, a total below the sequence's
                committed length or past ``max_seq_len``;
                :class:`CacheFullError` when too few pages are free.
                Nothing is reserved then.
        """
        if not isinstance(totals, Mapping):
            raise ArgumentTypeError(
                f"totals must be a mapping {{seq_id: tokens}}, got {type(totals).__name__}"
            )
        with self._lock:
            ids = self._validate_ids(list(totals), must_be_claimed=True, allow_empty=True)
            wanted = []
            for seq_id in ids:
                total = require_int(f"totals[{seq_id}]", totals[seq_id], 0)
                if total < self._lengths[seq_id] or total > self.max_seq_len:
                    raise ValueError(
                        f"seq_id {seq_id}: a total of {total} tokens is outside "
                        f"[{self._lengths[seq_id]} committed, max_seq_len {self.max_seq_len}]"
                    )
                wanted.append(total)
            if ids:
                self._storage_reserve(ids, wanted)

    def fetch(
        self,
        seq_ids: Sequence[int],
        num_steps: int = 1,
        *,
        active_lengths: Sequence[int] | Mapping[int, int] | None = None,
    ) -> list[CacheInputs]:
        """Protocol step 2: reserves room for ``num_steps`` steps and returns the graph inputs.

        Args:
            seq_ids: Claimed ids, in batch order.
            num_steps: Model steps these inputs cover; steps after the first
                are decode steps of one new token per sequence, reached with
                :meth:`increment_cache_lengths`.
            active_lengths: New tokens of each sequence in the first step,
                in ``seq_ids`` order or as ``{seq_id: n}``: the prompt length
                for context encoding.  Default: 1 per sequence (a decode step).

        Returns:
            Per device, a 4-tuple whose last element is the host uint32
            ``[num_steps, 2]`` tensor ``max_lengths``: row *i* holds (max new
            tokens, max cache length) of step *i*; row 0's max cache length
            is 0 exactly when every cache is empty.

        Raises:
            ValueError: On an empty, repeated, unknown or released id, a
                non-positive ``num_steps`` or active length, a sequence that
                would pass ``max_seq_len`` within ``num_steps``, or (paged)
                too few free pages.  Nothing is reserved then.
        """
        with self._lock:
            ids = self._validate_ids(seq_ids, must_be_claimed=True)
            steps = require_int("num_steps", num_steps, 1)
            active = self._active_lengths(ids, active_lengths)
            lengths = np.array([self._lengths[s] for s in ids], dtype=np.int64)
            totals = []
            for seq_id, length, new in zip(ids, lengths, active, strict=True):
                needed = int(length) + int(new) + steps - 1
                if needed > self.max_seq_len:
                    raise ValueError(
                        f"seq_id {seq_id} has {length} cached tokens; {new} new tokens and "
                        f"{steps - 1} further steps need {needed} > max_seq_len "
                        f"{self.max_seq_len}"
                    )
                totals.append(needed)
            self._storage_reserve(ids, totals)
            max_lengths = np.empty((steps, 2), dtype=np.uint32)
            max_lengths[0] = (active.max(), lengths.max())
            after_first = lengths + active
            for i in range(1, steps):
                max_lengths[i] = (1, after_first.max() + i - 1)
            return self._storage_inputs(ids, lengths.astype(np.uint32), max_lengths)

    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[CacheInputs],
        prev_model_inputs: Any,
    ) -> list[CacheInputs]:
        """Protocol step 3 (between steps): the next step's inputs, advanced on the device.

        ``cache_lengths`` (element 1) becomes ``cache_lengths +
        diff(input_row_offsets)`` through a compiled graph (no host round
        trip, no sync, no allocation); ``max_lengths`` becomes a view of its
        next row onwards; the other inputs pass through.  The committed
        lengths are not touched: call :meth:`step` for that.

        Args:
            kv_cache_inputs: This step's inputs, as :meth:`fetch` or an
                earlier call returned them.
            prev_model_inputs: The inputs of the step that just ran: a tuple
                whose element 1 is ``input_row_offsets`` (uint32
                ``[batch + 1]`` on the first device, as in MAX 24.x), or an
                object with an ``input_row_offsets`` attribute.

        Raises:
            ValueError: If the inputs are not one 4-tuple per device, the row
                offsets do not match the batch, or no further step was
                fetched (``max_lengths`` has a single row).
        """
        return self._increment(self.cache_device, kv_cache_inputs, prev_model_inputs)

    def _increment(
        self,
        cache_device: CacheDevice,
        kv_cache_inputs: Sequence[CacheInputs],
        prev_model_inputs: Any,
    ) -> list[CacheInputs]:
        """:meth:`increment_cache_lengths` of one cache's 4-tuples, by ``cache_device``."""
        if len(kv_cache_inputs) != len(self.devices):
            raise ValueError(
                f"expected one 4-tuple per device ({len(self.devices)}), got {len(kv_cache_inputs)}"
            )
        row_offsets = _row_offsets(prev_model_inputs)
        if row_offsets.device != self.devices[0]:
            raise ValueError(
                f"input_row_offsets must be on the first device {self.devices[0]}, "
                f"got {row_offsets.device}"
            )
        for i, inputs in enumerate(kv_cache_inputs):
            ((_, lengths, _, max_lengths),) = split_inputs(inputs, 1, f"kv_cache_inputs[{i}]")
            if max_lengths.shape[0] < 2:
                raise ValueError(
                    "no further step was fetched: max_lengths has one row left; "
                    "fetch(seq_ids, num_steps=N) covers N steps"
                )
            if row_offsets.shape[0] != lengths.shape[0] + 1:
                raise ValueError(
                    f"input_row_offsets has {row_offsets.shape[0]} entries, expected "
                    f"batch + 1 = {lengths.shape[0] + 1}"
                )
        new_lengths = cache_device.increment(row_offsets, [inputs[1] for inputs in kv_cache_inputs])
        return [
            KVCacheInputs(storage, lengths, table, max_lengths[1:, :])
            for (storage, _, table, max_lengths), lengths in zip(
                kv_cache_inputs, new_lengths, strict=True
            )
        ]

    def step(
        self,
        valid_lengths: Mapping[int, int],
        tokens: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        """Protocol step 4: commits ``valid_lengths[seq_id]`` new tokens per sequence.

        Args:
            valid_lengths: ``{seq_id: new_tokens}``.
            tokens: ``{seq_id: token ids}`` of those tokens; required for
                every sequence that commits tokens when prefix caching is on
                (which records them), ignored otherwise.  Each list must hold
                exactly ``valid_lengths[seq_id]`` ids.

        Raises:
            ValueError: If an id is not claimed, a count is negative, a
                sequence would pass ``max_seq_len``, or token ids disagree
                with the counts; nothing is committed then.
        """
        if not isinstance(valid_lengths, Mapping):
            raise ArgumentTypeError(
                f"valid_lengths must be a mapping {{seq_id: new_tokens}}, got "
                f"{type(valid_lengths).__name__}"
            )
        if self.prefix_caching:
            missing = [s for s, n in valid_lengths.items() if n and s not in (tokens or {})]
            if missing:
                raise ValueError(
                    f"prefix caching records committed tokens: pass tokens= for seq_ids {missing}"
                )
        with self._lock:
            self._validate_ids(list(valid_lengths), must_be_claimed=True, allow_empty=True)
            counts = {}
            for seq_id, new in valid_lengths.items():
                count = require_int(f"valid_lengths[{seq_id}]", new, 0)
                total = self._lengths[seq_id] + count
                if total > self.max_seq_len:
                    raise ValueError(
                        f"seq_id {seq_id}: {self._lengths[seq_id]} cached + {count} new tokens "
                        f"= {total} > max_seq_len {self.max_seq_len}"
                    )
                if total > self._storage_room(seq_id):
                    raise ValueError(
                        f"seq_id {seq_id}: {self._lengths[seq_id]} cached + {count} new tokens "
                        f"= {total}, past the {self._storage_room(seq_id)} reserved for it "
                        "(fetch or reserve the step first)"
                    )
                counts[seq_id] = count
            token_lists = self._validate_tokens(counts, tokens)
            for seq_id, count in counts.items():
                self._lengths[seq_id] += count
            self._on_commit(token_lists)
            self._storage_committed(list(counts))

    def release(self, seq_id: int) -> None:
        """Protocol step 4: frees ``seq_id`` and its storage.

        Raises:
            ValueError: If ``seq_id`` is not claimed.
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            del self._lengths[seq]
            self._storage_release(seq)

    # ------------------------------------------------------- sequence ops

    def fork(self, parent_seq_id: int, fork_pos: int | None = None) -> int:
        """Between rounds: a new sequence holding ``parent``'s first ``fork_pos`` tokens.

        Args:
            parent_seq_id: A claimed sequence; it is not changed.
            fork_pos: Tokens the child starts with; default: all the
                parent's committed tokens.

        Returns:
            The child's id.

        Raises:
            ValueError: If the parent is not claimed, ``fork_pos`` is negative
                or past the parent's length, no sequence can be claimed, or
                the cache cannot copy rows (:attr:`copies_supported`).
        """
        self._require_copies("fork")
        with self._lock:
            (parent,) = self._validate_ids([parent_seq_id], must_be_claimed=True)
            length = self._lengths[parent]
            pos = length if fork_pos is None else require_int("fork_pos", fork_pos, 0)
            if pos > length:
                raise ValueError(
                    f"fork_pos {pos} is past seq_id {parent}'s {length} committed tokens"
                )
            if self._free_ids() == 0:
                raise CacheFullError(f"cannot fork seq_id {parent}: no sequence can be claimed")
            (child,) = self._storage_claim(1)
            self._lengths[child] = 0
            try:
                self._storage_fork(parent, child, pos)
            except BaseException:
                del self._lengths[child]
                self._storage_release(child)
                raise
            self._lengths[child] = pos
            return child

    def pop_n(self, seq_id: int, n: int) -> None:
        """Between rounds: drops the last ``n`` committed tokens of ``seq_id``.

        Raises:
            ValueError: If ``seq_id`` is not claimed, not ``0 < n <= length``, or
                (paged, sliding window) the shorter sequence would attend to
                tokens whose pages were given back.
        """
        with self._lock:
            (seq,) = self._validate_ids([seq_id], must_be_claimed=True)
            count = require_int("n", n, 1)
            if count > self._lengths[seq]:
                raise ValueError(
                    f"cannot pop {count} tokens: seq_id {seq} holds {self._lengths[seq]}"
                )
            self._storage_truncate(seq, self._lengths[seq] - count)
            self._lengths[seq] -= count

    @property
    def copies_supported(self) -> bool:
        """Whether this cache can copy token rows (fork, prefix reuse on the contiguous
        cache, copy-on-write): MAX's device work can, on the CPU and on GPUs; a
        :class:`CacheDevice` given to the manager may not."""
        return self.cache_device.copies_supported

    def warm_up(self) -> None:
        """Prepares the device work the protocol runs (increment, copies) now, not on
        first use: for timings and the first decode step."""
        self.cache_device.warm_up()

    # ------------------------------------- capabilities (CacheCapabilities)
    # Declared here so that the layers above type against this class; a manager
    # with the capability overrides them.

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds (capability ``pages``)."""
        self._unsupported("pages", "free_pages")

    def pages_to_claim(self, prompt: Sequence[int], *, salt: str | None = None) -> int:
        """Free pages a claim of ``prompt`` and its first step would take now
        (capability ``pages``)."""
        self._unsupported("pages", "pages_to_claim")

    def attach_kv_events(self, sink: EventSink) -> KVEventLog:
        """From now on, announces the blocks of its prefix cache to ``sink`` as KV
        events (capability ``events``)."""
        self._unsupported("events", "attach_kv_events")

    def swap_out(self, seq_id: int) -> SwappedSequence:
        """Moves ``seq_id`` to host memory, between rounds (capability ``swap``)."""
        self._unsupported("swap", "swap_out")

    def swap_in_pages(self, swapped: SwappedSequence) -> int:
        """Free pages :meth:`swap_in` would take now (capability ``swap``)."""
        self._unsupported("swap", "swap_in_pages")

    def swap_in(self, swapped: SwappedSequence) -> int:
        """Continues a swapped-out sequence; returns its new id (capability ``swap``)."""
        self._unsupported("swap", "swap_in")

    def enable_attention_sinks(self, seq_id: int, window: int, sink: int = 0) -> None:
        """``seq_id`` keeps its first ``sink`` tokens and its last ``window``
        (StreamingLLM; capability ``sinks``)."""
        self._unsupported("sinks", "enable_attention_sinks")

    def enable_sliding_window(self, seq_id: int, window: int, sink: int = 0) -> None:
        """TVM's name (``EnableSlidingWindowForSeq``) of :meth:`enable_attention_sinks`:
        a sequence's window with sinks, not a model layer's sliding window."""
        self.enable_attention_sinks(seq_id, window, sink)

    def read_tokens(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """A copy of the K and V of ``seq_id``'s tokens ``[start, end)`` (capability
        ``blending``)."""
        self._unsupported("blending", "read_tokens")

    def mark_blended(self, seq_id: int, position: int) -> None:
        """Marks ``seq_id``'s KV from ``position`` on as blended (CacheBlend: reused
        from elsewhere, so never cached for its tokens; capability ``blending``)."""
        self._unsupported("blending", "mark_blended")

    def blended_position(self, seq_id: int) -> int | None:
        """Where ``seq_id``'s blended KV starts, or ``None``: always ``None``
        without the ``blending`` capability."""
        with self._lock:
            self._validate_ids([seq_id], must_be_claimed=True)
            return None

    def approximate_from(self, seq_id: int, position: int) -> None:
        """The older name of :meth:`mark_blended`."""
        self.mark_blended(seq_id, position)

    def approximate_position(self, seq_id: int) -> int | None:
        """The older name of :meth:`blended_position`."""
        return self.blended_position(seq_id)

    def _unsupported(self, capability: str, method: str) -> NoReturn:
        have = ", ".join(self.capabilities.names()) or "none"
        raise ValueError(
            f"{type(self).__name__} has no {capability!r} capability ({method}); it has: {have}"
        )

    # ----------------------------------------------------------- helpers

    def _validate_tokens(
        self, counts: Mapping[int, int], tokens: Mapping[int, Sequence[int]] | None
    ) -> dict[int, list[int]]:
        if tokens is None:
            return {}
        if not isinstance(tokens, Mapping):
            raise ArgumentTypeError(
                f"tokens must be a mapping {{seq_id: ids}}, got {type(tokens).__name__}"
            )
        extra = [s for s in tokens if s not in counts]
        if extra:
            raise ValueError(f"tokens given for seq_ids {extra} that valid_lengths does not commit")
        lists = {}
        for seq_id, ids in tokens.items():
            values = [require_int(f"tokens[{seq_id}]", t, 0) for t in ids]
            if len(values) != counts[seq_id]:
                raise ValueError(
                    f"seq_id {seq_id}: {len(values)} token ids for {counts[seq_id]} "
                    "committed tokens"
                )
            lists[seq_id] = values
        return lists

    def _on_commit(self, tokens: Mapping[int, list[int]]) -> None:
        """Called after a commit with the validated token ids (default: ignored)."""
        del tokens

    def _validate_ids(
        self, seq_ids: Sequence[int], *, must_be_claimed: bool, allow_empty: bool = False
    ) -> list[int]:
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
            raise ArgumentTypeError(
                f"seq_ids must be a sequence of ints, got {type(seq_ids).__name__}"
            )
        if not seq_ids and not allow_empty:
            raise ValueError("seq_ids must not be empty")
        ids = [require_int("seq_id", s, 0) for s in seq_ids]
        seen: set[int] = set()
        for seq_id in ids:
            if seq_id in seen:
                raise ValueError(f"seq_id {seq_id} appears more than once")
            seen.add(seq_id)
            if seq_id >= self.max_batch_size:
                raise ValueError(f"seq_id {seq_id} is out of range [0, {self.max_batch_size})")
            claimed = seq_id in self._lengths
            if must_be_claimed and not claimed:
                raise ValueError(f"seq_id {seq_id} is not claimed (unknown or released)")
            if not must_be_claimed and claimed:
                raise ValueError(f"seq_id {seq_id} is already claimed")
        return ids

    @staticmethod
    def _active_lengths(
        ids: list[int], active_lengths: Sequence[int] | Mapping[int, int] | None
    ) -> np.ndarray:
        if active_lengths is None:
            return np.ones(len(ids), dtype=np.int64)
        if isinstance(active_lengths, Mapping):
            missing = [s for s in ids if s not in active_lengths]
            extra = [s for s in active_lengths if s not in ids]
            if missing or extra:
                raise ValueError(
                    f"active_lengths keys must be the fetched seq_ids; missing {missing}, "
                    f"not fetched {extra}"
                )
            values = [active_lengths[s] for s in ids]
        else:
            values = list(active_lengths)
            if len(values) != len(ids):
                raise ValueError(f"active_lengths has {len(values)} entries for {len(ids)} seq_ids")
        return np.array(
            [require_int(f"active_lengths[{s}]", v, 1) for s, v in zip(ids, values, strict=True)],
            dtype=np.int64,
        )

    def _require_copies(self, what: str) -> None:
        if not self.copies_supported:
            raise ValueError(
                f"{what} copies cache rows, which this cache's device work "
                f"({type(self.cache_device).__name__}) cannot do"
            )

    def _copy_tokens(self, inputs: list[KVCacheInputs], start: int, end: int) -> None:
        """Tokens ``[start, end)`` of entry 0 into entry 1 of ``inputs`` (one device's
        4-tuple of ``[source, destination]`` per device), waited for."""
        self.cache_device.copy_tokens(inputs, start, end)


def _single(spec: CacheSpec | HybridCacheSpec) -> CacheSpec:
    if isinstance(spec, HybridCacheSpec):
        raise ValueError("a hybrid cache has a collection per layer group: see its groups")
    return spec


def _max_cache_device(
    spec: CacheSpec, devices: Sequence[Device], session: InferenceSession | None
) -> CacheDevice:
    """MAX's device layer, for a manager given none (imported here only: the
    managers' bookkeeping does not depend on MAX's graphs)."""
    from .device import MaxCacheDevice

    assert session is not None
    return MaxCacheDevice(spec, devices, session)


def device_inputs(
    storage: Sequence[Buffer],
    devices: Sequence[Device],
    lengths: np.ndarray,
    table: np.ndarray,
    max_lengths: np.ndarray,
) -> list[KVCacheInputs]:
    """One :class:`KVCacheInputs` per device: that device's storage, copies of
    ``lengths`` and the lookup or page ``table`` moved to it, and ``max_lengths``
    as one host buffer shared by every device."""
    max_lengths_buffer = Buffer.from_numpy(max_lengths)
    return [
        KVCacheInputs(
            blocks,
            Buffer.from_numpy(lengths.copy()).to(device),
            Buffer.from_numpy(table.copy()).to(device),
            max_lengths_buffer,
        )
        for blocks, device in zip(storage, devices, strict=True)
    ]


def validate_sizes(
    params: KVCacheParams,
    max_batch_size: int,
    max_seq_len: int,
    num_layers: int,
    devices: Sequence[Device],
    *,
    batch_arg: str = "max_batch_size",
) -> None:
    """The size checks every manager (and ``estimated_memory_size``) runs.

    Raises:
        ArgumentTypeError: If a size is not an int.
        ValueError: If a size is below 1, ``max_seq_len`` does not fit in
            uint32, or the devices are not ``params.n_devices``.
    """
    require_int(batch_arg, max_batch_size, 1)
    require_int("max_seq_len", max_seq_len, 1)
    require_int("num_layers", num_layers, 1)
    if len(devices) != params.n_devices:
        raise ValueError(
            f"params.n_devices is {params.n_devices} but {len(devices)} devices were given"
        )
    if max_seq_len >= 2**32:
        raise ValueError(f"max_seq_len must fit in uint32, got {max_seq_len}")


def _salt(salt: object) -> str | None:
    if salt is not None and not isinstance(salt, str):
        raise ArgumentTypeError(f"salt must be a str or None, got {type(salt).__name__}")
    return salt


def _row_offsets(prev_model_inputs: Any) -> Buffer:
    if hasattr(prev_model_inputs, "input_row_offsets"):
        offsets = prev_model_inputs.input_row_offsets
    elif isinstance(prev_model_inputs, (tuple, list)) and len(prev_model_inputs) > 1:
        offsets = prev_model_inputs[1]
    else:
        raise ValueError(
            "prev_model_inputs must be a tuple whose element 1 is input_row_offsets "
            "or have an input_row_offsets attribute"
        )
    if not isinstance(offsets, Buffer):
        raise ArgumentTypeError(
            f"input_row_offsets must be a max.driver.Buffer, got {type(offsets).__name__}"
        )
    if offsets.dtype != DType.uint32 or offsets.rank != 1:
        raise ValueError(
            f"input_row_offsets must be uint32 of rank 1, got {offsets.dtype} "
            f"of rank {offsets.rank}"
        )
    return offsets
