"""Block-quantized weight copies: read from GGUF exactly, and read by the matmul bit-identically.

References are independent of the code under test: ``gguf``'s own
quantize/dequantize (through maxkv's float32 loader, itself checked against
transformers in ``test_models``) for the blocks, and maxkv's float32
``linear_packed`` (itself checked against NumPy) for the kernel, compared
bit for bit, plus NumPy's matmul.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, Weight

from maxkv import ops as kvops
from maxkv.cpu.quantized import (
    GGUF_TYPES,
    PACKED_FORMATS,
    BlockQuantized,
    Floats16,
    PackedFormat,
    TileBuilder,
    from_gguf_blocks,
)
from maxkv.models import load_model
from maxkv.models.decoder import (
    graph_weight_bytes,
    graph_weight_shapes,
    graph_weights,
    matrix_sources,
    quantized_formats,
)
from maxkv.models.gguf_file import read_gguf_quantized
from maxkv.models.held import HeldWeights
from maxkv.models.resolve import LoadedModel

from .gguf_helpers import TINY, hf_weights, random_blocks, write_llama_gguf

# ------------------------------------------------------------------ from GGUF


@pytest.mark.unit
@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_hold_exactly_the_loaded_weights(tmp_path: Path, matrix_type: str) -> None:
    weights = hf_weights(TINY, seed=5)
    path = tmp_path / f"tiny-{matrix_type}.gguf"
    write_llama_gguf(path, weights, matrix_type=matrix_type)
    _, loaded = load_model(path)  # gguf's dequantization, checked against transformers
    quantized = read_gguf_quantized(path)
    matrices = sorted(n for n, a in weights.items() if a.ndim == 2)
    assert sorted(quantized) == matrices
    for name, copy in quantized.items():
        assert copy.bits == (8 if matrix_type == "Q8_0" else 4)
        np.testing.assert_array_equal(copy.dequantize(), loaded[name], err_msg=name)
        assert copy.exactly(loaded[name]), name


#: What each GGML type is read as: (bits, weights per scale) of the kernel's copy.
#: Each type's integers' bits and block, and whether its scales stay factored.
_FORMATS = {
    "Q4_0": (4, 32, False),
    "Q4_1": (4, 32, False),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, False),
    "Q8_0": (8, 32, False),
    "Q4_K": (4, 32, True),
    "Q5_K": (6, 32, True),
    "Q6_K": (6, 16, True),
    "Q2_K": (6, 16, True),
    "Q3_K": (6, 16, True),
    "IQ4_NL": (8, 32, False),
    "IQ4_XS": (8, 32, False),
}


@pytest.mark.unit
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_every_block_type_reads_as_gguf_dequantizes_it(type_name: str) -> None:
    """Random blocks of every type (every integer, sub-block scale and min; float16
    fields of either sign): the copy holds exactly ``gguf.quants.dequantize``'s
    float32 values, each one ``fma(q, scale, offset)`` with an exact product."""
    import gguf
    from gguf import quants

    assert set(_FORMATS) == set(GGUF_TYPES)
    rng = np.random.default_rng(sum(map(ord, type_name)))
    n, k = 9, 768
    raw = random_blocks(type_name, n, k, rng)
    expected = quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, k)
    copy = from_gguf_blocks(type_name, raw, (n, k))
    assert (copy.bits, copy.block, copy.factors is not None) == _FORMATS[type_name]
    np.testing.assert_array_equal(copy.dequantize(), expected)
    assert copy.exactly(expected)
    if copy.factors is not None:  # what the kernel computes from the factors, in float64
        d, m = copy.factors
        per = 256 // copy.block
        scale = np.repeat(d[..., 0].astype(np.float64), per, 1) * m[..., 0]
        offset = np.repeat(d[..., 1].astype(np.float64), per, 1) * m[..., 1]
        values = np.repeat(scale, copy.block, 1) * copy.q + np.repeat(offset, copy.block, 1)
        np.testing.assert_array_equal(values.astype(np.float32), expected)
    # Stacked with a copy in blocks of 16 (Q6_K), every type is still exact: factored
    # with the K-quants, plain bytes with the others.
    q6 = from_gguf_blocks("Q6_K", random_blocks("Q6_K", 3, k, rng), (3, k))
    both = BlockQuantized.concat([copy, q6])
    factored = copy.factors is not None
    assert both.format == (PackedFormat(6, 16, True) if factored else PackedFormat(8, 16))
    assert both.exactly(np.concatenate([expected, q6.dequantize()]))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("type_name", "d", "largest"), [("Q6_K", 2048.0, 2047.0), ("Q3_K", -16384.0, -16376.0)]
)
def test_k_quants_past_float16_range_are_refused_by_name(
    type_name: str, d: float, largest: float
) -> None:
    """A Q6_K block whose ``-32 d`` (Q3_K: ``-4 d``) is no float16 cannot be held
    with float16 factors: reading it raises, naming the cause, before anything
    is laid out; the largest ``d`` that fits reads exactly."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(73)
    raw = random_blocks(type_name, 2, 512, rng).reshape(2, 2, -1)
    at = raw.shape[-1] - 2  # the float16 d, the last field of both types
    raw[0, 1, at:] = np.array([d], "<f2").view(np.uint8)
    with pytest.raises(ValueError, match="past float16's range"):
        from_gguf_blocks(type_name, raw, (2, 512))
    raw[0, 1, at:] = np.array([largest], "<f2").view(np.uint8)  # -32 d or -4 d: 65504
    expected = quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(2, 512)
    copy = from_gguf_blocks(type_name, raw, (2, 512))
    assert copy.factors is not None and copy.exactly(expected)
    with pytest.raises(ValueError, match="float16 values"):
        BlockQuantized.factored(
            copy.q, copy.factors.d * np.float32(1 + 2**-20), copy.factors.m, 6, 16
        )


