"""Writes into an encoded cache, bit for bit against NumPy quantizing the same way,
and the device copies (fork, copy-on-write) over encoded rows.

``write_kv_ragged`` (CacheBlend's store) encodes float32 keys and values on the
way in; what a cache of each encoding holds afterwards must be exactly what
:func:`tests.reference.encode_rows` (int8, float8 through torch's conversion,
int4), written from the definitions, or NumPy's own rounding (float16,
bfloat16: nearest, ties to even) makes of the same float32 values, ties included.
Attention over encoded caches: ``test_attention.test_float32_model_over_a_narrower_cache``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType

import maxkv
from maxkv import KVCacheParams, PagedKVCacheManager

from .reference import (
    QUANTIZED_ENCODINGS,
    decode_rows,
    encode_rows,
    quantize_int4,
    quantize_int8,
    rotate,
)

pytestmark = pytest.mark.compile

HEADS, HEAD_DIM, LAYERS, PAGE = 2, 32, 2, 4  # int4: one group of 32 values a head
WIDTH = HEADS * HEAD_DIM


def params(encoding: str) -> KVCacheParams:
    return KVCacheParams(DType.float32, HEADS, HEAD_DIM, cache_dtype=encoding)  # type: ignore[arg-type]


def manager(encoding: str, session: InferenceSession) -> PagedKVCacheManager:
    return PagedKVCacheManager(params(encoding), PAGE, 16, 4, 32, LAYERS, [CPU()], session)


_models: dict[str, Model] = {}


def write_model(m: PagedKVCacheManager, kernels: Path) -> Model:
    """keys, values -> ``write_kv_ragged`` into every layer (layer l gets keys + l)."""
    encoding = m.params.encoding
    if encoding not in _models:
        ref = DeviceRef.CPU()
        types = [
            *m.input_symbols()[0],
            TensorType(DType.float32, ["tokens", WIDTH], ref),
            TensorType(DType.float32, ["tokens", WIDTH], ref),
            TensorType(DType.uint32, ["offsets"], ref),
        ]
        with Graph(f"write_{encoding}", input_types=types, custom_extensions=[kernels]) as g:
            *cache, keys, values, offsets = (v.tensor for v in g.inputs)
            kv = m.collection_fetcher()(*cache)
            for layer in range(LAYERS):
                out = maxkv.ops.write_kv_ragged(m.params, keys + layer, values, offsets, kv, layer)
            g.output(out)
        _models[encoding] = m.session.load(g)
    return _models[encoding]


def expected_rows(values: np.ndarray, encoding: str) -> np.ndarray:
    """What a cache of ``encoding`` stores of float32 ``values`` ``[..., HEAD_DIM]``
    (quantized: bytes; bfloat16: bits)."""
    values = values.astype(np.float32)
    if encoding in QUANTIZED_ENCODINGS:
        return encode_rows(values, encoding)
    if encoding == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return values.astype(np.float16)


def stored(m: PagedKVCacheManager, seq: int, n: int) -> np.ndarray:
    """``[n, 2, layers, heads, head_width]`` rows of ``seq`` as stored (quantized:
    bytes; bfloat16: bits)."""
    buffer = m.fetch([seq])[0][0]
    if buffer.dtype == DType.bfloat16:
        buffer = buffer.view(DType.uint16)
    pages = buffer.to_numpy()
    if m.params.quantized:
        pages = np.ascontiguousarray(pages).view(np.uint8)
    return np.stack([pages[m.pages(seq)[t // PAGE], :, :, t % PAGE] for t in range(n)])


def rows_with_ties(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Random rows, an all-zero row, and rows whose values, once rotated
    (:func:`tests.reference.rotate`: a quantized encoding quantizes ``H x``), sit
    exactly halfway between two steps of an encoding:

    - row 1, int8: scale 0.125 (max 15.875 = 127 x 0.125), values k x 0.0625, k odd;
    - row 3, int4: scale -0.5 (the largest magnitude 4 = -8 x -0.5), values
      k x 0.25, k odd;
    - row 4, float8: scale 0.125 (max 56 = 448 x 0.125), values halfway between
      two float8 E4M3 numbers (normal and subnormal) times 0.125.

    Such a row is stored as ``H t / n`` for the halfway values ``t``: every sum
    of these short binary fractions is exact in float32, so ``H`` of it is ``t``
    again, bit for bit.
    """
    rows = rng.standard_normal((tokens, HEADS, HEAD_DIM)).astype(np.float32) * 3
    index = np.arange(HEADS * HEAD_DIM).reshape(HEADS, HEAD_DIM)
    halfway = np.zeros((5, HEADS, HEAD_DIM), np.float32)
    halfway[1] = (index % 9 * 2 - 7) * 0.0625
    halfway[1, :, 0] = 15.875
    halfway[3] = (index % 15 * 2 - 15) * 0.25
    halfway[3, :, 0] = 4
    mantissa = 1 + (2 * (index % 8) + 1) / 16  # halfway between two of [1, 2)'s steps
    exponent = index % 5 - 2  # 2^-2 .. 2^2: a sum of 32 stays exact
    between = np.where(index % 5 == 0, (index % 8 * 2 + 1) * 2.0**-10, mantissa * 2.0**exponent)
    halfway[4] = np.where(index % 2 == 0, between, -between) * 0.125
    halfway[4, :, 0] = 56
    for row in (1, 3, 4):
        rows[row] = rotate(halfway[row]) / HEAD_DIM
        assert np.array_equal(rotate(rows[row]), halfway[row])  # exact both ways
    rows[2] = 0
    return rows


