"""The graph-build-time checks of maxkv's graph functions: one family for all.

Every check raises before any op is added to the graph:

- :class:`ArgumentTypeError` (a ``TypeError`` and a ``ValueError``) when an
  argument is not of the kind asked for: not a ``TensorValue``, not a
  :class:`~maxkv.KVCacheParams`, not an int, not a bool;
- ``ValueError`` when it is of the right kind with a wrong value: dtype,
  rank, a static dim, a device, a range.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.graph import DeviceRef, TensorValue

from ..cache.params import KVCacheParams
from ..errors import ArgumentTypeError
from ..validation import require_int

__all__ = [
    "ArgumentTypeError",
    "check_bool",
    "check_host",
    "check_on",
    "check_params",
    "check_positive_int",
    "check_static_dim",
    "check_tensor",
    "same_device",
    "static_dim",
]


def check_params(params: object) -> KVCacheParams:
    """``params`` if it is a :class:`~maxkv.KVCacheParams`."""
    if not isinstance(params, KVCacheParams):
        raise ArgumentTypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
    return params


def check_tensor(
    name: str, value: object, dtype: DType | tuple[DType, ...], rank: int
) -> TensorValue:
    """``value`` if it is a ``TensorValue`` of ``dtype`` (or one of them) and ``rank``."""
    if not isinstance(value, TensorValue):
        raise ArgumentTypeError(f"{name} must be a TensorValue, got {type(value).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if value.dtype not in dtypes:
        expected = " or ".join(d.name for d in dtypes)
        raise ValueError(f"{name} must have dtype {expected}, got {value.dtype.name}")
    if value.rank != rank:
        raise ValueError(f"{name} must have rank {rank}, got rank {value.rank} ({value.shape})")
    return value


def static_dim(name: str, value: TensorValue, axis: int) -> int:
    """Dim ``axis`` of ``value``, which must be static."""
    dim: Any = value.shape[axis]
    try:
        return int(dim)
    except TypeError:
        raise ValueError(f"{name} dim {axis} must be static, got symbolic {dim}") from None


def check_static_dim(name: str, value: TensorValue, axis: int, expected: int, what: str) -> None:
    """Dim ``axis`` of ``value`` must be the static ``expected`` (``what`` names it)."""
    dim: Any = value.shape[axis]
    try:
        actual = int(dim)
    except TypeError:
        raise ValueError(
            f"{name} dim {axis} must be the static {what} = {expected}, got symbolic {dim}"
        ) from None
    if actual != expected:
        raise ValueError(f"{name} dim {axis} must be {what} = {expected}, got {actual}")


def same_device(a: DeviceRef, b: DeviceRef) -> bool:
    """Whether ``a`` and ``b`` name the same device.

    MAX 26.7's ``DeviceRef ==`` cannot be used: ``DeviceKind`` is a frozen
    dataclass over a ``str`` enum whose generated ``__eq__`` finds every kind
    equal, so ``DeviceRef.GPU() == DeviceRef.CPU()`` is true.
    """
    return bool(a.is_cpu() == b.is_cpu() and a.id == b.id)


def check_on(name: str, value: TensorValue, device: DeviceRef, of: str | None = None) -> None:
    """``value`` must be on ``device`` (the device of the value named ``of``, if given)."""
    if not same_device(value.device, device):
        where = f"the device of {of}, {device}" if of else str(device)
        raise ValueError(f"{name} must be on {where}, got {value.device}")


def check_host(name: str, value: TensorValue) -> None:
    """``value`` must live on the host (CPU)."""
    if not value.device.is_cpu():
        raise ValueError(f"{name} must live on the host, got {value.device}")


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an int ``>= 1`` (:func:`maxkv.validation.require_int`)."""
    return require_int(name, value, 1)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
