"""Graph-side types and values of the continuous-batching KV cache.

Mirrors ``max.pipelines.kv_cache.continuous_batching_cache`` of MAX 24.x:
the four tensors that :meth:`ContinuousBatchingKVCacheManager.fetch` returns
enter a graph as inputs (see ``input_symbols()``) and
:class:`FetchContinuousBatchingKVCacheCollection` turns them into one opaque
:class:`ContinuousBatchingKVCacheCollection` value that maxkv's Mojo ops take.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops
from max.graph.type import DeviceKind, _OpaqueType
from max.graph.value import _OpaqueValue

from .params import KVCacheParams

#: Name of the Mojo struct behind the collection (``mojo_ops/collection.mojo``).
COLLECTION_TYPE_NAME = "ContinuousBatchingKVCacheCollection"
#: Name of the Mojo struct behind a single layer's cache.
CACHE_TYPE_NAME = "ContinuousBatchingKVCache"
#: The Mojo op that builds the collection.
CTOR_OP_NAME = "maxkv.kv_collection_ctor"
#: Symbolic dim of ``cache_lengths``/``lookup_table`` in ``input_symbols()``.
BATCH_DIM = "batch_size"
#: Symbolic dim of ``max_lengths``' first axis in ``input_symbols()``.
STEPS_DIM = "num_steps"
#: Symbolic dims of the blocks' slot and token axes in ``input_symbols()``: one
#: compiled graph serves managers of any ``max_cache_batch_size`` and ``max_seq_len``.
SLOTS_DIM = "kv_cache_slots"
SEQ_LEN_DIM = "kv_max_seq_len"


def opaque_parameters(params: KVCacheParams) -> dict[str, bool | int | str]:
    """Mojo parameters of the collection struct for ``params`` (one device)."""
    return {
        "dtype_name": params.dtype_name,
        "num_heads": params.n_kv_heads_per_device,
        "head_dim": params.head_dim,
    }


def kernel_parameters(params: KVCacheParams) -> dict[str, bool | int | str | DType]:
    """Op parameters every maxkv kernel that takes a collection needs.

    A Mojo kernel parameter that no tensor argument carries cannot be inferred
    by the graph compiler, so the collection's parameters are passed again.
    """
    return {**opaque_parameters(params), "dtype": params.dtype}


class ContinuousBatchingKVCacheCollectionType(_OpaqueType):
    """The graph type of a view of the cache for the sequences of one batch.

    The view borrows the manager's blocks; it owns nothing.
    """

    def __init__(self, params: KVCacheParams) -> None:
        super().__init__(COLLECTION_TYPE_NAME, opaque_parameters(params))


class ContinuousBatchingKVCacheType(_OpaqueType):
    """The graph type of one layer's key (or value) cache.

    Kept for API parity with MAX 24.x; maxkv's ops take the collection and a
    layer index instead.
    """

    def __init__(self, params: KVCacheParams) -> None:
        super().__init__(CACHE_TYPE_NAME, opaque_parameters(params))


class ContinuousBatchingKVCacheCollection(_OpaqueValue):
    """The graph value of a :class:`ContinuousBatchingKVCacheCollectionType`.

    Opaque values carry no device in MAX, so the collection remembers the
    device of the blocks it was built from: maxkv's ops run there.
    """

    def __init__(self, value: Any, device: DeviceRef | None = None) -> None:
        super().__init__(value)
        if device is None and isinstance(value, ContinuousBatchingKVCacheCollection):
            device = value._device
        self._device: DeviceRef | None = device

    @property
    def device(self) -> DeviceRef:
        """The device of the cache blocks this view borrows."""
        if self._device is None:
            raise ValueError(
                "this ContinuousBatchingKVCacheCollection does not know its device; "
                "build it with FetchContinuousBatchingKVCacheCollection"
            )
        return self._device


class ContinuousBatchingKVCache(_OpaqueValue):
    """The graph value of a :class:`ContinuousBatchingKVCacheType`."""


def _check(name: str, value: TensorValue, dtype: DType, rank: int) -> None:
    if not isinstance(value, TensorValue):
        raise TypeError(f"{name} must be a TensorValue, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {value.dtype}")
    if value.rank != rank:
        raise ValueError(f"{name} must have rank {rank}, got rank {value.rank} ({value.shape})")


def _check_static_dim(name: str, value: TensorValue, axis: int, expected: int, what: str) -> None:
    dim: Any = value.shape[axis]
    try:
        actual = int(dim)
    except TypeError:
        raise ValueError(
            f"{name} dim {axis} must be the static {what} = {expected}, got symbolic {dim}"
        ) from None
    if actual != expected:
        raise ValueError(f"{name} dim {axis} must be {what} = {expected}, got {actual}")


class FetchContinuousBatchingKVCacheCollection:
    """Builds a :class:`ContinuousBatchingKVCacheCollection` inside a graph.

    Args:
        params: The cache parameters the manager was created with.

    Call it with one device's four graph inputs, in ``fetch()`` order.
    """

    def __init__(self, params: KVCacheParams) -> None:
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
        self.params = params

    def __call__(
        self,
        blocks: TensorValue,
        cache_lengths: TensorValue,
        lookup_table: TensorValue,
        max_lengths: TensorValue,
    ) -> ContinuousBatchingKVCacheCollection:
        """Wraps the four tensors into the opaque collection.

        Args:
            blocks: ``[max_cache_batch_size, 2, num_layers, max_seq_len,
                n_kv_heads_per_device, head_dim]`` of ``params.dtype``.
            cache_lengths: uint32 ``[batch]``, tokens already cached per sequence.
            lookup_table: uint32 ``[batch]``, cache slot of each sequence.
            max_lengths: uint32 ``[num_steps, 2]`` on the host; row 0 holds
                (max new tokens, max cache length) of this step.

        Returns:
            The collection, placed on ``blocks``' device.

        Raises:
            ValueError: If a dtype, rank, static dim or device is wrong.
        """
        params = self.params
        _check("blocks", blocks, params.dtype, 6)
        _check("cache_lengths", cache_lengths, DType.uint32, 1)
        _check("lookup_table", lookup_table, DType.uint32, 1)
        _check("max_lengths", max_lengths, DType.uint32, 2)
        _check_static_dim("blocks", blocks, 1, 2, "the key/value axis")
        _check_static_dim(
            "blocks", blocks, 4, params.n_kv_heads_per_device, "n_kv_heads_per_device"
        )
        _check_static_dim("blocks", blocks, 5, params.head_dim, "head_dim")
        _check_static_dim("max_lengths", max_lengths, 1, 2, "(max new tokens, max cache length)")
        if max_lengths.device.device_type != DeviceKind.CPU:
            raise ValueError(f"max_lengths must live on the host, got {max_lengths.device}")
        for name, value in (("cache_lengths", cache_lengths), ("lookup_table", lookup_table)):
            if value.device != blocks.device:
                raise ValueError(
                    f"{name} must be on the blocks' device {blocks.device}, got {value.device}"
                )

        out = ops.custom(
            CTOR_OP_NAME,
            device=blocks.device,
            values=[blocks, cache_lengths, lookup_table, max_lengths],
            out_types=[ContinuousBatchingKVCacheCollectionType(params)],
            parameters=kernel_parameters(params),
        )[0]
        return ContinuousBatchingKVCacheCollection(out, device=blocks.device)
