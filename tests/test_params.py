from __future__ import annotations

import pytest
from max.dtype import DType

from maxkv import KVCacheParams

pytestmark = pytest.mark.unit


def test_per_device_heads_and_dtype_name() -> None:
    params = KVCacheParams(DType.bfloat16, n_kv_heads=8, head_dim=64, n_devices=4)
    assert params.n_kv_heads_per_device == 2
    assert params.dtype_name == "bfloat16"
    assert KVCacheParams(DType.float32, 3, 16).n_kv_heads_per_device == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_kv_heads": 0}, "n_kv_heads must be >= 1"),
        ({"n_kv_heads": -2}, "n_kv_heads must be >= 1"),
        ({"head_dim": 0}, "head_dim must be >= 1"),
        ({"n_devices": 0}, "n_devices must be >= 1"),
        ({"n_kv_heads": 6, "n_devices": 4}, "not divisible by n_devices=4"),
        ({"dtype": DType.int32}, "dtype int32 is not supported"),
    ],
)
def test_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"dtype": DType.float32, "n_kv_heads": 4, "head_dim": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        KVCacheParams(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"n_kv_heads": 2.0}, {"head_dim": "8"}, {"n_devices": True}, {"dtype": "float32"}]
)
def test_rejects_wrong_types(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"dtype": DType.float32, "n_kv_heads": 4, "head_dim": 8}
    args.update(kwargs)
    with pytest.raises(TypeError):
        KVCacheParams(**args)  # type: ignore[arg-type]


def test_every_layer_takes_numpy_integers_the_same_way() -> None:
    """One validator (``maxkv.validation.require_int``) for the parameters, the
    spec, the managers and the graph builders: a NumPy integer is an int (stored
    as a Python int), a bool is not."""
    import numpy as np

    from maxkv.cache.spec import CacheSpec
    from maxkv.graph.checks import check_positive_int

    from . import fakes

    params = KVCacheParams(DType.float32, np.int64(4), np.int32(8))  # type: ignore[arg-type]
    assert params == KVCacheParams(DType.float32, 4, 8)
    assert type(params.n_kv_heads) is int and type(params.head_dim) is int
    spec = CacheSpec(params, np.int64(2), "paged", np.uint16(4))  # type: ignore[arg-type]
    assert (type(spec.num_layers), type(spec.page_size)) == (int, int)
    assert check_positive_int("page_size", np.int64(16)) == 16
    manager = fakes.paged(params, np.int64(4), 8, 2, 64, num_layers=2)  # type: ignore[arg-type]
    assert manager.page_size == 4
    for call in (
        lambda: KVCacheParams(DType.float32, True, 8),  # type: ignore[arg-type]
        lambda: CacheSpec(params, True, "paged", 4),  # type: ignore[arg-type]
        lambda: check_positive_int("page_size", True),
    ):
        with pytest.raises(TypeError, match="must be an int"):
            call()
