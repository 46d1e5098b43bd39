"""The greedy head: the exact argmax of a float32 LM head from integer logits (CPU).

:func:`pack_greedy_head` makes an int8 copy of the head with per-row error
bounds; :func:`greedy_head` computes integer logits with AVX-512 VNNI or
AVX2, and float32 logits only for the tiles whose bounds cannot rule them out.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from max.dtype import DType
from max.graph import TensorType, TensorValue, ops

from .. import settings
from ..graph.checks import check_positive_int, check_tensor, static_dim
from .arrays import aligned
from .features import cpu_flags
from .linear import BLOCK_COLS, PACKED_TILE

#: Layouts of :func:`pack_greedy_head`'s int8 copy: read by AVX-512 VNNI's
#: VPDPBUSD, or widened to int16 for AVX2's VPMADDWD.
GreedyHeadLayout = Literal["vnni", "avx2"]
GREEDY_HEAD_LAYOUTS: tuple[str, ...] = ("vnni", "avx2")


def greedy_head_layout() -> GreedyHeadLayout | None:
    """The layout :func:`greedy_head` reads on this host, or ``None`` where it cannot run.

    ``"vnni"`` on x86 CPUs with AVX-512 VNNI, ``"avx2"`` on those with AVX2
    and FMA (read from ``/proc/cpuinfo``, Linux); ``MAXKV_GREEDY_HEAD=0``
    turns the op off (models then compute every logit and take their argmax).
    """
    if not settings.GREEDY_HEAD.read():
        return None
    flags = cpu_flags()
    if "avx512_vnni" in flags:
        return "vnni"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def greedy_head_supported() -> bool:
    """Whether this host's CPU runs :func:`greedy_head` (see :func:`greedy_head_layout`)."""
    return greedy_head_layout() is not None


