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

from collections.abc import Sequence
from typing import Any, ClassVar

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops
from max.graph.type import _OpaqueType
from max.graph.value import _OpaqueValue

from ..cache.params import KVCacheParams
from ..cache.spec import CacheSpec, HybridCacheSpec, split_inputs
from .checks import (
    check_host,
    check_on,
    check_params,
    check_positive_int,
    check_static_dim,
    check_tensor,
)

#: Name of the Mojo struct behind the collection (``mojo_ops/collection.mojo``).
COLLECTION_TYPE_NAME = "ContinuousBatchingKVCacheCollection"
#: MAX 24.x's name of a single layer's cache (no maxkv struct: see ContinuousBatchingKVCacheType).
CACHE_TYPE_NAME = "ContinuousBatchingKVCache"
#: The Mojo op that builds the collection.
CTOR_OP_NAME = "maxkv.kv_collection_ctor"
#: Name of the Mojo struct behind the paged collection (``mojo_ops/paged_collection.mojo``).
PAGED_COLLECTION_TYPE_NAME = "PagedKVCacheCollection"
#: The Mojo op that builds the paged collection.
PAGED_CTOR_OP_NAME = "maxkv.paged.kv_collection_ctor"


def opaque_parameters(
    params: KVCacheParams, page_size: int | None = None
) -> dict[str, bool | int | str]:
    """Mojo parameters of the collection struct for ``params`` (one device);
    with ``page_size``, of the paged collection."""
    parameters: dict[str, bool | int | str] = {
        "dtype_name": params.cache_dtype_name,
        "num_heads": params.n_kv_heads_per_device,
        "head_dim": params.head_dim,
    }
    if page_size is not None:
        parameters["page_size"] = page_size
    return parameters


def ctor_parameters(
    params: KVCacheParams, page_size: int | None = None
) -> dict[str, bool | int | str | DType]:
    """Op parameters of a collection's ctor: the collection struct's parameters
    and ``dtype``, the cache encoding's storage dtype (its blocks' dtype).

    A Mojo kernel parameter that no tensor argument carries cannot be inferred
    by the graph compiler, so the collection's parameters are passed again.
    """
    return {**opaque_parameters(params, page_size), "dtype": params.cache_dtype}


class ContinuousBatchingKVCacheCollectionType(_OpaqueType):
    """The graph type of a view of the cache for the sequences of one batch.

    The view borrows the manager's blocks; it owns nothing.
    """

    def __init__(self, params: KVCacheParams) -> None:
        super().__init__(COLLECTION_TYPE_NAME, opaque_parameters(params))


class ContinuousBatchingKVCacheType(_OpaqueType):
    """MAX 24.x's graph type of one layer's cache, kept so that its imports resolve.

    maxkv's ops take the collection and a layer index instead, and no maxkv
    op takes or returns this type: there is no Mojo struct behind it, so a
    graph whose inputs or outputs use it does not compile.  Use
    :class:`ContinuousBatchingKVCacheCollectionType`.
    """

    def __init__(self, params: KVCacheParams) -> None:
        super().__init__(CACHE_TYPE_NAME, opaque_parameters(check_params(params)))


class PagedKVCacheCollectionType(_OpaqueType):
    """The graph type of a view of the paged cache for the sequences of one batch."""

    def __init__(self, params: KVCacheParams, page_size: int) -> None:
        super().__init__(PAGED_COLLECTION_TYPE_NAME, opaque_parameters(params, page_size))


class KVCacheCollection(_OpaqueValue):
    """A graph value of one of maxkv's collection types: what :mod:`maxkv.ops` take.

    Opaque values carry no device in MAX, so the collection remembers the
    device of the blocks it was built from (maxkv's ops run there) and the
    cache parameters it was built for (the ops read them from here).
    """

    #: The Mojo struct behind this collection.
    type_name: ClassVar[str]
    #: Prefix of the Mojo op names registered for this collection.
    op_prefix: ClassVar[str]

    def __init__(
        self, value: Any, device: DeviceRef | None = None, params: KVCacheParams | None = None
    ) -> None:
        super().__init__(value)
        if isinstance(value, KVCacheCollection):
            device = device or value._device
            params = params or value._params
        self._device: DeviceRef | None = device
        self._params: KVCacheParams | None = params
        #: The (graph, row offsets) pairs whose step check this collection's
        #: ops already emitted (see :func:`maxkv.graph.ops.check_row_offsets`).
        self.rows_checked: set[tuple[object, object]] = (
            value.rows_checked if isinstance(value, KVCacheCollection) else set()
        )

    @property
    def params(self) -> KVCacheParams:
        """The cache parameters this view was built for."""
        if self._params is None:
            raise ValueError(
                f"this {type(self).__name__} does not know its cache parameters; build it "
                f"with Fetch{type(self).__name__}"
            )
        return self._params

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

    def kernel_parameters(self) -> dict[str, bool | int | str | DType]:
        """:meth:`op_parameters` and the model's compute ``dtype`` (of Q, K, V and
        the attention output): what a kernel taking this collection is given
        (read from the collection, not from the caller).  The cache encoding
        is the collection's own ``dtype_name``."""
        return {**self.op_parameters(), "dtype": self.params.dtype}