@pytest.mark.parametrize(
    "encoding",
    [
        *QUANTIZED_ENCODINGS,
        # A bfloat16 cache is checked under attention: tests/test_attention.py.
        pytest.param("bfloat16", marks=pytest.mark.sweep),
        pytest.param("float16", marks=pytest.mark.sweep),
    ],
)
def test_writes_encode_exactly_as_numpy(
    encoding: str, session: InferenceSession, kernels: Path
) -> None:
    m = manager(encoding, session)
    model = write_model(m, kernels)
    rng = np.random.default_rng(3)
    (seq,) = m.claim(1)
    keys, values = rows_with_ties(rng, 6), rows_with_ties(rng, 6)[::-1].copy()
    (inputs,) = m.fetch([seq], active_lengths=[6])
    model.execute(
        *inputs,
        Buffer.from_numpy(keys.reshape(6, WIDTH)),
        Buffer.from_numpy(values.reshape(6, WIDTH)),
        Buffer.from_numpy(np.array([0, 6], dtype=np.uint32)),
    )
    m.step({seq: 6})
    got = stored(m, seq, 6)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(got[:, 0, layer], expected_rows(keys + layer, encoding))
        np.testing.assert_array_equal(got[:, 1, layer], expected_rows(values, encoding))
    if encoding == "int8":
        q, scale = quantize_int8(rotate(keys[1]))
        assert scale[0] == np.float16(0.125) and (q[0, 1:] % 2 == 0).all()  # ties went to even
    if encoding == "int4":
        q, scale = quantize_int4(rotate(keys[3]))
        assert scale[0, 0] == np.float16(-0.5)
        assert ((q[0, 1:] % 2 == 0) | (q[0, 1:] == 7)).all()  # ties to even (8 clamped to 7)
    if encoding in QUANTIZED_ENCODINGS:  # the zero row: scale 0 (int4: -0), q 0
        assert not decode_rows(got[2, 0, 0], encoding).any()


@pytest.mark.parametrize(
    "encoding",
    [e if e == "int8" else pytest.param(e, marks=pytest.mark.sweep) for e in QUANTIZED_ENCODINGS],
)
def test_fork_copies_quantized_rows_with_their_scales(
    encoding: str, session: InferenceSession, kernels: Path
) -> None:
    """A fork mid-page copies the parent's partial page (``copy_tokens``) row for row,
    scales included; then each sequence writes its own next token."""
    m = manager(encoding, session)
    model = write_model(m, kernels)
    rng = np.random.default_rng(4)
    (parent,) = m.claim(1)
    rows = rng.standard_normal((10, WIDTH)).astype(np.float32)
    (inputs,) = m.fetch([parent], active_lengths=[10])
    offsets = Buffer.from_numpy(np.array([0, 10], dtype=np.uint32))
    model.execute(*inputs, Buffer.from_numpy(rows), Buffer.from_numpy(rows), offsets)
    m.step({parent: 10})
    child = m.fork(parent)
    assert m.pages(child)[:2] == m.pages(parent)[:2] and m.pages(child)[2] != m.pages(parent)[2]
    np.testing.assert_array_equal(stored(m, child, 10), stored(m, parent, 10))
    for seq, seed in ((parent, 5), (child, 6)):
        row = np.random.default_rng(seed).standard_normal((1, WIDTH)).astype(np.float32)
        (inputs,) = m.fetch([seq], active_lengths=[1])
        one = Buffer.from_numpy(np.array([0, 1], dtype=np.uint32))
        model.execute(*inputs, Buffer.from_numpy(row), Buffer.from_numpy(row), one)
        m.step({seq: 1})
        got = stored(m, seq, 11)
        np.testing.assert_array_equal(
            got[10, 1, 0], expected_rows(row.reshape(HEADS, HEAD_DIM), encoding)
        )
    assert not np.array_equal(stored(m, parent, 11)[10], stored(m, child, 11)[10])
    np.testing.assert_array_equal(stored(m, parent, 10), stored(m, child, 10))
