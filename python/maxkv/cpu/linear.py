"""Packed float32 matmuls and SwiGLU for the CPU: the dense kernels of the model graph.

:func:`pack_linear_weight` lays a weight out once in column blocks that the
Mojo kernel's register blocks read contiguously; :func:`linear_packed` is
``x @ w.T`` over it (optionally reading an exact block-quantized copy at
small row counts, and adding a residual in its epilogue); :func:`swiglu` is
the MLP's activation over a fused gate/up projection.
"""

from __future__ import annotations

import numpy as np
from max.dtype import DType
from max.graph import TensorType, TensorValue, ops

from .. import settings
from ..graph.checks import check_positive_int, check_tensor, static_dim
from .arrays import aligned_zeros
from .features import cpu_flags, int8_dot_products
from .quantized import ACTIVATIONS, PACKED_FORMATS, SUPER, PackedFormat

#: Output columns per tile of a weight packed by :func:`pack_linear_weight`.
PACKED_TILE = 64
#: Column-block widths :func:`linear_packed` takes (see :func:`packed_block_cols`).
BLOCK_COLS = (16, 64)


def packed_block_cols() -> int:
    """The column-block width :func:`pack_linear_weight` uses on this host.

    64 on x86 CPUs with AVX-512 (32 vector registers hold a 4 x 64 block of
    outputs), 16 elsewhere (AVX2's 16 registers hold 6 x 16).  Either width
    gives the same results on any CPU; this one is the fast one here.
    """
    return 64 if "avx512f" in cpu_flags() else 16


def activations() -> str:
    """``MAXKV_ACTIVATIONS``, one of :data:`~maxkv.cpu.quantized.ACTIVATIONS`, after
    checking this host's CPU runs it: ``"int8"`` needs AVX2 or AVX-512 VNNI
    (:func:`~maxkv.cpu.features.int8_dot_products`).

    Raises:
        SettingError: If the CPU cannot run the mode asked for.
    """
    mode = settings.ACTIVATIONS.read()
    assert mode in ACTIVATIONS, mode
    if mode == "int8" and int8_dot_products() is None:
        raise settings.SettingError(
            "MAXKV_ACTIVATIONS=int8 multiplies with AVX2 (VPMADDUBSW) or AVX-512 VNNI "
            "(VPDPBUSD), which this CPU lacks; unset it (float32)"
        )
    return mode