def pack_greedy_head(
    weight: np.ndarray, layout: GreedyHeadLayout | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The int8 copy and error bounds :func:`greedy_head` reads for an LM head.

    Each row of the float32 ``weight`` ``[N, K]`` becomes ``t q``, ``q`` int8
    in ``[-127, 127]``, ``t = max|row| / 127``: an approximation whose error
    the op bounds, not a replacement (the op's tokens come from the float32
    weights).  ``layout`` defaults to :func:`greedy_head_layout` (``"vnni"``
    where the op cannot run).

    Returns:
        ``q``, the int8 bytes as uint8, tile *t* of 64 rows at a time:
        ``"vnni"``: ``[ceil(N / 64), K / 4, 256]`` (group of four columns
        *g*, then 4 x 16 rows of 4 bytes, as VPDPBUSD reads them);
        ``"avx2"``: ``[ceil(N / 64), 2 K, 32]`` (4 blocks of 16 rows, each
        ``[K / 2, 16, 2]``: two consecutive columns per row, as VPMADDWD
        pairs them).  And ``info`` float32 ``[4, 64 ceil(N / 64)]``: per row
        ``t``, ``|w|``, ``|w - t q|`` (both from float64 and rounded up) and
        ``sum(q)``.  Padding rows past ``N`` get ``|w| = 1e30`` so that
        their bounds never decide anything.

    Raises:
        ValueError: If ``weight`` is not a finite ``[N, K]`` matrix with
            ``K`` a multiple of 4, or on an unknown ``layout``.
    """
    layout = layout or greedy_head_layout() or "vnni"
    if layout not in GREEDY_HEAD_LAYOUTS:
        raise ValueError(f"layout must be one of {GREEDY_HEAD_LAYOUTS}, got {layout!r}")
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % 4 or not w.size:
        raise ValueError(f"weight must be [N, K] with K a multiple of 4, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    n, k = w.shape
    tiles = -(-n // PACKED_TILE)
    q = np.zeros((tiles * PACKED_TILE, k), np.int8)
    info = np.zeros((4, tiles * PACKED_TILE), np.float32)
    info[1, n:] = 1e30
    for start in range(0, n, 4096):  # bounded float64 temporaries
        rows = w[start : start + 4096]
        t = np.abs(rows).max(axis=1) / np.float32(127)
        t[t == 0] = 1
        qr = np.clip(np.rint(rows / t[:, None]), -127, 127)
        err = rows.astype(np.float64) - t[:, None].astype(np.float64) * qr
        up = np.float32(1 + 2**-20)
        end = start + len(rows)
        q[start:end] = qr
        info[0, start:end] = t
        info[1, start:end] = np.linalg.norm(rows.astype(np.float64), axis=1).astype(np.float32) * up
        info[2, start:end] = np.linalg.norm(err, axis=1).astype(np.float32) * up
        info[3, start:end] = qr.sum(axis=1)
    if layout == "vnni":
        packed = q.reshape(tiles, 4, 16, k // 4, 4).transpose(0, 3, 1, 2, 4)
    else:
        packed = q.reshape(tiles, 4, 16, k // 2, 2).transpose(0, 1, 3, 2, 4)
    shape = greedy_q_shape(n, k, layout)
    return aligned(packed.reshape(shape)).view(np.uint8), info


def greedy_q_shape(vocab: int, k: int, layout: GreedyHeadLayout) -> tuple[int, int, int]:
    """Shape of :func:`pack_greedy_head`'s int8 copy of a ``[vocab, k]`` head."""
    tiles = -(-vocab // PACKED_TILE)
    if layout == "vnni":
        return (tiles, k // 4, 4 * PACKED_TILE)
    return (tiles, 2 * k, 32)


def greedy_head(
    x: TensorValue,
    w_packed: TensorValue,
    q: TensorValue,
    info: TensorValue,
    vocab: int,
) -> TensorValue:
    """``argmax(x @ w.T, axis=-1)``, exactly, without every float32 logit (CPU).

    The same token per row as :func:`linear_packed` then an argmax (first
    index on ties), from integer approximations (AVX-512 VNNI or AVX2) with
    a rigorous error bound and float32 logits only for the tiles that bound
    cannot rule out (see ``mojo_ops/greedy_head.mojo``).  Needs
    :func:`greedy_head_supported`.

    Args:
        x: float32 ``[M, K]`` on the CPU.
        w_packed: the head as :func:`pack_linear_weight` packs it.
        q: The int8 copy :func:`pack_greedy_head` made of the same head, in
            this host's :func:`greedy_head_layout`.
        info: Its error bounds, from the same call.
        vocab: ``N``, the head's rows.

    Returns:
        int64 ``[M]``.
    """
    check_tensor("x", x, DType.float32, 2)
    check_tensor("w_packed", w_packed, DType.float32, 4)
    check_tensor("q", q, DType.uint8, 3)
    check_tensor("info", info, DType.float32, 2)
    for name, value in (("x", x), ("w_packed", w_packed), ("q", q), ("info", info)):
        if not value.device.is_cpu():
            raise ValueError(f"greedy_head runs on CPU; {name} is on {value.device}")
    check_positive_int("vocab", vocab)
    k = static_dim("x", x, 1)
    tiles = -(-vocab // PACKED_TILE)
    bc = static_dim("w_packed", w_packed, 3)
    layout = greedy_head_layout() or "vnni"
    shapes = {
        "w_packed": (
            [static_dim("w_packed", w_packed, i) for i in range(4)],
            [tiles, PACKED_TILE // bc, k, bc] if bc in BLOCK_COLS else "a packed head",
        ),
        "q": ([static_dim("q", q, i) for i in range(3)], list(greedy_q_shape(vocab, k, layout))),
        "info": ([static_dim("info", info, i) for i in range(2)], [4, tiles * PACKED_TILE]),
    }
    if k % 4:
        raise ValueError(f"greedy_head needs K a multiple of 4, got {k}")
    for name, (got, want) in shapes.items():
        if got != want:
            raise ValueError(f"{name} {got} does not match a [{vocab}, {k}] head (expected {want})")
    return ops.custom(
        "maxkv.greedy_head",
        device=x.device,
        values=[x, w_packed, q, info],
        out_types=[TensorType(DType.int64, [x.shape[0]], x.device)],
        parameters={"vocab": vocab, "block_cols": bc},
    )[0].tensor
