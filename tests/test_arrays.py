"""Host arrays handed to MAX start on a cache line (maxkv.cpu.arrays).

MAX passes a NumPy graph weight to the kernels where it lies (checked in
maxkv.cpu.arrays' docstring), and NumPy aligns large arrays to 16 bytes only.
"""

from __future__ import annotations

from pathlib import Path

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


def test_aligned_never_returns_a_read_only_array(tmp_path: Path) -> None:
    """A view of a memory-mapped file (GGUF's F32 tensors) is copied into the
    process's own writable memory: MAX keeps no reference to a read-only weight."""
    file = tmp_path / "weights.bin"
    np.arange(64 * 4, dtype=np.float32).tofile(file)
    mapped = np.memmap(file, np.float32, mode="r")
    view = mapped[16:32]  # on a cache line, contiguous, read-only
    assert is_aligned(view) and not view.flags.writeable
    out = aligned(view)
    assert out is not view and out.flags.writeable and is_aligned(out)
    assert not np.shares_memory(out, mapped)
    np.testing.assert_array_equal(out, view)
    frozen = aligned_zeros((8,), np.float32)
    frozen.flags.writeable = False
    assert aligned(frozen).flags.writeable


def test_gguf_graph_weights_are_writable_copies(tmp_path: Path) -> None:
    """Every weight graph_weights makes from a GGUF file (whose F32 tensors
    NumPy maps read-only) is writable and shares no memory with the file."""
    from maxkv.models.gguf_file import read_gguf

    from .gguf_helpers import TINY, hf_weights, write_llama_gguf

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_weights(TINY), matrix_type="Q8_0")
    config, weights = read_gguf(path)
    assert any(not a.flags.writeable for a in weights.values())  # the norms: file views
    for packed in (True, False):
        registry = graph_weights(config, weights, packed=packed)
        read_only = [n for n, a in registry.items() if not a.flags.writeable]
        assert not read_only, read_only


def test_load_graph_refuses_read_only_weights() -> None:
    from maxkv.kernels import load_graph

    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False

    class NoSession:
        def load(self, graph: object, **kwargs: object) -> None:
            raise AssertionError("reached MAX")

    with pytest.raises(ValueError, match=r"weights w are read-only arrays"):
        load_graph(NoSession(), None, weights_registry={"w": frozen, "v": np.zeros(4)})
