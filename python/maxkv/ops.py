"""Graph functions over maxkv's Mojo ops.

Every function here takes the opaque :class:`ContinuousBatchingKVCacheCollection`
built by :class:`~maxkv.graph.FetchContinuousBatchingKVCacheCollection` and the
:class:`~maxkv.params.KVCacheParams` it was built with, validates its
arguments at graph-build time, and emits one Mojo op.  A graph that uses them
must load :func:`maxkv.kernels_path` as a custom extension.
"""

from __future__ import annotations

from max.dtype import DType
from max.graph import TensorType, TensorValue, ops
from max.graph.dim import DimLike

from .graph import (
    BATCH_DIM,
    COLLECTION_TYPE_NAME,
    ContinuousBatchingKVCacheCollection,
    opaque_parameters,
)
from .params import KVCacheParams


def _check_collection(
    params: KVCacheParams, kv_collection: object
) -> ContinuousBatchingKVCacheCollection:
    if not isinstance(params, KVCacheParams):
        raise TypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
    if not isinstance(kv_collection, ContinuousBatchingKVCacheCollection):
        raise TypeError(
            "kv_collection must be a ContinuousBatchingKVCacheCollection, got "
            f"{type(kv_collection).__name__}"
        )
    kv_type = kv_collection.type
    expected = opaque_parameters(params)
    if kv_type.name != COLLECTION_TYPE_NAME or dict(kv_type.parameters) != expected:
        raise ValueError(
            f"kv_collection was built for {kv_type.name}{dict(kv_type.parameters)}, "
            f"but params describe {COLLECTION_TYPE_NAME}{expected}"
        )
    return kv_collection


def cache_lengths(
    params: KVCacheParams,
    kv_collection: ContinuousBatchingKVCacheCollection,
    batch_size: DimLike = BATCH_DIM,
) -> TensorValue:
    """Reads each sequence's cache length back through the collection.

    A diagnostic op: what a kernel sees as ``cache_length(b)``.

    Args:
        params: The cache parameters the collection was built with.
        kv_collection: The collection.
        batch_size: The batch dim; the default is the symbolic name that
            ``input_symbols()`` gives ``cache_lengths``.

    Returns:
        uint32 ``[batch_size]`` on the collection's device.
    """
    _check_collection(params, kv_collection)
    device = kv_collection.device
    return ops.inplace_custom(
        "maxkv.cache_lengths",
        device=device,
        values=[kv_collection],
        out_types=[TensorType(DType.uint32, [batch_size], device=device)],
        parameters=opaque_parameters(params),
    )[0].tensor
