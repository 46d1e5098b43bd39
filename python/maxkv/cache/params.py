"""Static parameters of a continuous-batching KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from max.dtype import DType

from ..errors import ArgumentTypeError

#: Cache dtypes the Mojo ops are instantiated for.  The Mojo side is generic
#: over any floating dtype; this list is what the test suite exercises.
SUPPORTED_DTYPES: tuple[DType, ...] = (DType.float32, DType.bfloat16, DType.float16)


def _require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class KVCacheParams:
    """Shape and dtype of the cached keys and values.

    Mirrors ``max.pipelines.kv_cache.KVCacheParams`` of MAX 24.x for the
    continuous-batching strategy.

    Args:
        dtype: Element type of the cache; one of :data:`SUPPORTED_DTYPES`.
        n_kv_heads: Total number of key/value heads of the model.
        head_dim: Size of one head.
        n_devices: Number of devices the heads are split across.  Each
            device holds ``n_kv_heads // n_devices`` heads.

    Raises:
        ArgumentTypeError: If an argument has the wrong type (a ``TypeError``).
        ValueError: If a size is not positive, the dtype is unsupported, or
            ``n_kv_heads`` is not divisible by ``n_devices``.
    """

    dtype: DType
    n_kv_heads: int
    head_dim: int
    n_devices: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise ArgumentTypeError(f"dtype must be a max.dtype.DType, got {self.dtype!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(d.name for d in SUPPORTED_DTYPES)
            raise ValueError(f"dtype {self.dtype.name} is not supported; expected one of {names}")
        _require_positive_int("n_kv_heads", self.n_kv_heads)
        _require_positive_int("head_dim", self.head_dim)
        _require_positive_int("n_devices", self.n_devices)
        if self.n_kv_heads % self.n_devices:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} is not divisible by n_devices={self.n_devices}"
            )

    @property
    def n_kv_heads_per_device(self) -> int:
        """Key/value heads stored on each device."""
        return self.n_kv_heads // self.n_devices

    @property
    def dtype_name(self) -> str:
        """The dtype as the Mojo ops spell it (``"float32"``, ``"bfloat16"``)."""
        return _MOJO_DTYPE_NAMES[self.dtype]


_MOJO_DTYPE_NAMES: dict[DType, str] = {
    DType.float32: "float32",
    DType.bfloat16: "bfloat16",
    DType.float16: "float16",
}
