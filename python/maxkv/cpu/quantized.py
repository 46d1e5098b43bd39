"""Block-quantized copies of float32 weights that hold exactly the same values.

A GGUF file stores most matrices of a model in blocks of 32 weights along the
input dimension: a float16 scale (and, for Q4_1, a float16 offset) and 4- or
8-bit integers.  maxkv computes in float32 with the dequantized weights, the
same numbers transformers computes with.  For the few rows of a decode step a
matmul only streams weights, so reading the blocks (4 to 7 times fewer
bytes) instead of their float32 expansion is faster, and gives bit-identical
results when every weight is exactly ``fma(q, scale, offset)`` in float32:
:class:`BlockQuantized` holds such a copy, :meth:`BlockQuantized.exactly`
checks it weight by weight, :meth:`BlockQuantized.pack` lays it out for
:func:`maxkv.ops.linear_packed` (its ``quantized`` argument).

Types read from GGUF (:func:`from_gguf_blocks`): Q8_0 (``q - 128`` times the
scale: ``offset = -128 scale``), Q4_0 (``offset = -8 scale``) and Q4_1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .arrays import aligned

#: Weights per block along the input dimension.
BLOCK = 32
#: Output columns per packed tile (as :data:`maxkv.ops.PACKED_TILE`).
TILE = 64
#: GGML types :func:`from_gguf_blocks` reads.
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class BlockQuantized:
    """A ``[N, K]`` matrix as ``fma(q, scale, offset)`` per block of 32 along ``K``.

    ``q`` uint8 ``[N, K]`` (values below ``2 ** bits``), ``scale`` and
    ``offset`` float32 ``[N, K / 32]``.
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.q.ndim != 2 or self.q.dtype != np.uint8:
            raise ValueError(f"q must be uint8 [N, K], got {self.q.dtype} {self.q.shape}")
        n, k = self.q.shape
        if k % BLOCK:
            raise ValueError(f"K = {k} is not a multiple of the block size {BLOCK}")
        for name in ("scale", "offset"):
            value = getattr(self, name)
            if value.dtype != np.float32 or value.shape != (n, k // BLOCK):
                raise ValueError(
                    f"{name} must be float32 [{n}, {k // BLOCK}], got {value.dtype} {value.shape}"
                )
        if self.bits == 4 and int(self.q.max(initial=0)) > 15:
            raise ValueError("4-bit q holds a value above 15")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` matrix: ``q * scale + offset`` in float32.

        Where every product is exact (see :meth:`exactly`) this is the one
        rounding of ``fma(q, scale, offset)``, what the kernel computes.
        """
        scale = np.repeat(self.scale, BLOCK, axis=1)
        offset = np.repeat(self.offset, BLOCK, axis=1)
        result: np.ndarray = self.q.astype(np.float32) * scale + offset
        return result

    def exactly(self, weight: np.ndarray) -> bool:
        """Whether this copy holds exactly ``weight`` (float32 ``[N, K]``), value for value."""
        weight = np.asarray(weight)
        if weight.shape != self.shape or weight.dtype != np.float32:
            return False
        if not np.all(_exact_products(self.q, self.scale)):
            return False
        # Equal values; a zero may differ in sign (Q4_0's ``scale * 0`` is -0 for a
        # negative scale), which no product changes: accumulators start at +0.
        return bool(np.array_equal(self.dequantize(), weight))

    def rows(self, order: np.ndarray) -> BlockQuantized:
        """The matrix with its rows taken in ``order``."""
        return BlockQuantized(self.q[order], self.scale[order], self.offset[order], self.bits)

    @staticmethod
    def concat(parts: Sequence[BlockQuantized]) -> BlockQuantized:
        """Stacks matrices of one ``K`` by rows (as ``np.concatenate``); widest ``bits`` wins."""
        return BlockQuantized(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
            max(p.bits for p in parts),
        )

    def pack(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q, sm)`` as :func:`maxkv.ops.linear_packed` takes them.

        ``q`` uint8 ``[ceil(N / 64), K, 64 * bits / 8]``: tile ``t``, row ``k``
        holds the integers of columns ``64 t ..``; with 4 bits, byte ``j``
        holds column ``j`` in its low and column ``j + 32`` in its high
        nibble.  ``sm`` float32 ``[ceil(N / 64), K / 32, 2, 64]``: each
        block's scales, then offsets.  Padding columns are zero.
        """
        n, k = self.shape
        tiles = -(-n // TILE)
        blocks = k // BLOCK
        q = np.zeros((tiles * TILE, k), np.uint8)
        q[:n] = self.q
        q_packed = q.reshape(tiles, TILE, k).transpose(0, 2, 1)
        if self.bits == 4:
            q_packed = q_packed[..., : TILE // 2] | (q_packed[..., TILE // 2 :] << 4)
        sm = np.zeros((2, tiles * TILE, blocks), np.float32)
        sm[0, :n] = self.scale
        sm[1, :n] = self.offset
        sm_packed = sm.reshape(2, tiles, TILE, blocks).transpose(1, 3, 0, 2)
        return aligned(q_packed), aligned(sm_packed)


def _exact_products(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per block: whether every ``q * scale`` is exact in float32 (needed for one rounding)."""
    product = q.astype(np.float64) * np.repeat(scale.astype(np.float64), BLOCK, axis=1)
    exact: np.ndarray = product.astype(np.float32).astype(np.float64) == product
    return exact


def from_gguf_blocks(type_name: str, blocks: np.ndarray, shape: tuple[int, int]) -> BlockQuantized:
    """Reads a GGUF tensor of type Q4_0, Q4_1 or Q8_0 (raw bytes) as ``[N, K]`` blocks.

    Args:
        type_name: The GGML type's name.
        blocks: The tensor's bytes (uint8, any shape; ``gguf``'s ``tensor.data``).
        shape: ``(N, K)``, rows first.

    Raises:
        ValueError: On another type or a size that does not match ``shape``.
    """
    if type_name not in GGUF_TYPES:
        raise ValueError(f"cannot read {type_name} blocks (only {', '.join(GGUF_TYPES)})")
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    flat = np.asarray(blocks, dtype=np.uint8).reshape(-1)
    if flat.size != n * (k // BLOCK) * size:
        raise ValueError(f"{flat.size} bytes do not hold a {type_name} [{n}, {k}] matrix")
    raw = flat.reshape(n, k // BLOCK, size)
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockQuantized(q.reshape(n, k), scale, -128 * scale, 8)
    nibbles = raw[..., 4:] if type_name == "Q4_1" else raw[..., 2:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k)
    if type_name == "Q4_1":
        offset = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        offset = -8 * scale
    return BlockQuantized(np.ascontiguousarray(q), scale, offset, 4)
