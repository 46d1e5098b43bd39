"""The device work of maxkv's managers, on MAX: zero fill, length increments, token copies.

A manager keeps its bookkeeping on the host and is given a
:class:`~maxkv.cache.protocol.CacheDevice` for the little it does on the
devices.  :class:`MaxCacheDevice` is the one the managers use unless they are
given another (the unit tests give a NumPy one): it fills the cache with
zeros when the manager is built, and compiles two small graphs, each once
per session and shared by every manager of the same shape:

- the increment graph: ``cache_lengths + diff(input_row_offsets)`` on every
  device, for the steps of a multistep round (no host round trip);
- the copy graph: tokens ``[start, end)`` of one sequence into another, all
  layers, through the ``maxkv.copy_tokens`` op (fork, prefix reuse on the
  contiguous cache, copy-on-write of a page), on CPU and GPU caches alike.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, ops

from ..graph import ops as kv_ops
from ..graph.types import collection_fetcher
from ..kernels import kernels_path, load_graph
from .spec import BATCH_DIM, CacheSpec, KVCacheInputs, split_inputs

_graphs: weakref.WeakKeyDictionary[InferenceSession, dict[tuple[object, ...], Model]] = (
    weakref.WeakKeyDictionary()
)
_graphs_lock = threading.Lock()


def compiled_once(
    session: InferenceSession, key: tuple[object, ...], build: Callable[[], Graph]
) -> Model:
    """``session.load(build())``, once per (session, key): shared by every manager."""
    with _graphs_lock:
        models = _graphs.setdefault(session, {})
        if key not in models:
            models[key] = load_graph(session, build())
        return models[key]


class MaxCacheDevice:
    """:class:`~maxkv.cache.protocol.CacheDevice` on MAX's devices and graphs.

    Args:
        spec: The cache the manager holds.
        devices: One device per ``spec.params.n_devices``.
        session: Compiles the increment and copy graphs (on first use).
    """

    def __init__(
        self, spec: CacheSpec, devices: Sequence[Device], session: InferenceSession
    ) -> None:
        self.spec = spec
        self.devices = list(devices)
        self.session = session
        self._refs = [DeviceRef.from_device(d) for d in self.devices]
        self._increment: Model | None = None
        self._copy: Model | None = None

    @property
    def copies_supported(self) -> bool:
        """True: ``maxkv.copy_tokens`` runs on the CPU and on GPUs."""
        return True

    def zeros(self, shape: Sequence[int], dtype: DType) -> list[Buffer]:
        """One zero-filled ``shape`` buffer per device, filled before this returns.

        ``Buffer.zeros`` only enqueues the fill (on the CPU too), and a graph
        that receives the buffer as an input is not ordered after it: the
        graph's ops write the cache through the opaque collection, which MAX
        does not see as writes.  A fill that started late (on a loaded
        machine) then zeroed keys and values a model step had just written.
        Waiting for each device here, once per manager, rules that out.
        """
        buffers = [Buffer.zeros(list(shape), dtype, device=device) for device in self.devices]
        for device in self.devices:
            device.synchronize()
        return buffers

    def increment(self, row_offsets: Buffer, cache_lengths: Sequence[Buffer]) -> list[Buffer]:
        """``cache_lengths[d] + diff(row_offsets)`` per device, launched without a sync."""
        if self._increment is None:
            self._increment = compiled_once(
                self.session, self._key("increment"), self._increment_graph
            )
        return list(self._increment.execute(row_offsets, *cache_lengths))

    def copy_tokens(self, inputs: Sequence[KVCacheInputs], start: int, end: int) -> None:
        """Copies tokens ``[start, end)`` of batch entry 0 into entry 1, every layer and
        device, and waits for the copy (later steps read the destination).

        ``inputs``: one device's 4-tuple per device for the batch
        ``[source, destination]``.
        """
        if end <= start:
            return
        if self._copy is None:
            self._copy = compiled_once(self.session, self._key("copy", self.spec), self._copy_graph)
        token_range = Buffer.from_numpy(np.array([start, end], dtype=np.uint32))
        flat = [buffer for device_inputs in inputs for buffer in device_inputs]
        for result in self._copy.execute(*flat, token_range):
            result.to_numpy()

    def warm_up(self) -> None:
        """Compiles the graphs now rather than on first use."""
        if self._increment is None:
            self._increment = compiled_once(
                self.session, self._key("increment"), self._increment_graph
            )
        if self.copies_supported and self._copy is None:
            self._copy = compiled_once(self.session, self._key("copy", self.spec), self._copy_graph)

    def _key(self, *what: object) -> tuple[object, ...]:
        """What makes a compiled graph reusable: its kind, the spec, the devices."""
        return (*what, *(str(ref) for ref in self._refs))

    def _increment_graph(self) -> Graph:
        """(input_row_offsets on devices[0], cache_lengths per device) -> new lengths."""
        first = self._refs[0]
        input_types = [TensorType(DType.uint32, ["input_row_offsets_len"], first)]
        input_types += [TensorType(DType.uint32, [BATCH_DIM], ref) for ref in self._refs]
        with Graph("maxkv_increment_cache_lengths", input_types=input_types) as graph:
            offsets = graph.inputs[0].tensor
            new_tokens = ops.rebind(offsets[1:] - offsets[:-1], [BATCH_DIM])
            outputs = []
            for value, ref in zip(graph.inputs[1:], self._refs, strict=True):
                delta = new_tokens if ref is first else ops.transfer_to(new_tokens, ref)
                outputs.append(value.tensor + delta)
            graph.output(*outputs)
        return graph

    def _copy_graph(self) -> Graph:
        symbols = self.spec.input_symbols(self.devices)
        range_type = TensorType(DType.uint32, [2], DeviceRef.CPU())
        input_types = [t for device_symbols in symbols for t in device_symbols] + [range_type]
        fetch = collection_fetcher(self.spec)
        params = self.spec.params
        with Graph(
            "maxkv_copy_tokens", input_types=input_types, custom_extensions=[kernels_path()]
        ) as graph:
            values = [v.tensor for v in graph.inputs]
            outputs = []
            for inputs in split_inputs(values[:-1], len(self.devices)):
                kv = fetch(*inputs)
                outputs.append(kv_ops.copy_tokens(params, kv, values[-1]))
            graph.output(*outputs)
        return graph