@pytest.mark.unit
def test_a_k_quant_file_gets_an_exact_copy_of_every_matrix(tmp_path: Path) -> None:
    """A Q4_K_M-style file (llama.cpp's mix: Q4_K, Q5_0, Q6_K, Q8_0 matrices): every
    graph matrix, stacked ones included, gets a copy holding exactly what
    ``load_model`` (``gguf``'s dequantization) loads, in the format its parts need."""
    config = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    weights = hf_weights(config, seed=8)
    kinds = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K"}
    kinds |= {"ffn_gate": "Q5_0", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}
    overrides = {f"blk.{i}.{t}.weight": kind for t, kind in kinds.items() for i in range(2)}
    overrides["output.weight"] = "Q8_0"
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_llama_gguf(path, weights, config, matrix_type="Q4_K", overrides=overrides)
    loaded_config, loaded = load_model(path)
    quantized = read_gguf_quantized(path)
    assert sorted(quantized) == sorted(n for n, a in weights.items() if a.ndim == 2)
    for name, copy in quantized.items():
        assert copy.exactly(loaded[name]), name
    registry = graph_weights(loaded_config, loaded, packed=True, quantized=quantized)
    formats = quantized_formats(registry)
    pieces = {f"layers.{i}.gate_up.1" for i in range(loaded_config.num_hidden_layers)}
    matrices = set(matrix_sources(loaded_config, packed=True))
    assert set(formats) == matrices | {"embed_tokens"} | pieces
    assert formats["layers.0.wqkv"] == PackedFormat(8, 32)  # Q5_0 + Q5_0 + Q8_0: one piece
    assert formats["layers.0.wo"] == PackedFormat(4, 32, True)  # Q4_K
    assert formats["layers.0.gate_up"] == PackedFormat(8, 32)  # Q5_0, then a piece of
    assert formats["layers.0.gate_up.1"] == PackedFormat(6, 16, True)  # Q5_K, 6 bits
    assert formats["layers.0.down"] == PackedFormat(6, 16, True)  # Q6_K
    # Held as the file stores them: no matrix has a float32 copy beside its blocks.
    assert not set(formats) & set(registry), "a float32 copy beside the blocks"
    assert all(registry[f"{n}.q"].dtype == np.uint8 for n in formats)


