"""Fused QKV matmul, RoPE and flash attention over the collection, against NumPy.

Three graphs are compiled once per session (about 90 s each on two cores):
f32 GQA with half-split RoPE (plus a no-mask output), f32 MHA with
interleaved RoPE, and bf16 GQA.  ``layer_idx`` is a graph input, so one graph
serves every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue

from maxkv import (
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    KVCacheParams,
)
from maxkv import ops as kvops
from maxkv.cache.protocol import KVCacheManagerBase
from maxkv.graph import KVCacheCollection

from .reference import (
    ReferenceLayerCache,
    decode_rows,
    encode_rows,
    rotate,
)

pytestmark = pytest.mark.compile


CPU_REF = DeviceRef.CPU()
THETA = 10000.0
MAX_POSITIONS = 512


@dataclass(frozen=True)
class AttentionConfig:
    dtype: DType
    n_heads: int
    n_kv_heads: int
    head_dim: int
    interleaved: bool
    with_null_mask: bool = False
    #: Also outputs the causal attention limited to this many tokens (after
    #: the no-mask output, which the config then must have).
    window: int | None = None
    #: The CPU model's path: a plain matmul, then ``store_kv_ragged`` with
    #: ``freqs_cis`` (store and rotate in one op); outputs Q only, and the
    #: RoPE table's rows are a dimension of the graph.
    store_rope: bool = False
    hidden: int = 32
    num_layers: int = 2
    slots: int = 6
    max_seq_len: int = 32
    #: The cache encoding (``None``: the compute dtype).
    cache_dtype: DType | str | None = None

    @property
    def params(self) -> KVCacheParams:
        return KVCacheParams(
            self.dtype,
            self.n_kv_heads,
            self.head_dim,
            cache_dtype=self.cache_dtype,  # type: ignore[arg-type]
        )

    def manager(self, session: InferenceSession) -> ContinuousBatchingKVCacheManager:
        return ContinuousBatchingKVCacheManager(
            self.params, self.slots, self.max_seq_len, self.num_layers, [CPU()], session
        )


GQA_F32 = AttentionConfig(DType.float32, 4, 2, 16, interleaved=False, with_null_mask=True)
GQA_F32_WINDOW = AttentionConfig(
    DType.float32, 4, 2, 16, interleaved=False, with_null_mask=True, window=128, max_seq_len=320
)
MHA_F32 = AttentionConfig(DType.float32, 2, 2, 32, interleaved=True)
GQA_BF16 = AttentionConfig(DType.bfloat16, 4, 2, 16, interleaved=False)
GQA_F32_STORE_ROPE = AttentionConfig(DType.float32, 4, 2, 16, interleaved=False, store_rope=True)
# A float32 model over a bfloat16 / float16 cache: stored (and rotated) by
# maxkv's store op, attended by maxkv's CPU kernel (causal and no mask).
GQA_F32_CACHE_BF16 = AttentionConfig(
    DType.float32,
    4,
    2,
    16,
    interleaved=False,
    store_rope=True,
    cache_dtype=DType.bfloat16,
    window=128,
    max_seq_len=320,
)
GQA_F32_CACHE_INT8 = replace(GQA_F32_CACHE_BF16, cache_dtype=DType.int8)
GQA_F32_CACHE_FLOAT8 = replace(GQA_F32_CACHE_BF16, cache_dtype="float8_e4m3fn")
# int4 keeps a scale per 32 values: a head of 32.
GQA_F32_CACHE_INT4 = replace(GQA_F32_CACHE_BF16, head_dim=32, cache_dtype="int4")
MHA_F32_STORE_ROPE_CACHE_F16 = AttentionConfig(
    DType.float32, 2, 2, 32, interleaved=True, store_rope=True, cache_dtype=DType.float16
)
MHA_F32_STORE_ROPE = AttentionConfig(DType.float32, 2, 2, 32, interleaved=True, store_rope=True)


def layer_input_types(config: AttentionConfig) -> list[TensorType]:
    qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    return [
        TensorType(config.dtype, ["total_tokens", config.hidden], CPU_REF),
        TensorType(DType.uint32, ["row_offsets_len"], CPU_REF),
        TensorType(config.dtype, [qkv_rows, config.hidden], CPU_REF),
        TensorType(
            DType.float32,
            ["positions" if config.store_rope else MAX_POSITIONS, config.head_dim],
            CPU_REF,
        ),
        TensorType(DType.uint32, [], CPU_REF),
    ]


def build_layer_graph(
    config: AttentionConfig,
    session: InferenceSession,
    kernels: Path,
    manager: KVCacheManagerBase | None = None,
) -> Model:
    """cache inputs + (x, row offsets, wqkv, freqs, layer) -> (Q rotated, attention[, no-mask]).

    ``manager`` gives the cache inputs and the collection (default: contiguous).
    """
    params = config.params
    manager = manager or config.manager(session)
    symbols = [*manager.input_symbols()[0], *layer_input_types(config)]
    with Graph("layer", input_types=symbols, custom_extensions=[kernels]) as graph:
        blocks, lengths, lookup, max_lengths, x, offsets, wqkv, freqs, layer = (
            value.tensor for value in graph.inputs
        )
        kv = manager.collection_fetcher()(blocks, lengths, lookup, max_lengths)
        if config.store_rope:
            q = kvops.store_kv_ragged(
                params,
                x @ wqkv.T,
                offsets,
                kv,
                layer,
                freqs_cis=freqs,
                interleaved=config.interleaved,
            )
            q = q.reshape(["total_tokens", config.n_heads, config.head_dim])
            outputs = [q]
            if config.cache_dtype is not None:  # attention over the encoded cache too
                outputs.append(kvops.flash_attention_ragged(params, q, offsets, kv, layer))
                outputs.append(
                    kvops.flash_attention_ragged(params, q, offsets, kv, layer, mask_variant="null")
                )
                if config.window:
                    outputs.append(
                        kvops.flash_attention_ragged(
                            params, q, offsets, kv, layer, window=config.window
                        )
                    )
            graph.output(*outputs)
            return session.load(graph)
        q = kvops.fused_qkv_ragged_matmul(params, x, offsets, wqkv, kv, layer)
        q = q.reshape(["total_tokens", config.n_heads, config.head_dim])
        q = kvops.fused_qk_ragged_rope(
            params, q, offsets, kv, freqs, layer, interleaved=config.interleaved
        )
        outputs = [q, kvops.flash_attention_ragged(params, q, offsets, kv, layer)]
        if config.with_null_mask:
            outputs.append(
                kvops.flash_attention_ragged(params, q, offsets, kv, layer, mask_variant="null")
            )
        if config.window:
            outputs.append(
                kvops.flash_attention_ragged(params, q, offsets, kv, layer, window=config.window)
            )
        graph.output(*outputs)
    return session.load(graph)


_models: dict[AttentionConfig, Model] = {}


@pytest.fixture(scope="session")
def layer_model(session: InferenceSession, kernels: Path) -> Callable[[AttentionConfig], Model]:
    def get(config: AttentionConfig) -> Model:
        if config not in _models:
            _models[config] = build_layer_graph(config, session, kernels)
        return _models[config]

    return get


def as_numpy(buffer: Buffer) -> np.ndarray:
    """float32 copy of a buffer (bf16 buffers are widened through a graph-free view)."""
    if buffer.dtype == DType.bfloat16:
        raw = buffer.view(DType.uint16).to_numpy().astype(np.uint32) << 16
        return raw.view(np.float32)
    return buffer.to_numpy().astype(np.float32)


def encode(array: np.ndarray, params: KVCacheParams) -> np.ndarray:
    """What a cache of ``params``' encoding keeps of float64 values computed in
    float32: rounded to float32, then to the encoding (nearest, ties to even;
    quantized head rows as :func:`tests.reference.encode_rows`), as float64."""
    single = np.asarray(array, dtype=np.float32)
    dtype = params.cache_dtype
    if params.quantized:
        return decode_rows(encode_rows(single, params.encoding), params.encoding)
    if dtype == DType.bfloat16:
        bits = single.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    if dtype == DType.float16:
        return single.astype(np.float16).astype(np.float64)
    return single.astype(np.float64)


def decoded(blocks: Buffer, params: KVCacheParams) -> np.ndarray:
    """A cache buffer's values as float64 (quantized head rows decoded with their scales)."""
    if params.quantized:
        return decode_rows(blocks.to_numpy(), params.encoding)
    return as_numpy(blocks).astype(np.float64)


