"""How the cache stores one head row of keys or values: its encodings.

A collection's `dtype_name` names its storage dtype, which selects the
encoding (one storage dtype per encoding: MAX graphs take no float8 tensor on
a CPU, so float8 rows are kept as `uint8` and int4 rows as `uint16`), and
every op reads and writes head rows through `HeadCodec[storage dtype,
head_dim]`, so no kernel is written per encoding:

- `float32`, `bfloat16`, `float16`: `head_dim` values of that dtype (a narrower
  one rounds to nearest even on write).
- `int8`: `head_dim` int8 values `q`, then the row's scale as the 2 bytes of a
  float16 (`SCALE_BYTES`, little-endian): `x ~ q * scale` with
  `scale = f16(max|x| / 127)` per token and KV head and `q = round(x / scale)`
  (to nearest, ties to even), clamped to `[-127, 127]`.
- `float8_e4m3fn` (stored as `uint8`): the same row layout with float8 E4M3
  values:
  `scale = f16(max|x| / 448)`, `q = float8(x / scale)` (to nearest even),
  clamped to `[-448, 448]` first.
- `int4` (stored as `uint16`, 4 values an element): groups of `INT4_GROUP`
  values with a float16 scale each, as llama.cpp's `q4_0`: `m` is the group's value of largest
  magnitude (the maximum on a tie), `scale = f16(m / -8)`,
  `q = round(x / scale)` clamped to `[-8, 7]`.  Byte `i` of the row holds
  `q[i] + 8` in its low nibble and `q[i + head_dim / 2] + 8` in its high one;
  the groups' scales follow (`head_dim / 2 + 2 * head_dim / 32` bytes a row).

The quantized encodings quantize a head row after rotating it (QuaRot's
remedy for outlier channels: a few large channels would set a row's scale and
leave the others a handful of levels): `store` encodes `H x`, `H` the
Walsh-Hadamard transform (unnormalized, Sylvester order: `H H = n I`) of each
block of `rotation_block` values (the largest power of two dividing
`head_dim`), computed in float32 by `log2(n)` constant-geometry stages
`(a, b) = x.deinterleave(); x = (a + b).join(a - b)`.  Attention undoes it
exactly: `q . k = (H q) . (H k) / n` and `sum p v = H (sum p H v) / n`, so
the kernel rotates each query row once and each output row once (`rotate`),
never a key or value.

`HeadCodec.width` is a row's storage elements (int4: half its bytes); `maxkv.cache.params` computes
the same byte sizes.  Kernels keep their math in float32: `load` gives a row's
values as float32 up to the factor `scale` (1 for the float encodings and int4,
whose group scales `load` applies), so a dot product is scaled once, after its
sum.
"""

from std.bit import count_trailing_zeros
from std.memory import bitcast


comptime SCALE_BYTES = 2
"""Bytes of one float16 scale in a quantized head row."""
comptime INT4_GROUP = 32
"""Values sharing one scale in an int4 head row."""


@always_inline
def _read_half(bytes: UnsafePointer[UInt8, MutUntrackedOrigin], at: Int) -> Float32:
    var half = UInt16(bytes[unsafe_offset=at]) | (UInt16(bytes[unsafe_offset=at + 1]) << 8)
    return bitcast[DType.float16](half).cast[DType.float32]()


@always_inline
def _write_half(bytes: UnsafePointer[UInt8, MutUntrackedOrigin], at: Int, value: Float16):
    var bits = bitcast[DType.uint16](value)
    bytes[unsafe_offset=at] = UInt8(bits & 0xFF)
    bytes[unsafe_offset=at + 1] = UInt8(bits >> 8)