@pytest.mark.unit
def test_a_gguf_matrix_is_never_held_as_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading a Q4_K_M-style file (with IQ4_XS and IQ4_NL matrices, as such
    files of the families come too) and laying out its graph weights widens no
    matrix: the loader keeps only 1-D tensors as float32, nothing dequantizes a
    held matrix on the way (the embedding is gathered from its blocks), and
    every float32 graph weight is a vector or the RoPE table."""
    config = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    path = tmp_path / "tiny-q4_k_m.gguf"
    kinds = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "IQ4_XS", "ffn_up": "IQ4_NL"}
    overrides = {f"blk.{i}.{t}.weight": kind for t, kind in kinds.items() for i in range(2)}
    overrides |= {"output.weight": "Q6_K", "token_embd.weight": "Q4_K"}
    write_llama_gguf(
        path, hf_weights(config, seed=9), config, matrix_type="Q4_K", overrides=overrides
    )
    loaded_config, loaded = load_model(path)
    assert isinstance(loaded, HeldWeights)
    assert all(a.ndim == 1 for a in loaded.dense.values()), "a matrix was dequantized"
    # Rows read in pieces are the matrix's rows (Q's llama.cpp permutation undone).
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    whole, piece = loaded.blocks[q_proj], loaded.blocks.read(q_proj, 3, 40)
    np.testing.assert_array_equal(piece.q, whole.q[3:40])
    np.testing.assert_array_equal(piece.scale, whole.scale[3:40])
    registry = held_registry(loaded_config, loaded, monkeypatch)
    # The embedding's own Q4_K tiles (2 of 64 rows, factored scales) beside the
    # Q6_K head's.
    assert registry["embed_tokens.q"].shape == (2, 256, 32)
    assert registry["embed_tokens.sm"].shape == (2, 1, 5, 64)
    assert registry["lm_head.q"].shape == (2, 256, 48)
    # Tied: one table, the head's, which the embedding gathers from.
    tied = tmp_path / "tiny-tied.gguf"
    overrides.pop("output.weight")
    write_llama_gguf(
        tied, hf_weights(config, seed=9, tied=True), config, matrix_type="Q4_K", overrides=overrides
    )
    tied_config, tied_weights = load_model(tied)
    assert tied_config.tie_word_embeddings
    registry = held_registry(tied_config, tied_weights, monkeypatch)
    assert registry["lm_head.q"].shape == (2, 256, 32)  # the Q4_K table
    assert not {"embed_tokens", "embed_tokens.q", "lm_head"} & set(registry)


def held_registry(
    config: Any, loaded: HeldWeights, monkeypatch: pytest.MonkeyPatch
) -> dict[str, np.ndarray]:
    """``graph_weights(config, loaded, packed=True)``, failing if a held matrix is
    widened to float32 on the way or a float32 graph weight is a matrix (only
    vectors, the RoPE tables and the copies' scales are float32), and checking the
    bytes the memory check counts (from shapes and formats) are the ones held."""

    def widened(self: object) -> np.ndarray:
        raise AssertionError("a held matrix was widened to float32")

    with monkeypatch.context() as patch:
        patch.setattr(BlockQuantized, "dequantize", widened)
        patch.setattr(Floats16, "dequantize", widened)
        registry = graph_weights(config, loaded, packed=True)
    rope = set(config.ropes())
    for name, array in registry.items():
        if array.dtype == np.float32 and name not in rope and not name.endswith(".sm"):
            assert array.ndim == 1, f"{name} {array.shape} is a float32 matrix"
    held_bytes = sum(a.nbytes for a in registry.values())
    assert graph_weight_bytes(config, loaded, packed=True) == held_bytes
    return registry


@pytest.mark.compile
def test_a_stack_of_two_formats_is_held_in_pieces_and_gives_transformers_logits(
    tmp_path: Path, session: InferenceSession
) -> None:
    """llama.cpp's Q4_K_M mix stores a Q6_K V beside Q4_K Q and K: the stacked
    ``wqkv`` is held as two pieces in their own formats (4-bit Q and K rows, not
    widened to V's 6 bits), read by two matmuls; prompt steps (panels) and one-row
    steps give the logits transformers computes from the same file."""
    pytest.importorskip("torch")
    from max.driver import CPU

    from maxkv import ContinuousBatchingKVCacheManager
    from maxkv.models.decoder import DecoderModel, cache_params
    from maxkv.models.hf import hf_from_pretrained

    config = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    kinds = {"attn_v": "Q6_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K"}
    overrides = {f"blk.{i}.{t}.weight": kind for t, kind in kinds.items() for i in range(2)}
    overrides |= {"output.weight": "Q6_K"}
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_llama_gguf(
        path, hf_weights(config, seed=4), config, matrix_type="Q4_K", overrides=overrides
    )
    loaded_config, loaded = load_model(path)
    registry = graph_weights(loaded_config, loaded, packed=True)
    formats = quantized_formats(registry)
    q_rows = loaded_config.num_attention_heads * loaded_config.head_dim
    kv_rows = loaded_config.num_key_value_heads * loaded_config.head_dim
    assert formats["layers.0.wqkv"] == PackedFormat(4, 32, True)  # Q and K, 4 bits
    assert formats["layers.0.wqkv.2"] == PackedFormat(6, 16, True)  # V, 6 bits
    assert registry["layers.0.wqkv.q"].shape[0] == -(-(q_rows + kv_rows) // 64)
    assert registry["layers.0.wqkv.2.q"].shape[0] == -(-kv_rows // 64)
    assert formats["layers.0.gate_up"] == PackedFormat(4, 32, True)  # gate
    assert formats["layers.0.gate_up.1"] == PackedFormat(8, 32)  # up, Q8_0
    assert "layers.0.wqkv.1" not in formats and "layers.0.down.1" not in formats
    assert graph_weight_bytes(loaded_config, loaded, packed=True) == sum(
        a.nbytes for a in registry.values()
    )

    manager = ContinuousBatchingKVCacheManager(
        cache_params(loaded_config), 1, 64, loaded_config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(loaded_config, loaded, manager, session, output="logits")
    assert set(model.quant_formats) == set(formats)
    # A prompt (more rows than the one-row path), then decode.
    assert_steps_give_transformers_logits(model, manager, hf_from_pretrained(path), (20, 1, 1))


def assert_steps_give_transformers_logits(
    model: Any,
    manager: Any,
    hf: Any,
    lengths: tuple[int, ...],
    seed: int = 6,
    tolerance: float = 2e-4,
) -> None:
    """Feeds one sequence random chunks of ``lengths`` tokens through ``model``
    (``output="logits"``, over ``manager``) and checks each step's last logits
    against transformers' float32 model ``hf`` on the whole history, within
    ``tolerance`` of their largest (at least 1)."""
    import torch

    rng = np.random.default_rng(seed)
    (seq,) = manager.claim(1)
    history: list[int] = []
    for length in lengths:
        chunk = rng.integers(3, model.config.vocab_size, length).tolist()
        (inputs,) = manager.fetch([seq], active_lengths=[length])
        offsets = np.array([0, length], np.uint32)
        tokens = np.asarray(chunk, np.int64)
        got = model.execute(Buffer.from_numpy(tokens), Buffer.from_numpy(offsets), inputs)
        manager.step({seq: length})
        history += chunk
        with torch.no_grad():
            want = hf(torch.tensor([history])).logits[0, -1].float().numpy()
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(
            got.to_numpy()[0], want, rtol=0, atol=tolerance * max(1.0, scale)
        )
    manager.release(seq)


@pytest.mark.unit
def test_a_model_the_memory_cannot_hold_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoder refuses weights that need more than the available memory, both
    figures in the message, before laying out any weight or compiling."""
    from maxkv.cache.spec import CacheSpec
    from maxkv.models import memory
    from maxkv.models.decoder import DecoderModel, cache_params

    path = tmp_path / "tiny-q8.gguf"
    write_llama_gguf(path, hf_weights(TINY, seed=2), matrix_type="Q8_0")
    config, weights = load_model(path)
    needed = graph_weight_bytes(config, weights, packed=True)
    monkeypatch.setattr(memory, "available_bytes", lambda: needed - 1)

    def no_layout(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were laid out")

    monkeypatch.setattr("maxkv.models.decoder.graph_weights", no_layout)
    spec = CacheSpec(cache_params(config), config.num_hidden_layers)
    with pytest.raises(memory.InsufficientMemoryError, match=r"needs 0\.00 GiB .* available"):
        DecoderModel(config, weights, spec, InferenceSession(devices=[]), output="logits")
    with pytest.raises(memory.InsufficientMemoryError, match=r"3\.00 GiB of KV cache"):
        memory.check_fits("a model", 2**30, 3 * 2**30)
    monkeypatch.setattr(memory, "available_bytes", lambda: needed)
    memory.check_fits("a model", needed)  # exactly fits


@pytest.mark.unit
def test_available_memory_is_read_on_linux() -> None:
    from maxkv.models.memory import available_bytes

    available = available_bytes()
    assert available is not None and 0 < available < 2**50


def _tile_layout(copy: BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's tile layout written out in NumPy (``linear.mojo``'s reads),
    zero padding columns: q ``[tiles, K, 64 bits / 8]``, 4-bit byte j = column
    j | column j + 32 << 4, 6-bit the same 32 bytes then byte 32 + j = the top
    two bits of columns j, j + 16, j + 32, j + 48 from the lowest up; sm plain
    ``[tiles, K / block, 2, 64]``; factored ``[tiles, K / 256, slots, 64]``: the
    factors' two rows as float16 in one slot, then the int8 multipliers ``[256 /
    block, 2, 64]``."""
    n, k = copy.shape
    fmt = copy.format
    tiles = -(-n // 64)
    q = np.zeros((tiles * 64, k), np.uint8)
    q[:n] = copy.q
    q = q.reshape(tiles, 64, k).transpose(0, 2, 1)
    if fmt.bits in (4, 6):
        low = q & 15
        high = q >> 4
        q4 = low[..., :32] | (low[..., 32:] << 4)
        if fmt.bits == 4:
            q = q4
        else:
            top = high[..., 0:16] | high[..., 16:32] << 2 | high[..., 32:48] << 4
            q = np.concatenate([q4, top | high[..., 48:64] << 6], axis=-1)
    if copy.factors is None:
        sm = np.zeros((2, tiles * 64, k // fmt.block), np.float32)
        sm[0, :n], sm[1, :n] = copy.scale, copy.offset
        return q, sm.reshape(2, tiles, 64, -1).transpose(1, 3, 0, 2)
    d, m = copy.with_block(fmt.block).factors
    per = 256 // fmt.block
    dd = np.zeros((tiles * 64, k // 256, 2), np.float32)
    dd[:n] = d
    mm = np.zeros((tiles * 64, k // 256, per, 2), np.int8)
    mm[:n] = m.reshape(n, k // 256, per, 2)
    factors = dd.astype(np.float16).reshape(tiles, 64, k // 256, 2).transpose(0, 2, 3, 1)
    factors = np.ascontiguousarray(factors).view(np.float32).reshape(tiles, k // 256, 1, 64)
    mult = mm.reshape(tiles, 64, k // 256, per * 2).transpose(0, 2, 3, 1)
    mult = np.ascontiguousarray(mult).view(np.float32).reshape(tiles, k // 256, -1, 64)
    return q, np.concatenate([factors, mult], axis=2)


@pytest.mark.unit
def test_matrices_stack_into_tiles_a_piece_at_a_time() -> None:
    """A stacked matrix laid out from pieces at any row (mid-tile, mixed formats)
    equals the kernel's layout of the whole (:func:`_tile_layout`)."""
    rng = np.random.default_rng(4)
    k = 512
    q4, q8 = PackedFormat(4, 32), PackedFormat(8, 32)
    k4, k6 = PackedFormat(4, 32, True), PackedFormat(6, 16, True)
    for formats, stacked in (
        ((q4, PackedFormat(8, 16), q8, q4), PackedFormat(8, 16)),
        ((k4, k6, k4), k6),
        ((k4, k4), k4),
        ((k4, q8), PackedFormat(8, 32)),
        ((q4, k6), PackedFormat(8, 16)),
    ):
        _check_stacking(rng, k, formats, stacked)
    four = TileBuilder(PackedFormat(4, 32), 64, k)
    with pytest.raises(ValueError, match="does not fit"):
        four.write(0, _random_copy(rng, 8, k, PackedFormat(8, 16)))  # 8-bit rows, 4-bit layout
    with pytest.raises(ValueError, match="does not fit"):
        four.write(40, _random_copy(rng, 37, k, q4))  # past the last row
    with pytest.raises(ValueError, match="does not fit"):  # plain scales cannot be factored
        TileBuilder(k6, 64, k).write(0, _random_copy(rng, 8, k, q4))


def _check_stacking(
    rng: np.random.Generator, k: int, formats: tuple[PackedFormat, ...], stacked: PackedFormat
) -> None:
    parts = [_random_copy(rng, n, k, f) for n, f in zip((37, 70, 5, 64), formats, strict=False)]
    whole = BlockQuantized.concat(parts)
    assert whole.format == stacked
    assert whole.exactly(np.concatenate([p.dequantize() for p in parts]))
    builder = TileBuilder(whole.format, whole.shape[0], k)
    row = 0
    for part in parts:
        cut = part.shape[0] // 3  # two pieces, in reverse order
        rows = np.arange(part.shape[0])
        builder.write(row + cut, part.rows(rows[cut:]))
        builder.write(row, part.rows(rows[:cut]))
        row += part.shape[0]
    q, sm = _tile_layout(whole)
    np.testing.assert_array_equal(builder.q, q)
    np.testing.assert_array_equal(builder.sm, sm)
    for got, want in zip(whole.pack(), (q, sm), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.unit
def test_16_bit_matrices_are_held_and_float32_ones_left_out(tmp_path: Path) -> None:
    """A GGUF's F16 and BF16 matrices are held as their 16-bit values (Q and K rows
    in transformers' order: llama.cpp's permutation undone), each the value the
    writer rounded the float32 weight to; an F32 matrix stays a dense array."""
    from .test_bfloat16 import bfloat16_rounded

    weights = hf_weights(TINY, seed=6)
    path = tmp_path / "tiny-mixed.gguf"
    overrides = {
        "blk.0.ffn_down.weight": "F32",
        "blk.0.attn_q.weight": "F16",
        "blk.1.attn_k.weight": "BF16",
    }
    write_llama_gguf(path, weights, matrix_type="Q8_0", overrides=overrides)
    quantized = read_gguf_quantized(path)
    assert "model.layers.0.mlp.down_proj.weight" not in quantized
    assert "model.layers.1.mlp.down_proj.weight" in quantized
    q_proj, k_proj = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    )
    assert quantized.format(q_proj) == PackedFormat(16, 1, False, "float16")
    assert quantized.format(k_proj) == PackedFormat(16, 1, False, "bfloat16")
    want = weights[q_proj].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(quantized[q_proj].dequantize(), want)
    np.testing.assert_array_equal(quantized[k_proj].dequantize(), bfloat16_rounded(weights[k_proj]))
    _, loaded = load_model(path)
    assert isinstance(loaded, HeldWeights)
    assert {q_proj, k_proj} <= set(loaded.blocks)
    assert loaded.dense["model.layers.0.mlp.down_proj.weight"].ndim == 2


@pytest.mark.unit
def test_exactly_refuses_any_other_weight() -> None:
    rng = np.random.default_rng(0)
    copy = _random_copy(rng, 40, 64, 4)
    weight = copy.dequantize()
    assert copy.exactly(weight)
    changed = weight.copy()
    changed[3, 17] = np.nextafter(changed[3, 17], np.float32(np.inf))
    assert not copy.exactly(changed)
    assert not copy.exactly(weight[:, :32])
    assert not copy.exactly(weight.astype(np.float64))
    # A scale whose products are not exact in float32 cannot be rounded once.
    inexact = BlockQuantized(copy.q, copy.scale * np.float32(1 + 2**-20), copy.offset, 4)
    assert not inexact.exactly(inexact.dequantize())


@pytest.mark.unit
def test_bad_blocks_are_refused() -> None:
    q = np.zeros((2, 64), np.uint8)
    scale = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="bits"):
        BlockQuantized(q, scale, scale, 5)
    with pytest.raises(ValueError, match="multiple"):
        BlockQuantized(q[:, :48], scale, scale, 8)
    with pytest.raises(ValueError, match="value of 16 or more"):
        BlockQuantized(q + 16, scale, scale, 4)
    with pytest.raises(ValueError, match="value of 64 or more"):
        BlockQuantized(q + 64, scale, scale, 6)
    with pytest.raises(ValueError, match="scale"):
        BlockQuantized(q, scale[:, :1], scale, 8)
    with pytest.raises(ValueError, match="block must be"):
        BlockQuantized(q, np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), 4, 8)
    q256 = np.zeros((2, 256), np.uint8)
    d, m = np.ones((2, 1, 2), np.float32), np.ones((2, 16, 2), np.int8)
    with pytest.raises(ValueError, match="multiple of 256"):
        BlockQuantized.factored(q, d, m[:, :4], 6, 16)
    with pytest.raises(ValueError, match="at most 6 bits"):
        BlockQuantized.factored(q256, d, m, 8, 16)
    with pytest.raises(ValueError, match=r"factors\.m must be int8"):
        BlockQuantized.factored(q256, d, m.astype(np.int16), 6, 16)
    with pytest.raises(ValueError, match="does not fit"):  # 6-bit rows into 4 bits
        BlockQuantized.factored(q256, d, m, 6, 16).as_format(PackedFormat(4, 32, True))
    with pytest.raises(ValueError, match="cannot read IQ3_S"):
        from_gguf_blocks("IQ3_S", np.zeros(110, np.uint8), (1, 256))
    with pytest.raises(ValueError, match="bytes"):
        from_gguf_blocks("Q8_0", np.zeros(33, np.uint8), (1, 32))
    with pytest.raises(ValueError, match="multiple of Q4_K's 256"):
        from_gguf_blocks("Q4_K", np.zeros(72, np.uint8), (1, 128))


