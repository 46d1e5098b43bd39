"""Static parameters of a KV cache: the model's compute dtype, the cache's
encoding, the head layout, and the byte size of what it stores.

The compute dtype (``dtype``) is what the model's Q, K and V are in when they
reach the cache ops; the cache's encoding (``cache_dtype``) is how keys and
values are stored.  They may differ: a float32 model can keep its KV in
bfloat16 or float16 (half the bytes), as MAX's ``--kv-cache-format`` does, or
in int8 or float8 with a float16 scale per token and KV head (about a
quarter), or in int4 with a float16 scale per 32 values (about an eighth).  The
store ops encode on write (rounding to nearest even), the attention kernels
decode in their inner loop; no decoded copy of the cache is ever made.
:attr:`KVCacheParams.head_width` and :meth:`KVCacheParams.token_bytes` are the
one place the layout of a cached head row and its byte size are computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from max.dtype import DType

from ..errors import ArgumentTypeError, UnsupportedEncodingError
from ..validation import require_int

#: Compute dtypes and cache encodings the Mojo ops are instantiated for.  The
#: Mojo side is generic over any floating dtype; this list is what the test
#: suite exercises.
SUPPORTED_DTYPES: tuple[DType, ...] = (DType.float32, DType.bfloat16, DType.float16)

#: Every cache encoding a user may name (MAX's ``--kv-cache-format`` values and
#: maxkv's own): ``None`` where maxkv implements it, else why not.
#: The implemented ones are :data:`CACHE_DTYPES`.
CACHE_ENCODINGS: dict[str, str | None] = {
    "float32": None,
    "bfloat16": None,
    "float16": None,
    "float8_e4m3fn": None,
    "int8": None,
    "int4": None,
    "float4_e2m1fn": "NVFP4 KV is a GPU format MAX implements for its own cache only",
    "float4_e2m1": "NVFP4 KV is a GPU format MAX implements for its own cache only",
}

#: The storage dtype of each implemented encoding: the buffers' element type,
#: which is how the Mojo ops tell encodings apart.  MAX graphs take no float8
#: tensor on a CPU, so float8 rows are kept as ``uint8`` (their bytes), and
#: int4 rows as ``uint16`` (four values an element).
_STORAGE: dict[str, DType] = {
    "float32": DType.float32,
    "bfloat16": DType.bfloat16,
    "float16": DType.float16,
    "float8_e4m3fn": DType.uint8,
    "int8": DType.int8,
    "int4": DType.uint16,
}
_ENCODING_OF: dict[DType, str] = {dtype: name for name, dtype in _STORAGE.items()}

#: The cache encodings maxkv implements, as their storage dtypes.
CACHE_DTYPES: tuple[DType, ...] = tuple(_STORAGE.values())

#: The quantized encodings: their head rows carry float16 scales.
QUANTIZED_ENCODINGS: tuple[str, ...] = ("float8_e4m3fn", "int8", "int4")

#: Bytes of one float16 scale in a quantized head row (``mojo_ops/kv/encoding.mojo``).
SCALE_BYTES = 2

#: Values that share one scale in an ``int4`` head row (llama.cpp's ``q4_0`` block).
INT4_GROUP = 32


def cache_encoding(name: object) -> DType:
    """The storage dtype of the cache encoding ``name`` (``"bfloat16"``, a
    ``DType``, or MAX's ``DType.bfloat16`` spelled as text).  ``float8_e4m3fn``
    is stored as ``uint8`` and ``int4`` as ``uint16``: those dtypes (not
    their names as text) also name them.

    Raises:
        UnsupportedEncodingError: For an encoding maxkv knows but does not
            implement (``"float4_e2m1fn"``): it says which are.
        ValueError: For a name that is no cache encoding at all.
    """
    if isinstance(name, DType):
        key = _ENCODING_OF.get(name, name.name)
    elif isinstance(name, str):
        key = name.strip().lower().removeprefix("dtype.")
    else:
        raise ArgumentTypeError(
            f"a cache encoding is a str or a max.dtype.DType, got {type(name).__name__}"
        )
    implemented = ", ".join(_STORAGE)
    if key not in CACHE_ENCODINGS:
        raise ValueError(f"{name!r} is not a KV cache encoding; maxkv implements {implemented}")
    reason = CACHE_ENCODINGS[key]
    if reason is not None:
        raise UnsupportedEncodingError(
            f"the KV cache encoding {key} is refused: {reason}; maxkv implements {implemented}"
        )
    return _STORAGE[key]


@dataclass(frozen=True)
class KVCacheParams:
    """Compute dtype, cache encoding and head layout of the cached keys and values.

    Mirrors ``max.pipelines.kv_cache.KVCacheParams`` of MAX 24.x for the
    continuous-batching strategy, with the storage encoding apart from the
    compute dtype (MAX 26's ``cache_dtype``).

    Args:
        dtype: The model's compute dtype: what the ops take Q, K and V in and
            return attention in; one of :data:`SUPPORTED_DTYPES`.
        n_kv_heads: Total number of key/value heads of the model.
        head_dim: Size of one head.
        n_devices: Number of devices the heads are split across.  Each
            device holds ``n_kv_heads // n_devices`` heads.
        cache_dtype: How keys and values are stored; ``None`` (default) is
            ``dtype``.  A ``DType`` or an encoding name (:data:`CACHE_ENCODINGS`);
            after construction it is always a ``DType``.

    Raises:
        ArgumentTypeError: If an argument has the wrong type (a ``TypeError``).
        UnsupportedEncodingError: For a cache encoding maxkv does not implement.
        ValueError: If a size is not positive, the dtype is unsupported, or
            ``n_kv_heads`` is not divisible by ``n_devices``.
    """

    dtype: DType
    n_kv_heads: int
    head_dim: int
    n_devices: int = 1
    cache_dtype: DType = None  # None: ``dtype``; a DType after __post_init__

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise ArgumentTypeError(f"dtype must be a max.dtype.DType, got {self.dtype!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(d.name for d in SUPPORTED_DTYPES)
            raise ValueError(f"dtype {self.dtype.name} is not supported; expected one of {names}")
        storage = self.dtype if self.cache_dtype is None else cache_encoding(self.cache_dtype)
        object.__setattr__(self, "cache_dtype", storage)
        for field in ("n_kv_heads", "head_dim", "n_devices"):
            object.__setattr__(self, field, require_int(field, getattr(self, field), 1))
        if self.n_kv_heads % self.n_devices:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} is not divisible by n_devices={self.n_devices}"
            )
        if self.encoding == "int4" and self.head_dim % INT4_GROUP:
            raise ValueError(
                f"an int4 cache keeps a scale per {INT4_GROUP} values of a head: head_dim "
                f"{self.head_dim} is not a multiple of {INT4_GROUP}"
            )

    @property
    def n_kv_heads_per_device(self) -> int:
        """Key/value heads stored on each device."""
        return self.n_kv_heads // self.n_devices

    @property
    def dtype_name(self) -> str:
        """The compute dtype as the Mojo ops spell it (``"float32"``, ``"bfloat16"``)."""
        return _MOJO_DTYPE_NAMES[self.dtype]

    @property
    def encoding(self) -> str:
        """The cache encoding's name (``cache_dtype`` is its storage dtype:
        ``uint8`` for ``"float8_e4m3fn"``, ``uint16`` for ``"int4"``)."""
        return _ENCODING_OF[self.cache_dtype]

    @property
    def quantized(self) -> bool:
        """Whether the cache encoding keeps scales (:data:`QUANTIZED_ENCODINGS`)."""
        return self.encoding in QUANTIZED_ENCODINGS

    @property
    def head_width(self) -> int:
        """Storage elements of one cached head row (the last dim of every cache
        buffer): ``head_dim`` values; int8 and float8 add the
        :data:`SCALE_BYTES` of the row's float16 scale; int4 packs two values a
        byte and adds a float16 scale per :data:`INT4_GROUP` values, in uint16
        elements (half the row's bytes)."""
        if self.encoding == "int4":
            row_bytes = self.head_dim // 2 + self.head_dim // INT4_GROUP * SCALE_BYTES
            return row_bytes // int(self.cache_dtype.size_in_bytes)
        return self.head_dim + (SCALE_BYTES if self.quantized else 0)

    @property
    def row_format(self) -> str:
        """The name of a stored head row's format, which blocks moved out of the
        cache (the KV tiers) carry: the encoding, marked ``+hadamard`` for the
        quantized ones, whose rows are rotated before they are quantized (so a
        block of int8 rows not rotated, or of another encoding, is refused)."""
        return f"{self.encoding}+hadamard" if self.quantized else self.encoding

    @property
    def cache_dtype_name(self) -> str:
        """The storage dtype as the Mojo ops spell it: the collection's ``dtype_name``."""
        return _MOJO_DTYPE_NAMES[self.cache_dtype]

    def token_bytes(self, num_layers: int) -> int:
        """Bytes one cached token takes on one device: keys and values of
        ``num_layers`` layers, ``n_kv_heads_per_device`` heads, in the cache
        encoding (scales included).  Every byte count of a cache
        (slots, pages, budgets, tier blocks) is a multiple of it."""
        layers = require_int("num_layers", num_layers, 1)
        element = int(self.cache_dtype.size_in_bytes)
        return 2 * layers * self.n_kv_heads_per_device * self.head_width * element


_MOJO_DTYPE_NAMES: dict[DType, str] = {
    DType.float32: "float32",
    DType.bfloat16: "bfloat16",
    DType.float16: "float16",
    DType.int8: "int8",
    DType.uint8: "uint8",
    DType.uint16: "uint16",
}