struct HeadCodec[dtype: DType, head_dim: Int]:
    """Reads and writes one head row of `head_dim` values stored as `dtype`."""

    comptime int8 = Self.dtype == DType.int8
    comptime float8 = Self.dtype == DType.uint8
    comptime int4 = Self.dtype == DType.uint16
    comptime row_scaled = Self.int8 or Self.float8
    """One float16 scale after the row's values."""
    comptime quantized = Self.row_scaled or Self.int4
    comptime rotated = Self.quantized
    """Rows are rotated (`rotate`) before they are quantized."""
    comptime rotation_block = Self.head_dim & -Self.head_dim
    """Values per Walsh-Hadamard block: the largest power of two dividing `head_dim`."""
    comptime groups = Self.head_dim // INT4_GROUP
    comptime width = (
        Self.head_dim + SCALE_BYTES if Self.row_scaled else (
            (Self.head_dim // 2 + Self.groups * SCALE_BYTES) // 2 if Self.int4 else Self.head_dim
        )
    )
    """Storage elements per head row (the buffers' last dimension)."""
    comptime top = Float32(127) if Self.int8 else Float32(448)
    """The largest magnitude a row-scaled value is stored as."""
    comptime Ptr = UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin]
    comptime Row = SIMD[DType.float32, Self.head_dim]

    @staticmethod
    @always_inline
    def scale(row: Self.Ptr) -> Float32:
        """The factor the row's `load`ed values are multiplied by."""
        comptime if Self.row_scaled:
            var s = _read_half(row.unsafe_bitcast[UInt8](), Self.head_dim)
            comptime if Self.float8:
                return s * 256  # `load` gives float8 values / 256
            return s
        else:
            return 1

    @staticmethod
    @always_inline
    def load(row: Self.Ptr) -> Self.Row:
        """The row's values as float32, up to the factor `scale(row)`."""
        comptime if Self.int4:
            comptime half = Self.head_dim // 2
            var bytes = row.unsafe_bitcast[UInt8]()
            var b = bytes.unsafe_load[width=half](0)
            var low = (b & 0xF).cast[DType.float32]()
            var q = rebind[Self.Row](low.join((b >> 4).cast[DType.float32]()))
            var s = Self.Row(0)
            comptime for g in range(Self.groups):
                s = s.insert[offset=g * INT4_GROUP](
                    SIMD[DType.float32, INT4_GROUP](_read_half(bytes, half + g * SCALE_BYTES))
                )
            return (q - 8) * s
        elif Self.float8:
            # E4M3 bits into a float16's: the same value over 2^8 (exponent
            # bias 7 against 15), subnormals included; `scale` has the 256.
            var bytes = row.unsafe_bitcast[UInt8]().unsafe_load[width=Self.head_dim](0)
            var b = bytes.cast[DType.uint16]()
            var bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
            return bitcast[DType.float16](bits).cast[DType.float32]()
        else:
            return row.unsafe_load[width=Self.head_dim](0).cast[DType.float32]()

    @staticmethod
    @always_inline
    def rotate(x: Self.Row) -> Self.Row:
        """`H x`: the unnormalized Walsh-Hadamard transform of each block of
        `rotation_block` values (`H H = rotation_block x I`)."""
        comptime B = Self.rotation_block
        var out = x
        comptime for first in range(0, Self.head_dim, B):
            var v = x.slice[B, offset=first]()
            comptime for _ in range(count_trailing_zeros(B)):  # log2(B) stages
                var pairs = v.deinterleave()
                v = rebind[SIMD[DType.float32, B]]((pairs[0] + pairs[1]).join(pairs[0] - pairs[1]))
            out = out.insert[offset=first](v)
        return out

    @staticmethod
    @always_inline
    def store(row: Self.Ptr, x: Self.Row):
        """Encodes `x` into the row (quantized encodings: `rotate(x)`)."""
        var values = x
        comptime if Self.rotated:
            values = Self.rotate(x)
        comptime if Self.int4:
            comptime half = Self.head_dim // 2
            var bytes = row.unsafe_bitcast[UInt8]()
            var q = Self.Row(0)
            comptime for g in range(Self.groups):
                var x = values.slice[INT4_GROUP, offset=g * INT4_GROUP]()
                var hi = x.reduce_max()
                var lo = x.reduce_min()
                var m = hi if hi >= -lo else lo
                var d16 = (m / -8).cast[DType.float16]()
                var d = d16.cast[DType.float32]()
                var qg = SIMD[DType.float32, INT4_GROUP](0)
                if d != 0:
                    qg = min(max(round(x / d), -8), 7)
                q = q.insert[offset=g * INT4_GROUP](qg)
                _write_half(bytes, half + g * SCALE_BYTES, d16)
            var n = (q + 8).cast[DType.uint8]()
            bytes.unsafe_store(0, n.slice[half, offset=0]() | (n.slice[half, offset=half]() << 4))
        elif Self.row_scaled:
            var amax = abs(values).reduce_max()
            var s16 = (amax / Self.top).cast[DType.float16]()
            var s = s16.cast[DType.float32]()
            var q = Self.Row(0)
            if s > 0:
                q = min(max(values / s, -Self.top), Self.top)
                comptime if Self.int8:
                    q = round(q)
            comptime if Self.int8:
                row.unsafe_store(0, rebind[SIMD[Self.dtype, Self.head_dim]](q.cast[DType.int8]()))
            else:
                var bits = bitcast[DType.uint8](q.cast[DType.float8_e4m3fn]())
                row.unsafe_store(0, rebind[SIMD[Self.dtype, Self.head_dim]](bits))
            _write_half(row.unsafe_bitcast[UInt8](), Self.head_dim, s16)
        else:
            row.unsafe_store(0, values.cast[Self.dtype]())
