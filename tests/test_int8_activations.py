"""``MAXKV_ACTIVATIONS=int8``: held integer matrices multiplied by int8 activations.

References are independent of the code under test: the layout is decoded by the
rule its docstring gives, written out again here; the matmul is checked against
NumPy's float64 product of the activations quantized as documented (per block,
``round(x / d)`` halves away from zero, ``d = max|x| / 127``) with the
dequantized weights, and against the exact float32 product within the
quantization's own error bound; a model's logits against transformers on the
same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, Weight

from maxkv import ops as kvops
from maxkv import settings
from maxkv.cpu import features as cpu_features
from maxkv.cpu.quantized import PACKED_FORMATS, PackedFormat
from maxkv.models import load_model

from .gguf_helpers import TINY, hf_weights, write_llama_gguf
from .test_quantized import _random_copy, assert_steps_give_transformers_logits

#: The integer formats (the ones an int8 copy holds).
INTEGER_FORMATS = [f for f in PACKED_FORMATS if not f.floating]
_N = 200  # 4 tiles, the last one partly padding


def _k(fmt: PackedFormat) -> int:
    return 768 if fmt.factored else 608


def _name(fmt: PackedFormat) -> str:
    return f"{fmt.bits}bit_block{fmt.block}{'_factored' if fmt.factored else ''}"


def decode_int8_layout(q: np.ndarray, bits: int, n: int, k: int) -> np.ndarray:
    """The integers ``[n, k]`` of an int8 copy's ``q``, read value by value as
    :class:`~maxkv.cpu.quantized.TileBuilder` documents the layout."""
    out = np.zeros((q.shape[0] // 4 * 64, k), np.int64)
    for group in range(q.shape[0]):
        for c in range(16):
            column = group * 16 + c  # tile group // 4, columns 16 (group % 4) ..
            h, cc = divmod(c, 8)
            for kk in range(k):
                p, i = divmod(kk, 4)
                v = 4 * cc + i
                row = q[group, p]
                if bits == 8:
                    value = int(row[32 * h + v])
                else:
                    value = int(row[v]) >> (4 * h) & 15
                    if bits == 6:
                        u = 32 * h + v
                        value |= (int(row[32 + u % 16]) >> (2 * (u // 16)) & 3) << 4
                out[column, kk] = value
    return out[:n]


def quantized_rows(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` ``[M, K]`` as the documented int8 levels: ``(levels * d, d)`` per block."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block).astype(np.float32)
    top = np.abs(blocks).max(-1)
    d = (top / np.float32(127)).astype(np.float32)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    scaled = (blocks * inverse[..., None]).astype(np.float32)
    half = np.where(scaled < 0, np.float32(-0.5), np.float32(0.5))
    levels = np.clip(np.trunc((scaled + half).astype(np.float32)), -127, 127)
    return (levels * d[..., None].astype(np.float64)).reshape(m, k), d


@pytest.mark.unit
@pytest.mark.parametrize("fmt", INTEGER_FORMATS, ids=_name)
def test_an_int8_copy_holds_the_copys_integers_and_scales(fmt: PackedFormat) -> None:
    """Every integer format's int8 copy: the same integers, placed as documented,
    the same ``sm`` as the copy by rows, and a shape that names its layout."""
    n, k = 70, 256 if fmt.factored else 64
    copy = _random_copy(np.random.default_rng(1), n, k, fmt)
    q, sm = copy.pack("int8")
    rows_q, rows_sm = copy.pack()
    assert q.shape == (4 * 2, k // 4, 64 * fmt.bits // 8)
    assert q.nbytes == rows_q.nbytes
    np.testing.assert_array_equal(sm, rows_sm)
    np.testing.assert_array_equal(decode_int8_layout(q, fmt.bits, n, k), copy.q)
    assert PackedFormat.of(q.shape, sm.shape) == fmt.for_activations("int8")
    assert PackedFormat.of(rows_q.shape, rows_sm.shape) == fmt


@pytest.mark.unit
def test_16_bit_floats_and_float32_mode_stay_by_rows() -> None:
    bf16 = PackedFormat.floats("bfloat16")
    assert not bf16.for_activations("int8").int8
    assert not PackedFormat(4, 32).for_activations("float32").int8
    with pytest.raises(ValueError, match="activations must be one of"):
        PackedFormat(4, 32).for_activations("bfloat16")
    with pytest.raises(ValueError, match="integers only as an int8 copy"):
        PackedFormat.check(16, 1, False, "bfloat16", int8=True)


@pytest.mark.unit
def test_the_mode_is_read_and_checked_against_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MAXKV_ACTIVATIONS`` takes float32 or int8 only; int8 is refused by name on a
    CPU with neither AVX2 nor AVX-512 VNNI, never run in float32 instead, and names
    the instructions the kernels multiply with where it runs."""
    monkeypatch.delenv("MAXKV_ACTIVATIONS", raising=False)
    assert kvops.activations() == "float32"
    monkeypatch.setenv("MAXKV_ACTIVATIONS", "bfloat16")
    with pytest.raises(settings.SettingError, match="MAXKV_ACTIVATIONS"):
        kvops.activations()
    monkeypatch.setenv("MAXKV_ACTIVATIONS", "int8")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"sse2", "fma"}))
    with pytest.raises(settings.SettingError, match=r"MAXKV_ACTIVATIONS=int8 .* AVX2"):
        kvops.activations()
    assert cpu_features.int8_dot_products() is None
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert kvops.activations() == "int8"
    assert cpu_features.int8_dot_products() == "AVX2"
    # VNNI without AVX-512 (AVX-VNNI on client chips): the kernels use AVX2's pairs.
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx_vnni"}))
    assert cpu_features.int8_dot_products() == "AVX2"
    flags = frozenset({"avx2", "avx512f", "avx512_vnni"})
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    assert kvops.activations() == "int8"
    assert cpu_features.int8_dot_products() == "AVX-512 VNNI"


