"""Graph-side types and values of maxkv's KV caches (contiguous and paged).

Mirrors ``max.pipelines.kv_cache.continuous_batching_cache`` of MAX 24.x:
the four tensors that :meth:`ContinuousBatchingKVCacheManager.fetch` returns
enter a graph as inputs (see ``input_symbols()``) and
:class:`FetchContinuousBatchingKVCacheCollection` turns them into one opaque
:class:`ContinuousBatchingKVCacheCollection` value that maxkv's Mojo ops take.
The paged cache (:class:`~maxkv.PagedKVCacheManager`) works the same way
through :class:`FetchPagedKVCacheCollection` and :class:`PagedKVCacheCollection`;
every op in :mod:`maxkv.ops` takes either collection.
"""

from __future__ import annotations

from typing import Any, ClassVar

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops
from max.graph.type import _OpaqueType
from max.graph.value import _OpaqueValue

from .params import KVCacheParams

#: Name of the Mojo struct behind the collection (``mojo_ops/collection.mojo``).
COLLECTION_TYPE_NAME = "ContinuousBatchingKVCacheCollection"
#: Name of the Mojo struct behind a single layer's cache.
CACHE_TYPE_NAME = "ContinuousBatchingKVCache"
#: The Mojo op that builds the collection.
CTOR_OP_NAME = "maxkv.kv_collection_ctor"
#: Name of the Mojo struct behind the paged collection (``mojo_ops/paged_collection.mojo``).
PAGED_COLLECTION_TYPE_NAME = "PagedKVCacheCollection"
#: The Mojo op that builds the paged collection.
PAGED_CTOR_OP_NAME = "maxkv.paged.kv_collection_ctor"
#: Symbolic dim of ``cache_lengths``/``lookup_table`` in ``input_symbols()``.
BATCH_DIM = "batch_size"
#: Symbolic dim of ``max_lengths``' first axis in ``input_symbols()``.
STEPS_DIM = "num_steps"
#: Symbolic dims of the paged manager's page count and page-table width.
PAGES_DIM = "kv_num_pages"
PAGE_TABLE_WIDTH_DIM = "kv_max_pages_per_seq"
#: Symbolic dims of the blocks' slot and token axes in ``input_symbols()``: one
#: compiled graph serves managers of any ``max_cache_batch_size`` and ``max_seq_len``.
SLOTS_DIM = "kv_cache_slots"
SEQ_LEN_DIM = "kv_max_seq_len"


def opaque_parameters(
    params: KVCacheParams, page_size: int | None = None
) -> dict[str, bool | int | str]:
    """Mojo parameters of the collection struct for ``params`` (one device);
    with ``page_size``, of the paged collection."""
    parameters: dict[str, bool | int | str] = {
        "dtype_name": params.dtype_name,
        "num_heads": params.n_kv_heads_per_device,
        "head_dim": params.head_dim,
    }
    if page_size is not None:
        parameters["page_size"] = page_size
    return parameters


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


class PagedKVCacheCollectionType(_OpaqueType):
    """The graph type of a view of the paged cache for the sequences of one batch."""

    def __init__(self, params: KVCacheParams, page_size: int) -> None:
        super().__init__(PAGED_COLLECTION_TYPE_NAME, opaque_parameters(params, page_size))


class KVCacheCollection(_OpaqueValue):
    """A graph value of one of maxkv's collection types: what :mod:`maxkv.ops` take.

    Opaque values carry no device in MAX, so the collection remembers the
    device of the blocks it was built from: maxkv's ops run there.
    """

    #: The Mojo struct behind this collection.
    type_name: ClassVar[str]
    #: Prefix of the Mojo op names registered for this collection.
    op_prefix: ClassVar[str]

    def __init__(self, value: Any, device: DeviceRef | None = None) -> None:
        super().__init__(value)
        if device is None and isinstance(value, KVCacheCollection):
            device = value._device
        self._device: DeviceRef | None = device

    @property
    def device(self) -> DeviceRef:
        """The device of the cache blocks this view borrows."""
        if self._device is None:
            raise ValueError(
                f"this {type(self).__name__} does not know its device; build it with "
                f"Fetch{type(self).__name__}"
            )
        return self._device

    def op_name(self, op: str) -> str:
        """The name of Mojo op ``op`` (e.g. ``"flash_attention_ragged"``) for this collection."""
        return self.op_prefix + op

    def op_parameters(self) -> dict[str, bool | int | str]:
        """The collection struct's Mojo parameters, which every op taking it needs again."""
        return dict(self.type.parameters)


class ContinuousBatchingKVCacheCollection(KVCacheCollection):
    """The graph value of a :class:`ContinuousBatchingKVCacheCollectionType`."""

    type_name = COLLECTION_TYPE_NAME
    op_prefix = "maxkv."


