"""Rotary position embeddings: the frequencies of every RoPE type maxkv implements.

:class:`RopeScaling` is a checkpoint's ``rope_scaling`` (transformers 5:
``rope_parameters``) other than the default; :func:`rope_table` is the
``freqs_cis`` table the model's cache ops take (:func:`maxkv.ops.rope_freqs_cis`'s
layout), with the scaling's frequencies and attention factor applied.  The
formulas are transformers' ``modeling_rope_utils`` (``linear``, ``dynamic``,
``llama3``, ``yarn``), written here in NumPy (float64); the tests compare them
with transformers' own functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..graph.ops import freqs_cis_table, rope_freqs_cis
from .errors import ModelLoadError

#: The RoPE types maxkv implements (``default`` needs no :class:`RopeScaling`).
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")

#: Keys of a rope dict that name the RoPE itself, not its scaling.
_BASE_KEYS = frozenset({"rope_type", "type", "rope_theta"})
#: The keys each type reads (anything else in the dict is refused).
_TYPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling: its type and the parameters that type reads (as in ``config.json``)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any] | None) -> RopeScaling | None:
        """The scaling of a checkpoint's rope dict (``None`` for the default RoPE).

        Raises:
            ModelLoadError: If the type is not one of :data:`ROPE_TYPES`, a key
                that type does not read is set (e.g. ``partial_rotary_factor``),
                or a parameter it needs is missing or not a number.
        """
        if not rope:
            return None
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if rope_type not in _TYPE_KEYS:
            raise ModelLoadError(
                f"rope type {rope_type!r} is not supported "
                f"(maxkv implements {', '.join(ROPE_TYPES)})"
            )
        allowed = _TYPE_KEYS[rope_type] | _BASE_KEYS
        extra = sorted(k for k, v in rope.items() if k not in allowed and v is not None)
        if extra:
            raise ModelLoadError(f"rope {rope_type!r} with {', '.join(extra)} is not supported")
        if rope_type == "default":
            return None
        fields: dict[str, Any] = {"rope_type": rope_type}
        try:
            for key in _TYPE_KEYS[rope_type]:
                value = rope.get(key)
                if value is None:
                    continue
                if key == "truncate":
                    fields[key] = bool(value)
                elif key == "original_max_position_embeddings":
                    fields[key] = int(value)
                else:
                    fields[key] = float(value)
        except (TypeError, ValueError):
            raise ModelLoadError(
                f"rope {rope_type!r} has a parameter that is not a number: {rope}"
            ) from None
        needed = {
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": ("factor", "original_max_position_embeddings"),
        }.get(rope_type, ("factor",))
        missing = [k for k in needed if k not in fields]
        if missing:
            raise ModelLoadError(f"rope {rope_type!r} lacks {', '.join(missing)}")
        return cls(**fields)

    def inv_freq(self, base: float, head_dim: int) -> tuple[np.ndarray, float]:
        """The inverse frequencies (float64 ``[head_dim / 2]``) and the attention
        factor that multiplies cos and sin (1 but for ``yarn``)."""
        dim = head_dim
        inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if self.rope_type == "linear":
            return inv / self.factor, 1.0
        if self.rope_type == "dynamic":
            # transformers rescales the base only past max_position_embeddings,
            # which maxkv's context never exceeds (the table ends there).
            return inv, 1.0
        if self.rope_type == "llama3":
            assert self.low_freq_factor and self.high_freq_factor
            old = float(self.original_max_position_embeddings or 0)
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled), 1.0
        assert self.rope_type == "yarn"
        return self._yarn(base, dim)

    def _yarn(self, base: float, dim: int) -> tuple[np.ndarray, float]:
        factor = self.factor
        original = float(self.original_max_position_embeddings or 0)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = mscale(factor, self.mscale) / mscale(factor, self.mscale_all_dim)
            else:
                attention = mscale(factor)
        beta_fast, beta_slow = self.beta_fast or 32.0, self.beta_slow or 1.0

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(attention)


def rope_table(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """The ``freqs_cis`` table: float32 ``[max_positions, head_dim]``, row *p*
    ``[cos(p θ_0), sin(p θ_0), cos(p θ_1), ...]`` times the attention factor."""
    if scaling is None:
        return rope_freqs_cis(head_dim, max_positions, theta)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim}")
    inv, factor = scaling.inv_freq(theta, head_dim)
    return freqs_cis_table(inv, max_positions, factor)
