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
so ``fma`` rounds once where ``gguf.quants.dequantize`` rounds once.  The
K-quants keep their factoring (:class:`Factors`): per 256 weights two float16
factors (``d`` and ``-dmin``, or ``d`` and ``-32 d``), per block two int8
multipliers (``sc`` and ``m``), so the kernel computes each scale and offset
as one exact product and the copy holds about the file's bytes.  A block
whose factor is not a float16 (Q6_K's ``-32 d`` past float16's range, ``|d| >
2047``; Q3_K's ``-4 d``, ``|d| > 16376``: weights in the millions, which no
quantizer writes for a model) is refused by name, since a matrix's format is
known from its type before its blocks are read.

=======  ==========  =====  =====================================================
type     q stored    block  scale, offset
=======  ==========  =====  =====================================================
Q4_0     4 bits      32     ``d``, ``-8 d``
Q4_1     4 bits      32     ``d``, ``m``
Q5_0     8 bits (5)  32     ``d``, ``-16 d``
Q5_1     8 bits (5)  32     ``d``, ``m``
Q8_0     8 bits      32     ``d``, ``-128 d``
Q4_K     4 bits      32     ``d * sc``, ``-(dmin * m)`` (6-bit ``sc``, ``m``)
Q5_K     6 bits (5)  32     ``d * sc``, ``-(dmin * m)``
Q6_K     6 bits      16     ``d * sc``, ``-32 d * sc`` (int8 ``sc``)
Q2_K     6 bits (2)  16     ``d * sc``, ``-(dmin * m)`` (4-bit ``sc``, ``m``)
Q3_K     6 bits (3)  16     ``d * sc``, ``-4 d * sc`` (6-bit ``sc - 32``)
IQ4_NL   8 bits      32     ``d``, ``-128 d``
IQ4_XS   8 bits      32     ``d * (ls - 32)``, ``-128 d * (ls - 32)`` (6-bit ``ls``)
=======  ==========  =====  =====================================================

IQ4_NL and IQ4_XS store 4-bit indices into a table of 16 int8 values
(:data:`IQ4_VALUES`, non-linear, so no scale and offset make them 4-bit
integers): the copy holds each weight's table value plus 128, a byte, and every
``fma`` is exact (``(q - 128) * scale`` has at most 24 significant bits).

