"""Host arrays laid out for maxkv's CPU kernels.

MAX hands a NumPy array given as a graph weight (or through
``Buffer.from_numpy``) to the kernels where it lies, and NumPy aligns large
arrays to 16 bytes only.  maxkv's kernels load a packed weight tile's rows
as whole vectors (64 bytes with AVX-512, two 32-byte vectors per 16 columns
with AVX2); at a 16-byte offset every one of those loads spans two cache
lines, which cost ``linear_packed`` about a third of its speed (measured:
91 vs 128 GFLOP/s at 32 rows of a 1536 x 1536 matmul on two AVX2 cores).
So weights are allocated on a cache-line boundary.

They are also writable arrays of the process's own memory: MAX keeps a
reference to a writable weight array but not to a read-only one, such as a
view of a memory-mapped GGUF file, which could then be unmapped under the
compiled model (:func:`maxkv.kernels.load_graph`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

#: Bytes: one cache line, and one AVX-512 vector.
ALIGNMENT = 64


def aligned_zeros(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """A zero-filled C-contiguous array whose data starts on an :data:`ALIGNMENT` boundary."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.zeros(count * dt.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    out: np.ndarray = raw[start : start + count * dt.itemsize].view(dt).reshape(shape)
    return out


def is_aligned(a: np.ndarray) -> bool:
    """Whether ``a`` is C-contiguous and starts on an :data:`ALIGNMENT` boundary."""
    return bool(a.flags.c_contiguous) and a.ctypes.data % ALIGNMENT == 0


def aligned(a: np.ndarray, dtype: DTypeLike | None = None, *, copy: bool = False) -> np.ndarray:
    """``a`` as a writable C-contiguous ``dtype`` array on an :data:`ALIGNMENT` boundary.

    Returns ``a`` itself when it already is one (and ``copy`` is false);
    otherwise an aligned copy (always for a read-only ``a``, e.g. a view of a
    memory-mapped file).
    """
    src = np.asarray(a, dtype=dtype)
    if is_aligned(src) and src.flags.writeable and not copy:
        return src
    out = aligned_zeros(src.shape, src.dtype)
    out[...] = src
    return out
