"""Bounds checks every op runs before it reads or writes the cache (any collection)."""

from extensibility import InputTensor
from max.gpu.host.info import is_cpu

from .kv_trait import MaxkvKVCollection


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


def check_rows[
    C: MaxkvKVCollection, //, target: StaticString
](
    kv: C,
    input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    total_tokens: Int,
) raises:
    """Checks the ragged layout against the collection (lengths on CPU only).

    On CPU every sequence's `cache_length + new tokens` must have storage (a
    slot of that many tokens, or that many tokens of real pages); on GPU the
    offsets live in device memory and only their count is checked.
    """
    if input_row_offsets.dim_size(0) != kv.batch() + 1:
        raise Error(
            "maxkv: input_row_offsets has ", input_row_offsets.dim_size(0),
            " entries for a batch of ", kv.batch(),
        )
    comptime if is_cpu[target]():
        if Int(input_row_offsets[0]) != 0 or Int(input_row_offsets[kv.batch()]) != total_tokens:
            raise Error(
                "maxkv: input_row_offsets must run from 0 to the ", total_tokens, " input tokens"
            )
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