@pytest.mark.unit
def test_an_int8_copy_is_the_weight_alone() -> None:
    copy = _random_copy(np.random.default_rng(2), 64, 64, PackedFormat(4, 32))
    q, sm = copy.pack("int8")
    device = DeviceRef.CPU()
    w = kvops.pack_linear_weight(copy.dequantize())
    with Graph("both", input_types=[TensorType(DType.float32, [2, 64], device)]) as g:
        quantized = (
            Weight("q", DType.uint8, q.shape, device),
            Weight("sm", DType.float32, sm.shape, device),
        )
        packed = Weight("w", DType.float32, w.shape, device)
        with pytest.raises(ValueError, match="int8 copy is the weight alone"):
            kvops.linear_packed(g.inputs[0].tensor, packed, 64, quantized)


@pytest.mark.compile
def test_int8_matmul_is_the_quantized_rows_product(
    session: InferenceSession, kernels: Path
) -> None:
    """Every integer format's int8 copy, every register-block split, with and without
    the residual epilogue: each output within float32 rounding of NumPy's product of
    the documented int8 rows with the dequantized weights, and within the
    quantization's bound of the exact product.  Rows with a NaN give NaN; zero rows
    give zero.  Embedding rows are gathered from an int8 copy exactly."""
    device = DeviceRef.CPU()
    registry: dict[str, np.ndarray] = {}
    copies = []
    for i, fmt in enumerate(INTEGER_FORMATS):
        copy = _random_copy(np.random.default_rng(20 + i), _N, _k(fmt), fmt)
        registry[f"q{i}"], registry[f"sm{i}"] = copy.pack("int8")
        copies.append(copy)
    types = [
        TensorType(DType.float32, ["m", 608], device),
        TensorType(DType.float32, ["m", 768], device),
        TensorType(DType.float32, ["m", _N], device),
        TensorType(DType.int64, ["t"], device),
    ]
    with Graph("int8", input_types=types, custom_extensions=[kernels]) as g:
        plain, factored, residual, tokens = (v.tensor for v in g.inputs)
        outputs = []
        for i, fmt in enumerate(INTEGER_FORMATS):
            copy_weights = (
                Weight(f"q{i}", DType.uint8, registry[f"q{i}"].shape, device),
                Weight(f"sm{i}", DType.float32, registry[f"sm{i}"].shape, device),
            )
            x = factored if fmt.factored else plain
            outputs.append(kvops.linear_packed(x, None, _N, copy_weights))
            outputs.append(kvops.linear_packed(x, None, _N, copy_weights, residual=residual))
            outputs.append(kvops.gather_quantized(tokens, copy_weights, _N, _k(fmt)))
        g.output(*outputs)
    model = session.load(g, weights_registry=registry)
    rng = np.random.default_rng(7)
    ids = np.array([0, 199, 63, 64, 130, 5], np.int64)
    for m in (1, 2, 3, 4, 5, 8, 9, 13, 33):
        xs = [rng.standard_normal((m, k)).astype(np.float32) for k in (608, 768)]
        if m > 1:
            for x in xs:
                x[-1] = 0.0  # a zero row
                x[0, 40] = np.nan  # row 0's second block of 32 (of 16: its third)
        add = rng.standard_normal((m, _N)).astype(np.float32)
        got = [o.to_numpy() for o in model.execute(*map(Buffer.from_numpy, (*xs, add, ids)))]
        for i, (fmt, copy) in enumerate(zip(INTEGER_FORMATS, copies, strict=True)):
            y, y_added, rows = got[3 * i : 3 * i + 3]
            x = xs[1] if fmt.factored else xs[0]
            w = copy.dequantize().astype(np.float64)
            finite = np.isfinite(x).all(1)
            assert np.isnan(y[~finite]).all(), f"{fmt} M={m}: a NaN row must give NaN"
            x_q, d = quantized_rows(np.where(np.isfinite(x), x, 0), fmt.block)
            want = x_q @ w.T
            scale = np.abs(x_q) @ np.abs(w).T
            err = np.abs(y - want)[finite]
            assert np.all(err <= 1e-5 * scale[finite] + 1e-30), f"{fmt} M={m}: {err.max()}"
            # |x - x_q| <= d / 2 per value: the product is within sum |w| d / 2.
            bound = 0.5 * np.repeat(d, fmt.block, axis=1) @ np.abs(w).T
            exact = x.astype(np.float64) @ w.T
            assert np.all(np.abs(y - exact)[finite] <= (bound * 1.001 + 1e-5 * scale)[finite])
            if m > 1:
                np.testing.assert_array_equal(y[-1], 0.0)
            with np.errstate(invalid="ignore"):
                np.testing.assert_array_equal(y_added[finite], (add + y)[finite])
            np.testing.assert_array_equal(rows, copy.dequantize()[ids])