def to_buffer(array: np.ndarray, dtype: DType) -> Buffer:
    if dtype == DType.bfloat16:
        bits = (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) + 0x8000) >> 16
        return Buffer.from_numpy(bits.astype(np.uint16)).view(DType.bfloat16)
    return Buffer.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def round_to(array: np.ndarray, dtype: DType) -> np.ndarray:
    """The values ``to_buffer`` stores, as float64 (bf16 rounding applied)."""
    return as_numpy(to_buffer(array, dtype)).astype(np.float64)


class LayerHarness:
    """Runs layer steps through maxkv and through the NumPy reference side by side."""

    def __init__(
        self, config: AttentionConfig, model: Model, session: InferenceSession, seed: int = 0
    ) -> None:
        self.config = config
        self.model = model
        self.manager = config.manager(session)
        self.reference = ReferenceLayerCache()
        self.rng = np.random.default_rng(seed)
        qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = [
            round_to(self.rng.standard_normal((qkv_rows, config.hidden)) * 0.25, config.dtype)
            for _ in range(config.num_layers)
        ]
        self.freqs = kvops.rope_freqs_cis(config.head_dim, MAX_POSITIONS, THETA)

    def run(
        self, layer: int, seqs: list[int], new_tokens: list[int]
    ) -> tuple[list[np.ndarray], tuple[np.ndarray, ...]]:
        cfg = self.config
        x = round_to(self.rng.standard_normal((sum(new_tokens), cfg.hidden)), cfg.dtype)
        offsets = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32)
        (inputs,) = self.manager.fetch(seqs, active_lengths=new_tokens)
        outputs = self.model.execute(
            *inputs,
            to_buffer(x, cfg.dtype),
            Buffer.from_numpy(offsets),
            to_buffer(self.wqkv[layer], cfg.dtype),
            Buffer.from_numpy(self.freqs),
            Buffer.from_numpy(np.array(layer, dtype=np.uint32)),
        )
        expected = self.reference.step(
            layer,
            seqs,
            x,
            new_tokens,
            self.wqkv[layer],
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            THETA,
            cfg.interleaved,
            cfg.window,
            store=None if cfg.cache_dtype is None else lambda a: encode(a, cfg.params),
        )
        return [as_numpy(o) for o in outputs], expected

    def blocks(self) -> np.ndarray:
        return as_numpy(self.manager.fetch([next(iter(self.manager.cache_lengths))])[0][0])

    def check_cache(self, atol: float) -> float:
        """Compares every (slot, layer) the reference knows; other slots must stay zero."""
        blocks = self.blocks()
        worst = 0.0
        touched = np.zeros(blocks.shape[:1] + blocks.shape[2:3], dtype=bool)
        for (seq, layer), keys in self.reference.k.items():
            n = keys.shape[0]
            for kv, expected in ((0, keys), (1, self.reference.v[(seq, layer)])):
                error = np.abs(blocks[seq, kv, layer, :n] - expected).max()
                worst = max(worst, float(error))
                assert error <= atol, (seq, layer, kv, error)
            assert not blocks[seq, :, layer, n:].any(), "bytes past the cache length changed"
            touched[seq, layer] = True
        for seq, layer in zip(*np.nonzero(~touched), strict=True):
            assert not blocks[seq, :, layer].any(), f"slot {seq} layer {layer} changed"
        return worst


