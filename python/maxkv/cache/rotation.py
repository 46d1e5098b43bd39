"""Moving cached keys to other positions: RoPE rotations applied after the fact.

The model rotates each key by its position when it is stored (RoPE), so a
key's position is baked into the cache.  Attention sinks with StreamingLLM's
positions (:meth:`~maxkv.PagedKVCacheManager.enable_attention_sinks`) number
the tokens by their place in the cache: when the oldest window tokens are
dropped, the keys after them move back by as many positions, which for RoPE
is one more rotation by minus that many positions (RoPE rotations compose).
Only relative positions enter attention, so the model sees exactly what it
would with those keys stored at their new places.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["KeyRotation"]


@dataclass(frozen=True, eq=False)
class KeyRotation:
    """A model's RoPE, per layer: the inverse frequencies ``[head_dim / 2]``
    (float64) its keys are rotated by, in the half-split layout (dims ``i`` and
    ``i + head_dim / 2`` rotate together, as MAX's ``interleaved=False`` and
    transformers' Llama).  A cos/sin scale (YaRN's attention factor) is part of
    the stored keys and needs no change: rotations preserve it.
    """

    inv_freq: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        if not self.inv_freq:
            raise ValueError("a KeyRotation needs the inverse frequencies of every layer")
        for layer, inv in enumerate(self.inv_freq):
            if inv.ndim != 1 or not np.isfinite(inv).all():
                raise ValueError(f"layer {layer}: inverse frequencies must be a finite vector")

    @classmethod
    def of_layers(cls, inv_freq: Sequence[np.ndarray]) -> KeyRotation:
        return cls(tuple(np.asarray(f, dtype=np.float64) for f in inv_freq))

    @property
    def num_layers(self) -> int:
        return len(self.inv_freq)

    def shift(self, keys: np.ndarray, layer: int, positions: int) -> None:
        """Rotates ``keys`` ``[..., head_dim]`` of ``layer`` in place as if stored
        ``positions`` later (negative: earlier)."""
        inv = self.inv_freq[layer]
        half = inv.shape[0]
        if keys.shape[-1] != 2 * half:
            raise ValueError(f"keys of head_dim {keys.shape[-1]}; layer {layer} rotates {2 * half}")
        angle = positions * inv
        cos, sin = np.cos(angle), np.sin(angle)
        a = keys[..., :half].astype(np.float64)
        b = keys[..., half:].astype(np.float64)
        keys[..., :half] = a * cos - b * sin
        keys[..., half:] = a * sin + b * cos