@pytest.mark.model
def test_every_smollm2_matrix_gets_an_exact_copy(smollm2: LoadedModel) -> None:
    config = smollm2.config
    registry = graph_weights(config, smollm2.weights, packed=True, quantized=smollm2.quantized)
    # The tied head's copy is the embedding's table too.
    names = set(matrix_sources(config, packed=True))
    assert {n[: -len(".q")] for n in registry if n.endswith(".q")} == names
    assert not (names | {"embed_tokens"}) & set(registry), "a float32 copy beside the blocks"
    q_bytes = sum(a.nbytes for n, a in registry.items() if n.endswith((".q", ".sm")))
    shapes = graph_weight_shapes(config, packed=True)
    f32_bytes = sum(4 * math.prod(shapes[n]) for n in names)
    assert f32_bytes
    assert q_bytes < f32_bytes / 4
    # A greedy-head graph reads the head in float32 (its exact pass): the head keeps it.
    greedy = graph_weights(
        config, smollm2.weights, packed=True, quantized=smollm2.quantized, greedy_head=True
    )
    # ... and the embedding has its own copy then.
    assert {n[: -len(".q")] for n in greedy if n.endswith(".q")} == names - {"lm_head"} | {
        "embed_tokens"
    }
    assert {"lm_head", "lm_head.greedy_q", "lm_head.greedy_info"} <= set(greedy)