def check(
    actual: list[np.ndarray], expected: tuple[np.ndarray, ...], atol: float, rtol: float = 0.0
) -> None:
    for got, want in zip(actual, expected, strict=False):
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


F32_ATOL = 1e-4


@pytest.mark.parametrize(
    "config",
    [GQA_F32, pytest.param(GQA_F32_WINDOW, marks=pytest.mark.sweep)],
    ids=["full", "window128"],
)
def test_gqa_prefill_decode_mixed_over_two_layers(
    layer_model: Callable[[AttentionConfig], Model],
    session: InferenceSession,
    config: AttentionConfig,
) -> None:
    """Causal, no-mask and (``window128``) sliding-window attention: prompts longer
    than the window, decode steps (maxkv's CPU decode kernel) and mixed steps
    (MAX's generic kernel) against NumPy."""
    harness = LayerHarness(config, layer_model(config), session)
    manager = harness.manager
    manager.claim(6)
    seqs = [3, 0, 5]  # non-contiguous, out of order

    # Ragged prefill [n, 9, 1], layer 0 only: layer 1 must stay untouched
    # (n = 150 is past the window).
    n = 150 if config.window else 20
    actual, expected = harness.run(0, seqs, [n, 9, 1])
    assert len(actual) == 3 + bool(config.window)
    check(actual, expected, F32_ATOL)
    harness.check_cache(F32_ATOL)
    actual, expected = harness.run(1, seqs, [n, 9, 1])
    check(actual, expected, F32_ATOL)
    harness.check_cache(F32_ATOL)
    manager.step({3: n, 0: 9, 5: 1})

    # A decode step on top of it: one token each, positions n, 9 and 1.
    for layer in (0, 1):
        actual, expected = harness.run(layer, seqs, [1, 1, 1])
        check(actual, expected, F32_ATOL)
    manager.step({3: 1, 0: 1, 5: 1})

    # A mixed step: seq 2 joins with a 4-token prompt while the others decode.
    mixed = [5, 2, 3, 0]
    for layer in (1, 0):
        actual, expected = harness.run(layer, mixed, [1, 4, 1, 1])
        check(actual, expected, F32_ATOL)
    worst = harness.check_cache(F32_ATOL)
    assert worst < F32_ATOL