@pytest.mark.compile
def test_a_q4_k_m_model_in_int8_mode_is_close_to_transformers(
    tmp_path: Path, session: InferenceSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama in llama.cpp's Q4_K_M mix loaded with ``MAXKV_ACTIVATIONS=int8``:
    every held matrix is an int8 copy (no float32 matrix), and prompt and decode
    steps give logits within 2% of their largest of transformers' on the same
    file."""
    pytest.importorskip("torch")
    from max.driver import CPU

    from maxkv import ContinuousBatchingKVCacheManager
    from maxkv.models.decoder import DecoderModel, cache_params
    from maxkv.models.hf import hf_from_pretrained

    monkeypatch.setenv("MAXKV_ACTIVATIONS", "int8")
    config = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    kinds = {"attn_v": "Q6_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K"}
    overrides = {f"blk.{i}.{t}.weight": kind for t, kind in kinds.items() for i in range(2)}
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_llama_gguf(
        path, hf_weights(config, seed=4), config, matrix_type="Q4_K", overrides=overrides
    )
    loaded_config, loaded = load_model(path)
    manager = ContinuousBatchingKVCacheManager(
        cache_params(loaded_config), 1, 64, loaded_config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(loaded_config, loaded, manager, session, output="logits")
    assert model.activations == "int8"
    assert model.int8_matrices and set(model.int8_matrices) == set(model.quant_formats)
    assert "14 matrices held as integer blocks" in model.describe_arithmetic()
    for name, array in model._weights.items():
        is_tiles = array.dtype == np.float32 and array.ndim == 4 and not name.endswith(".sm")
        assert not is_tiles, f"{name} is float32 tiles"
    # A prompt (20 rows), then decode steps.
    assert_steps_give_transformers_logits(
        model, manager, hf_from_pretrained(path), (20, 1, 1), tolerance=0.02
    )
