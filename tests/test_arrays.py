"""Host arrays handed to MAX start on a cache line (maxkv.cpu.arrays).

MAX passes a NumPy graph weight to the kernels where it lies (checked in
maxkv.cpu.arrays' docstring), and NumPy aligns large arrays to 16 bytes only.
"""

from __future__ import annotations

import numpy as np
import pytest

from maxkv.cpu.arrays import ALIGNMENT, aligned, aligned_zeros, is_aligned
from maxkv.models.config import default_llama
from maxkv.models.decoder import graph_weights

pytestmark = pytest.mark.unit


def _misaligned(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array starting 4 bytes past a cache line."""
    raw = aligned_zeros((int(np.prod(shape)) + 1,), np.float32)
    out: np.ndarray = raw[1:].reshape(shape)
    assert out.ctypes.data % ALIGNMENT == 4
    return out


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (7, 1, 9, 16)])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int64])
def test_aligned_zeros(shape: tuple[int, ...], dtype: type) -> None:
    a = aligned_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and not a.any()
    assert is_aligned(a) or a.size == 0


def test_aligned_copies_only_when_needed() -> None:
    src = _misaligned((6, 10))
    src[...] = np.arange(60, dtype=np.float32).reshape(6, 10)
    out = aligned(src)
    assert is_aligned(out) and out is not src
    np.testing.assert_array_equal(out, src)
    assert aligned(out) is out  # already aligned: no copy
    assert aligned(out, copy=True) is not out
    assert aligned(out, np.float64).dtype == np.float64
    strided = aligned(out[:, ::2])  # not contiguous: copied
    assert is_aligned(strided)
    np.testing.assert_array_equal(strided, src[:, ::2])


def test_every_graph_weight_starts_on_a_cache_line() -> None:
    config, weights = default_llama()
    for packed in (True, False):
        registry = graph_weights(config, weights, packed=packed)
        misaligned = [name for name, a in registry.items() if not is_aligned(a)]
        assert not misaligned, misaligned