@pytest.mark.sweep  # interleaved RoPE: none of the five families uses it
def test_mha_interleaved_rope_at_nonzero_positions(
    layer_model: Callable[[AttentionConfig], Model], session: InferenceSession
) -> None:
    harness = LayerHarness(MHA_F32, layer_model(MHA_F32), session, seed=1)
    harness.manager.claim(4)
    seqs = [2, 1]
    actual, expected = harness.run(0, seqs, [3, 7])
    check(actual, expected, F32_ATOL)
    harness.manager.step({2: 3, 1: 7})
    for _ in range(2):  # positions 3.. and 7..: RoPE starts at the cache length
        actual, expected = harness.run(0, seqs, [2, 1])
        check(actual, expected, F32_ATOL)
        harness.manager.step({2: 2, 1: 1})
    harness.check_cache(F32_ATOL)


@pytest.mark.parametrize(
    "config",
    [GQA_F32_STORE_ROPE, pytest.param(MHA_F32_STORE_ROPE, marks=pytest.mark.sweep)],
    ids=["half", "pairs"],
)
def test_store_kv_with_rope_matches_reference(
    layer_model: Callable[[AttentionConfig], Model],
    session: InferenceSession,
    config: AttentionConfig,
) -> None:
    """``store_kv_ragged(freqs_cis=...)``: Q and the cached K rotated at their positions,
    V stored as is, nothing else touched; ragged prefill, decode and a mixed step."""
    harness = LayerHarness(config, layer_model(config), session, seed=4)
    harness.manager.claim(6)
    seqs = [4, 1, 3]
    for layer in (1, 0):
        actual, expected = harness.run(layer, seqs, [6, 1, 11])
        assert len(actual) == 1
        check(actual, expected, F32_ATOL)
    harness.manager.step({4: 6, 1: 1, 3: 11})
    for new_tokens in ([1, 1, 1], [2, 7, 1]):
        actual, expected = harness.run(0, seqs, new_tokens)
        check(actual, expected, F32_ATOL)
        harness.manager.step(dict(zip(seqs, new_tokens, strict=True)))
    harness.check_cache(F32_ATOL)


def test_store_kv_with_rope_refuses_positions_past_the_table(
    layer_model: Callable[[AttentionConfig], Model], session: InferenceSession
) -> None:
    config = GQA_F32_STORE_ROPE
    harness = LayerHarness(config, layer_model(config), session, seed=5)
    harness.manager.claim(2)
    harness.run(0, [0, 1], [2, 3])
    harness.manager.step({0: 2, 1: 3})
    before = harness.blocks()
    (inputs,) = harness.manager.fetch([0, 1], active_lengths=[1, 2])
    with pytest.raises(Exception, match="sequence 1 reaches position 4; freqs_cis has 4 positions"):
        harness.model.execute(
            *inputs,
            Buffer.from_numpy(np.ones((3, config.hidden), dtype=np.float32)),
            Buffer.from_numpy(np.array([0, 1, 3], dtype=np.uint32)),
            Buffer.from_numpy(harness.wqkv[0].astype(np.float32)),
            Buffer.from_numpy(np.ascontiguousarray(harness.freqs[:4])),
            Buffer.from_numpy(np.array(0, dtype=np.uint32)),
        )
    np.testing.assert_array_equal(harness.blocks(), before)


