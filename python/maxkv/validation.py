"""The one validator of integer arguments, shared by every layer (parameters,
managers, graph builders, CPU ops): a Python or NumPy integer, never a bool,
at least a minimum."""

from __future__ import annotations

import numpy as np

from .errors import ArgumentTypeError


def require_int(name: str, value: object, minimum: int) -> int:
    """``value`` as a Python int ``>= minimum`` (NumPy integers accepted).

    Raises:
        ArgumentTypeError: If it is not an int (a ``TypeError``; bools refused).
        ValueError: If it is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)
