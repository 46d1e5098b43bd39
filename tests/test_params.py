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
        ({"n_kv_heads": 0}, "n_kv_heads must be positive"),
        ({"n_kv_heads": -2}, "n_kv_heads must be positive"),
        ({"head_dim": 0}, "head_dim must be positive"),
        ({"n_devices": 0}, "n_devices must be positive"),
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