# bf16 keeps 8 significant bits: every rounding is within 2**-9 relative.  Q, K
# and V are rounded once to bf16 (the cache dtype) after the projection, the
# rotation and the output once more, and MAX's CPU kernels accumulate in
# float32.  With |values| of a few units that is a few 1e-2 absolute; the
# observed worst case is printed by the test.
BF16_ATOL, BF16_RTOL = 6e-2, 2e-2


@pytest.mark.sweep  # a bfloat16 model: tests/test_bfloat16.py
def test_bf16_gqa_prefill_then_decode(
    layer_model: Callable[[AttentionConfig], Model], session: InferenceSession
) -> None:
    harness = LayerHarness(GQA_BF16, layer_model(GQA_BF16), session, seed=2)
    harness.manager.claim(3)
    seqs = [1, 2]
    worst = 0.0
    for new_tokens in ([6, 2], [1, 1]):
        actual, expected = harness.run(1, seqs, new_tokens)
        for got, want in zip(actual, expected, strict=False):
            worst = max(worst, float(np.abs(got - want).max()))
        check(actual, expected, BF16_ATOL, BF16_RTOL)
        harness.manager.step(dict(zip(seqs, new_tokens, strict=True)))
    harness.check_cache(BF16_ATOL)
    print(f"bf16 worst abs error vs float64 reference: {worst:.3g}")


# The cache keeps K and V rounded to its encoding (the reference rounds them the
# same way); Q, the weights and the arithmetic stay float32, so what is left is
# float32 error and, rarely, a K that float32 and float64 round to neighbouring
# bf16/f16 values (one unit in the last place: 2**-8 / 2**-11 relative).
# Quantized: a value float32 and float64 put on either side of a rounding
# boundary is one quantization step apart (int8: max|row| / 127; float8: an
# eighth of the value; int4: max|group| / 8).  The rows are rotated first, and a
# rotated value sums 32 of them, so float32 and float64 part at a boundary more
# often than for one value (int8 measured 0.027 on AVX-512 with this seed).
CACHE_ATOL = {"bfloat16": 2e-2, "float16": 3e-3, "int8": 5e-2, "float8_e4m3fn": 5e-2, "int4": 5e-2}


def quantization_step(expected: np.ndarray, params: KVCacheParams) -> np.ndarray:
    """Per value of head rows ``expected``, the most its stored value may differ:
    one step of the encoding (1% over, for the scale's float16 rounding).  A
    quantized encoding quantizes the rotated row ``H x`` (:func:`tests.reference.rotate`)
    and stores ``H q / n``: an error of one step in one rotated value moves every
    value by ``step / n``; the bound takes the row's largest step."""
    if not params.quantized:  # bfloat16, float16: one unit in the last place, <= 2^-7 of it
        bound: np.ndarray = np.abs(expected) * 2**-7 * 1.01 + 1e-6
        return bound
    magnitude = np.abs(rotate(expected))
    if params.encoding == "int8":
        step = magnitude.max(axis=-1, keepdims=True) / 127
    elif params.encoding == "float8_e4m3fn":  # an eighth of the value
        step = magnitude.max(axis=-1, keepdims=True) / 8
    else:  # int4: the group's largest magnitude / 8
        groups = magnitude.reshape(*magnitude.shape[:-1], -1, 32)
        step = groups.max(axis=(-2, -1))[..., None] / 8
    bound = step * 1.01 + 1e-6
    return bound