# ------------------------------------------------------------------ the kernel


def _random_copy(
    rng: np.random.Generator, n: int, k: int, fmt: PackedFormat | int, block: int = 32
) -> Any:
    """A copy in ``fmt`` (or plain ``bits`` in ``block``s).  Scales and offsets are
    float16 values, factored ones float16 factors times int8 multipliers of
    either sign, so every ``q * scale`` is exact in float32.  16-bit floats:
    normal values of either sign, rounded to the type by NumPy (float16's first
    columns subnormal, which float32 holds as normal numbers)."""
    if isinstance(fmt, int):
        fmt = PackedFormat(fmt, block)
    if fmt.floating:
        values = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if fmt.floating == "float16":
            values[:, :8] = rng.uniform(-3e-5, 3e-5, (n, 8))  # below float16's 6.1e-5
            values = values.astype(np.float16).astype(np.float32)
        else:
            values = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        return Floats16.of(values, "float16" if fmt.floating == "float16" else "bfloat16")
    q = rng.integers(0, 1 << fmt.bits, (n, k), dtype=np.uint8)
    if fmt.factored:
        d = rng.uniform(0.0001, 0.001, (n, k // 256, 2)) * rng.choice([-1, 1], (n, k // 256, 2))
        m = rng.integers(-128, 128, (n, k // fmt.block, 2), dtype=np.int8)
        return BlockQuantized.factored(
            q, d.astype(np.float16).astype(np.float32), m, fmt.bits, fmt.block
        )
    scale = (rng.uniform(0.001, 0.05, (n, k // fmt.block))).astype(np.float16).astype(np.float32)
    offset = (rng.standard_normal((n, k // fmt.block)) * 0.1).astype(np.float16).astype(np.float32)
    return BlockQuantized(q, scale, offset, fmt.bits, fmt.block)


#: 4 tiles, the last one partly padding; K: 19 blocks of 32, two full panels of
#: 256 rows that larger steps over a copy alone dequantize at a time, and a part one.
_N, _K = 200, 608
#: K of the factored formats: three super-blocks of 256 (and three panels).
_K_FACTORED = 768


def _k(fmt: PackedFormat) -> int:
    return _K_FACTORED if fmt.factored else _K


def _prefix(fmt: PackedFormat) -> str:
    return f"f{fmt.bits}_{fmt.block}{'k' if fmt.factored else ''}{fmt.floating}_"


#: How a graph holds a matmul's weight: float32 alone, float32 with the
#: quantized copy (steps of <= 8 rows read the copy), the copy alone.
_HOLDINGS = ("float32", "both", "alone")


def _linear_weights(
    registry: dict[str, np.ndarray], prefix: str, holding: str, made: dict[str, Weight]
) -> tuple[Weight | None, tuple[Weight, Weight] | None]:
    """Graph weights for ``linear_packed`` as ``holding`` (:data:`_HOLDINGS`) holds
    them: the packed float32 ``{prefix}w`` and/or the quantized copy
    ``({prefix}q, {prefix}sm)`` of ``registry``; each made once per graph (``made``)."""

    def weight(name: str) -> Weight:
        if name not in made:
            array = registry[name]
            dtype = DType.uint8 if array.dtype == np.uint8 else DType.float32
            made[name] = Weight(name, dtype, array.shape, DeviceRef.CPU())
        return made[name]

    w = weight(f"{prefix}w") if holding != "alone" else None
    quantized = (weight(f"{prefix}q"), weight(f"{prefix}sm")) if holding != "float32" else None
    return w, quantized


@dataclass(frozen=True)
class _LinearCase:
    """One layout's matmul graph: for each format ``PACKED_FORMATS[f]``'s weight,
    ``x @ w.T`` held each of the :data:`_HOLDINGS` ways; then, over the 4-bit
    weight, ``residual + x @ w.T`` in the epilogue, held each way."""

    model: Model
    weights: dict[PackedFormat, np.ndarray]

    def run(
        self, x: np.ndarray, residual: np.ndarray | None = None, factored: bool = False
    ) -> list[np.ndarray]:
        """Every output, for ``x`` ``[M, K]`` (``K`` of the plain or the factored formats)."""
        m = x.shape[0]
        if residual is None:
            residual = np.zeros((m, _N), np.float32)
        other = np.zeros((m, _K if factored else _K_FACTORED), np.float32)
        xs = (other, x) if factored else (x, other)
        outputs = self.model.execute(*(Buffer.from_numpy(a) for a in (*xs, residual)))
        return [o.to_numpy() for o in outputs]

    def held(self, fmt: PackedFormat, x: np.ndarray) -> dict[str, np.ndarray]:
        """``x @ w.T`` over ``fmt``'s weight, by holding."""
        f = PACKED_FORMATS.index(fmt)
        out = self.run(x, factored=fmt.factored)
        n = len(_HOLDINGS)
        return dict(zip(_HOLDINGS, out[n * f : n * (f + 1)], strict=True))


@pytest.fixture(scope="module")
def linear_case(session: InferenceSession, kernels: Path) -> Callable[[int], _LinearCase]:
    """Per block_cols, one compiled graph of every copy format's matmuls (a graph
    per case would cost a compile each)."""
    built: dict[int, _LinearCase] = {}
    device = DeviceRef.CPU()

    def build(block_cols: int) -> _LinearCase:
        if block_cols not in built:
            registry: dict[str, np.ndarray] = {}
            weights: dict[PackedFormat, np.ndarray] = {}
            for i, fmt in enumerate(PACKED_FORMATS):
                copy = _random_copy(np.random.default_rng(i), _N, _k(fmt), fmt)
                weight = copy.dequantize()
                assert copy.exactly(weight)
                q, sm = copy.pack()
                assert PackedFormat.of(q.shape, sm.shape) == fmt
                prefix = _prefix(fmt)
                registry |= {
                    f"{prefix}w": kvops.pack_linear_weight(weight, block_cols),
                    f"{prefix}q": q,
                    f"{prefix}sm": sm,
                }
                weights[fmt] = weight
            types = [
                TensorType(DType.float32, ["m", _K], device),
                TensorType(DType.float32, ["m", _K_FACTORED], device),
                TensorType(DType.float32, ["m", _N], device),
            ]
            with Graph(f"lin_{block_cols}", input_types=types, custom_extensions=[kernels]) as g:
                x_plain, x_factored, residual = (v.tensor for v in g.inputs)
                made: dict[str, Weight] = {}
                outputs = []
                # A copy alone takes the register blocks' width as an argument.
                alone = {"block_cols": block_cols}
                for fmt in PACKED_FORMATS:
                    x = x_factored if fmt.factored else x_plain
                    for holding in _HOLDINGS:
                        w, quantized = _linear_weights(registry, _prefix(fmt), holding, made)
                        extra = alone if w is None else {}
                        outputs.append(kvops.linear_packed(x, w, _N, quantized, **extra))
                for holding in _HOLDINGS:  # the residual, over the 4-bit weight
                    w, quantized = _linear_weights(registry, "f4_32_", holding, made)
                    extra = alone if w is None else {}
                    outputs.append(
                        kvops.linear_packed(x_plain, w, _N, quantized, residual=residual, **extra)
                    )
                g.output(*outputs)
            built[block_cols] = _LinearCase(session.load(g, weights_registry=registry), weights)
        return built[block_cols]

    return build


@pytest.mark.compile
@pytest.mark.parametrize("block_cols", kvops.BLOCK_COLS)
@pytest.mark.parametrize(
    "fmt",
    PACKED_FORMATS,
    ids=lambda f: f.floating or f"{f.bits}bit_block{f.block}{'_factored' if f.factored else ''}",
)
def test_quantized_matmul_is_bit_identical_to_float32(
    linear_case: Callable[[int], _LinearCase], fmt: PackedFormat, block_cols: int
) -> None:
    """Every copy format, with both layouts (and register blocks) on any CPU: the
    host's own (AVX2's 16-column blocks or AVX-512's 64) and the other one; the
    copy beside the float32 weights and the copy alone (dequantized in panels
    past 8 rows) give the float32 weights' bits, which are within float32's
    rounding of the float64 product."""
    case = linear_case(block_cols)
    weight = case.weights[fmt]
    rng = np.random.default_rng(10 + fmt.bits + fmt.block)
    # <= 8 rows read the quantized copy; the others cover every register-block split
    # (blocks of 4 rows with 64 columns, of 6 with 16)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 33):
        x = rng.standard_normal((m, _k(fmt))).astype(np.float32)
        held = case.held(fmt, x)
        reference = x.astype(np.float64) @ weight.T.astype(np.float64)
        # A sum of 608 float32 products rounds ~sqrt(608) times 6e-8 of its scale.
        bound = 1e-5 * (np.abs(x) @ np.abs(weight).T)
        assert np.all(np.abs(held["float32"] - reference) <= bound), f"M={m}"
        for holding in ("both", "alone"):
            assert held[holding].shape == (m, _N)
            np.testing.assert_array_equal(
                held[holding], held["float32"], err_msg=f"M={m}, {holding}"
            )


@pytest.mark.compile
def test_the_matmul_layouts_agree_bit_for_bit(linear_case: Callable[[int], _LinearCase]) -> None:
    """Each output is one fma per k in order, whatever the block: the layouts agree exactly."""
    fmt = PackedFormat(8, 32)
    x = np.random.default_rng(3).standard_normal((19, _K)).astype(np.float32)
    for holding in _HOLDINGS:
        np.testing.assert_array_equal(
            linear_case(16).held(fmt, x)[holding], linear_case(64).held(fmt, x)[holding]
        )


@pytest.mark.compile
@pytest.mark.parametrize("block_cols", kvops.BLOCK_COLS)
def test_residual_is_added_in_the_epilogue(
    linear_case: Callable[[int], _LinearCase], block_cols: int
) -> None:
    """``residual + x @ w.T`` equals the matmul's result plus the residual added by NumPy
    in float32, bit for bit, over the float32 and the quantized weights, for every
    register-block split and the partial last tile."""
    case = linear_case(block_cols)
    fmt = PackedFormat(4, 32)
    weight = case.weights[fmt]
    rng = np.random.default_rng(30 + block_cols)
    for m in (1, 3, 5, 8, 9, 13, 33):
        x = rng.standard_normal((m, _K)).astype(np.float32)
        residual = rng.standard_normal((m, _N)).astype(np.float32)
        out = case.run(x, residual)
        product = case.held(fmt, x)["float32"]
        reference = x.astype(np.float64) @ weight.T.astype(np.float64)
        assert np.all(np.abs(product - reference) <= 1e-5 * (np.abs(x) @ np.abs(weight).T))
        for holding, got in zip(_HOLDINGS, out[-len(_HOLDINGS) :], strict=True):
            np.testing.assert_array_equal(got, residual + product, err_msg=f"M={m}, {holding}")


@pytest.mark.compile
def test_rows_are_gathered_from_the_tiles(session: InferenceSession, kernels: Path) -> None:
    """``gather_quantized`` over every copy format gives the rows of the dequantized
    matrix bit for bit (the embedding of a tied head's table); a token outside the
    table raises instead of reading past it."""
    device = DeviceRef.CPU()
    n = 200  # the last tile partly padding
    registry: dict[str, np.ndarray] = {}
    tables = []
    for i, fmt in enumerate(PACKED_FORMATS):
        copy = _random_copy(np.random.default_rng(40 + i), n, 512, fmt)
        registry[f"q{i}"], registry[f"sm{i}"] = copy.pack()
        tables.append(copy.dequantize())
    tokens_type = TensorType(DType.int64, ["t"], device)
    with Graph("gather", input_types=[tokens_type], custom_extensions=[kernels]) as g:
        tokens = g.inputs[0].tensor
        outputs = []
        for i in range(len(PACKED_FORMATS)):
            q = Weight(f"q{i}", DType.uint8, registry[f"q{i}"].shape, device)
            sm = Weight(f"sm{i}", DType.float32, registry[f"sm{i}"].shape, device)
            outputs.append(kvops.gather_quantized(tokens, (q, sm), n, 512))
        g.output(*outputs)
    model = session.load(g, weights_registry=registry)
    ids = np.array([0, 199, 63, 64, 130, 5, 5], np.int64)
    got = model.execute(Buffer.from_numpy(ids))
    for fmt, table, rows in zip(PACKED_FORMATS, tables, got, strict=True):
        np.testing.assert_array_equal(rows.to_numpy(), table[ids], err_msg=str(fmt))
    for bad in (200, -1):
        with pytest.raises(Exception, match="outside the table's 200 rows"):
            model.execute(Buffer.from_numpy(np.array([3, bad], np.int64)))
    with Graph("gather_bad", input_types=[tokens_type], custom_extensions=[kernels]) as g:
        q = Weight("q", DType.uint8, registry["q0"].shape, device)
        sm = Weight("sm", DType.float32, registry["sm0"].shape, device)
        with pytest.raises(ValueError, match="not a packed quantized"):
            kvops.gather_quantized(g.inputs[0].tensor, (q, sm), n, 256)  # the wrong K
        with pytest.raises(ValueError, match="not a packed quantized"):
            kvops.gather_quantized(g.inputs[0].tensor, (q, sm), 300, 512)  # the wrong rows


@pytest.mark.unit
def test_residual_must_match_the_output() -> None:
    device = DeviceRef.CPU()
    types = [
        TensorType(DType.float32, ["m", _K], device),
        TensorType(DType.float32, ["m", 8], device),
    ]
    with Graph("bad_residual", input_types=types) as g:
        x, narrow = (v.tensor for v in g.inputs)
        w = Weight("w", DType.float32, (4, 1, _K, 64), device)
        with pytest.raises(ValueError, match="residual"):
            kvops.linear_packed(x, w, _N, residual=narrow)
        with pytest.raises(ValueError, match="residual"):
            kvops.linear_packed(x, w, _N, residual=x[:2, :8].cast(DType.float32))
        with pytest.raises(ValueError, match="residual must have dtype float32"):
            kvops.linear_packed(x, w, _N, residual=narrow.cast(DType.bfloat16))


@pytest.mark.unit
def test_pack_linear_weight_layout() -> None:
    """Tile t, block b, row k holds w[64 t + bc b : ..., k]; padding is zero; cache-line aligned."""
    w = np.random.default_rng(4).standard_normal((_N, _K)).astype(np.float32)
    for bc in kvops.BLOCK_COLS:
        packed = kvops.pack_linear_weight(w, bc)
        assert packed.shape == (4, 64 // bc, _K, bc)
        assert packed.ctypes.data % 64 == 0 and packed.flags.c_contiguous
        for t in range(4):
            for b in range(64 // bc):
                start = 64 * t + bc * b
                expected = np.zeros((_K, bc), np.float32)
                cols = w[start : start + bc]
                expected[:, : len(cols)] = cols.T
                np.testing.assert_array_equal(packed[t, b], expected, err_msg=f"t={t} b={b}")
    assert kvops.pack_linear_weight(w).shape[3] == kvops.packed_block_cols()
    with pytest.raises(ValueError, match="block_cols"):
        kvops.pack_linear_weight(w, 32)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        kvops.pack_linear_weight(w[0])


@pytest.mark.unit
def test_quantized_matmul_refuses_mismatched_copies() -> None:
    device = DeviceRef.CPU()
    copy = _random_copy(np.random.default_rng(1), _N, _K, 4)
    q, sm = copy.pack()
    with Graph("bad_q", input_types=[TensorType(DType.float32, [2, _K], device)]) as g:
        w = Weight("w", DType.float32, (4, 1, _K, 64), device)
        good_q = Weight("q", DType.uint8, q.shape, device)
        good_sm = Weight("sm", DType.float32, sm.shape, device)
        x = g.inputs[0].tensor
        narrow_q = Weight("q2", DType.uint8, (4, _K, 16), device)
        short_sm = Weight("s2", DType.float32, (4, 2, 2, 64), device)
        # blocks of 16 are read with 8-bit integers only
        sm16 = Weight("s16", DType.float32, (4, _K // 16, 2, 64), device)
        float_q = Weight("q3", DType.float32, q.shape, device)
        with pytest.raises(ValueError, match="not a packed quantized"):
            kvops.linear_packed(x, w, _N, (narrow_q, good_sm))
        with pytest.raises(ValueError, match="not a packed quantized"):
            kvops.linear_packed(x, w, _N, (good_q, short_sm))
        with pytest.raises(ValueError, match="not a packed quantized"):
            kvops.linear_packed(x, w, _N, (good_q, sm16))
        with pytest.raises(ValueError, match="dtype uint8"):
            kvops.linear_packed(x, w, _N, (float_q, good_sm))
        with pytest.raises(ValueError, match="not a packed quantized"):
            kvops.linear_packed(x, None, _N, (good_q, short_sm))
        with pytest.raises(ValueError, match="needs w_packed, quantized, or both"):
            kvops.linear_packed(x, None, _N)
        with pytest.raises(ValueError, match="block_cols must be one of"):
            kvops.linear_packed(x, None, _N, (good_q, good_sm), block_cols=32)
        with pytest.raises(ValueError, match="block_cols is w_packed's own"):
            kvops.linear_packed(x, w, _N, (good_q, good_sm), block_cols=64)
        bad_shapes = [(4, 2, _K, 16), (4, 4, _K, 32), (4, _K, 64), (3, 1, _K, 64), (4, 1, 8, 64)]
        for i, shape in enumerate(bad_shapes):
            bad = Weight(f"bad_w{i}", DType.float32, shape, device)
            with pytest.raises(ValueError, match=r"packed|rank"):
                kvops.linear_packed(x, bad, _N)
