"""The continuous-batching KV cache manager.

Each sequence owns one *slot* of a preallocated cache: a
``[2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]`` block per
device.  A sequence id *is* its slot index in ``[0, max_cache_batch_size)``,
as in MAX 24.x.

Step protocol (every public method below says where it sits):

1. ``claim(n)`` or ``external_claim(ids)`` reserves slots; lengths start at 0.
2. ``fetch(seq_ids, num_steps, active_lengths=...)`` returns, per device, the
   4-tuple of graph inputs ``(blocks, cache_lengths, lookup_table,
   max_lengths)`` for the next ``num_steps`` model steps.
3. The model graph runs step 1; its kernels append each sequence's new keys
   and values at ``cache_length ..`` of its slot.
4. ``increment_cache_lengths(inputs, prev_model_inputs)`` turns step *i*'s
   inputs into step *i+1*'s on the device (no host round trip);
   3 and 4 repeat up to ``num_steps`` times.
5. ``step({seq_id: new_tokens})`` commits the tokens written since ``fetch``.
6. ``release(seq_id)`` returns the slot to the pool.

Thread safety: every public method holds one re-entrant lock while it reads
or changes the manager's state, so the manager may be called from many
threads at once; each call either completes or raises ``ValueError`` with the
state unchanged.  ``increment_cache_lengths`` only launches device work and
touches no bookkeeping, so concurrent model steps are not serialised on
their execution, only on their launch.
"""

from __future__ import annotations

import math
import threading
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, ops

from .graph import BATCH_DIM, SEQ_LEN_DIM, SLOTS_DIM, STEPS_DIM
from .params import KVCacheParams

#: Per device: (blocks, cache_lengths, lookup_table, max_lengths).
KVCacheInputs = tuple[Buffer, Buffer, Buffer, Buffer]
#: Per device: the TensorTypes of :data:`KVCacheInputs`.
KVCacheInputSymbols = tuple[TensorType, TensorType, TensorType, TensorType]

