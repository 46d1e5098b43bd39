"""Bounds checks run before any op reads or writes the cache (any collection).

The ragged layout of a step (`input_row_offsets` against the collection's
cache lengths and storage) is checked once per step by the
`maxkv[.paged].check_row_offsets` op, which the Python graph functions emit
before the first op of a graph that uses a (collection, offsets) pair; being
an in-place op it sits on the device's chain ahead of every later op.  Each
op then checks only what is its own: the layer, and that the offsets have one
entry per sequence and end at its input's row count (`check_row_count`).
"""

import extensibility
from extensibility import InputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from .collection import ContinuousBatchingKVCacheCollection
from .kv_trait import MaxkvKVCollection
from .paged_collection import PagedKVCacheCollection


def check_layer[
    C: MaxkvKVCollection
](kv: C, layer_idx: InputTensor[dtype=DType.uint32, rank=1, ...]) raises -> UInt32:
    """Reads the host scalar `layer_idx` and checks it against the cache.

    A rank-0 graph tensor reaches a custom op as a rank-1 view of one element.
    """
    var layer = layer_idx.unsafe_ptr()[0]
    if Int(layer) >= kv.num_layers():
        raise Error(
            "maxkv: layer_idx ", layer, " is out of range: the cache has ",
            kv.num_layers(), " layers",
        )
    return layer


def check_row_count[
    C: MaxkvKVCollection, //, target: StaticString
](
    kv: C,
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    total_tokens: Int,
) raises:
    """An op's own part of the row check: one offset per sequence plus one, and
    (CPU) the last equal to the op's `total_tokens` input rows.  O(1); the rest
    of the layout was checked for the step by `check_rows`."""
    if input_row_offsets.dim_size(0) != kv.batch() + 1:
        raise Error(
            "maxkv: input_row_offsets has ", input_row_offsets.dim_size(0),
            " entries for a batch of ", kv.batch(),
        )
    comptime if is_cpu[target]():
        if Int(input_row_offsets[kv.batch()]) != total_tokens:
            raise Error(
                "maxkv: input_row_offsets must run from 0 to the ", total_tokens, " input tokens"
            )


def check_rows[
    C: MaxkvKVCollection, //, target: StaticString
](kv: C, input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...]) raises:
    """Checks a step's ragged layout against the collection (lengths on CPU only).

    On CPU the offsets must start at 0 and not decrease, no sequence may bring
    more than `max_lengths[0, 0]` new tokens, and every sequence's
    `cache_length + new tokens` must have storage (a slot of that many tokens,
    or that many tokens of real pages); on GPU the offsets live in device
    memory and only their count is checked.
    """
    if input_row_offsets.dim_size(0) != kv.batch() + 1:
        raise Error(
            "maxkv: input_row_offsets has ", input_row_offsets.dim_size(0),
            " entries for a batch of ", kv.batch(),
        )
    comptime if is_cpu[target]():
        if Int(input_row_offsets[0]) != 0:
            raise Error("maxkv: input_row_offsets must run from 0, not ", input_row_offsets[0])
        for b in range(kv.batch()):
            var start = input_row_offsets[b]
            var end = input_row_offsets[b + 1]
            if end < start:
                raise Error("maxkv: input_row_offsets decrease at batch entry ", b)
            kv.check_extent(b, kv.cache_length(b) + Int(end - start))
            if Int(end - start) > Int(kv.max_new_tokens()):
                raise Error(
                    "maxkv: sequence ", b, " has ", end - start, " new tokens, more than "
                    "max_lengths[0, 0] = ", kv.max_new_tokens(),
                )


# ------------------------------------------------------- the step's row check


@extensibility.register("maxkv.check_row_offsets")
struct CheckRowOffsets:
    """See `check_rows`: an in-place op with no result, ordered by the device chain."""

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        target: StaticString,
    ](
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: ContinuousBatchingKVCacheCollection[dtype_name, num_heads, head_dim],
        ctx: DeviceContext,
    ) raises:
        check_rows[target](kv, input_row_offsets)


@extensibility.register("maxkv.paged.check_row_offsets")
struct PagedCheckRowOffsets:
    """See `check_rows`."""

    @staticmethod
    def execute[
        dtype_name: StaticString,
        num_heads: Int,
        head_dim: Int,
        page_size: Int,
        target: StaticString,
    ](
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        kv: PagedKVCacheCollection[dtype_name, num_heads, head_dim, page_size],
        ctx: DeviceContext,
    ) raises:
        check_rows[target](kv, input_row_offsets)
