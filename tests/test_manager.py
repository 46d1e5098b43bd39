"""Manager bookkeeping: no graph is compiled here, so these run in seconds."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams

from .fakes import NumpyCacheDevice

pytestmark = pytest.mark.unit

Make = Callable[..., ContinuousBatchingKVCacheManager]


def state(manager: ContinuousBatchingKVCacheManager) -> tuple[dict[int, int], int]:
    return dict(manager.cache_lengths), manager.slots_remaining


def test_claim_hands_out_lowest_free_ids(make_manager: Make) -> None:
    manager = make_manager()
    assert manager.claim(2) == [0, 1]
    assert manager.slots_remaining == 2
    manager.release(0)
    assert manager.claim(2) == [0, 2]
    assert manager.contains(2) and not manager.contains(3)
    assert dict(manager.cache_lengths) == {0: 0, 1: 0, 2: 0}


@pytest.mark.parametrize("n", [0, -1, 5, 2.0, True])
def test_claim_rejects_bad_counts(make_manager: Make, n: object) -> None:
    manager = make_manager()
    with pytest.raises(ValueError):
        manager.claim(n)  # type: ignore[arg-type]
    assert state(manager) == ({}, 4)


def test_claim_over_capacity_names_the_free_slots(make_manager: Make) -> None:
    manager = make_manager()
    manager.claim(3)
    with pytest.raises(ValueError, match="only 1 of 4 slots are free"):
        manager.claim(2)


def test_external_claim(make_manager: Make) -> None:
    manager = make_manager()
    manager.external_claim([3, 1])
    assert sorted(manager.cache_lengths) == [1, 3]
    assert manager.claim(2) == [0, 2]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "must not be empty"),
        ([1, 1], "appears more than once"),
        ([4], "out of range"),
        ([-1], "must be >= 0"),
        ([2, 0], "seq_id 0 is already claimed"),
        ("01", "sequence of ints"),
    ],
)
def test_external_claim_rejects_and_leaves_state(
    make_manager: Make, ids: object, message: str
) -> None:
    manager = make_manager()
    manager.claim(1)
    before = state(manager)
    with pytest.raises(ValueError, match=message):
        manager.external_claim(ids)  # type: ignore[arg-type]
    assert state(manager) == before


def test_fetch_orders_lengths_and_slots_like_seq_ids(make_manager: Make) -> None:
    manager = make_manager()
    manager.claim(4)
    manager.step({0: 3, 2: 7, 3: 1})
    blocks, lengths, lookup, max_lengths = manager.fetch([3, 0, 2])[0]
    assert list(blocks.shape) == [4, 2, 2, 16, 2, 8]
    assert blocks.dtype == DType.float32
    np.testing.assert_array_equal(lengths.to_numpy(), [1, 3, 7])
    np.testing.assert_array_equal(lookup.to_numpy(), [3, 0, 2])
    assert lengths.dtype == lookup.dtype == max_lengths.dtype == DType.uint32
    # Default: one new token per sequence (a decode step).
    np.testing.assert_array_equal(max_lengths.to_numpy(), [[1, 7]])


def test_fetch_max_lengths_rows_for_multistep(make_manager: Make) -> None:
    manager = make_manager()
    manager.claim(3)
    manager.step({1: 4})
    _, _, _, max_lengths = manager.fetch([0, 1, 2], num_steps=4, active_lengths=[6, 1, 2])[0]
    # Reference by hand: lengths [0, 4, 0] + [6, 1, 2] = [6, 5, 2] after step 0,
    # then one token per step.
    np.testing.assert_array_equal(max_lengths.to_numpy(), [[6, 4], [1, 6], [1, 7], [1, 8]])


def test_empty_caches_give_zero_max_cache_length(make_manager: Make) -> None:
    """The is_cache_empty of MAX 24.x is max_lengths[0, 1] == 0."""
    manager = make_manager()
    ids = manager.claim(2)
    max_lengths = manager.fetch(ids, active_lengths={0: 5, 1: 3})[0][3].to_numpy()
    assert max_lengths[0, 1] == 0 and max_lengths[0, 0] == 5
    manager.step({0: 5, 1: 3})
    assert manager.fetch(ids)[0][3].to_numpy()[0, 1] == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_ids": [0, 3]}, "seq_id 3 is not claimed"),
        ({"seq_ids": [0, 0]}, "appears more than once"),
        ({"seq_ids": []}, "must not be empty"),
        ({"seq_ids": [9]}, "out of range"),
        ({"seq_ids": [0], "num_steps": 0}, "num_steps must be >= 1"),
        ({"seq_ids": [0], "active_lengths": [0]}, "must be >= 1"),
        ({"seq_ids": [0], "active_lengths": [1, 2]}, "2 entries for 1 seq_ids"),
        ({"seq_ids": [0], "active_lengths": {1: 2}}, "missing \\[0\\]"),
        ({"seq_ids": [0], "active_lengths": [17]}, "need 17 > max_seq_len 16"),
        ({"seq_ids": [1], "num_steps": 8}, "need 17 > max_seq_len 16"),
    ],
)
def test_fetch_rejects(make_manager: Make, kwargs: dict[str, object], message: str) -> None:
    manager = make_manager()
    manager.claim(2)
    manager.step({1: 9})
    before = state(manager)
    with pytest.raises(ValueError, match=message):
        manager.fetch(**kwargs)  # type: ignore[arg-type]
    assert state(manager) == before


def test_fetch_accepts_exactly_max_seq_len(make_manager: Make) -> None:
    manager = make_manager()
    manager.claim(1)
    manager.step({0: 9})
    manager.fetch([0], num_steps=7)  # 9 + 1 + 6 == 16
    manager.fetch([0], active_lengths=[7])


def test_step_commits_atomically(make_manager: Make) -> None:
    manager = make_manager()
    manager.claim(2)
    manager.step({0: 10, 1: 2})
    with pytest.raises(ValueError, match="= 17 > max_seq_len 16"):
        manager.step({1: 3, 0: 7})
    assert dict(manager.cache_lengths) == {0: 10, 1: 2}
    with pytest.raises(ValueError, match="must be >= 0"):
        manager.step({0: -1})
    with pytest.raises(ValueError, match="seq_id 2 is not claimed"):
        manager.step({0: 1, 2: 1})
    with pytest.raises(ValueError, match="mapping"):
        manager.step([(0, 1)])  # type: ignore[arg-type]
    assert dict(manager.cache_lengths) == {0: 10, 1: 2}
    manager.step({})
    manager.step({0: 6})
    assert manager.cache_lengths[0] == 16


def test_release_frees_and_forgets(make_manager: Make) -> None:
    manager = make_manager()
    ids = manager.claim(2)
    manager.step({ids[0]: 4})
    manager.release(ids[0])
    assert not manager.contains(ids[0])
    with pytest.raises(ValueError, match="not claimed"):
        manager.release(ids[0])
    with pytest.raises(ValueError, match="not claimed"):
        manager.fetch([ids[0]])
    assert manager.claim(1) == [ids[0]]
    assert manager.cache_lengths[ids[0]] == 0


def test_cache_lengths_view_is_read_only(make_manager: Make) -> None:
    manager = make_manager()
    manager.claim(1)
    view = manager.cache_lengths
    with pytest.raises(TypeError):
        view[0] = 5  # type: ignore[index]


def test_shapes_and_symbols(make_manager: Make) -> None:
    manager = make_manager(dtype=DType.bfloat16, n_kv_heads=4, head_dim=16, num_layers=3)
    assert manager.block_shape(5) == [5, 2, 3, 16, 4, 16]
    (symbols,) = manager.input_symbols()
    blocks, lengths, lookup, max_lengths = symbols
    assert blocks.dtype == DType.bfloat16
    assert [str(d) for d in blocks.shape] == [
        "kv_cache_slots",
        "2",
        "3",
        "kv_max_seq_len",
        "4",
        "16",
    ]
    assert lengths.dtype == lookup.dtype == max_lengths.dtype == DType.uint32
    assert str(lengths.shape[0]) == "batch_size" and max_lengths.rank == 2
    assert max_lengths.device.is_cpu()


def test_estimated_memory_size_matches_the_blocks() -> None:
    params = KVCacheParams(DType.bfloat16, n_kv_heads=8, head_dim=64, n_devices=2)
    size = ContinuousBatchingKVCacheManager.estimated_memory_size(
        params, 16, 1024, 4, [CPU(), CPU()]
    )
    assert size == math.prod([16, 2, 4, 1024, 4, 64]) * 2 * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_cache_batch_size": 0}, "max_cache_batch_size must be >= 1"),
        ({"max_seq_len": -4}, "max_seq_len must be >= 1"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
    ],
)
def test_constructor_rejects(make_manager: Make, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_manager(**kwargs)


def test_constructor_rejects_device_count() -> None:
    params = KVCacheParams(DType.float32, 4, 8, n_devices=2)
    with pytest.raises(ValueError, match="n_devices is 2 but 1 devices"):
        ContinuousBatchingKVCacheManager(
            params, 2, 8, 1, [CPU()], None, cache_device=NumpyCacheDevice()
        )
    with pytest.raises(ValueError, match="a session is needed unless a cache_device is given"):
        ContinuousBatchingKVCacheManager(KVCacheParams(DType.float32, 4, 8), 2, 8, 1, [CPU()], None)
