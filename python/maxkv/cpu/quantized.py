"""Block-quantized copies of float32 weights that hold exactly the same values.

A GGUF file stores most matrices of a model in blocks along the input
dimension: small integers and, per block of 16 or 32 of them, a scale and an
offset (given directly as float16 values, or, in the K-quants, as 6- or
8-bit multiples of a float16 per 256 weights).  maxkv computes in float32
with the dequantized weights, the same numbers transformers computes with.
For the few rows of a decode step a matmul only streams weights, so reading
the blocks (3 to 7 times fewer bytes) instead of their float32 expansion is
faster, and gives bit-identical results when every weight is exactly
``fma(q, scale, offset)`` in float32: :class:`BlockQuantized` holds such a
copy, :meth:`BlockQuantized.exactly` checks it weight by weight,
:meth:`BlockQuantized.pack` lays it out for :func:`maxkv.ops.linear_packed`
(its ``quantized`` argument).

Every type :func:`from_gguf_blocks` reads is of that form, with each
``q * scale`` exact in float32 (a float16 times integers of at most 13 bits),
so ``fma`` rounds once where ``gguf.quants.dequantize`` rounds once:

=======  ==========  =====  =====================================================
type     q stored    block  scale, offset
=======  ==========  =====  =====================================================
Q4_0     4 bits      32     ``d``, ``-8 d``
Q4_1     4 bits      32     ``d``, ``m``
Q5_0     8 bits (5)  32     ``d``, ``-16 d``
Q5_1     8 bits (5)  32     ``d``, ``m``
Q8_0     8 bits      32     ``d``, ``-128 d``
Q4_K     4 bits      32     ``d * sc``, ``-(dmin * m)`` (6-bit ``sc``, ``m``)
Q5_K     8 bits (5)  32     ``d * sc``, ``-(dmin * m)``
Q6_K     8 bits (6)  16     ``d * sc``, ``-32 d * sc`` (int8 ``sc``)
Q2_K     8 bits (2)  16     ``d * sc``, ``-(dmin * m)`` (4-bit ``sc``, ``m``)
Q3_K     8 bits (3)  16     ``d * sc``, ``-4 d * sc`` (6-bit ``sc - 32``)
=======  ==========  =====  =====================================================

The kernel reads 4- and 8-bit integers, so 2-, 3-, 5- and 6-bit ones take a
byte each: such copies hold more bytes than the file (Q5_0: 1.25 bytes a
weight where the file has 0.69; Q2_K 1.5 where it has 0.33), still 2.7-3.2x
fewer than float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .arrays import aligned, aligned_zeros

#: Weights per block along the input dimension (the kernel's default; Q6_K's are 16).
BLOCK = 32
#: Output columns per packed tile (as :data:`maxkv.ops.PACKED_TILE`).
TILE = 64


class PackedFormat(NamedTuple):
    """How a packed quantized copy is laid out: the kernel's variants.

    ``bits`` 4 (two integers a byte) or 8, ``block`` 32 or 16 weights per
    scale along ``K`` (16 with 8 bits only).  The one place the shapes of
    ``(q, sm)`` are written (see :meth:`BlockQuantized.pack`).
    """

    bits: int
    block: int

    @staticmethod
    def check(bits: int, block: int) -> PackedFormat:
        """The format, after checking it is one the kernel reads."""
        if (bits, block) not in PACKED_FORMATS:
            raise ValueError(
                f"the kernel reads 4-bit integers in blocks of 32 and 8-bit ones in blocks "
                f"of 32 or 16, not {bits}-bit ones in blocks of {block}"
            )
        return PackedFormat(bits, block)

    def q_shape(self, tiles: int, k: int) -> tuple[int, int, int]:
        """``q``: uint8 ``[tiles, K, 64 * bits / 8]``."""
        return (tiles, k, TILE * self.bits // 8)

    def sm_shape(self, tiles: int, k: int) -> tuple[int, int, int, int]:
        """``sm``: float32 ``[tiles, K / block, 2, 64]``."""
        return (tiles, k // self.block, 2, TILE)

    def row_q_shape(self, n: int, k: int) -> tuple[int, int]:
        """``q`` read by rows (:meth:`BlockQuantized.pack_rows`): uint8 ``[N, K * bits / 8]``."""
        return (n, k * self.bits // 8)

    def row_sm_shape(self, n: int, k: int) -> tuple[int, int, int]:
        """``sm`` read by rows: float32 ``[N, K / block, 2]``."""
        return (n, k // self.block, 2)

    @staticmethod
    def of_rows(q_shape: Sequence[int], sm_shape: Sequence[int], k: int) -> PackedFormat:
        """The format of a ``(q, sm)`` pair read by rows of ``k`` weights, from their shapes."""
        return PackedFormat.check(int(q_shape[1]) * 8 // k, k // int(sm_shape[1]))

    @staticmethod
    def of(q_shape: Sequence[int], sm_shape: Sequence[int]) -> PackedFormat:
        """The format of a packed ``(q, sm)`` pair, from their shapes."""
        return PackedFormat.check(int(q_shape[2]) * 8 // TILE, int(q_shape[1]) // int(sm_shape[1]))


#: The formats the kernel reads (``mojo_ops/cpu/linear.mojo``).
PACKED_FORMATS = (PackedFormat(4, 32), PackedFormat(8, 32), PackedFormat(8, 16))

#: The format :func:`from_gguf_blocks` reads each GGML type in (the module's table).
GGUF_FORMATS = {
    "Q4_0": PackedFormat(4, 32),
    "Q4_1": PackedFormat(4, 32),
    "Q5_0": PackedFormat(8, 32),
    "Q5_1": PackedFormat(8, 32),
    "Q8_0": PackedFormat(8, 32),
    "Q4_K": PackedFormat(4, 32),
    "Q5_K": PackedFormat(8, 32),
    "Q6_K": PackedFormat(8, 16),
    "Q2_K": PackedFormat(8, 16),
    "Q3_K": PackedFormat(8, 16),
}
#: GGML types :func:`from_gguf_blocks` reads.
GGUF_TYPES = tuple(GGUF_FORMATS)


def stacked_format(formats: Sequence[PackedFormat]) -> PackedFormat:
    """The format of matrices stacked by rows: the widest ``bits`` and the smallest
    ``block`` win (Q4_K rows over Q6_K ones are 8 bits in blocks of 16)."""
    return PackedFormat.check(max(f.bits for f in formats), min(f.block for f in formats))


@dataclass(frozen=True)
class BlockQuantized:
    """A ``[N, K]`` matrix as ``fma(q, scale, offset)`` per block of ``block`` along ``K``.

    ``q`` uint8 ``[N, K]`` (values below ``2 ** bits``), ``scale`` and
    ``offset`` float32 ``[N, K / block]``; ``block`` 32, or 16 with 8 bits
    (:class:`PackedFormat`).
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int
    block: int = BLOCK

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        PackedFormat.check(self.bits, self.block)
        if self.q.ndim != 2 or self.q.dtype != np.uint8:
            raise ValueError(f"q must be uint8 [N, K], got {self.q.dtype} {self.q.shape}")
        n, k = self.q.shape
        if k % self.block:
            raise ValueError(f"K = {k} is not a multiple of the block size {self.block}")
        blocks = k // self.block
        for name in ("scale", "offset"):
            value = getattr(self, name)
            if value.dtype != np.float32 or value.shape != (n, blocks):
                raise ValueError(
                    f"{name} must be float32 [{n}, {blocks}], got {value.dtype} {value.shape}"
                )
        if self.bits == 4 and int(self.q.max(initial=0)) > 15:
            raise ValueError("4-bit q holds a value above 15")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def format(self) -> PackedFormat:
        """The kernel variant that reads this copy."""
        return PackedFormat(self.bits, self.block)

    def with_block(self, block: int) -> BlockQuantized:
        """The same values in blocks of ``block`` (16 from 32: each scale twice), 8 bits."""
        if block == self.block:
            return self
        if self.block % block:
            raise ValueError(f"blocks of {self.block} cannot be split into blocks of {block}")
        times = self.block // block
        return BlockQuantized(
            self.q, np.repeat(self.scale, times, 1), np.repeat(self.offset, times, 1), 8, block
        )

    def pack_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q, sm)`` read a row at a time (the embedding's gather).

        ``q`` uint8 ``[N, K * bits / 8]``: with 4 bits, byte ``j`` of a row
        holds weight ``j`` in its low and weight ``j + K / 2`` in its high
        nibble; ``sm`` float32 ``[N, K / block, 2]``: each block's scale and
        offset.  (Shapes: :meth:`PackedFormat.row_q_shape`, ``row_sm_shape``.)
        """
        n, k = self.shape
        q = self.q
        if self.bits == 4:
            q = q[:, : k // 2] | (q[:, k // 2 :] << 4)
        sm = np.stack([self.scale, self.offset], axis=-1)
        assert q.shape == self.format.row_q_shape(n, k)
        assert sm.shape == self.format.row_sm_shape(n, k)
        return aligned(q), aligned(sm)

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` matrix: ``q * scale + offset`` in float32.

        Where every product is exact (see :meth:`exactly`) this is the one
        rounding of ``fma(q, scale, offset)``, what the kernel computes.
        """
        scale = np.repeat(self.scale, self.block, axis=1)
        offset = np.repeat(self.offset, self.block, axis=1)
        result: np.ndarray = self.q.astype(np.float32) * scale + offset
        return result

    def exactly(self, weight: np.ndarray) -> bool:
        """Whether this copy holds exactly ``weight`` (float32 ``[N, K]``), value for value."""
        weight = np.asarray(weight)
        if weight.shape != self.shape or weight.dtype != np.float32:
            return False
        if not np.all(_exact_products(self.q, self.scale, self.block)):
            return False
        # Equal values; a zero may differ in sign (Q4_0's ``scale * 0`` is -0 for a
        # negative scale), which no product changes: accumulators start at +0.
        return bool(np.array_equal(self.dequantize(), weight))

    def rows(self, order: np.ndarray) -> BlockQuantized:
        """The matrix with its rows taken in ``order``."""
        return BlockQuantized(
            self.q[order], self.scale[order], self.offset[order], self.bits, self.block
        )

    @staticmethod
    def concat(parts: Sequence[BlockQuantized]) -> BlockQuantized:
        """Stacks matrices of one ``K`` by rows (as ``np.concatenate``): widest ``bits``
        and smallest ``block`` win (Q5_0 and Q6_K rows stack as 8 bits in blocks of 16)."""
        fmt = stacked_format([p.format for p in parts])
        parts = [p.with_block(fmt.block) for p in parts]
        return BlockQuantized(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
            fmt.bits,
            fmt.block,
        )

    def pack(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q, sm)`` as :func:`maxkv.ops.linear_packed` takes them (see
        :class:`TileBuilder`, which lays them out)."""
        n, k = self.shape
        builder = TileBuilder(self.format, n, k)
        builder.write(0, self)
        return builder.q, builder.sm


class TileBuilder:
    """The tile layout :func:`maxkv.ops.linear_packed` reads, filled a row range at a time.

    ``q`` uint8 ``[ceil(N / 64), K, 64 * bits / 8]``: tile ``t``, row ``k``
    holds the integers of columns ``64 t ..``; with 4 bits, byte ``j`` holds
    column ``j`` in its low and column ``j + 32`` in its high nibble.  ``sm``
    float32 ``[ceil(N / 64), K / block, 2, 64]``: each block's scales, then
    offsets.  Padding columns are zero.  Rows may come in any pieces, each
    once (:meth:`write`), so a large matrix is never held unpacked whole.
    """

    def __init__(self, fmt: PackedFormat, n: int, k: int) -> None:
        self.format, self.n, self.k = fmt, n, k
        tiles = -(-n // TILE)
        self.q = aligned_zeros(fmt.q_shape(tiles, k), np.uint8)
        self.sm = aligned_zeros(fmt.sm_shape(tiles, k), np.float32)

    def write(self, row: int, part: BlockQuantized) -> None:
        """Lays out ``part``'s rows as rows ``row ..`` of the matrix.

        Raises:
            ValueError: If ``part`` does not fit (rows, ``K``, wider integers
                or blocks that cannot be split into the format's).
        """
        n, k = part.shape
        if k != self.k or not 0 <= row <= row + n <= self.n or part.bits > self.format.bits:
            raise ValueError(
                f"a {part.bits}-bit [{n}, {k}] part does not fit rows {row}.. of a "
                f"{self.format.bits}-bit [{self.n}, {self.k}] matrix"
            )
        part = part.with_block(self.format.block)
        half = TILE // 2
        for tile in range(row // TILE, -(-(row + n) // TILE)):
            first, last = max(row, tile * TILE), min(row + n, (tile + 1) * TILE)
            rows = slice(first - row, last - row)
            cols = slice(first - tile * TILE, last - tile * TILE)
            self.sm[tile, :, 0, cols] = part.scale[rows].T
            self.sm[tile, :, 1, cols] = part.offset[rows].T
            q = part.q[rows].T  # [K, columns]
            if self.format.bits == 8:
                self.q[tile, :, cols] = q
                continue
            for nibble, (lo, hi) in enumerate(((0, half), (half, TILE))):
                a, b = max(cols.start, lo), min(cols.stop, hi)
                if a < b:
                    self.q[tile, :, a - lo : b - lo] |= q[:, a - cols.start : b - cols.start] << (
                        4 * nibble
                    )


def _exact_products(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """Per weight: whether ``q * scale`` is exact in float32 (needed for one rounding)."""
    product = q.astype(np.float64) * np.repeat(scale.astype(np.float64), block, axis=1)
    exact: np.ndarray = product.astype(np.float32).astype(np.float64) == product
    return exact


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 values of the last axis's byte pairs, as float32."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-weight block's 16 bytes ``[..., 16]`` -> ``[..., 32]``: weights 0-15 in the
    low nibbles, 16-31 in the high ones (Q4_0, Q4_1, Q5_0, Q5_1)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bit_plane(bits: np.ndarray, count: int) -> np.ndarray:
    """Bit ``i`` of a little-endian bit string (bytes ``[..., count / 8]``) as ``[..., count]``."""
    return np.unpackbits(bits, axis=-1, count=count, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins per super-block."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _super(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's per-32 scales ``d * sc`` and offsets ``-(dmin * m)`` (both exact
    in float32: a float16 times a 6-bit integer), and the bytes after the scales."""
    d, dmin = _f16(raw[..., 0:2]), _f16(raw[..., 2:4])
    sc, mn = _k_scales(raw[..., 4:16])
    return d * sc, -(dmin * mn), raw[..., 16:]


def from_gguf_blocks(type_name: str, blocks: np.ndarray, shape: tuple[int, int]) -> BlockQuantized:
    """Reads a GGUF tensor of one of :data:`GGUF_TYPES` (raw bytes) as ``[N, K]`` blocks.

    The layouts are GGML's (``ggml-common.h``); what
    :meth:`BlockQuantized.dequantize` gives is exactly what
    ``gguf.quants.dequantize`` gives for the same bytes (see the module's
    table: every product is exact, so each computes one rounding).

    Args:
        type_name: The GGML type's name.
        blocks: The tensor's bytes (uint8, any shape; ``gguf``'s ``tensor.data``).
        shape: ``(N, K)``, rows first.

    Raises:
        ValueError: On another type or a size that does not match ``shape``.
    """
    if type_name not in GGUF_TYPES:
        raise ValueError(f"cannot read {type_name} blocks (only {', '.join(GGUF_TYPES)})")
    import gguf

    n, k = shape
    per_block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if k % per_block:
        raise ValueError(f"K = {k} is not a multiple of {type_name}'s {per_block}")
    flat = np.asarray(blocks, dtype=np.uint8).reshape(-1)
    if flat.size != n * (k // per_block) * size:
        raise ValueError(f"{flat.size} bytes do not hold a {type_name} [{n}, {k}] matrix")
    raw = flat.reshape(n, k // per_block, size)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        scale = _f16(raw[..., 0:2])[..., 0]
        has_min = type_name.endswith("_1")
        offset = _f16(raw[..., 2:4])[..., 0] if has_min else None
        rest = raw[..., 4:] if has_min else raw[..., 2:]
        if type_name.startswith("Q5"):
            high, rest = _bit_plane(rest[..., :4], 32), rest[..., 4:]
            q = _nibbles(rest) | (high << 4)
            if offset is None:
                offset = -16 * scale
            return BlockQuantized(np.ascontiguousarray(q.reshape(n, k)), scale, offset, 8)
        q = _nibbles(rest)
        if offset is None:
            offset = -8 * scale
        return BlockQuantized(np.ascontiguousarray(q.reshape(n, k)), scale, offset, 4)
    if type_name == "Q8_0":
        scale = _f16(raw[..., 0:2])[..., 0]
        q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockQuantized(q.reshape(n, k), scale, -128 * scale, 8)
    if type_name in ("Q4_K", "Q5_K"):
        scale, offset, rest = _super(raw)
        if type_name == "Q4_K":
            # 4 groups of 32 bytes: 32 weights in the low nibbles, the next 32 in the high.
            qs = rest.reshape(n, -1, 4, 1, 32)
            q = np.concatenate([qs & 15, qs >> 4], axis=-2)
            bits = 4
        else:
            high = _bit_plane(rest[..., :32], 256).reshape(n, -1, 32, 8)  # bit j of byte l
            qs = rest[..., 32:].reshape(n, -1, 4, 1, 32)
            low = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(n, -1, 8, 32)
            q = low | (high.transpose(0, 1, 3, 2) << 4)  # weight 32 j + l: bit j of byte l
            bits = 8
        return BlockQuantized(
            np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8),
            scale.reshape(n, -1),
            offset.reshape(n, -1),
            bits,
        )
    if type_name == "Q2_K":
        # 16 bytes of scales (low nibble sc, high m), 64 of 2-bit q, float16 d, dmin.
        # Weight 128 h + 32 s + l: bits 2 s of byte 32 h + l.
        sc = raw[..., :16]
        qs = raw[..., 16:80].reshape(n, -1, 2, 1, 32)
        q = (qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        scale = _f16(raw[..., 80:82]) * (sc & 15).astype(np.float32)
        offset = -(_f16(raw[..., 82:84]) * (sc >> 4).astype(np.float32))
        return BlockQuantized(
            np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8),
            scale.reshape(n, -1),
            offset.reshape(n, -1),
            8,
            16,
        )
    if type_name == "Q3_K":
        # 32 bytes of high bits (weight 32 j + l: bit j of byte l), 64 of 2-bit lows
        # (as Q2_K's), 12 bytes of sixteen 6-bit scales, a float16 d; q - 4.
        high = (
            raw[..., :32].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        ) & 1
        qs = raw[..., 32:96].reshape(n, -1, 2, 1, 32)
        low = (qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        q = low.reshape(n, -1, 256) | (high.reshape(n, -1, 256) << 2)
        packed = raw[..., 96:108]
        lows = (packed[..., :8, None] >> np.array([0, 4], np.uint8)).swapaxes(-1, -2)
        highs = (packed[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2)
        sc = (lows.reshape(n, -1, 16) & 15) | ((highs.reshape(n, -1, 16) & 3) << 4)
        scale = _f16(raw[..., 108:110]) * (sc.astype(np.float32) - 32)
        return BlockQuantized(
            np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8),
            scale.reshape(n, -1),
            (-4 * scale).reshape(n, -1),
            8,
            16,
        )
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, a float16 d.
    ql = raw[..., :128].reshape(n, -1, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2).reshape(n, -1, 2, 4, 32)
    qh = raw[..., 128:192].reshape(n, -1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = low | (high << 4)
    scale = _f16(raw[..., 208:210]) * raw[..., 192:208].view(np.int8).astype(np.float32)
    return BlockQuantized(
        np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8),
        scale.reshape(n, -1),
        (-32 * scale).reshape(n, -1),
        8,
        16,
    )