class PagedKVCacheCollection(KVCacheCollection):
    """The graph value of a :class:`PagedKVCacheCollectionType`."""

    type_name = PAGED_COLLECTION_TYPE_NAME
    op_prefix = "maxkv.paged."


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


def same_device(a: DeviceRef, b: DeviceRef) -> bool:
    """Whether ``a`` and ``b`` name the same device.

    MAX 26.7's ``DeviceRef ==`` cannot be used: ``DeviceKind`` is a frozen
    dataclass over a ``str`` enum whose generated ``__eq__`` finds every kind
    equal, so ``DeviceRef.GPU() == DeviceRef.CPU()`` is true.
    """
    return bool(a.is_cpu() == b.is_cpu() and a.id == b.id)


def _check_cache_inputs(
    params: KVCacheParams,
    storage: tuple[str, TensorValue],
    cache_lengths: TensorValue,
    table: tuple[str, TensorValue, int],
    max_lengths: TensorValue,
) -> None:
    """The checks both fetchers run on one device's four inputs (dtypes, ranks,
    static dims of the storage's K/V, head and dim axes, devices)."""
    storage_name, blocks = storage
    table_name, table_value, table_rank = table
    _check(storage_name, blocks, params.dtype, 6)
    _check("cache_lengths", cache_lengths, DType.uint32, 1)
    _check(table_name, table_value, DType.uint32, table_rank)
    _check("max_lengths", max_lengths, DType.uint32, 2)
    _check_static_dim(storage_name, blocks, 1, 2, "the key/value axis")
    _check_static_dim(
        storage_name, blocks, 4, params.n_kv_heads_per_device, "n_kv_heads_per_device"
    )
    _check_static_dim(storage_name, blocks, 5, params.head_dim, "head_dim")
    _check_static_dim("max_lengths", max_lengths, 1, 2, "(max new tokens, max cache length)")
    if not max_lengths.device.is_cpu():
        raise ValueError(f"max_lengths must live on the host, got {max_lengths.device}")
    for name, value in (("cache_lengths", cache_lengths), (table_name, table_value)):
        if not same_device(value.device, blocks.device):
            raise ValueError(
                f"{name} must be on the device of {storage_name}, {blocks.device}, "
                f"got {value.device}"
            )


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
        _check_cache_inputs(
            params,
            ("blocks", blocks),
            cache_lengths,
            ("lookup_table", lookup_table, 1),
            max_lengths,
        )

        out = ops.custom(
            CTOR_OP_NAME,
            device=blocks.device,
            values=[blocks, cache_lengths, lookup_table, max_lengths],
            out_types=[ContinuousBatchingKVCacheCollectionType(params)],
            parameters=kernel_parameters(params),
        )[0]
        return ContinuousBatchingKVCacheCollection(out, device=blocks.device)


class FetchPagedKVCacheCollection:
    """Builds a :class:`PagedKVCacheCollection` inside a graph.

    Args:
        params: The cache parameters the paged manager was created with.
        page_size: Its tokens per page.

    Call it with one device's four graph inputs, in ``fetch()`` order.
    """

    def __init__(self, params: KVCacheParams, page_size: int) -> None:
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.params = params
        self.page_size = page_size

    def __call__(
        self,
        pages: TensorValue,
        cache_lengths: TensorValue,
        page_table: TensorValue,
        max_lengths: TensorValue,
    ) -> PagedKVCacheCollection:
        """Wraps the four tensors into the opaque paged collection.

        Args:
            pages: ``[num_pages, 2, num_layers, page_size, n_kv_heads_per_device,
                head_dim]`` of ``params.dtype``.
            cache_lengths: uint32 ``[batch]``, tokens already cached per sequence.
            page_table: uint32 ``[batch, max_pages_per_seq]``; entry ``[b, i]``
                is the page holding sequence *b*'s tokens ``i * page_size ..``.
            max_lengths: uint32 ``[num_steps, 2]`` on the host.

        Returns:
            The collection, placed on ``pages``' device.

        Raises:
            ValueError: If a dtype, rank, static dim or device is wrong.
        """
        params = self.params
        _check_cache_inputs(
            params, ("pages", pages), cache_lengths, ("page_table", page_table, 2), max_lengths
        )
        _check_static_dim("pages", pages, 3, self.page_size, "page_size")
        out = ops.custom(
            PAGED_CTOR_OP_NAME,
            device=pages.device,
            values=[pages, cache_lengths, page_table, max_lengths],
            out_types=[PagedKVCacheCollectionType(params, self.page_size)],
            parameters={**opaque_parameters(params, self.page_size), "dtype": params.dtype},
        )[0]
        return PagedKVCacheCollection(out, device=pages.device)
