"""CacheBlend's selective recompute: the :class:`BlendExecutor` of maxkv.

Per forward pass (layer 0 first), with ``check_layers`` = ``[c, ...]``:

- layers before ``c``: every token is computed fresh; the fresh K/V are the
  layer's K/V (no blending).
- at a check layer: the retrieved K, re-rotated from its original positions
  to the tokens' positions in the new prompt, is compared with the fresh K;
  per request, the ``ceil(recompute_ratio * valid)`` valid tokens whose K
  deviates most (squared L2 over heads and dims), plus every token with no
  retrieved KV, stay selected.  The layer's K/V are still the fresh ones
  (all tokens were computed); Q is narrowed to the selected tokens.
- later layers: only the selected tokens are computed; their fresh K/V
  replace the retrieved (re-rotated) rows, the other rows are reused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from .interfaces import BlendExecutor, BlendOutput

#: ``(k [T, kv_heads, dim], from_positions [T], to_positions [T]) -> k`` re-rotated.
Rerotate = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def rerotate_numpy(theta: float) -> Rerotate:
    """A NumPy (float64) RoPE re-rotation for half-split heads, for tests and tools."""

    def rotate(k: np.ndarray, from_positions: np.ndarray, to_positions: np.ndarray) -> np.ndarray:
        half = k.shape[-1] // 2
        inv = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / k.shape[-1])
        angle = (to_positions - from_positions).astype(np.float64)[:, None, None] * inv
        cos, sin = np.cos(angle), np.sin(angle)
        x1, x2 = k[..., :half].astype(np.float64), k[..., half:].astype(np.float64)
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(k.dtype)

    return rotate


class CacheBlendExecutor(BlendExecutor):
    """Selective recompute with ``recompute_ratio`` and ``check_layers``.

    Args:
        rerotate: Re-rotates retrieved K between positions (maxkv's MAX graph
            from :class:`~maxkv.blend.BlendedPrefill`, or :func:`rerotate_numpy`).
        recompute_ratio: Share of each request's retrieved tokens recomputed
            after the check layer, in ``[0, 1]``; 1.0 recomputes everything
            (the output then equals a full prefill).
        check_layers: Layers where the deviation is measured (the first one
            selects; later ones narrow among the selected tokens).

    The executor keeps which tokens are selected between layers of one
    forward pass; a call with ``layer_id == 0`` starts a new pass.
    """

    def __init__(
        self,
        rerotate: Rerotate,
        recompute_ratio: float = 0.15,
        check_layers: Sequence[int] = (1,),
    ) -> None:
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if not check_layers or any(layer < 0 for layer in check_layers):
            raise ValueError(f"check_layers must be non-negative layer ids, got {check_layers}")
        self.rerotate = rerotate
        self.recompute_ratio = float(recompute_ratio)
        self.check_layers = sorted(set(int(layer) for layer in check_layers))
        self._long_index: np.ndarray | None = None
        self._long_positions: np.ndarray | None = None
        self._starts: np.ndarray | None = None

    def blend(
        self,
        layer_id: int,
        retrieved_k: np.ndarray | None,
        retrieved_v: np.ndarray | None,
        valid_mask: np.ndarray,
        original_positions: np.ndarray,
        fresh_q: np.ndarray,
        fresh_k: np.ndarray,
        fresh_v: np.ndarray,
        positions: np.ndarray,
        query_start_loc: np.ndarray,
        token_dim: int,
    ) -> BlendOutput:
        """See :meth:`BlendExecutor.blend`; ``token_dim`` must be 0."""
        if token_dim != 0:
            raise ValueError(f"maxkv's executor takes tokens on axis 0, got token_dim {token_dim}")
        if layer_id == 0 or self._long_index is None:
            # A new pass: every token is computed; remember them as the long layout.
            self._long_index = np.arange(fresh_q.shape[0])
            self._long_positions = np.asarray(positions, dtype=np.int64).copy()
            self._starts = np.asarray(query_start_loc, dtype=np.int64).copy()
        current = self._long_index
        everything = np.arange(fresh_q.shape[0])
        valid = np.asarray(valid_mask, dtype=bool)
        if retrieved_k is None or retrieved_v is None or not valid.any():
            return BlendOutput(fresh_q, fresh_k, fresh_v, positions, everything, None)
        if layer_id < self.check_layers[0]:
            return BlendOutput(fresh_q, fresh_k, fresh_v, positions, everything, None)
        assert self._long_positions is not None and self._starts is not None
        # Retrieved K, rotated at its original positions, moved to the new ones.
        long_k = np.array(retrieved_k, dtype=fresh_k.dtype, copy=True)
        long_v = np.array(retrieved_v, dtype=fresh_v.dtype, copy=True)
        long_k[valid] = self.rerotate(
            long_k[valid], np.asarray(original_positions)[valid], self._long_positions[valid]
        )
        if layer_id in self.check_layers:
            selected = self._select(fresh_k, long_k[current], valid[current], current)
            self._long_index = current[selected]
            if current.shape[0] == long_k.shape[0]:  # all tokens fresh: the layer's K/V
                long_k, long_v = fresh_k, fresh_v
            else:
                long_k[current], long_v[current] = fresh_k, fresh_v
            starts = np.searchsorted(self._long_index, self._starts)
            return BlendOutput(
                fresh_q[selected],
                long_k,
                long_v,
                np.asarray(positions)[selected],
                selected,
                starts.astype(np.asarray(query_start_loc).dtype),
            )
        long_k[current] = fresh_k
        long_v[current] = fresh_v
        return BlendOutput(fresh_q, long_k, long_v, positions, everything, None)

    def _select(
        self, fresh_k: np.ndarray, retrieved_k: np.ndarray, valid: np.ndarray, current: np.ndarray
    ) -> np.ndarray:
        """Local indices (sorted) of the tokens kept: per request, the most deviating
        valid ones and every invalid one."""
        assert self._starts is not None
        deviation = np.square(fresh_k.astype(np.float64) - retrieved_k.astype(np.float64))
        deviation = deviation.reshape(deviation.shape[0], -1).sum(axis=1)
        keep = ~valid
        bounds = np.searchsorted(current, self._starts)
        for start, end in itertools.pairwise(bounds):
            rows = np.arange(start, end)
            candidates = rows[valid[rows]]
            count = math.ceil(self.recompute_ratio * candidates.shape[0])
            if count:
                order = np.argsort(-deviation[candidates], kind="stable")[:count]
                keep[candidates[order]] = True
        return np.nonzero(keep)[0]