# The increment graph depends only on the session and the devices, so managers
# that share them share one compiled model (compiling it takes seconds).
_increment_models: weakref.WeakKeyDictionary[InferenceSession, dict[tuple[str, ...], Model]] = (
    weakref.WeakKeyDictionary()
)
_increment_models_lock = threading.Lock()


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class ContinuousBatchingKVCacheManager:
    """Owns the cache blocks and the bookkeeping of which sequence holds which slot.

    Args:
        params: Dtype and head layout of the cache.
        max_cache_batch_size: Number of slots (sequences cached at once).
        max_seq_len: Tokens one slot can hold (prompt plus generated tokens).
        num_layers: Transformer layers cached per slot.
        devices: One device per ``params.n_devices``; device *i* holds heads
            ``[i * n, (i + 1) * n)`` with ``n = params.n_kv_heads_per_device``.
        session: The session that runs the model; used to compile the small
            graph behind :meth:`increment_cache_lengths`.

    Raises:
        ValueError: If a size is not a positive int or the number of devices
            differs from ``params.n_devices``.
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
    ) -> None:
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
        self._validate_sizes(params, max_cache_batch_size, max_seq_len, num_layers, devices)
        self.params = params
        self.max_cache_batch_size = int(max_cache_batch_size)
        self.max_seq_len = int(max_seq_len)
        self.num_layers = int(num_layers)
        self.devices = list(devices)
        self.session = session

        self._lock = threading.RLock()
        self._free_slots: set[int] = set(range(self.max_cache_batch_size))
        self._lengths: dict[int, int] = {}
        self._increment_model: Model | None = None
        shape = self.block_shape(self.max_cache_batch_size)
        self._blocks = [Buffer.zeros(shape, params.dtype, device=d) for d in self.devices]

    @staticmethod
    def _validate_sizes(
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
    ) -> None:
        _require_int("max_cache_batch_size", max_cache_batch_size, 1)
        _require_int("max_seq_len", max_seq_len, 1)
        _require_int("num_layers", num_layers, 1)
        if len(devices) != params.n_devices:
            raise ValueError(
                f"params.n_devices is {params.n_devices} but {len(devices)} devices were given"
            )
        if max_seq_len >= 2**32:
            raise ValueError(f"max_seq_len must fit in uint32, got {max_seq_len}")

    # ------------------------------------------------------------------ sizes

    def block_shape(self, n_sequences: int) -> list[int]:
        """Shape of one device's blocks for ``n_sequences`` slots.

        ``[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device,
        head_dim]``; axis 1 is 0 for keys, 1 for values.
        """
        n = _require_int("n_sequences", n_sequences, 1)
        p = self.params
        return [n, 2, self.num_layers, self.max_seq_len, p.n_kv_heads_per_device, p.head_dim]

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
        cls._validate_sizes(params, max_cache_batch_size, max_seq_len, num_layers, devices)
        per_device = math.prod(
            (
                max_cache_batch_size,
                2,
                num_layers,
                max_seq_len,
                params.n_kv_heads_per_device,
                params.head_dim,
            )
        )
        return int(per_device * params.dtype.size_in_bytes * len(devices))

    def input_symbols(self) -> list[KVCacheInputSymbols]:
        """Graph input types of :meth:`fetch`'s 4-tuples, one tuple per device.

        The blocks are ``["kv_cache_slots", 2, num_layers, "kv_max_seq_len",
        n_kv_heads_per_device, head_dim]``: their slot and token axes are
        symbolic, so one compiled graph serves managers of every
        ``max_cache_batch_size`` and ``max_seq_len`` (the Mojo ctor reads the
        actual shape at run time).  ``cache_lengths`` and ``lookup_table``
        have the symbolic dim ``"batch_size"``; ``max_lengths`` is
        ``["num_steps", 2]`` on the host.
        """
        host = DeviceRef.CPU()
        p = self.params
        blocks = [SLOTS_DIM, 2, self.num_layers, SEQ_LEN_DIM, p.n_kv_heads_per_device, p.head_dim]
        symbols: list[KVCacheInputSymbols] = []
        for device in self.devices:
            ref = DeviceRef.from_device(device)
            symbols.append(
                (
                    TensorType(p.dtype, blocks, ref),
                    TensorType(DType.uint32, [BATCH_DIM], ref),
                    TensorType(DType.uint32, [BATCH_DIM], ref),
                    TensorType(DType.uint32, [STEPS_DIM, 2], host),
                )
            )
        return symbols

    # -------------------------------------------------------------- protocol

    @property
    def slots_remaining(self) -> int:
        """Slots that :meth:`claim` can still hand out."""
        with self._lock:
            return len(self._free_slots)

    @property
    def cache_lengths(self) -> Mapping[int, int]:
        """Committed tokens per claimed sequence id (a read-only snapshot)."""
        with self._lock:
            return types.MappingProxyType(dict(self._lengths))

    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is currently claimed."""
        with self._lock:
            return seq_id in self._lengths

    def claim(self, n: int) -> list[int]:
        """Protocol step 1: reserves ``n`` slots and returns their sequence ids.

        The lowest free ids are handed out, in increasing order.

        Raises:
            ValueError: If ``n`` is not a positive int or more than
                :attr:`slots_remaining`.
        """
        with self._lock:
            count = _require_int("n", n, 1)
            if count > len(self._free_slots):
                raise ValueError(
                    f"cannot claim {count} sequences: only {len(self._free_slots)} of "
                    f"{self.max_cache_batch_size} slots are free"
                )
            seq_ids = sorted(self._free_slots)[:count]
            for seq_id in seq_ids:
                self._free_slots.remove(seq_id)
                self._lengths[seq_id] = 0
            return seq_ids

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Protocol step 1, with ids chosen by the caller.

        Raises:
            ValueError: If ``seq_ids`` is empty, repeats an id, or names an
                id outside ``[0, max_cache_batch_size)`` or already claimed.
        """
        with self._lock:
            ids = self._validate_ids(seq_ids, must_be_claimed=False)
            for seq_id in ids:
                self._free_slots.remove(seq_id)
                self._lengths[seq_id] = 0

    def fetch(
        self,
        seq_ids: Sequence[int],
        num_steps: int = 1,
        *,
        active_lengths: Sequence[int] | Mapping[int, int] | None = None,
    ) -> list[KVCacheInputs]:
        """Protocol step 2: graph inputs for the next ``num_steps`` steps.

        Args:
            seq_ids: Claimed ids, in batch order.
            num_steps: Model steps these inputs cover; steps after the first
                are decode steps of one new token per sequence, reached with
                :meth:`increment_cache_lengths`.
            active_lengths: New tokens of each sequence in the first step,
                in ``seq_ids`` order or as ``{seq_id: n}``: the prompt length
                for context encoding.  Default: 1 per sequence (a decode step).

        Returns:
            Per device, ``(blocks, cache_lengths, lookup_table, max_lengths)``:
            the device's whole cache; uint32 ``[batch]`` committed lengths and
            slots in ``seq_ids`` order (on the device); and a host uint32
            ``[num_steps, 2]`` whose row *i* holds (max new tokens, max cache
            length) of step *i*.  Row 0's max cache length is 0 exactly when
            every cache is empty: it replaces MAX 24.x's ``is_cache_empty``.

        Raises:
            ValueError: On an empty, repeated, unknown or released id, a
                non-positive ``num_steps`` or active length, or when a
                sequence would pass ``max_seq_len`` within ``num_steps``.
        """
        with self._lock:
            ids = self._validate_ids(seq_ids, must_be_claimed=True)
            steps = _require_int("num_steps", num_steps, 1)
            active = self._active_lengths(ids, active_lengths)
            lengths = np.array([self._lengths[s] for s in ids], dtype=np.int64)
            for seq_id, length, new in zip(ids, lengths, active, strict=True):
                needed = int(length) + int(new) + steps - 1
                if needed > self.max_seq_len:
                    raise ValueError(
                        f"seq_id {seq_id} has {length} cached tokens; {new} new tokens and "
                        f"{steps - 1} further steps need {needed} > max_seq_len "
                        f"{self.max_seq_len}"
                    )
            max_lengths = np.empty((steps, 2), dtype=np.uint32)
            max_lengths[0] = (active.max(), lengths.max())
            after_first = lengths + active
            for i in range(1, steps):
                max_lengths[i] = (1, after_first.max() + i - 1)

            host_lengths = lengths.astype(np.uint32)
            host_slots = np.array(ids, dtype=np.uint32)
            max_lengths_buffer = Buffer.from_numpy(max_lengths)
            return [
                (
                    blocks,
                    Buffer.from_numpy(host_lengths.copy()).to(device),
                    Buffer.from_numpy(host_slots.copy()).to(device),
                    max_lengths_buffer,
                )
                for blocks, device in zip(self._blocks, self.devices, strict=True)
            ]

    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[KVCacheInputs],
        prev_model_inputs: Any,
    ) -> list[KVCacheInputs]:
        """Protocol step 4: the next step's inputs, advanced on the device.

        ``cache_lengths`` becomes ``cache_lengths + diff(input_row_offsets)``
        through a compiled graph (no host round trip, no sync);
        ``max_lengths`` becomes a view of its next row onwards.  The
        committed lengths are not touched: call :meth:`step` for that.

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
        if len(kv_cache_inputs) != len(self.devices):
            raise ValueError(
                f"expected one 4-tuple per device ({len(self.devices)}), got {len(kv_cache_inputs)}"
            )
        row_offsets = self._row_offsets(prev_model_inputs)
        self._check_on_first_device(row_offsets)
        for i, inputs in enumerate(kv_cache_inputs):
            if len(inputs) != 4:
                raise ValueError(f"kv_cache_inputs[{i}] must be a 4-tuple, got {len(inputs)}")
            _, lengths, _, max_lengths = inputs
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
        with self._lock:
            model = self._get_increment_model()
        new_lengths = model.execute(row_offsets, *(inputs[1] for inputs in kv_cache_inputs))
        return [
            (blocks, lengths, lookup, max_lengths[1:, :])
            for (blocks, _, lookup, max_lengths), lengths in zip(
                kv_cache_inputs, new_lengths, strict=True
            )
        ]

    def warm_up(self) -> None:
        """Compiles the graph behind :meth:`increment_cache_lengths` now.

        It is otherwise compiled on first use (seconds; shared by managers of
        the same session and devices): call this before timing multistep
        decoding.
        """
        with self._lock:
            self._get_increment_model()

    def step(self, valid_lengths: Mapping[int, int]) -> None:
        """Protocol step 5: commits ``valid_lengths[seq_id]`` new tokens per sequence.

        Raises:
            ValueError: If an id is not claimed, a count is negative, or a
                sequence would pass ``max_seq_len``; nothing is committed then.
        """
        if not isinstance(valid_lengths, Mapping):
            raise ValueError(
                f"valid_lengths must be a mapping {{seq_id: new_tokens}}, got "
                f"{type(valid_lengths).__name__}"
            )
        with self._lock:
            self._validate_ids(list(valid_lengths), must_be_claimed=True, allow_empty=True)
            for seq_id, new in valid_lengths.items():
                count = _require_int(f"valid_lengths[{seq_id}]", new, 0)
                total = self._lengths[seq_id] + count
                if total > self.max_seq_len:
                    raise ValueError(
                        f"seq_id {seq_id}: {self._lengths[seq_id]} cached + {count} new tokens "
                        f"= {total} > max_seq_len {self.max_seq_len}"
                    )
            for seq_id, new in valid_lengths.items():
                self._lengths[seq_id] += int(new)

    def release(self, seq_id: int) -> None:
        """Protocol step 6: frees ``seq_id``'s slot for a later claim.

        Raises:
            ValueError: If ``seq_id`` is not claimed.
        """
        with self._lock:
            (slot,) = self._validate_ids([seq_id], must_be_claimed=True)
            del self._lengths[slot]
            self._free_slots.add(slot)

    # --------------------------------------------------------------- helpers

    def _validate_ids(
        self, seq_ids: Sequence[int], *, must_be_claimed: bool, allow_empty: bool = False
    ) -> list[int]:
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
            raise ValueError(f"seq_ids must be a sequence of ints, got {type(seq_ids).__name__}")
        if not seq_ids and not allow_empty:
            raise ValueError("seq_ids must not be empty")
        ids = [_require_int("seq_id", s, 0) for s in seq_ids]
        seen: set[int] = set()
        for seq_id in ids:
            if seq_id in seen:
                raise ValueError(f"seq_id {seq_id} appears more than once")
            seen.add(seq_id)
            if seq_id >= self.max_cache_batch_size:
                raise ValueError(
                    f"seq_id {seq_id} is out of range [0, {self.max_cache_batch_size})"
                )
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
            [_require_int(f"active_lengths[{s}]", v, 1) for s, v in zip(ids, values, strict=True)],
            dtype=np.int64,
        )

    @staticmethod
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
            raise ValueError(
                f"input_row_offsets must be a max.driver.Buffer, got {type(offsets).__name__}"
            )
        if offsets.dtype != DType.uint32 or offsets.rank != 1:
            raise ValueError(
                f"input_row_offsets must be uint32 of rank 1, got {offsets.dtype} "
                f"of rank {offsets.rank}"
            )
        return offsets

    def _check_on_first_device(self, offsets: Buffer) -> None:
        if offsets.device != self.devices[0]:
            raise ValueError(
                f"input_row_offsets must be on the first device {self.devices[0]}, "
                f"got {offsets.device}"
            )

    def _get_increment_model(self) -> Model:
        """The compiled ``cache_lengths + diff(input_row_offsets)`` graph for these devices.

        Built once per (session, devices) and shared by every manager using them.
        """
        if self._increment_model is None:
            key = tuple(str(DeviceRef.from_device(d)) for d in self.devices)
            with _increment_models_lock:
                models = _increment_models.setdefault(self.session, {})
                if key not in models:
                    models[key] = self.session.load(_increment_graph(self.devices))
                self._increment_model = models[key]
        return self._increment_model


def _increment_graph(devices: Sequence[Device]) -> Graph:
    """Graph: (input_row_offsets on devices[0], cache_lengths per device) -> new lengths."""
    first = DeviceRef.from_device(devices[0])
    input_types = [TensorType(DType.uint32, ["input_row_offsets_len"], first)]
    input_types += [
        TensorType(DType.uint32, [BATCH_DIM], DeviceRef.from_device(d)) for d in devices
    ]
    with Graph("maxkv_increment_cache_lengths", input_types=input_types) as graph:
        offsets = graph.inputs[0].tensor
        new_tokens = ops.rebind(offsets[1:] - offsets[:-1], [BATCH_DIM])
        outputs = []
        for value, device in zip(graph.inputs[1:], devices, strict=True):
            ref = DeviceRef.from_device(device)
            delta = new_tokens if ref == first else ops.transfer_to(new_tokens, ref)
            outputs.append(value.tensor + delta)
        graph.output(*outputs)
    return graph
