"""How the cache stores one head row of keys or values: its encodings.

A collection's `dtype_name` names its encoding; the storage dtype is the
`DType` of that name, and every op reads and writes head rows through
`HeadCodec[storage dtype, head_dim]`, so no kernel is written per encoding:

- `float32`, `bfloat16`, `float16`: `head_dim` values of that dtype (a narrower
  one rounds to nearest even on write).
- `int8`: `head_dim` int8 values `q`, then the row's scale as the 2 bytes of a
  float16 (`INT8_SCALE_BYTES`): `x ~ q * scale` with `scale = f16(max|x| / 127)`
  per token and KV head and `q = round(x / scale)` (to nearest, ties to even),
  clamped to `[-127, 127]`.  A row is `head_dim + 2` int8 elements
  (`HeadCodec.width`); `maxkv.cache.params` computes the same byte size.

Kernels keep their math in float32: `load` gives a row's stored values as
float32 and `scale` the factor they are multiplied by (1 for the float
encodings), so a dot product is scaled once, after its sum.
"""

from std.memory import bitcast


comptime INT8_SCALE_BYTES = 2
"""Bytes of the float16 scale at the end of an int8 head row."""
comptime INT8_MAX = Float32(127)


struct HeadCodec[dtype: DType, head_dim: Int]:
    """Reads and writes one head row of `head_dim` values stored as `dtype`."""

    comptime quantized = Self.dtype == DType.int8
    comptime width = Self.head_dim + INT8_SCALE_BYTES if Self.quantized else Self.head_dim
    """Storage elements per head row (the buffers' last dimension)."""
    comptime Ptr = UnsafePointer[Scalar[Self.dtype], MutUntrackedOrigin]

    @staticmethod
    @always_inline
    def scale(row: Self.Ptr) -> Float32:
        """The factor the row's stored values are multiplied by."""
        comptime if Self.quantized:
            var bits = row.unsafe_offset(Self.head_dim).unsafe_bitcast[UInt8]()
            var half = UInt16(bits[unsafe_offset=0]) | (UInt16(bits[unsafe_offset=1]) << 8)
            return bitcast[DType.float16](half).cast[DType.float32]()
        else:
            return 1

    @staticmethod
    @always_inline
    def load[width: Int](row: Self.Ptr, d: Int) -> SIMD[DType.float32, width]:
        """Stored values `d .. d + width` of the row, as float32 (unscaled)."""
        return row.unsafe_load[width=width](d).cast[DType.float32]()

    @staticmethod
    @always_inline
    def store(row: Self.Ptr, values: SIMD[DType.float32, Self.head_dim]):
        """Encodes `values` into the row."""
        comptime if Self.quantized:
            var amax = abs(values).reduce_max()
            var half = (amax / INT8_MAX).cast[DType.float16]()
            var scale = half.cast[DType.float32]()
            var q = SIMD[DType.float32, Self.head_dim](0)
            if scale > 0:
                q = min(max(round(values / scale), -INT8_MAX), INT8_MAX)
            row.unsafe_store(0, rebind[SIMD[Self.dtype, Self.head_dim]](q.cast[DType.int8]()))
            var bits = bitcast[DType.uint16](half)
            var dst = row.unsafe_offset(Self.head_dim).unsafe_bitcast[UInt8]()
            dst[unsafe_offset=0] = UInt8(bits & 0xFF)
            dst[unsafe_offset=1] = UInt8(bits >> 8)
        else:
            row.unsafe_store(0, values.cast[Self.dtype]())
