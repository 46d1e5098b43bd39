"""The opaque collection end to end: manager -> graph inputs -> Mojo ctor -> consumer op.

Each distinct graph is compiled once per session (see conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

import maxkv
from maxkv import FetchContinuousBatchingKVCacheCollection, KVCacheParams

from .conftest import CacheConfig, LengthsModel

pytestmark = pytest.mark.compile


def run_lengths(model: LengthsModel, inputs: tuple[Buffer, ...]) -> np.ndarray:
    return model.model.execute(*inputs)[0].to_numpy()


def row_offsets(new_tokens: list[int]) -> Buffer:
    return Buffer.from_numpy(np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32))


def test_kernel_sees_lengths_of_out_of_order_slots(
    lengths_model: LengthsModel, session: InferenceSession
) -> None:
    manager = lengths_model.config.manager(session)
    manager.claim(4)
    manager.step({0: 2, 1: 11, 2: 0, 3: 5})
    seq_ids = [3, 1, 0]
    (inputs,) = manager.fetch(seq_ids)
    np.testing.assert_array_equal(run_lengths(lengths_model, inputs), [5, 11, 2])


def test_lifecycle_with_multistep_increment(
    lengths_model: LengthsModel, session: InferenceSession
) -> None:
    """claim -> fetch -> run -> increment x2 -> step -> fetch -> increment -> release."""
    manager = lengths_model.config.manager(session)
    seq_ids = manager.claim(3)
    prompts = [5, 9, 1]
    inputs = manager.fetch(seq_ids, num_steps=3, active_lengths=prompts)
    expected = np.zeros(3, dtype=np.int64)
    np.testing.assert_array_equal(run_lengths(lengths_model, inputs[0]), expected)

    new_tokens = prompts
    for _step in (1, 2):
        inputs = manager.increment_cache_lengths(inputs, (None, row_offsets(new_tokens)))
        expected += new_tokens
        new_tokens = [1, 1, 1]
        np.testing.assert_array_equal(run_lengths(lengths_model, inputs[0]), expected)
        np.testing.assert_array_equal(inputs[0][3].to_numpy()[0], [1, expected.max()])

    with pytest.raises(ValueError, match="no further step was fetched"):
        manager.increment_cache_lengths(inputs, (None, row_offsets(new_tokens)))

    manager.step({s: p + 2 for s, p in zip(seq_ids, prompts, strict=True)})
    assert dict(manager.cache_lengths) == {0: 7, 1: 11, 2: 3}
    inputs = manager.fetch([seq_ids[2], seq_ids[0]], num_steps=2)

    class StepInputs:
        input_row_offsets = row_offsets([1, 1])

    inputs = manager.increment_cache_lengths(inputs, StepInputs())
    np.testing.assert_array_equal(run_lengths(lengths_model, inputs[0]), [4, 8])
    for seq_id in seq_ids:
        manager.release(seq_id)
    assert manager.slots_remaining == lengths_model.config.max_cache_batch_size


def test_increment_rejects_mismatched_row_offsets(
    lengths_model: LengthsModel, session: InferenceSession
) -> None:
    manager = lengths_model.config.manager(session)
    ids = manager.claim(2)
    inputs = manager.fetch(ids, num_steps=2)
    with pytest.raises(ValueError, match="expected batch \\+ 1 = 3"):
        manager.increment_cache_lengths(inputs, (None, row_offsets([1])))
    with pytest.raises(ValueError, match="uint32"):
        bad = Buffer.from_numpy(np.array([0, 1, 2], dtype=np.int32))
        manager.increment_cache_lengths(inputs, (None, bad))
    with pytest.raises(ValueError, match="one 4-tuple per device"):
        manager.increment_cache_lengths([], (None, row_offsets([1, 1])))
    with pytest.raises(ValueError, match="input_row_offsets attribute"):
        manager.increment_cache_lengths(inputs, object())


def forged_inputs(
    config: CacheConfig, lengths: list[int], slots: list[int], max_new: int
) -> tuple[Buffer, ...]:
    blocks = Buffer.zeros(
        [
            config.max_cache_batch_size,
            2,
            config.num_layers,
            config.max_seq_len,
            config.n_kv_heads,
            config.head_dim,
        ],
        config.dtype,
    )
    return (
        blocks,
        Buffer.from_numpy(np.array(lengths, dtype=np.uint32)),
        Buffer.from_numpy(np.array(slots, dtype=np.uint32)),
        Buffer.from_numpy(np.array([[max_new, max(lengths)]], dtype=np.uint32)),
    )


def test_ctor_rejects_forged_lookup_table(lengths_model: LengthsModel) -> None:
    inputs = forged_inputs(lengths_model.config, [1, 2], [0, 4], 1)
    with pytest.raises(Exception, match="lookup_table\\[1\\] = 4 is out of range"):
        run_lengths(lengths_model, inputs)


def test_ctor_rejects_forged_lengths(lengths_model: LengthsModel) -> None:
    """A cache length past the slot is refused by the ctor.  New tokens are checked
    per sequence by every op that writes (``max_lengths`` only bounds the longest),
    so a length that leaves room for fewer than ``max_lengths[0, 0]`` is accepted here."""
    inputs = forged_inputs(lengths_model.config, [3, 17], [0, 1], 3)
    with pytest.raises(Exception, match="past max_seq_len 16"):
        run_lengths(lengths_model, inputs)
    ok = forged_inputs(lengths_model.config, [3, 16], [0, 1], 3)
    np.testing.assert_array_equal(run_lengths(lengths_model, ok), [3, 16])


# ---------------------------------------------------------- graph-build checks

PARAMS = KVCacheParams(DType.float32, n_kv_heads=2, head_dim=8)
CPU_REF = DeviceRef.CPU()


def build(
    blocks: TensorType,
    lengths: TensorType,
    lookup: TensorType,
    max_lengths: TensorType,
    params: KVCacheParams = PARAMS,
) -> None:
    with Graph("validation", input_types=[blocks, lengths, lookup, max_lengths]) as graph:
        FetchContinuousBatchingKVCacheCollection(params)(*(v.tensor for v in graph.inputs))


GOOD = (
    TensorType(DType.float32, [4, 2, 2, 16, 2, 8], CPU_REF),
    TensorType(DType.uint32, ["batch_size"], CPU_REF),
    TensorType(DType.uint32, ["batch_size"], CPU_REF),
    TensorType(DType.uint32, ["num_steps", 2], CPU_REF),
)


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (0, TensorType(DType.bfloat16, [4, 2, 2, 16, 2, 8], CPU_REF), "blocks must have dtype"),
        (0, TensorType(DType.float32, [4, 2, 16, 2, 8], CPU_REF), "blocks must have rank 6"),
        (0, TensorType(DType.float32, [4, 2, 2, 16, 4, 8], CPU_REF), "n_kv_heads_per_device"),
        (0, TensorType(DType.float32, [4, 2, 2, 16, 2, 16], CPU_REF), "head_dim = 8"),
        (0, TensorType(DType.float32, [4, 3, 2, 16, 2, 8], CPU_REF), "key/value axis"),
        (0, TensorType(DType.float32, [4, 2, 2, 16, 2, "d"], CPU_REF), "symbolic"),
        (1, TensorType(DType.int32, ["batch_size"], CPU_REF), "cache_lengths must have dtype"),
        (2, TensorType(DType.uint32, ["batch_size", 1], CPU_REF), "lookup_table must have rank"),
        (3, TensorType(DType.uint32, ["num_steps", 3], CPU_REF), "max_lengths dim 1"),
        (3, TensorType(DType.uint32, ["num_steps"], CPU_REF), "max_lengths must have rank 2"),
    ],
)
def test_fetch_collection_validates(index: int, bad: TensorType, message: str) -> None:
    types = list(GOOD)
    types[index] = bad
    with pytest.raises(ValueError, match=message):
        build(*types)


def test_cache_lengths_op_rejects_foreign_params(kernels: Path) -> None:
    other = KVCacheParams(DType.float32, n_kv_heads=4, head_dim=8)
    with Graph("mismatch", input_types=list(GOOD), custom_extensions=[kernels]) as graph:
        collection = FetchContinuousBatchingKVCacheCollection(PARAMS)(
            *(v.tensor for v in graph.inputs)
        )
        with pytest.raises(ValueError, match="but params describe"):
            maxkv.ops.cache_lengths(other, collection)
        with pytest.raises(TypeError, match="ContinuousBatchingKVCacheCollection"):
            maxkv.ops.cache_lengths(PARAMS, graph.inputs[0].tensor)  # type: ignore[arg-type]
