"""One decode step of flash attention: maxkv's collection vs MAX's paged cache.

Both sides get identical keys and values (written into each cache's own
layout) and identical queries.  maxkv runs ``maxkv.ops.flash_attention_ragged``
on its continuous-batching collection (a decode step, so maxkv's own CPU
decode kernel, ``mojo_ops/decode_attention.mojo``); MAX runs
``max.nn.kernels.flash_attention_ragged`` on ``PagedKVCacheManager``'s inputs
(MAX's kernel).  Outputs must agree (1e-4 in float32, 3e-2 in bfloat16, where
each side rounds its output) or the comparison is void.  Each graph is
compiled once; batch and context are runtime dims; the two sides are timed in
turns (medians).  ``AttentionShape.dtype``: float32 (the CPU's) or bfloat16
(a GPU's): the same float32 data rounded for both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from max import tree
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, ops

from maxkv import (
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    KVCacheParams,
    kernels_path,
)
from maxkv import ops as kvops
from maxkv.cache.spec import CacheSpec
from maxkv.models.decoder import bfloat16_bits

from .timing import interleaved_median_seconds


@dataclass(frozen=True)
class AttentionShape:
    n_heads: int = 8
    head_dim: int = 64
    max_batch: int = 32
    max_context: int = 2048
    page_size: int = 128
    dtype: DType = DType.float32


@dataclass
class DecodeData:
    """Queries and per-sequence keys/values of one grid point.  Keys and values
    repeat every ``fresh`` positions (:func:`make_data`'s ``period``): they are
    drawn, rounded and laid out once per period, and tiled to ``context`` only
    in the form a side reads."""

    q: np.ndarray  # [batch, heads, head_dim]
    k_fresh: np.ndarray  # [batch, fresh, heads, head_dim]
    v_fresh: np.ndarray
    context: int
    _stored: dict[DType, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return int(self.q.shape[0])

    @cached_property
    def k(self) -> np.ndarray:
        """float32 ``[batch, context, heads, head_dim]``."""
        return _repeat(self.k_fresh, self.context)

    @cached_property
    def v(self) -> np.ndarray:
        return _repeat(self.v_fresh, self.context)

    def stored_kv(self, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values as a cache of ``dtype`` stores them (:func:`stored`),
        rounded once for both sides."""
        if dtype not in self._stored:
            self._stored[dtype] = (
                _repeat(stored(self.k_fresh, dtype), self.context),
                _repeat(stored(self.v_fresh, dtype), self.context),
            )
        return self._stored[dtype]


def _repeat(rows: np.ndarray, context: int) -> np.ndarray:
    """``rows`` ``[batch, fresh, ...]`` repeated along axis 1 to ``context`` positions."""
    fresh = rows.shape[1]
    if fresh >= context:
        return rows[:, :context]
    reps = (1, -(-context // fresh)) + (1,) * (rows.ndim - 2)
    return np.ascontiguousarray(np.tile(rows, reps)[:, :context])


def query_types(shape: AttentionShape, device: DeviceRef) -> list[TensorType]:
    """Graph inputs after the cache's: Q ``[batch, heads, head_dim]`` and row offsets."""
    return [
        TensorType(shape.dtype, ["batch_size", shape.n_heads, shape.head_dim], device),
        TensorType(DType.uint32, ["offsets_len"], device),
    ]


def host_buffer(array: np.ndarray, dtype: DType) -> Buffer:
    """float32 ``array`` as a host buffer of ``dtype`` (float32 or bfloat16)."""
    return stored_buffer(stored(array, dtype), dtype)


def stored_buffer(rows: np.ndarray, dtype: DType) -> Buffer:
    """A host buffer of ``dtype`` over ``rows`` as :func:`stored` gives them (no copy
    where they are contiguous)."""
    buffer = Buffer.from_numpy(np.ascontiguousarray(rows))
    return buffer.view(DType.bfloat16, list(rows.shape)) if dtype == DType.bfloat16 else buffer


def host_float32(buffer: Buffer) -> np.ndarray:
    """A float32 or bfloat16 buffer, on any device, as a float32 NumPy array."""
    host = buffer if buffer.is_host else buffer.to(CPU())
    if host.dtype == DType.bfloat16:
        bits = host.view(DType.uint16, list(host.shape)).to_numpy().astype(np.uint32)
        return (bits << 16).view(np.float32)
    return host.to_numpy()


def query_buffers(data: DecodeData, device: Device, dtype: DType = DType.float32) -> list[Buffer]:
    """Runtime values of :func:`query_types`: one new token per sequence."""
    offsets = np.arange(data.q.shape[0] + 1, dtype=np.uint32)
    return [host_buffer(data.q, dtype).to(device), Buffer.from_numpy(offsets).to(device)]


def stored(array: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 ``array`` as a cache of ``dtype`` stores it: float32, or bfloat16's
    bits (uint16), rounded once for every copy made from it."""
    if dtype == DType.bfloat16:
        return bfloat16_bits(array)
    if dtype != DType.float32:
        raise ValueError(f"the attention benchmark runs float32 or bfloat16, not {dtype}")
    return np.ascontiguousarray(array, np.float32)


def write_rows(target: Buffer, writes: list[tuple[int, np.ndarray]], device: Device) -> None:
    """Copies each ``(row, rows)`` of ``writes`` into ``target`` seen as rows of
    ``[heads, head_dim]`` (its last two axes), ``rows`` (:func:`stored`, ``[n,
    heads, head_dim]``) from row ``row`` on, then waits: the copies may run
    asynchronously, and their sources must outlive them.  Only the rows a step
    reads travel (a cache sized for 128 x 8,192 tokens is gigabytes)."""
    *lead, heads, width = (int(d) for d in target.shape)
    flat = target.view(target.dtype, [math.prod(lead), heads, width])
    sources = []
    for row, rows in writes:
        source = stored_buffer(rows, target.dtype)
        flat[row : row + len(rows), :, :].inplace_copy_from(source)
        sources.append(source)
    device.synchronize()
    del sources


def make_data(
    batch: int, context: int, shape: AttentionShape, seed: int = 0, *, period: int | None = None
) -> DecodeData:
    """Random queries, keys and values; with ``period``, keys and values repeat every
    ``period`` positions (the same work, for GPU-sized caches that NumPy would take
    minutes to fill with fresh numbers)."""
    rng = np.random.default_rng(seed)
    fresh = context if period is None else min(period, context)
    dims = (batch, fresh, shape.n_heads, shape.head_dim)
    k = rng.standard_normal(dims, dtype=np.float32)
    v = rng.standard_normal(dims, dtype=np.float32)
    q = rng.standard_normal((batch, shape.n_heads, shape.head_dim), dtype=np.float32)
    return DecodeData(q=q, k_fresh=k, v_fresh=v, context=context)


class MaxkvDecodeAttention:
    """maxkv: continuous-batching collection + ``flash_attention_ragged``."""

    def __init__(self, shape: AttentionShape, device: Device, session: InferenceSession) -> None:
        self.shape = shape
        self.device = device
        self.params = self.cache_params(shape)
        self.manager = ContinuousBatchingKVCacheManager(
            self.params, shape.max_batch, shape.max_context, 1, [device], session
        )
        self.model: Model = session.load(self.graph(shape, DeviceRef.from_device(device)))

    @staticmethod
    def cache_params(shape: AttentionShape) -> KVCacheParams:
        return KVCacheParams(shape.dtype, shape.n_heads, shape.head_dim)

    @classmethod
    def graph(cls, shape: AttentionShape, device: DeviceRef) -> Graph:
        """The step's graph; it needs no cache (so it compiles for a virtual device)."""
        params = cls.cache_params(shape)
        spec = CacheSpec(params, 1, "contiguous")
        types = [*spec.input_symbols([device])[0], *query_types(shape, device)]
        with Graph(
            "maxkv_decode_attention", input_types=types, custom_extensions=[kernels_path()]
        ) as graph:
            *cache, q, offsets = (v.tensor for v in graph.inputs)
            kv = FetchContinuousBatchingKVCacheCollection(params)(*cache)
            graph.output(kvops.flash_attention_ragged(params, q, offsets, kv, 0))
        return graph

    def prepare(self, data: DecodeData) -> list[Buffer]:
        batch, context = data.batch, data.context
        ids = self.manager.claim(batch)
        (inputs,) = self.manager.fetch(ids)
        # Blocks [slots, 2 (K, V), 1 layer, max_context, heads, head_dim].
        k, v = data.stored_kv(self.shape.dtype)
        rows = self.shape.max_context
        writes = [
            ((2 * slot + side) * rows, kv[b])
            for b, slot in enumerate(ids)
            for side, kv in enumerate((k, v))
        ]
        write_rows(inputs[0], writes, self.device)
        self.manager.step({i: context - 1 for i in ids})  # the new token's K/V is in place
        (inputs,) = self.manager.fetch(ids)
        for i in ids:
            self.manager.release(i)
        return [*inputs, *query_buffers(data, self.device, self.shape.dtype)]

    def run(self, inputs: list[Buffer]) -> Buffer:
        (out,) = self.model.execute(*inputs)
        return out


class MaxPagedDecodeAttention:
    """MAX 26.7: ``PagedKVCacheManager`` + ``max.nn.kernels.flash_attention_ragged``."""

    def __init__(self, shape: AttentionShape, device: Device, session: InferenceSession) -> None:
        from max.pipelines.kv_cache import PagedKVCacheManager

        self.shape = shape
        self.device = device
        ref = DeviceRef.from_device(device)
        self.params = self.cache_params(shape, ref)
        pages = shape.max_batch * math.ceil(shape.max_context / shape.page_size)
        self.manager = PagedKVCacheManager(
            params=self.params,
            session=session,
            total_num_pages=pages,
            max_batch_size=shape.max_batch,
        )
        self._n_kv = len(tree.flatten(self.params.get_symbolic_inputs())[0])
        self.model: Model = session.load(self.graph(shape, ref))
        self._contexts: list[object] = []

    @staticmethod
    def cache_params(shape: AttentionShape, device: DeviceRef) -> Any:
        from max.nn.kv_cache import MHAKVCacheParams

        return MHAKVCacheParams(
            dtype=shape.dtype,
            n_kv_heads=shape.n_heads,
            head_dim=shape.head_dim,
            num_layers=1,
            page_size=shape.page_size,
            devices=[device],
        )

    @classmethod
    def graph(cls, shape: AttentionShape, device: DeviceRef) -> Graph:
        """The step's graph; it needs no cache (so it compiles for a virtual device)."""
        from max.nn.attention.mask_config import MHAMaskVariant
        from max.nn.kernels import flash_attention_ragged

        params = cls.cache_params(shape, device)
        kv_types, _ = tree.flatten(params.get_symbolic_inputs())
        types = [*kv_types, *query_types(shape, device)]
        with Graph("max_paged_decode_attention", input_types=types) as graph:
            (kv,) = params.unflatten_kv_inputs(iter(graph.inputs[: len(kv_types)]))
            q, offsets = (v.tensor for v in graph.inputs[len(kv_types) :])
            layer = ops.constant(0, DType.uint32, device=DeviceRef.CPU())
            graph.output(
                flash_attention_ragged(
                    params,
                    q,
                    offsets,
                    kv,
                    layer,
                    mask_variant=MHAMaskVariant.CAUSAL_MASK,
                    scale=1.0 / math.sqrt(shape.head_dim),
                )
            )
        return graph

    def prepare(self, data: DecodeData) -> list[Buffer]:
        from max.pipelines.context import TextContext, TokenBuffer
        from max.pipelines.modeling.types import RequestID

        for ctx in self._contexts:
            self.manager.release(ctx)
        batch, context = data.batch, data.context
        page = self.shape.page_size
        contexts = []
        for _ in range(batch):
            ctx = TextContext(
                request_id=RequestID(),
                max_length=self.shape.max_context + 1,
                tokens=TokenBuffer(np.zeros(context - 1, dtype=np.int64)),
            )
            self.manager.claim(ctx)
            self.manager.alloc(ctx)
            contexts.append(ctx)
        self.manager.runtime_inputs([contexts])  # the prefill step, not executed
        for ctx in contexts:
            ctx.update(0)
            self.manager.step(ctx)
            self.manager.alloc(ctx)
        (inputs,) = self.manager.runtime_inputs([contexts])
        self._contexts = contexts

        # Pages [pages, 2 (K, V), 1 layer, page, heads, head_dim]: the rows of
        # each page in the batch's tables (the kernel reads no others).
        table = inputs.lookup_table.to_numpy()
        k, v = data.stored_kv(self.shape.dtype)
        writes = [
            ((2 * int(table[b, j]) + side) * page, kv[b, j * page : (j + 1) * page])
            for b in range(batch)
            for j in range(math.ceil(context / page))
            for side, kv in enumerate((k, v))
        ]
        write_rows(inputs.kv_blocks, writes, self.device)
        flat, _ = tree.flatten((inputs,))
        return [*flat, *query_buffers(data, self.device, self.shape.dtype)]

    def run(self, inputs: list[Buffer]) -> Buffer:
        (out,) = self.model.execute(*inputs)
        return out


def bench_attention_decode(
    session: InferenceSession,
    device: Device,
    batches: list[int],
    contexts: list[int],
    *,
    warmup: int,
    repeats: int,
    shape: AttentionShape | None = None,
    read_bandwidth_gbps: float | None = None,
    period: int | None = None,
    max_tokens: int | None = None,
) -> list[dict[str, float | int]]:
    """Median ms of one decode step per (batch, context), both sides, same data.

    With ``read_bandwidth_gbps`` (measured in the same run), each row also
    gives the fraction of it that each side's KV streaming reaches.
    ``period``: see :func:`make_data`.  ``max_tokens``: points whose batch x
    context is larger are left out (their data takes the host minutes to make).
    """
    shape = shape or AttentionShape(max_batch=max(batches), max_context=max(contexts))
    maxkv_side = MaxkvDecodeAttention(shape, device, session)
    paged_side = MaxPagedDecodeAttention(shape, device, session)
    rows: list[dict[str, float | int]] = []
    for batch in batches:
        for context in contexts:
            if max_tokens is not None and batch * context > max_tokens:
                continue
            data = make_data(batch, context, shape, period=period)
            ours = maxkv_side.prepare(data)
            theirs = paged_side.prepare(data)
            del data
            difference = np.abs(
                host_float32(maxkv_side.run(ours)) - host_float32(paged_side.run(theirs))
            ).max()
            tolerance = 1e-4 if shape.dtype == DType.float32 else 3e-2
            if not difference < tolerance:
                raise RuntimeError(
                    f"maxkv and MAX paged disagree by {difference} at batch {batch}, "
                    f"context {context}: the comparison is void"
                )

            def run_ours(inputs: list[Buffer] = ours) -> None:
                maxkv_side.run(inputs)
                device.synchronize()

            def run_theirs(inputs: list[Buffer] = theirs) -> None:
                paged_side.run(inputs)
                device.synchronize()

            medians = interleaved_median_seconds(
                {"maxkv": run_ours, "max_paged": run_theirs}, warmup=warmup, repeats=repeats
            )
            maxkv_ms, paged_ms = medians["maxkv"] * 1e3, medians["max_paged"] * 1e3
            # Bytes a decode step must read: every cached K and V once.
            row_bytes = shape.n_heads * shape.head_dim * shape.dtype.size_in_bytes
            kv_bytes = 2 * batch * context * row_bytes
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "maxkv_ms": round(maxkv_ms, 4),
                    "max_paged_ms": round(paged_ms, 4),
                    "ratio": round(maxkv_ms / paged_ms, 3),
                    "maxkv_GBps": round(kv_bytes / maxkv_ms / 1e6, 2),
                    "max_paged_GBps": round(kv_bytes / paged_ms / 1e6, 2),
                    "max_abs_difference": float(difference),
                }
            )
            if read_bandwidth_gbps:
                rows[-1]["maxkv_fraction_of_read_bandwidth"] = round(
                    kv_bytes / maxkv_ms / 1e6 / read_bandwidth_gbps, 3
                )
                rows[-1]["max_paged_fraction_of_read_bandwidth"] = round(
                    kv_bytes / paged_ms / 1e6 / read_bandwidth_gbps, 3
                )
    return rows