@pytest.mark.parametrize(
    "config",
    [
        GQA_F32_CACHE_BF16,
        pytest.param(MHA_F32_STORE_ROPE_CACHE_F16, marks=pytest.mark.sweep),
        # Their writes are checked exactly in tests/test_quantized_kv.py.
        pytest.param(GQA_F32_CACHE_INT8, marks=pytest.mark.sweep),
        pytest.param(GQA_F32_CACHE_FLOAT8, marks=pytest.mark.sweep),
        pytest.param(GQA_F32_CACHE_INT4, marks=pytest.mark.sweep),
    ],
    ids=["bf16-gqa", "f16-mha", "int8-gqa", "float8-gqa", "int4-gqa"],
)
def test_float32_model_over_a_narrower_cache(
    layer_model: Callable[[AttentionConfig], Model],
    session: InferenceSession,
    config: AttentionConfig,
) -> None:
    """A float32 model over a bfloat16, float16, int8, float8 or int4 cache: the
    cache holds K and V rounded to its encoding (quantized ones as
    :func:`tests.reference.encode_rows` encodes them), and prefill, decode and
    mixed steps (causal, no mask and, where the config has one, a sliding window)
    attend over exactly those values."""
    assert config.cache_dtype is not None
    harness = LayerHarness(config, layer_model(config), session, seed=6)
    manager = harness.manager
    manager.claim(4)
    seqs = [2, 0, 3]
    assert manager.fetch(seqs)[0][0].dtype == config.params.cache_dtype
    atol = CACHE_ATOL[config.params.encoding]
    worst = 0.0
    prompt = 150 if config.window else 13  # past the window
    for new_tokens in ([prompt, 5, 1], [1, 1, 1], [1, 4, 2]):
        for layer in (0, 1):
            actual, expected = harness.run(layer, seqs, new_tokens)
            for got, want in zip(actual, expected, strict=False):
                worst = max(worst, float(np.abs(got - want).max()))
            check(actual, expected, atol)
        manager.step(dict(zip(seqs, new_tokens, strict=True)))
    # The cache holds the encoding's values of the reference's K and V (one rounding
    # step apart where float32 and float64 round differently).
    blocks = decoded(manager.fetch(seqs)[0][0], config.params)
    for (seq, layer), keys in harness.reference.k.items():
        n = keys.shape[0]
        for kv, expected in ((0, keys), (1, harness.reference.v[(seq, layer)])):
            bound = quantization_step(expected, config.params)
            assert (np.abs(blocks[seq, kv, layer, :n] - expected) <= bound).all()
    print(f"{config.params.encoding} cache: worst abs error vs float64 reference {worst:.3g}")


# ------------------------------------------------------------- kernel guards


def test_kernels_reject_forged_lengths_and_layers(
    layer_model: Callable[[AttentionConfig], Model], session: InferenceSession
) -> None:
    """Tensors built by hand, not by the manager: the ops raise and write nothing."""
    config = GQA_F32
    model = layer_model(config)
    harness = LayerHarness(config, model, session, seed=3)
    harness.manager.claim(2)
    harness.run(0, [0, 1], [2, 3])
    before = harness.blocks()
    blocks = harness.manager.fetch([0])[0][0]

    def execute(lengths: list[int], offsets: list[int], layer: int) -> None:
        tokens = offsets[-1]
        model.execute(
            blocks,
            Buffer.from_numpy(np.array(lengths, dtype=np.uint32)),
            Buffer.from_numpy(np.array([0, 1], dtype=np.uint32)),
            Buffer.from_numpy(np.array([[1, max(lengths)]], dtype=np.uint32)),
            Buffer.from_numpy(np.ones((tokens, config.hidden), dtype=np.float32)),
            Buffer.from_numpy(np.array(offsets, dtype=np.uint32)),
            Buffer.from_numpy(harness.wqkv[0].astype(np.float32)),
            Buffer.from_numpy(harness.freqs),
            Buffer.from_numpy(np.array(layer, dtype=np.uint32)),
        )

    # max_lengths claims one new token, but sequence 1 brings 5 at length 30 of 32.
    with pytest.raises(Exception, match="past max_seq_len 32"):
        execute([2, 30], [0, 1, 6], 0)
    with pytest.raises(Exception, match="layer_idx 2 is out of range"):
        execute([2, 3], [0, 1, 2], 2)
    with pytest.raises(Exception, match="must run from 0"):
        execute([2, 3], [1, 1, 2], 0)
    np.testing.assert_array_equal(harness.blocks(), before)


# ------------------------------------------------------- graph-build checks