def pack_linear_weight(weight: np.ndarray, block_cols: int | None = None) -> np.ndarray:
    """Packs a float32 ``[N, K]`` weight for :func:`linear_packed`.

    Returns ``[ceil(N / 64), 64 / block_cols, K, block_cols]``: tile *t*,
    column block *b*, row *k* holds ``weight[64 t + block_cols b : 64 t +
    block_cols (b + 1), k]``, zero-padded past ``N``, so that each of the
    kernel's register blocks reads its weights contiguously.  ``block_cols``
    (16 or 64) defaults to :func:`packed_block_cols`.  The array starts on a
    cache line (:mod:`maxkv.cpu.arrays`), as the kernel's vector loads want.
    """
    bc = packed_block_cols() if block_cols is None else block_cols
    if bc not in BLOCK_COLS:
        raise ValueError(f"block_cols must be one of {BLOCK_COLS}, got {block_cols!r}")
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be [N, K], got shape {w.shape}")
    n, k = w.shape
    tiles = -(-n // PACKED_TILE)
    blocks = PACKED_TILE // bc
    packed = aligned_zeros((tiles, blocks, k, bc), np.float32)
    full = n // bc  # column blocks with no padding
    flat = packed.reshape(tiles * blocks, k, bc)
    flat[:full] = w[: full * bc].reshape(full, bc, k).transpose(0, 2, 1)
    if n > full * bc:
        flat[full, :, : n - full * bc] = w[full * bc :].T
    return packed


def linear_packed(
    x: TensorValue,
    w_packed: TensorValue | None,
    out_features: int,
    quantized: tuple[TensorValue, TensorValue] | None = None,
    *,
    residual: TensorValue | None = None,
    block_cols: int | None = None,
) -> TensorValue:
    """``x @ w.T`` with ``w`` packed by :func:`pack_linear_weight` (CPU, float32).

    Faster than MAX's CPU matmul at the few rows of a decode step, which
    packs ``w`` again on every call; every weight is streamed once.  With
    ``quantized``, a block-quantized copy of the same weights
    (:meth:`maxkv.cpu.quantized.BlockQuantized.pack`, checked exact with
    :meth:`~maxkv.cpu.quantized.BlockQuantized.exactly`), steps of at most 8
    rows read that copy instead: 3 to 7 times fewer bytes, bit-identical
    results.  With ``quantized`` and no ``w_packed`` the copy is the weight
    (a model held as its file stores it): steps of more than 8 rows
    dequantize 256 weight rows of a column block at a time into a scratch
    panel of their worker's, which every register block of the step reads
    from cache; the results are the same bits again.  An int8 copy
    (:attr:`~maxkv.cpu.quantized.PackedFormat.int8`, the weight alone) is
    multiplied by ``x`` quantized to int8 per block of 32 (16 for blocks of
    16) along ``K``, in integers (AVX2): every step size, approximate results
    (the quantized ``x``'s products with the dequantized weights).

    Args:
        x: float32 ``[M, K]`` on the CPU.
        w_packed: float32 ``[ceil(out_features / 64), 64 / block_cols, K,
            block_cols]`` on the CPU (:func:`pack_linear_weight`), or None
            with ``quantized``.
        out_features: ``N``, the rows of the unpacked weight.
        quantized: ``(q, sm)``: uint8 ``[ceil(N / 64), K, 64 * bits / 8]``
            (an int8 copy: ``[ceil(N / 64) * 4, K / 4, 64 * bits / 8]``)
            and float32 ``[ceil(N / 64), K / block, 2, 64]`` (plain scales:
            4 bits in blocks of 32, 8 in blocks of 32 or 16) or ``[ceil(N /
            64), K / 256, slots, 64]`` (factored: 4 bits in blocks of 32, 6 in
            blocks of 16), as :class:`~maxkv.cpu.quantized.PackedFormat` says.
        residual: float32 ``[M, out_features]`` on the CPU: returns
            ``residual + x @ w.T``, added as each output tile is stored (a
            layer's residual add without another pass; the same bits as
            adding afterwards).
        block_cols: The register blocks' width over a quantized copy alone
            (16 or 64; default :func:`packed_block_cols`); with ``w_packed``,
            its layout's.

    Returns:
        float32 ``[M, out_features]``.
    """
    check_tensor("x", x, DType.float32, 2)
    if w_packed is None and quantized is None:
        raise ValueError("linear_packed needs w_packed, quantized, or both")
    values = [x]
    if w_packed is not None:
        check_tensor("w_packed", w_packed, DType.float32, 4)
        values.append(w_packed)
    if quantized is not None:
        q, sm = quantized
        check_tensor("q", q, DType.uint8, 3)
        check_tensor("sm", sm, DType.float32, 4)
        values += [q, sm]
    if residual is not None:
        check_tensor("residual", residual, DType.float32, 2)
        values.append(residual)
    names = (
        "x",
        *(("w_packed",) if w_packed is not None else ()),
        *(("q", "sm") if quantized is not None else ()),
        "residual",
    )
    for name, value in zip(names[: len(values)], values, strict=True):
        if not value.device.is_cpu():
            raise ValueError(f"linear_packed runs on CPU; {name} is on {value.device}")
    check_positive_int("out_features", out_features)
    k = static_dim("x", x, 1)
    tiles = -(-out_features // PACKED_TILE)
    bc = packed_block_cols() if block_cols is None else block_cols
    if bc not in BLOCK_COLS:
        raise ValueError(f"block_cols must be one of {BLOCK_COLS}, got {block_cols!r}")
    if w_packed is not None:
        if block_cols is not None:
            raise ValueError("block_cols is w_packed's own: pass it only without w_packed")
        tiles_w, blocks, k_w, bc = (static_dim("w_packed", w_packed, i) for i in range(4))
        if bc not in BLOCK_COLS or blocks * bc != PACKED_TILE or k_w != k or tiles_w != tiles:
            raise ValueError(
                f"w_packed {list(w_packed.shape)} is not a packed [{out_features}, {k}] weight "
                f"(expected [{tiles}, 64 / b, {k}, b], b in {BLOCK_COLS})"
            )
    if quantized is not None:
        if _check_copy_shapes(quantized, out_features, k).int8 and w_packed is not None:
            raise ValueError("an int8 copy is the weight alone: pass w_packed=None")
    if residual is not None and (
        residual.shape[0] != x.shape[0] or static_dim("residual", residual, 1) != out_features
    ):
        raise ValueError(
            f"residual {list(residual.shape)} must be [{x.shape[0]}, {out_features}]: x @ w.T's"
        )
    if w_packed is None:
        op = "maxkv.linear_quantized"
    else:
        op = "maxkv.linear_packed" + ("" if quantized is None else "_q")
    return ops.custom(
        op + ("" if residual is None else "_add"),
        device=x.device,
        values=values,
        out_types=[TensorType(DType.float32, [x.shape[0], out_features], x.device)],
        parameters={"block_cols": bc},
    )[0].tensor


def _check_copy_shapes(quantized: tuple[TensorValue, TensorValue], n: int, k: int) -> PackedFormat:
    """The format of ``(q, sm)``, a packed quantized ``[n, k]`` matrix in one of
    :data:`~maxkv.cpu.quantized.PACKED_FORMATS` (or an int8 copy of an integer one).

    Raises:
        ValueError: If it is none of them.
    """
    q, sm = quantized
    q_shape = tuple(static_dim("q", q, i) for i in range(3))
    sm_shape = tuple(static_dim("sm", sm, i) for i in range(4))
    fitting = [
        layout
        for f in PACKED_FORMATS
        if k % (SUPER if f.factored else f.block) == 0
        for layout in dict.fromkeys([f, f.for_activations("int8")])
    ]
    found = [f for f in fitting if (q_shape, sm_shape) == f.shapes(n, k)]
    if k == 0 or not found:
        expected = " or ".join(
            f"{list(f.shapes(n, k)[0])} / {list(f.shapes(n, k)[1])}" for f in fitting
        )
        raise ValueError(
            f"q {list(q_shape)} / sm {list(sm_shape)} are not a packed quantized "
            f"[{n}, {k}] weight (expected {expected or 'K a multiple of 16'})"
        )
    return found[0]


def gather_quantized(
    tokens: TensorValue, quantized: tuple[TensorValue, TensorValue], rows: int, k: int
) -> TensorValue:
    """Rows ``tokens`` of a ``[rows, k]`` matrix held as a packed quantized copy (CPU).

    The copy :func:`linear_packed` reads (its ``quantized``), so a tied
    embedding is gathered from the table its head reads, with the values the
    matmul dequantizes there (``fma(q, scale, offset)``, one rounding: the
    dequantized matrix's).

    Args:
        tokens: int64 ``[T]`` on the CPU; each in ``0 .. rows - 1`` (the kernel
            raises on any other).
        quantized: ``(q, sm)`` as :func:`linear_packed` takes them.
        rows: The matrix's rows (an embedding's vocabulary).
        k: Its columns (the hidden size).

    Returns:
        float32 ``[T, k]``.
    """
    check_tensor("tokens", tokens, DType.int64, 1)
    q, sm = quantized
    check_tensor("q", q, DType.uint8, 3)
    check_tensor("sm", sm, DType.float32, 4)
    for name, value in (("tokens", tokens), ("q", q), ("sm", sm)):
        if not value.device.is_cpu():
            raise ValueError(f"gather_quantized runs on CPU; {name} is on {value.device}")
    check_positive_int("rows", rows)
    check_positive_int("k", k)
    _check_copy_shapes(quantized, rows, k)
    return ops.custom(
        "maxkv.gather_quantized",
        device=tokens.device,
        values=[tokens, q, sm],
        out_types=[TensorType(DType.float32, [tokens.shape[0], k], tokens.device)],
        parameters={"rows": rows},
    )[0].tensor


def swiglu(gate_up: TensorValue) -> TensorValue:
    """``silu(gate) * up`` of a fused gate/up projection (CPU, float32).

    Args:
        gate_up: float32 ``[tokens, 2 * intermediate]``: gate columns, then up.

    Returns:
        float32 ``[tokens, intermediate]``.
    """
    check_tensor("gate_up", gate_up, DType.float32, 2)
    if not gate_up.device.is_cpu():
        raise ValueError(f"swiglu runs on CPU; gate_up is on {gate_up.device}")
    width = static_dim("gate_up", gate_up, 1)
    if width % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {width}")
    return ops.custom(
        "maxkv.swiglu",
        device=gate_up.device,
        values=[gate_up],
        out_types=[TensorType(DType.float32, [gate_up.shape[0], width // 2], gate_up.device)],
    )[0].tensor
