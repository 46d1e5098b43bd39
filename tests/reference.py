"""Independent NumPy reference of a transformer attention layer over a KV cache.

Written from the definitions (matmul, rotary embedding, softmax attention),
not from maxkv's code: the tests compare maxkv's kernels against it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest


def rope(x: np.ndarray, positions: np.ndarray, theta: float, interleaved: bool) -> np.ndarray:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]`` at ``positions`` ``[tokens]``."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [tokens, head_dim/2]
    cos = np.cos(angles)[:, None, :]
    sin = np.sin(angles)[:, None, :]
    x = x.astype(np.float64)
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out
    # Hugging Face Llama: x * cos + rotate_half(x) * sin, frequencies repeated twice.
    cos2 = np.concatenate([cos, cos], axis=-1)
    sin2 = np.concatenate([sin, sin], axis=-1)
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    halves: np.ndarray = x * cos2 + rotated * sin2
    return halves


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    first_position: int,
    causal: bool,
    scale: float,
    window: int | None = None,
) -> np.ndarray:
    """Softmax attention of ``q`` ``[new, H, D]`` over ``k, v`` ``[total, KVH, D]``.

    Query token *t* sits at position ``p = first_position + t``; with a
    ``window`` (causal only) it sees positions ``p - window + 1 .. p``.
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    out = np.zeros(q.shape, dtype=np.float64)
    total = k.shape[0]
    for t in range(q.shape[0]):
        visible = first_position + t + 1 if causal else total
        lo = max(0, visible - window) if window else 0
        for h in range(n_heads):
            keys = k[lo:visible, h // group].astype(np.float64)
            values = v[lo:visible, h // group].astype(np.float64)
            scores = keys @ q[t, h].astype(np.float64) * scale
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            out[t, h] = weights @ values
    return out


class ReferenceLayerCache:
    """Per sequence and layer, the K (rotated) and V a correct cache holds."""

    def __init__(self) -> None:
        self.k: dict[tuple[int, int], np.ndarray] = {}
        self.v: dict[tuple[int, int], np.ndarray] = {}

    def length(self, seq: int, layer: int) -> int:
        return 0 if (seq, layer) not in self.k else self.k[(seq, layer)].shape[0]

    def step(
        self,
        layer: int,
        seqs: list[int],
        x: np.ndarray,
        new_tokens: list[int],
        wqkv: np.ndarray,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        theta: float,
        interleaved: bool,
        window: int | None = None,
        store: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One layer step over a ragged batch.

        Returns the rotated Q, the causal attention output, the attention
        output without a mask and that of the causal mask limited to
        ``window`` tokens (the causal output again without one), each
        ``[total_tokens, n_heads, head_dim]``.  ``store`` maps the rotated K
        and the V to what the cache keeps (its encoding's rounding); the
        attention reads what is kept.
        """
        keep = store or (lambda a: a)
        qkv = x.astype(np.float64) @ wqkv.astype(np.float64).T
        q_all = qkv[:, : n_heads * head_dim].reshape(-1, n_heads, head_dim)
        k_all = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].reshape(-1, n_kv, head_dim)
        v_all = qkv[:, (n_heads + n_kv) * head_dim :].reshape(-1, n_kv, head_dim)
        q_out, causal_out, full_out, window_out = [], [], [], []
        start = 0
        for seq, count in zip(seqs, new_tokens, strict=True):
            rows = slice(start, start + count)
            start += count
            past = self.length(seq, layer)
            positions = np.arange(past, past + count)
            q = rope(q_all[rows], positions, theta, interleaved)
            k = rope(k_all[rows], positions, theta, interleaved)
            key = (seq, layer)
            self.k[key] = np.concatenate([self.k.get(key, np.zeros((0, n_kv, head_dim))), keep(k)])
            self.v[key] = np.concatenate(
                [self.v.get(key, np.zeros((0, n_kv, head_dim))), keep(v_all[rows])]
            )
            q_out.append(q)
            scale = 1.0 / np.sqrt(head_dim)
            causal_out.append(attention(q, self.k[key], self.v[key], past, True, scale))
            full_out.append(attention(q, self.k[key], self.v[key], past, False, scale))
            window_out.append(attention(q, self.k[key], self.v[key], past, True, scale, window))
        return (
            np.concatenate(q_out),
            np.concatenate(causal_out),
            np.concatenate(full_out),
            np.concatenate(window_out),
        )


#: The quantized cache encodings, as maxkv's ``mojo_ops/kv/encoding.mojo``
#: documents them: a head row is rotated (:func:`rotate`), then quantized;
#: ``int8`` and ``float8_e4m3fn`` rows end with a float16 scale per row,
#: ``int4`` keeps a float16 scale per group of 32 values.
QUANTIZED_ENCODINGS = ("int8", "float8_e4m3fn", "int4")
INT4_GROUP = 32


def rotation_block(head_dim: int) -> int:
    """Values per Walsh-Hadamard block: the largest power of two dividing ``head_dim``."""
    return head_dim & -head_dim


def rotate(x: np.ndarray) -> np.ndarray:
    """``H x`` over the last axis, in ``x``'s dtype: the unnormalized Walsh-Hadamard
    transform (Sylvester order, ``H H = n I``) of each block of
    :func:`rotation_block` values, by ``log2(n)`` stages of ``(a, b) = (even,
    odd) values; x = (a + b, a - b)`` (the same additions, in the same order,
    as maxkv's kernels)."""
    block = rotation_block(x.shape[-1])
    v = x.reshape(*x.shape[:-1], -1, block)
    for _ in range(block.bit_length() - 1):
        a, b = v[..., 0::2], v[..., 1::2]
        v = np.concatenate([a + b, a - b], axis=-1)
    rotated: np.ndarray = v.reshape(x.shape)
    return rotated


def unrotate(x: np.ndarray) -> np.ndarray:
    """The inverse of :func:`rotate`, ``H x / n``, in float64."""
    back: np.ndarray = rotate(np.asarray(x, dtype=np.float64)) / rotation_block(x.shape[-1])
    return back


def _half_bytes(scale: np.ndarray) -> np.ndarray:
    """float16 scales ``[...]`` as their little-endian bytes ``[..., 2]``."""
    return np.ascontiguousarray(scale.astype("<f2")).view(np.uint8).reshape(*scale.shape, 2)


def _halves(data: np.ndarray) -> np.ndarray:
    """float64 values of little-endian float16 bytes ``[..., 2 * n]``."""
    return np.ascontiguousarray(data).view("<f2").astype(np.float64)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row of the last axis, from the definition: ``scale =
    float16(max|x| / 127)`` (in float32, then rounded to float16), ``q =
    round(x / scale)`` to nearest with ties to even, clamped to [-127, 127];
    an all-zero row has scale 0 and q 0.  Returns ``(q int8, scale float16)``."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(axis=-1) / np.float32(127)).astype(np.float16)
    wide = scale.astype(np.float32)[..., None]
    safe = np.where(wide > 0, wide, np.float32(1))
    q = np.where(wide > 0, np.rint(x / safe), np.float32(0))
    return np.clip(q, -127, 127).astype(np.int8), scale


def quantize_float8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8 E4M3 per row of the last axis: ``scale = float16(max|x| / 448)``,
    ``q = float8_e4m3fn(x / scale)`` (torch's conversion: nearest, ties to
    even) of ``x / scale`` clamped to [-448, 448].  Returns ``(q as its uint8
    bit patterns, scale float16)``."""
    torch = pytest.importorskip("torch")

    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(axis=-1) / np.float32(448)).astype(np.float16)
    wide = scale.astype(np.float32)[..., None]
    safe = np.where(wide > 0, wide, np.float32(1))
    q = np.where(wide > 0, np.clip(x / safe, -448, 448), np.float32(0)).astype(np.float32)
    bits = torch.from_numpy(np.ascontiguousarray(q)).to(torch.float8_e4m3fn).view(torch.uint8)
    return bits.numpy(), scale


def quantize_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q4_0 per group of 32 values of the last axis: ``m`` is the
    group's value of largest magnitude (its maximum on a tie), ``scale =
    float16(m / -8)``, ``q = round(x / scale)`` (ties to even) clamped to
    [-8, 7].  Returns ``(q int8 [..., n], scale float16 [..., n / 32])``."""
    x = np.asarray(x, dtype=np.float32)
    groups = x.reshape(*x.shape[:-1], -1, INT4_GROUP)
    hi, lo = groups.max(axis=-1), groups.min(axis=-1)
    m = np.where(hi >= -lo, hi, lo)
    scale = (m / np.float32(-8)).astype(np.float16)
    wide = scale.astype(np.float32)[..., None]
    safe = np.where(wide != 0, wide, np.float32(1))
    q = np.where(wide != 0, np.clip(np.rint(groups / safe), -8, 7), np.float32(0))
    return q.astype(np.int8).reshape(x.shape), scale


def encode_rows(x: np.ndarray, encoding: str) -> np.ndarray:
    """The stored bytes (uint8 ``[..., row bytes]``) of head rows ``x``
    ``[..., head_dim]`` in a quantized ``encoding``: the rows are rotated in
    float32 (:func:`rotate`), then quantized; int8 and float8 values then the
    row's float16 scale; int4 values ``q + 8`` as nibbles (byte ``i``: ``q[i]``
    low, ``q[i + head_dim / 2]`` high) then the groups' scales."""
    x = rotate(np.asarray(x, dtype=np.float32))
    if encoding == "int4":
        q, scale = quantize_int4(x)
        n = (q.astype(np.int16) + 8).astype(np.uint8)
        half = n.shape[-1] // 2
        packed = n[..., :half] | (n[..., half:] << 4)
        scales = _half_bytes(scale).reshape(*scale.shape[:-1], -1)
        return np.concatenate([packed, scales], axis=-1)
    quantize = {"int8": quantize_int8, "float8_e4m3fn": quantize_float8}[encoding]
    values, scale = quantize(x)
    return np.concatenate([values.view(np.uint8), _half_bytes(scale)], axis=-1)


def decode_rows(rows: np.ndarray, encoding: str) -> np.ndarray:
    """float64 values of stored head rows (:func:`encode_rows`'s layout; as bytes
    or in any storage dtype, whose bytes are read), rotated back."""
    rows = np.ascontiguousarray(rows).view(np.uint8)
    if encoding == "int4":
        head_dim = rows.shape[-1] * 16 // 9  # head_dim / 2 + 2 * head_dim / 32 bytes
        half = head_dim // 2
        q = np.concatenate([rows[..., :half] & 0xF, rows[..., :half] >> 4], axis=-1)
        values = q.astype(np.float64) - 8
        scale = _halves(rows[..., half:])
        groups = values.reshape(*values.shape[:-1], -1, INT4_GROUP) * scale[..., None]
        return unrotate(groups.reshape(values.shape))
    scale = _halves(rows[..., -2:])[..., 0]
    if encoding == "int8":
        values = rows[..., :-2].view(np.int8).astype(np.float64)
    else:
        torch = pytest.importorskip("torch")
        bits = torch.from_numpy(np.ascontiguousarray(rows[..., :-2]))
        values = bits.view(torch.float8_e4m3fn).to(torch.float64).numpy()
    return unrotate(values * scale[..., None])
