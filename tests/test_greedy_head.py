"""The exact greedy head: the same tokens as every float32 logit's argmax.

References: maxkv's float32 ``linear_packed`` (itself checked against NumPy
in ``test_quantized``) followed by NumPy's argmax, compared token for token,
and NumPy's float64 product where the top two logits are clearly apart.  The
real model's greedy tokens against transformers run through this op in
``test_models`` / ``test_llama_demo`` (the fixture asserts it is on).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, Weight

from maxkv import ops as kvops
from maxkv.models.decoder import DecoderModel

pytestmark = pytest.mark.skipif(
    not kvops.greedy_head_supported(), reason="maxkv.greedy_head needs AVX-512 VNNI or AVX2"
)

_N, _K = 200, 64  # 4 tiles, the last one partly padding


def _head(rng: np.random.Generator) -> np.ndarray:
    """Rows of mixed scale, one outlier column, and two pairs of equal rows (exact ties)."""
    w = (rng.standard_normal((_N, _K)) * rng.uniform(0.02, 0.2, (_N, 1))).astype(np.float32)
    w[:, 7] *= 10
    w[10] = w[150] = rng.standard_normal(_K) * 2  # long rows: x along one makes it the max
    w[70] = w[71] = rng.standard_normal(_K) * 2
    return w


@pytest.fixture(scope="module")
def head_models(session: InferenceSession, kernels: Path) -> tuple[Model, Model, np.ndarray]:
    """(greedy_head, linear_packed logits, the head), any number of rows."""
    w = _head(np.random.default_rng(0))
    q, info = kvops.pack_greedy_head(w)
    registry = {"w": kvops.pack_linear_weight(w), "q": q, "info": info}
    device = DeviceRef.CPU()
    x_type = TensorType(DType.float32, ["m", _K], device)
    with Graph("greedy_head", input_types=[x_type], custom_extensions=[kernels]) as g:
        w_packed = Weight("w", DType.float32, registry["w"].shape, device)
        q_w = Weight("q", DType.uint8, q.shape, device)
        info_w = Weight("info", DType.float32, info.shape, device)
        g.output(kvops.greedy_head(g.inputs[0].tensor, w_packed, q_w, info_w, _N))
    greedy = session.load(g, weights_registry=registry)
    with Graph("head_logits", input_types=[x_type], custom_extensions=[kernels]) as g:
        w_packed = Weight("w", DType.float32, registry["w"].shape, device)
        g.output(kvops.linear_packed(g.inputs[0].tensor, w_packed, _N))
    logits = session.load(g, weights_registry={"w": registry["w"]})
    return greedy, logits, w


def _inputs(rng: np.random.Generator, w: np.ndarray) -> dict[str, np.ndarray]:
    m = 9
    flat = rng.standard_normal((m, _K)).astype(np.float32)  # near-uniform logits: many candidates
    peaked = (w[rng.integers(0, _N, m)] * 30 + rng.standard_normal((m, _K)) * 0.01).astype(
        np.float32
    )
    outliers = rng.standard_normal((m, _K)).astype(np.float32)
    outliers[:, 3] = 400  # one huge component, as real hidden states have
    tied = np.stack([w[10], w[70], w[10] * 3, w[70] * 0.5]).astype(np.float32)
    negative = -np.abs(rng.standard_normal((m, _K))).astype(np.float32)
    return {
        "flat": flat,
        "peaked": peaked,
        "outliers": outliers,
        "tied": tied,
        "negative": negative,
        "zeros": np.zeros((3, _K), np.float32),
        "one_row": flat[:1],
        "fourteen_rows": rng.standard_normal((14, _K)).astype(np.float32),
        "tiny": (flat * 1e-30).astype(np.float32),
    }


@pytest.mark.compile
def test_greedy_head_equals_the_argmax_of_every_float32_logit(
    head_models: tuple[Model, Model, np.ndarray],
) -> None:
    greedy, logits, w = head_models
    rng = np.random.default_rng(1)
    for case, x in _inputs(rng, w).items():
        got = greedy.execute(Buffer.from_numpy(np.ascontiguousarray(x)))[0].to_numpy()
        full = logits.execute(Buffer.from_numpy(np.ascontiguousarray(x)))[0].to_numpy()
        assert got.dtype == np.int64 and got.shape == (len(x),), case
        np.testing.assert_array_equal(got, np.argmax(full, axis=-1), err_msg=case)
        exact = x.astype(np.float64) @ w.T.astype(np.float64)
        top2 = np.sort(exact, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3 * np.abs(top2[:, 1]) + 1e-30
        np.testing.assert_array_equal(got[clear], np.argmax(exact, axis=-1)[clear], err_msg=case)
    ties = greedy.execute(Buffer.from_numpy(_inputs(rng, w)["tied"]))[0].to_numpy()
    assert list(ties) == [10, 70, 10, 70]  # first index of two equal rows


@pytest.mark.compile
def test_greedy_head_with_an_all_negative_head(session: InferenceSession, kernels: Path) -> None:
    """Every logit negative and a padded last tile: padding must never win or decide.

    The head is packed in the column blocks this host does not use by default,
    so the float32 recompute runs over both layouts (``head_models`` has the other).
    """
    rng = np.random.default_rng(2)
    w = np.abs(rng.standard_normal((_N, _K))).astype(np.float32)
    q, info = kvops.pack_greedy_head(w)
    other = next(b for b in kvops.BLOCK_COLS if b != kvops.packed_block_cols())
    packed = kvops.pack_linear_weight(w, other)
    device = DeviceRef.CPU()
    with Graph(
        "greedy_neg",
        input_types=[TensorType(DType.float32, [5, _K], device)],
        custom_extensions=[kernels],
    ) as g:
        out = kvops.greedy_head(
            g.inputs[0].tensor,
            Weight("w", DType.float32, packed.shape, device),
            Weight("q", DType.uint8, q.shape, device),
            Weight("info", DType.float32, info.shape, device),
            _N,
        )
        g.output(out)
    model = session.load(g, weights_registry={"w": packed, "q": q, "info": info})
    x = -np.abs(rng.standard_normal((5, _K))).astype(np.float32)
    got = model.execute(Buffer.from_numpy(x))[0].to_numpy()
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert (exact < 0).all()
    np.testing.assert_array_equal(got, np.argmax(exact, axis=-1))


@pytest.mark.unit
@pytest.mark.parametrize("layout", kvops.GREEDY_HEAD_LAYOUTS)
def test_pack_greedy_head_bounds_its_own_error(layout: kvops.GreedyHeadLayout) -> None:
    w = _head(np.random.default_rng(3))
    q, info = kvops.pack_greedy_head(w, layout)
    assert q.dtype == np.uint8 and q.ctypes.data % 64 == 0
    assert info.shape == (4, 256) and info.dtype == np.float32
    raw = q.view(np.int8)
    if layout == "vnni":  # tile, group of 4 columns, 4 x 16 rows, 4 bytes (VPDPBUSD)
        assert q.shape == (4, _K // 4, 256)
        ints = raw.reshape(4, _K // 4, 4, 16, 4).transpose(0, 2, 3, 1, 4).reshape(256, _K)
    else:  # tile, 4 blocks of 16 rows, pairs of columns, 16 rows x 2 (VPMADDWD)
        assert q.shape == (4, 2 * _K, 32)
        ints = raw.reshape(4, 4, _K // 2, 16, 2).transpose(0, 1, 3, 2, 4).reshape(256, _K)
    t = info[0, :_N].astype(np.float64)
    approx = t[:, None] * ints[:_N]
    assert np.abs(approx - w).max() <= t.max() / 2 * (1 + 1e-6)
    np.testing.assert_array_less(np.linalg.norm(w.astype(np.float64), axis=1), info[1, :_N])
    np.testing.assert_array_less(np.linalg.norm(w - approx, axis=1), info[2, :_N])
    np.testing.assert_array_equal(info[3, :_N], ints[:_N].sum(axis=1))
    assert (ints[_N:] == 0).all() and (info[1, _N:] == 1e30).all()
    with pytest.raises(ValueError, match="multiple of 4"):
        kvops.pack_greedy_head(np.ones((8, 6), np.float32), layout)
    with pytest.raises(ValueError, match="non-finite"):
        kvops.pack_greedy_head(np.full((8, 8), np.inf, np.float32), layout)
    with pytest.raises(ValueError, match="layout"):
        kvops.pack_greedy_head(w, "avx9")  # type: ignore[arg-type]


@pytest.mark.unit
def test_greedy_head_refuses_mismatched_inputs() -> None:
    device = DeviceRef.CPU()
    with Graph("bad_greedy", input_types=[TensorType(DType.float32, [2, _K], device)]) as g:
        x = g.inputs[0].tensor
        w = Weight("w", DType.float32, (4, 1, _K, 64), device)
        q = Weight("q", DType.uint8, (4, _K // 4, 256), device)
        info = Weight("info", DType.float32, (4, 256), device)
        with pytest.raises(ValueError, match="does not match"):
            kvops.greedy_head(x, w, q, info, 300)
        with pytest.raises(ValueError, match="does not match"):
            kvops.greedy_head(x, w, Weight("q2", DType.uint8, (4, _K, 64), device), info, _N)
        with pytest.raises(ValueError, match="dtype uint8"):
            kvops.greedy_head(x, w, Weight("q3", DType.int8, q.shape, device), info, _N)
        with pytest.raises(ValueError, match="must be >= 1"):
            kvops.greedy_head(x, w, q, info, 0)


@pytest.mark.model
def test_a_head_held_as_blocks_is_read_as_blocks(smollm2_llama: DecoderModel) -> None:
    """SmolLM2's GGUF holds its tied head as Q8_0 blocks: the model's tokens are
    the argmax of logits read from them, with no float32 head kept for the
    greedy head's exact pass (which decodes dense checkpoints' heads), and the
    embedding gathered from the same blocks (no table of its own)."""
    assert not smollm2_llama.greedy_head
    assert "lm_head" in smollm2_llama.quant_formats
    assert "embed_tokens" not in smollm2_llama.quant_formats
    assert not {"lm_head", "embed_tokens", "embed_tokens.q"} & set(smollm2_llama._weights)