@pytest.fixture
def graph_values(kernels: Path) -> Callable[..., object]:
    """Builds a graph with GQA_F32's inputs and hands the values to ``body``."""

    def run(body: Callable[..., object]) -> object:
        config = GQA_F32
        symbols = [
            *config.manager(InferenceSession(devices=[CPU()])).input_symbols()[0],
            *layer_input_types(config),
        ]
        with Graph("checks", input_types=symbols, custom_extensions=[kernels]) as graph:
            values = [v.tensor for v in graph.inputs]
            kv = FetchContinuousBatchingKVCacheCollection(config.params)(*values[:4])
            return body(config.params, kv, *values[4:])

    return run


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(
                p, x.cast(DType.bfloat16), o, w, kv, 0
            ),
            ValueError,
            "input must have dtype float32",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(
                p, x, o.cast(DType.int32), w, kv, 0
            ),
            ValueError,
            "input_row_offsets must have dtype uint32",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(p, x, o, w[:72], kv, 0),
            ValueError,
            "wqkv has 72 rows",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(
                p, x, o, w[:, :16], kv, 0
            ),
            ValueError,
            "hidden size",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(p, x, o, w[:112], kv, 0),
            ValueError,
            "not a positive multiple",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(p, x, o, w, kv, -1),
            ValueError,
            "layer_idx must be in",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(p, x, o, w, kv, 1.0),
            TypeError,
            "layer_idx must be an int",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qkv_ragged_matmul(p, x, o, w, kv, o),
            ValueError,
            "layer_idx must have rank 0",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qk_ragged_rope(p, x, o, kv, f, layer),
            ValueError,
            "input must have rank 3",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qk_ragged_rope(
                p, x.reshape(["total_tokens", 2, 16]), o, kv, f[:, :8], layer
            ),
            ValueError,
            "freqs_cis dim 1 must be head_dim",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.fused_qk_ragged_rope(
                p, x.reshape(["total_tokens", 4, 8]), o, kv, f, layer
            ),
            ValueError,
            "input dim 2 must be head_dim",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.store_kv_ragged(
                p, x @ w.T, o, kv, layer, freqs_cis=f[:, :8]
            ),
            ValueError,
            "freqs_cis dim 1 must be head_dim",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.store_kv_ragged(
                p, x @ w.T, o, kv, layer, freqs_cis=f.cast(DType.bfloat16)
            ),
            ValueError,
            "freqs_cis must have dtype float32",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.store_kv_ragged(
                p, x @ w.T, o, kv, layer, freqs_cis=f, interleaved=1
            ),
            TypeError,
            "interleaved must be a bool",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                p, x.reshape(["total_tokens", 1, 32])[:, :, :16], o, kv, layer
            ),
            ValueError,
            "not a positive multiple",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                p, x.reshape(["total_tokens", 2, 16]), o, kv, layer, mask_variant="sliding"
            ),
            ValueError,
            "mask_variant must be one of",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                p, x.reshape(["total_tokens", 2, 16]), o, kv, layer, window=127
            ),
            ValueError,
            "window must be at least 128",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                p, x.reshape(["total_tokens", 2, 16]), o, kv, layer, window=32.0
            ),
            TypeError,
            "window must be an int",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                p, x.reshape(["total_tokens", 2, 16]), o, kv, layer, "null", window=128
            ),
            ValueError,
            "a window limits the causal mask",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                p, x.reshape(["total_tokens", 2, 16]), o, kv, layer, scale=0.0
            ),
            ValueError,
            "scale must be a positive",
        ),
        (
            lambda p, kv, x, o, w, f, layer: kvops.flash_attention_ragged(
                KVCacheParams(DType.float32, 4, 16),
                x.reshape(["total_tokens", 2, 16]),
                o,
                kv,
                layer,
            ),
            ValueError,
            "but params describe",
        ),
    ],
)
def test_ops_validate_at_graph_build(
    graph_values: Callable[..., object],
    call: Callable[..., object],
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        graph_values(call)


def test_row_offsets_are_checked_once_per_graph(graph_values: Callable[..., object]) -> None:
    """Two layers' ops over one (collection, offsets) pair emit one step check, ahead of
    the first op on the device chain; other offsets get a check of their own."""

    def two_layers(
        p: KVCacheParams, kv: KVCacheCollection, x: TensorValue, o: TensorValue, w: TensorValue,
        *_: object,
    ) -> tuple[str, str]:  # fmt: skip
        for layer in (0, 1):
            q = kvops.fused_qkv_ragged_matmul(p, x, o, w, kv, layer)
            kvops.flash_attention_ragged(p, q.reshape(["total_tokens", 4, 16]), o, kv, layer)
        two = str(Graph.current)
        kvops.flash_attention_ragged(p, q.reshape(["total_tokens", 4, 16]), o + 0, kv, 0)
        return two, str(Graph.current)

    result = graph_values(two_layers)
    assert isinstance(result, tuple)
    two, three = result
    assert two.count("maxkv.check_row_offsets") == 1
    assert two.index("maxkv.check_row_offsets") < two.index("maxkv.fused_qkv_ragged_matmul")
    assert two.count("maxkv.flash_attention_ragged") == 2
    assert three.count("maxkv.check_row_offsets") == 2