class ContinuousBatchingKVCacheCollection(KVCacheCollection):
    """The graph value of a :class:`ContinuousBatchingKVCacheCollectionType`."""

    type_name = COLLECTION_TYPE_NAME
    op_prefix = "maxkv."


class PagedKVCacheCollection(KVCacheCollection):
    """The graph value of a :class:`PagedKVCacheCollectionType`."""

    type_name = PAGED_COLLECTION_TYPE_NAME
    op_prefix = "maxkv.paged."


class ContinuousBatchingKVCache(_OpaqueValue):
    """MAX 24.x's graph value of one layer's cache, kept so that its imports resolve;
    see :class:`ContinuousBatchingKVCacheType` (no maxkv op takes one)."""


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
    check_tensor(storage_name, blocks, params.cache_dtype, 6)
    check_tensor("cache_lengths", cache_lengths, DType.uint32, 1)
    check_tensor(table_name, table_value, DType.uint32, table_rank)
    check_tensor("max_lengths", max_lengths, DType.uint32, 2)
    check_static_dim(storage_name, blocks, 1, 2, "the key/value axis")
    check_static_dim(storage_name, blocks, 4, params.n_kv_heads_per_device, "n_kv_heads_per_device")
    row = f"a {params.encoding} head row" if params.quantized else "head_dim"
    check_static_dim(storage_name, blocks, 5, params.head_width, row)
    check_static_dim("max_lengths", max_lengths, 1, 2, "(max new tokens, max cache length)")
    check_host("max_lengths", max_lengths)
    for name, value in (("cache_lengths", cache_lengths), (table_name, table_value)):
        check_on(name, value, blocks.device, of=storage_name)


class FetchContinuousBatchingKVCacheCollection:
    """Builds a :class:`ContinuousBatchingKVCacheCollection` inside a graph.

    Args:
        params: The cache parameters the manager was created with.

    Call it with one device's four graph inputs, in ``fetch()`` order.
    """

    def __init__(self, params: KVCacheParams) -> None:
        self.params = check_params(params)

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
                n_kv_heads_per_device, head_dim]`` of ``params.cache_dtype``.
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
            parameters=ctor_parameters(params),
        )[0]
        return ContinuousBatchingKVCacheCollection(out, device=blocks.device, params=params)


class FetchPagedKVCacheCollection:
    """Builds a :class:`PagedKVCacheCollection` inside a graph.

    Args:
        params: The cache parameters the paged manager was created with.
        page_size: Its tokens per page.

    Call it with one device's four graph inputs, in ``fetch()`` order.
    """

    def __init__(self, params: KVCacheParams, page_size: int) -> None:
        self.params = check_params(params)
        self.page_size = check_positive_int("page_size", page_size)

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
                head_dim]`` of ``params.cache_dtype``.
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
        check_static_dim("pages", pages, 3, self.page_size, "page_size")
        out = ops.custom(
            PAGED_CTOR_OP_NAME,
            device=pages.device,
            values=[pages, cache_lengths, page_table, max_lengths],
            out_types=[PagedKVCacheCollectionType(params, self.page_size)],
            parameters=ctor_parameters(params, self.page_size),
        )[0]
        return PagedKVCacheCollection(out, device=pages.device, params=params)


def collection_fetcher(
    spec: CacheSpec,
) -> FetchContinuousBatchingKVCacheCollection | FetchPagedKVCacheCollection:
    """What turns one device's inputs of a cache of ``spec`` into the opaque
    collection inside a graph."""
    if spec.kind == "paged":
        assert spec.page_size is not None
        return FetchPagedKVCacheCollection(spec.params, spec.page_size)
    return FetchContinuousBatchingKVCacheCollection(spec.params)


def layer_collections(
    spec: CacheSpec | HybridCacheSpec, values: Sequence[Any]
) -> list[tuple[KVCacheCollection, int]]:
    """Inside a graph: per model layer, its collection and its layer index there,
    from one device's cache input values (``spec.input_symbols``' order; a hybrid
    cache's groups one after the other, one collection per group)."""
    if isinstance(spec, CacheSpec):
        kv = collection_fetcher(spec)(*values)
        return [(kv, i) for i in range(spec.num_layers)]
    collections = [
        collection_fetcher(group)(*inputs)
        for group, inputs in zip(spec.groups, split_inputs(values, len(spec.groups)), strict=True)
    ]
    return [(collections[g], i) for g, i in spec.layers]