A matrix stored as 16-bit floats (a bfloat16 or float16 checkpoint's, a
GGUF's ``F16`` and ``BF16`` matrices) is held as those values
(:class:`Floats16`, two bytes a weight, as the file): each widens to float32
exactly, so the kernel multiplies the checkpoint's own values.

The kernel reads 4-, 6- and 8-bit integers and 16-bit floats
(:data:`PACKED_FORMATS`), so, in bits a weight with the scales: Q4_0 and
Q4_1 take 6 (the files 4.5 and 5), Q5_0, Q5_1 and Q8_0 10 (the files 5.5, 6
and 8.5), Q2_K, Q3_K and Q5_K six-bit integers in blocks of 16, 7.125 (the
files 2.63, 3.44 and 5.5); Q4_K takes 4.625 (the file 4.5: 1.03x), Q6_K 7.125
(the file 6.56: 1.09x), IQ4_NL and IQ4_XS 10 (the files 4.5 and 4.25).

Under ``MAXKV_ACTIVATIONS=int8`` (:data:`ACTIVATIONS`) the integers are laid out
as an int8 copy instead (:attr:`PackedFormat.int8`, the same bytes, four rows
along ``K`` interleaved per column: :class:`TileBuilder`), which the kernel
multiplies by activations quantized to int8 per block: approximate products,
no longer the float32 ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeAlias

import numpy as np

from .arrays import aligned_zeros

#: Weights per block along the input dimension (the kernel's default; Q6_K's are 16).
BLOCK = 32
#: Output columns per packed tile (as :data:`maxkv.ops.PACKED_TILE`).
TILE = 64
#: Weights along ``K`` per pair of float32 factors of a factored copy (GGML's super-block).
SUPER = 256
#: Columns of a group of an int8 copy (:class:`TileBuilder`): 4 a tile.
GROUP_COLS = 16
#: Rows along ``K`` an int8 copy interleaves per column.
QUAD = 4
#: How the linear layers multiply held integers (``MAXKV_ACTIVATIONS``): by
#: float32 activations (the dequantized weights' exact products), or by
#: activations quantized to int8 per block (:class:`TileBuilder`'s int8 copy).
ACTIVATIONS = ("float32", "int8")
#: The 16-bit float types a :class:`Floats16` holds, in the order their ``sm``
#: shape names them (``[tiles, 1 + index, 1, 64]``).
FLOAT_TYPES = ("bfloat16", "float16")
FloatType: TypeAlias = Literal["bfloat16", "float16"]
#: The names GGML (and safetensors) give them.
GGML_FLOAT_TYPES: dict[str, FloatType] = {"BF16": "bfloat16", "F16": "float16"}


class Factors(NamedTuple):
    """A K-quant's scales and offsets as products: ``scale = d[..., 0] * m[..., 0]``
    and ``offset = d[..., 1] * m[..., 1]`` per block.

    ``d`` float32 ``[N, K / 256, 2]`` (per super-block of 256 weights), each a
    float16 value (the copy holds them as float16), ``m`` int8 ``[N, K / block,
    2]`` (per block).  Each product is exact in float32 (a float16 times an
    integer of at most 2^7 in size).
    """

    d: np.ndarray
    m: np.ndarray


class PackedFormat(NamedTuple):
    """How a packed quantized copy is laid out: the kernel's variants.

    ``bits`` 4 (two integers a byte), 6 (factored only) or 8; ``block`` 32
    or 16 weights per scale along ``K``; ``factored``: the scales and offsets
    as :class:`Factors` (4 bits in blocks of 32, or 6 in blocks of 16), else
    stored as float32 (4 bits in blocks of 32, 8 in blocks of 32 or 16).
    ``floating``: a 16-bit float type of :data:`FLOAT_TYPES` (``bits`` 16,
    ``block`` 1, no scales: :class:`Floats16`), else ``""``.  ``int8``: the
    integers laid out as an int8 copy, which the kernel multiplies by int8
    activations (``MAXKV_ACTIVATIONS=int8``; :class:`TileBuilder`), else by
    rows.  The one place the shapes of ``(q, sm)`` are written.
    """

    bits: int
    block: int
    factored: bool = False
    floating: str = ""
    int8: bool = False

    @staticmethod
    def check(
        bits: int, block: int, factored: bool = False, floating: str = "", int8: bool = False
    ) -> PackedFormat:
        """The format, after checking it is one the kernel reads."""
        fmt = PackedFormat(bits, block, factored, floating, int8)
        if fmt.by_rows not in PACKED_FORMATS or (int8 and floating):
            raise ValueError(
                f"the kernel reads 4-bit integers in blocks of 32 and 8-bit ones in blocks "
                f"of 32 or 16 with float32 scales, 4-bit ones in blocks of 32 or 6-bit "
                f"ones in blocks of 16 with factored scales, and bfloat16 or float16 "
                f"values (integers only as an int8 copy), not {fmt}"
            )
        return fmt

    @property
    def by_rows(self) -> PackedFormat:
        """The same numbers laid out by rows (multiplied by float32 activations)."""
        return self._replace(int8=False)

    def for_activations(self, activations: str) -> PackedFormat:
        """The layout this format is held in for ``activations`` (one of
        :data:`ACTIVATIONS`): integers as an int8 copy under ``"int8"``; 16-bit
        floats, and everything under ``"float32"``, by rows."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        return self._replace(int8=activations == "int8" and not self.floating)

    @staticmethod
    def floats(floating: str) -> PackedFormat:
        """The format of 16-bit floats of type ``floating`` (one of :data:`FLOAT_TYPES`)."""
        return PackedFormat(16, 1, False, floating)

    @property
    def slots(self) -> int:
        """Rows of 64 float32 in ``sm`` per block (plain) or per super-block (factored):
        a scale and an offset, or one of the two float16 factors then the int8
        multipliers, four a slot (16-bit floats: one, never read)."""
        if self.floating:
            return 1
        return 1 + 2 * (SUPER // self.block) // 4 if self.factored else 2

    def q_shape(self, tiles: int, k: int) -> tuple[int, int, int]:
        """``q``: uint8 ``[tiles, K, 64 * bits / 8]``; an int8 copy ``[tiles * 64 / 16,
        K / 4, 64 * bits / 8]`` (groups of 16 columns, 4 rows interleaved)."""
        if self.int8:
            return (tiles * (TILE // GROUP_COLS), k // QUAD, TILE * self.bits // 8)
        return (tiles, k, TILE * self.bits // 8)

    def sm_shape(self, tiles: int, k: int) -> tuple[int, int, int, int]:
        """``sm``: float32 ``[tiles, K / block, 2, 64]``, or factored ``[tiles, K / 256,
        slots, 64]``; 16-bit floats ``[tiles, 1 + FLOAT_TYPES.index(floating), 1, 64]``
        (never read: the shape names the type)."""
        if self.floating:
            return (tiles, 1 + FLOAT_TYPES.index(self.floating), 1, TILE)
        if self.factored:
            return (tiles, k // SUPER, self.slots, TILE)
        return (tiles, k // self.block, 2, TILE)

    def shapes(self, n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int, int]]:
        """``(q shape, sm shape)`` of an ``[n, k]`` matrix's copy (``n`` rows in
        tiles of 64, the last padded)."""
        tiles = -(-n // TILE)
        return self.q_shape(tiles, k), self.sm_shape(tiles, k)

    @staticmethod
    def of(q_shape: Sequence[int], sm_shape: Sequence[int]) -> PackedFormat:
        """The format of a packed ``(q, sm)`` pair, from their shapes."""
        bits, k = int(q_shape[2]) * 8 // TILE, int(q_shape[1])
        if int(sm_shape[2]) == 1 and 1 <= int(sm_shape[1]) <= len(FLOAT_TYPES):
            return PackedFormat.check(*PackedFormat.floats(FLOAT_TYPES[int(sm_shape[1]) - 1]))
        int8 = int(q_shape[0]) == int(sm_shape[0]) * (TILE // GROUP_COLS)
        k = k * QUAD if int8 else k
        if int(sm_shape[2]) == 2:
            return PackedFormat.check(bits, k // int(sm_shape[1]), int8=int8)
        block = 2 * SUPER // (4 * (int(sm_shape[2]) - 1))
        return PackedFormat.check(bits, block, True, int8=int8)


#: The formats the kernel reads (``mojo_ops/cpu/linear.mojo``).
PACKED_FORMATS = (
    PackedFormat(4, 32),
    PackedFormat(8, 32),
    PackedFormat(8, 16),
    PackedFormat(4, 32, True),
    PackedFormat(6, 16, True),
    *(PackedFormat.floats(floating) for floating in FLOAT_TYPES),
)

#: The format :func:`from_gguf_blocks` reads each GGML type in (the module's table).
GGUF_FORMATS = {
    "Q4_0": PackedFormat(4, 32),
    "Q4_1": PackedFormat(4, 32),
    "Q5_0": PackedFormat(8, 32),
    "Q5_1": PackedFormat(8, 32),
    "Q8_0": PackedFormat(8, 32),
    "Q4_K": PackedFormat(4, 32, True),
    "Q5_K": PackedFormat(6, 16, True),
    "Q6_K": PackedFormat(6, 16, True),
    "Q2_K": PackedFormat(6, 16, True),
    "Q3_K": PackedFormat(6, 16, True),
    "IQ4_NL": PackedFormat(8, 32),
    "IQ4_XS": PackedFormat(8, 32),
}

#: The int8 values IQ4_NL's and IQ4_XS's 4-bit indices name (``kvalues_iq4nl``).
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16
)
#: GGML types :func:`from_gguf_blocks` reads.
GGUF_TYPES = tuple(GGUF_FORMATS)
#: The format of every type a matrix is held in (:func:`from_file_bytes`): GGML's
#: blocks, and 16-bit floats under the names GGML and safetensors give them.
HELD_FORMATS = GGUF_FORMATS | {
    name: PackedFormat.floats(floating) for name, floating in GGML_FLOAT_TYPES.items()
}
#: The types :func:`from_file_bytes` reads.
HELD_TYPES = tuple(HELD_FORMATS)


def stacked_format(formats: Sequence[PackedFormat]) -> PackedFormat:
    """The format of matrices stacked by rows: the smallest format that holds them all.

    Factored ones stay factored (Q4_K rows over Q6_K ones: 6 bits in blocks of
    16); with a plain one, all are plain, the widest ``bits`` and the smallest
    ``block`` (Q5_0 rows over Q6_K ones: 8 bits in blocks of 16).  16-bit floats
    stack with the same type only.

    Raises:
        ValueError: If 16-bit floats meet another format.
    """
    if any(f.floating for f in formats):
        if len(set(formats)) > 1:
            raise ValueError(f"16-bit floats stack with their own type only, not {set(formats)}")
        return formats[0]
    block = min(f.block for f in formats)
    if all(f.factored for f in formats):
        return PackedFormat.check(
            4 if {f.bits for f in formats} == {4} and block == 32 else 6, block, True
        )
    return PackedFormat.check(4 if {f.bits for f in formats} == {4} else 8, block)


@dataclass(frozen=True)
class BlockQuantized:
    """A ``[N, K]`` matrix as ``fma(q, scale, offset)`` per block of ``block`` along ``K``.

    ``q`` uint8 ``[N, K]`` (values below ``2 ** bits``; ``bits`` 4, 6 or 8),
    ``scale`` and ``offset`` float32 ``[N, K / block]``; ``block`` 32 or 16.
    ``factors``: the same scales and offsets as products (:class:`Factors`; a
    K-quant's, made by :meth:`factored`), which the kernel reads instead of
    float32 ones.  :attr:`format` is the kernel's layout for it.
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int
    block: int = BLOCK
    factors: Factors | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8, got {self.bits}")
        if self.block not in (16, 32):
            raise ValueError(f"block must be 16 or 32, got {self.block}")
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
        if self.bits < 8 and int(self.q.max(initial=0)) >= 1 << self.bits:
            raise ValueError(f"{self.bits}-bit q holds a value of {1 << self.bits} or more")
        if self.factors is not None:
            _check_factors(self.q, self.factors, self.bits, self.block)

    @staticmethod
    def factored(
        q: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, block: int
    ) -> BlockQuantized:
        """A copy whose scales and offsets are ``d * m`` (:class:`Factors`), computed
        here in float32 as the kernel computes them.

        Raises:
            ValueError: If the shapes or dtypes do not fit (see :class:`Factors`).
        """
        _check_factors(q, Factors(d, m), bits, block)
        times = SUPER // block
        scale = np.repeat(d[..., 0], times, axis=1) * m[..., 0].astype(np.float32)
        offset = np.repeat(d[..., 1], times, axis=1) * m[..., 1].astype(np.float32)
        return BlockQuantized(q, scale, offset, bits, block, Factors(d, m))

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def format(self) -> PackedFormat:
        """The kernel's layout for this copy: factored, 4 bits in blocks of 32 or else
        6 in blocks of 16; plain, 4 bits in blocks of 32 or else 8."""
        if self.factors is not None:
            if self.bits == 4 and self.block == BLOCK:
                return PackedFormat(4, BLOCK, True)
            return PackedFormat(6, 16, True)
        return PackedFormat.check(4 if self.bits == 4 and self.block == BLOCK else 8, self.block)

    def with_block(self, block: int) -> BlockQuantized:
        """The same values in blocks of ``block`` (16 from 32: each scale twice)."""
        if block == self.block:
            return self
        if self.block % block:
            raise ValueError(f"blocks of {self.block} cannot be split into blocks of {block}")
        times = self.block // block
        factors = None
        if self.factors is not None:
            factors = Factors(self.factors.d, np.repeat(self.factors.m, times, 1))
        return BlockQuantized(
            self.q,
            np.repeat(self.scale, times, 1),
            np.repeat(self.offset, times, 1),
            self.bits,
            block,
            factors,
        )

    def as_format(self, fmt: PackedFormat) -> BlockQuantized:
        """The same values laid out as ``fmt`` (one that holds this copy's: see
        :func:`stacked_format`).

        Raises:
            ValueError: If ``fmt`` cannot hold them.
        """
        if stacked_format([self.format, fmt]) != fmt:
            raise ValueError(f"a {self.format} copy does not fit {fmt}")
        part = self.with_block(fmt.block)
        factors = part.factors if fmt.factored else None
        part = BlockQuantized(part.q, part.scale, part.offset, fmt.bits, fmt.block, factors)
        assert part.format == fmt
        return part

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
        factors = None
        if self.factors is not None:
            factors = Factors(self.factors.d[order], self.factors.m[order])
        return BlockQuantized(
            self.q[order], self.scale[order], self.offset[order], self.bits, self.block, factors
        )

    @staticmethod
    def concat(parts: Sequence[BlockQuantized]) -> BlockQuantized:
        """Stacks matrices of one ``K`` by rows (as ``np.concatenate``) in their
        :func:`stacked_format` (Q5_0 and Q6_K rows: 8 bits in blocks of 16)."""
        fmt = stacked_format([p.format for p in parts])
        parts = [p.as_format(fmt) for p in parts]
        factors = None
        if fmt.factored:
            factors = Factors(
                np.concatenate([p.factors.d for p in parts if p.factors is not None]),
                np.concatenate([p.factors.m for p in parts if p.factors is not None]),
            )
        return BlockQuantized(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
            max(p.bits for p in parts),
            fmt.block,
            factors,
        )

    def pack(self, activations: str = "float32") -> tuple[np.ndarray, np.ndarray]:
        """``(q, sm)`` as :func:`maxkv.ops.linear_packed` takes them (see
        :class:`TileBuilder`, which lays them out), for ``activations`` (one of
        :data:`ACTIVATIONS`: ``"int8"`` lays out an int8 copy)."""
        n, k = self.shape
        builder = TileBuilder(self.format.for_activations(activations), n, k)
        builder.write(0, self)
        return builder.q, builder.sm


@dataclass(frozen=True)
class Floats16:
    """A ``[N, K]`` matrix of 16-bit floats, held as its file stores them.

    ``bits`` uint16 ``[N, K]``: each weight's bfloat16 (float32's top half) or
    float16 bit pattern, as ``floating`` says.  Each widens to float32
    exactly, so :meth:`dequantize` gives the values transformers computes
    with, and the kernel, reading the two bytes, the same ones.
    """

    bits: np.ndarray
    floating: FloatType

    def __post_init__(self) -> None:
        if self.floating not in FLOAT_TYPES:
            raise ValueError(f"floating must be one of {FLOAT_TYPES}, got {self.floating!r}")
        if self.bits.ndim != 2 or self.bits.dtype != np.uint16:
            raise ValueError(f"bits must be uint16 [N, K], got {self.bits.dtype} {self.bits.shape}")

    @staticmethod
    def of(values: np.ndarray, floating: FloatType) -> Floats16:
        """``values`` (float32 ``[N, K]``) as 16-bit floats, if each is one exactly.

        Raises:
            ValueError: If a value is not a ``floating`` exactly.
        """
        values = np.ascontiguousarray(values, dtype=np.float32)
        if floating == "bfloat16":
            bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        else:
            bits = values.astype(np.float16).view(np.uint16)
        held = Floats16(bits, floating)
        if not held.exactly(values):
            raise ValueError(f"the values are not all {floating}")
        return held

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.bits.shape[0]), int(self.bits.shape[1]))

    @property
    def format(self) -> PackedFormat:
        """The kernel's layout for it: 16-bit floats of its type."""
        return PackedFormat.floats(self.floating)

    def exactly(self, weight: np.ndarray) -> bool:
        """Whether this holds exactly ``weight`` (float32 ``[N, K]``), value for value."""
        weight = np.asarray(weight)
        if weight.shape != self.shape or weight.dtype != np.float32:
            return False
        return bool(np.array_equal(self.dequantize(), weight, equal_nan=True))

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` matrix (each value widened exactly)."""
        if self.floating == "bfloat16":
            widened: np.ndarray = (self.bits.astype(np.uint32) << 16).view(np.float32)
            return widened
        return self.bits.view(np.float16).astype(np.float32)

    def rows(self, order: np.ndarray) -> Floats16:
        """The matrix with its rows taken in ``order``."""
        return Floats16(self.bits[order], self.floating)

    def pack(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q, sm)`` as :func:`maxkv.ops.linear_packed` takes them (:class:`TileBuilder`)."""
        n, k = self.shape
        builder = TileBuilder(self.format, n, k)
        builder.write(0, self)
        return builder.q, builder.sm


#: A matrix held as its file stores it: block-quantized integers or 16-bit floats.
HeldMatrix: TypeAlias = BlockQuantized | Floats16


class TileBuilder:
    """The tile layout :func:`maxkv.ops.linear_packed` reads, filled a row range at a time.

    ``q`` uint8 ``[ceil(N / 64), K, 64 * bits / 8]``: tile ``t``, row ``k``
    holds the integers of columns ``64 t ..``; with 4 bits, byte ``j`` holds
    column ``j`` in its low and column ``j + 32`` in its high nibble; with 6
    bits, those 32 bytes of low nibbles, then 16 bytes of the top two bits
    (column ``j`` in bits ``2 (j // 16)`` of byte ``32 + j % 16``).  ``sm``
    float32 ``[ceil(N / 64), K / block, 2, 64]``: each block's scales, then
    offsets; factored, ``[ceil(N / 64), K / 256, slots, 64]``: per 256 rows
    one slot of the two factors ``d`` as float16 ``[2, 64]``, then the bytes
    of the int8 multipliers ``m`` ``[256 / block, 2, 64]``.  16-bit floats:
    ``q`` ``[ceil(N / 64), K, 128]``, column ``j`` in bytes ``2 j`` and ``2 j +
    1`` (little-endian), and ``sm`` zeros (:meth:`PackedFormat.sm_shape`).
    Padding columns are zero.  Rows may come in any pieces, each once
    (:meth:`write`), so a large matrix is never held unpacked whole.

    An int8 copy (:attr:`PackedFormat.int8`) has the same ``sm`` and holds the
    same integers in ``q`` ``[ceil(N / 64) * 4, K / 4, 64 * bits / 8]``: group
    ``4 t + g`` holds columns ``64 t + 16 g ..`` of 16, and its row ``p`` the
    rows ``4 p .. 4 p + 3`` of them, as two halves of 8 columns, each 32
    values ``v = 4 c + i`` (column ``c`` of the half, row ``4 p + i``), so
    one vector load gives the ``[8 columns, 4 rows]`` an int8 dot product
    (VPMADDUBSW) multiplies by 4 activations.  8 bits: half ``h`` in bytes
    ``32 h ..``; 4 bits: byte ``v``, half 0 in its low nibble, half 1 in its
    high one; 6 bits: those 32 bytes of nibbles, then 16 bytes of the top
    two bits (value ``u = 32 h + v`` in bits ``2 (u // 16)`` of byte
    ``32 + u % 16``).
    """

    def __init__(self, fmt: PackedFormat, n: int, k: int) -> None:
        self.format, self.n, self.k = fmt, n, k
        q_shape, sm_shape = fmt.shapes(n, k)
        self.q = aligned_zeros(q_shape, np.uint8)
        self.sm = aligned_zeros(sm_shape, np.float32)

    def write(self, row: int, part: HeldMatrix) -> None:
        """Lays out ``part``'s rows as rows ``row ..`` of the matrix.

        Raises:
            ValueError: If ``part`` does not fit (rows, ``K``, wider integers,
                blocks that cannot be split into the format's, or another
                float type).
        """
        n, k = part.shape
        fmt = self.format
        if k != self.k or not 0 <= row <= row + n <= self.n:
            raise ValueError(
                f"a [{n}, {k}] part does not fit rows {row}.. of a [{self.n}, {self.k}] matrix"
            )
        if isinstance(part, Floats16) or fmt.floating:
            if part.format != fmt:
                raise ValueError(f"a {part.format} part does not fit a {fmt} matrix")
            assert isinstance(part, Floats16)
            # Row k of a tile: its 64 columns' values, two bytes each.
            tiles = self.q.view(np.uint16).reshape(-1, k, TILE)
            first, stop = row // TILE, -(-(row + n) // TILE)
            front = row - first * TILE
            window = np.zeros(((stop - first) * TILE, k), np.uint16)
            window[front : front + n] = part.bits
            block = window.reshape(stop - first, TILE, k).transpose(0, 2, 1)
            tiles[first:stop] |= block
            return
        part = part.as_format(fmt.by_rows)
        first, stop = row // TILE, -(-(row + n) // TILE)
        front, back = row - first * TILE, stop * TILE - row - n
        per = self.q.shape[0] // self.sm.shape[0]  # q's leading rows a tile: 1, or 4 groups
        rows = slice(first * per, stop * per)
        if front == back == 0:  # whole tiles, this part's alone: laid out in place
            _tiles(part, fmt, front, back, self.q[rows], self.sm[first:stop])
            return
        # Tiles shared with other parts: their columns are still zero here.
        q = np.empty(fmt.q_shape(stop - first, k), np.uint8)
        sm = np.empty(fmt.sm_shape(stop - first, k), np.float32)
        _tiles(part, fmt, front, back, q, sm)
        self.q[rows] |= q
        self.sm.view(np.uint32)[first:stop] |= sm.view(np.uint32)


def _tiles(
    part: BlockQuantized, fmt: PackedFormat, front: int, back: int, q: np.ndarray, sm: np.ndarray
) -> None:
    """Writes ``part``'s rows after ``front`` zero rows and before ``back`` ones as
    whole tiles of ``fmt`` (:class:`TileBuilder`'s layout) into ``q`` and ``sm``
    (of ``fmt``'s shapes for those tiles; every byte written, zero in the padding
    columns)."""
    n, k = part.shape
    rows = front + n + back
    tiles = rows // TILE

    def padded(a: np.ndarray) -> np.ndarray:
        if front == back == 0:
            return a
        out = np.zeros((rows, *a.shape[1:]), a.dtype)
        out[front : front + n] = a
        return out

    # [tiles, K, 64]: row k of a tile holds its 64 columns' integers.
    # Rows of a tile combined into bytes first (contiguous), then one transposing
    # copy into row k of the tile: its 64 columns' integers.
    src = np.ascontiguousarray(padded(part.q)).reshape(tiles, TILE, k)
    half = TILE // 2
    _tile_scales(part, fmt, tiles, padded, sm)
    if fmt.int8:
        _int8_tiles(src, fmt.bits, q)
        return
    if fmt.bits == 8:
        q[:] = src.transpose(0, 2, 1)
        return
    # Bytes combined eight at a time (uint64 lanes; no byte's bits reach another's).
    lanes = src.view(np.uint64)  # [tiles, 64, K / 8]
    # Column j in the low nibble of byte j, column j + 32 in the high one.
    if fmt.bits == 4:
        low = lanes[:, :half] | (lanes[:, half:] << 4)
    else:
        low = (lanes[:, :half] & _byte_mask(15)) | ((lanes[:, half:] & _byte_mask(15)) << 4)
        # The top two bits: column j in bits 2 (j // 16) of byte 32 + j % 16.
        top = (lanes >> np.uint64(4)) & _byte_mask(3)
        top = top[:, 0:16] | top[:, 16:32] << 2 | top[:, 32:48] << 4 | top[:, 48:64] << 6
        q[..., half:] = top.view(np.uint8).transpose(0, 2, 1)
    q[..., :half] = low.view(np.uint8).transpose(0, 2, 1)


def _int8_tiles(src: np.ndarray, bits: int, q: np.ndarray) -> None:
    """An int8 copy's ``q`` (:class:`TileBuilder`) of the integers ``src``
    ``[tiles, 64, K]``, written into ``q`` ``[tiles * 4, K / 4, 64 * bits / 8]``."""
    tiles, _, k = src.shape
    groups = TILE // GROUP_COLS
    # [tile, group, K / 4, half, 8 columns, 4 rows]: value v = 4 c + i of each half.
    values = src.reshape(tiles, groups, 2, 8, k // QUAD, QUAD).transpose(0, 1, 4, 2, 3, 5)
    values = values.reshape(tiles * groups, k // QUAD, 2, 8 * QUAD)
    if bits == 8:
        q[:] = values.reshape(q.shape)
        return
    q[..., :32] = (values[:, :, 0] & 15) | ((values[:, :, 1] & 15) << 4)
    if bits == 6:
        # Value u = 32 h + v's top two bits: bits 2 (u // 16) of byte 32 + u % 16.
        top = (values >> 4).reshape(tiles * groups, k // QUAD, 4, 16)
        q[..., 32:] = top[:, :, 0] | top[:, :, 1] << 2 | top[:, :, 2] << 4 | top[:, :, 3] << 6


def _tile_scales(
    part: BlockQuantized,
    fmt: PackedFormat,
    tiles: int,
    padded: Callable[[np.ndarray], np.ndarray],
    sm: np.ndarray,
) -> None:
    """The ``sm`` of :func:`_tiles`: ``part``'s scales and offsets (or factors and
    multipliers) in whole tiles, rows padded by ``padded``, written into ``sm``."""
    k = part.shape[1]
    if part.factors is None:
        blocks = k // fmt.block
        sm[:, :, 0] = padded(part.scale).reshape(tiles, TILE, blocks).transpose(0, 2, 1)
        sm[:, :, 1] = padded(part.offset).reshape(tiles, TILE, blocks).transpose(0, 2, 1)
        return
    d, m = part.factors
    supers, per = k // SUPER, SUPER // fmt.block
    assert sm.flags.c_contiguous, "the reshapes below must be views of sm"
    halves = sm.view(np.float16).reshape(tiles, supers, fmt.slots * 2 * TILE)
    factors = padded(d).astype(np.float16).reshape(tiles, TILE, supers, 2)
    halves[:, :, : 2 * TILE] = factors.transpose(0, 2, 3, 1).reshape(tiles, supers, 2 * TILE)
    mult = padded(m).reshape(tiles, TILE, supers, per, 2).transpose(0, 2, 3, 4, 1)
    sm_bytes = sm.view(np.int8).reshape(tiles, supers, fmt.slots * 4 * TILE)
    sm_bytes[:, :, 4 * TILE :] = mult.reshape(tiles, supers, per * 2 * TILE)


def _check_factors(q: np.ndarray, factors: Factors, bits: int, block: int) -> None:
    """Raises ValueError unless ``factors`` fit ``q`` ``[N, K]`` in blocks of ``block``."""
    n, k = q.shape
    d, m = factors
    if k % SUPER or bits > 6:
        raise ValueError(
            f"factored scales need K a multiple of {SUPER} and at most 6 bits "
            f"(K = {k}, {bits} bits)"
        )
    if d.dtype != np.float32 or d.shape != (n, k // SUPER, 2):
        raise ValueError(
            f"factors.d must be float32 [{n}, {k // SUPER}, 2], got {d.dtype} {d.shape}"
        )
    if m.dtype != np.int8 or m.shape != (n, k // block, 2):
        raise ValueError(f"factors.m must be int8 [{n}, {k // block}, 2], got {m.dtype} {m.shape}")
    if not _float16_values(d):
        raise ValueError(
            f"factors.d must hold float16 values (the copy holds them as float16): d up to "
            f"{float(np.max(np.abs(d))):g} is past float16's range or between its values"
        )


def _float16_values(values: np.ndarray) -> bool:
    """Whether every value of ``values`` (float32) is a float16 value exactly."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


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


def _iq4_bytes(qs: np.ndarray, n: int, k: int) -> np.ndarray:
    """IQ4 indices (per 32 weights 16 bytes: weights 0-15 in the low nibbles, 16-31
    in the high) -> uint8 ``[N, K]``: each weight's :data:`IQ4_VALUES` value + 128."""
    table = (IQ4_VALUES + 128).astype(np.uint8)
    return np.ascontiguousarray(table[_nibbles(qs.reshape(n, -1, 16))].reshape(n, k))


def _bit_plane(bits: np.ndarray, count: int) -> np.ndarray:
    """Bit ``i`` of a little-endian bit string (bytes ``[..., count / 8]``) as ``[..., count]``."""
    return np.unpackbits(bits, axis=-1, count=count, bitorder="little")


def _lanes(raw: np.ndarray, start: int, stop: int, groups: int) -> np.ndarray:
    """Bytes ``start:stop`` of each block (``raw`` ``[N, B, size]``), contiguous, as
    uint64 ``[N * B, groups, (stop - start) / 8 / groups]``: eight bytes a lane, so
    the byte-wise masks and shifts below touch eight integers an operation."""
    flat = np.ascontiguousarray(raw.reshape(-1, raw.shape[-1])[:, start:stop])
    return flat.view(np.uint64).reshape(flat.shape[0], groups, -1)


def _byte_mask(value: int) -> np.uint64:
    """``value`` in every byte of a uint64."""
    mask: np.uint64 = np.uint64(value * 0x0101010101010101)
    return mask


def _shifts(*values: int) -> np.ndarray:
    """Shift counts as uint64 (to broadcast against lanes)."""
    return np.array(values, np.uint64)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins per super-block."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _factored(
    q: np.ndarray,
    d: tuple[np.ndarray, np.ndarray],
    m: tuple[np.ndarray, np.ndarray],
    bits: int,
    block: int,
) -> BlockQuantized:
    """A K-quant ``[N, K / 256, 256]`` as a factored copy: ``scale = d[0] * m[0]``,
    ``offset = d[1] * m[1]`` (``d`` float32 ``[N, K / 256]`` each, ``m`` integers
    ``[N, K / 256, 256 / block]`` each).

    Raises:
        ValueError: If a factor is not a float16 value (Q6_K's ``-32 d`` for
            ``|d| > 2047``, Q3_K's ``-4 d`` for ``|d| > 16376``).
    """
    n = q.shape[0]
    factors = np.stack([d[0].reshape(n, -1), d[1].reshape(n, -1)], axis=-1)
    mult = np.stack([m[0].reshape(n, -1), m[1].reshape(n, -1)], axis=-1).astype(np.int8)
    q = np.ascontiguousarray(q.reshape(n, -1), dtype=np.uint8)
    return BlockQuantized.factored(q, factors, mult, bits, block)


def from_file_bytes(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> HeldMatrix:
    """A matrix's bytes as a file stores them (``type_name`` one of
    :data:`HELD_TYPES`: GGML's names, which safetensors gives its 16-bit types
    too) read as ``[N, K]``: :class:`Floats16` for ``BF16`` and ``F16``, else
    :func:`from_gguf_blocks`.

    Raises:
        ValueError: On another type or a size that does not match ``shape``.
    """
    if type_name not in GGML_FLOAT_TYPES:
        return from_gguf_blocks(type_name, raw, shape)
    n, k = shape
    flat = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if flat.size != 2 * n * k:
        raise ValueError(f"{flat.size} bytes do not hold a {type_name} [{n}, {k}] matrix")
    bits = np.ascontiguousarray(flat).view("<u2").reshape(n, k)
    return Floats16(bits, GGML_FLOAT_TYPES[type_name])


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
        q = raw[..., 2:] ^ np.uint8(128)  # int8 + 128, as uint8
        return BlockQuantized(q.reshape(n, k), scale, -128 * scale, 8)
    if type_name == "IQ4_NL":  # a float16 d, 16 bytes of indices (as Q4_0's nibbles)
        scale = _f16(raw[..., 0:2])[..., 0]
        return BlockQuantized(_iq4_bytes(raw[..., 2:], n, k), scale, -128 * scale, 8)
    if type_name == "IQ4_XS":
        # A float16 d, 16 high bits and 4 bytes of low nibbles of eight 6-bit ls
        # (sub-block j: nibble j of scales_l, bits 2 j of scales_h), then eight
        # sub-blocks of 16 bytes of indices.
        d = _f16(raw[..., 0:2])[..., 0]
        high = raw[..., 2:4].copy().view("<u2")  # [N, B, 1]
        high = (high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [N, B, 8]
        low = (raw[..., 4:8, None] >> np.array([0, 4], np.uint8)).reshape(n, -1, 8) & 15
        scale = (d[..., None] * ((low | (high << 4)).astype(np.float32) - 32)).reshape(n, -1)
        return BlockQuantized(_iq4_bytes(raw[..., 8:], n, k), scale, -128 * scale, 8)
    if type_name in ("Q4_K", "Q5_K"):
        # Per 32: d * sc and -(dmin * m), a float16 times 6-bit integers.
        d, dmin = _f16(raw[..., 0:2])[..., 0], _f16(raw[..., 2:4])[..., 0]
        sc, mn = _k_scales(raw[..., 4:16])
        # 4 groups g of 32 bytes: weights 64 g + l in the low nibble of byte l, 64 g +
        # 32 + l in the high; Q5_K's fifth bit of weight 32 j + l: bit j of byte l of qh.
        low = _lanes(raw, raw.shape[-1] - 128, raw.shape[-1], 4)  # qs: the last 128 bytes
        q = (low[:, :, None] >> _shifts(0, 4)[:, None]) & _byte_mask(15)  # [N B, g, 2, 4]
        bits = 4
        if type_name == "Q5_K":
            qh = _lanes(raw, 16, 48, 1)[:, :, None]  # [N B, 1, 1, 4]
            high = (qh >> _shifts(0, 1, 2, 3, 4, 5, 6, 7).reshape(4, 2, 1)) & _byte_mask(1)
            q |= high << np.uint64(4)
            bits = 6
        return _factored(q.view(np.uint8).reshape(n, k), (d, -dmin), (sc, mn), bits, 32)
    if type_name == "Q2_K":
        # 16 bytes of scales (low nibble sc, high m), 64 of 2-bit q, float16 d, dmin.
        # Weight 128 h + 32 s + l: bits 2 s of byte 32 h + l.
        sc = raw[..., :16]
        qs = raw[..., 16:80].reshape(n, -1, 2, 1, 32)
        q = (qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        d, dmin = _f16(raw[..., 80:82])[..., 0], _f16(raw[..., 82:84])[..., 0]
        return _factored(q, (d, -dmin), (sc & 15, sc >> 4), 6, 16)
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
        sc = sc.astype(np.int8) - 32
        d = _f16(raw[..., 108:110])[..., 0]
        return _factored(q, (d, -4 * d), (sc, sc), 6, 16)
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, a float16 d.
    # Per half h of 128 weights and l < 32: weights 128 h + l and + 64 in byte l of
    # ql's 64 (low and high nibble), + 32 and + 96 in byte 32 + l; their top bits in
    # bits 0, 4, 2 and 6 of byte l of qh's 32.
    ql = _lanes(raw, 0, 128, 2).reshape(-1, 2, 1, 2, 4)  # [N B, h, 1, 32-byte half, 4]
    qh = _lanes(raw, 128, 192, 2).reshape(-1, 2, 1, 1, 4)
    low = (ql >> _shifts(0, 4).reshape(2, 1, 1)) & _byte_mask(15)
    high = (qh >> _shifts(0, 2, 4, 6).reshape(2, 2, 1)) & _byte_mask(3)
    q = (low | (high << np.uint64(4))).view(np.uint8).reshape(n, k)
    sc = raw[..., 192:208].view(np.int8)
    d = _f16(raw[..., 208:210])[..., 0]
    return _factored(q, (d, -32 * d), (sc, sc), 6, 16)
