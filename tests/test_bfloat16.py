"""maxkv's Llama in bfloat16 (the GPU's dtype), here on the CPU through MAX's kernels.

The float64 NumPy reference runs on the same weights rounded to bfloat16, so
what remains is bfloat16 arithmetic in the graph: the logits must agree to 2%
of their scale, and the next tokens where the reference's top two are further
apart than that.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager
from maxkv.cache.spec import CacheSpec
from maxkv.models import DecoderModel
from maxkv.models.config import default_llama
from maxkv.models.decoder import cache_params, graph_weights
from maxkv.models.reference import logits_reference

PROMPTS = [[1, 5, 9, 200, 3], [7, 7, 100], [42]]


def bfloat16_rounded(array: np.ndarray) -> np.ndarray:
    """``array`` rounded to bfloat16 (nearest even), as float32: written apart from
    :func:`maxkv.models.decoder.bfloat16_buffer`."""
    bits = np.ascontiguousarray(array, np.float32).view(np.uint32).astype(np.uint64)
    lower = bits & 0xFFFF
    upper = bits >> 16
    round_up = (lower > 0x8000) | ((lower == 0x8000) & (upper & 1 == 1))
    return ((upper + round_up) << 16).astype(np.uint32).view(np.float32)


@pytest.mark.unit
def test_the_model_refuses_dtypes_and_weight_sources_it_cannot_take() -> None:
    config, weights = default_llama()
    session = InferenceSession(devices=[CPU()])
    half = CacheSpec(cache_params(config, DType.float16), config.num_hidden_layers)
    with pytest.raises(ValueError, match="computes in one of"):
        DecoderModel(config, weights, half, session)
    spec = CacheSpec(cache_params(config, DType.bfloat16), config.num_hidden_layers)
    with pytest.raises(ValueError, match="exactly one of weights and prepared"):
        DecoderModel(config, weights, spec, session, prepared={})
    with pytest.raises(ValueError, match="exactly one of weights and prepared"):
        DecoderModel(config, None, spec, session)
    prepared = graph_weights(config, weights, packed=False, dtype=DType.bfloat16)
    del prepared["norm"]
    with pytest.raises(ValueError, match=r"missing \['norm'\]"):
        DecoderModel(config, None, spec, session, prepared=prepared)
    prepared = graph_weights(config, weights, packed=False, dtype=DType.bfloat16)
    prepared["norm"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="prepared weight norm has shape"):
        DecoderModel(config, None, spec, session, prepared=prepared)


@pytest.mark.unit
def test_bfloat16_weights_are_rounded_to_nearest_even() -> None:
    config, weights = default_llama()
    registry = graph_weights(config, weights, packed=False, dtype=DType.bfloat16)
    embed = registry["embed_tokens"]
    assert isinstance(embed, Buffer) and embed.dtype == DType.bfloat16
    bits = embed.view(DType.uint16, list(embed.shape)).to_numpy().astype(np.uint32) << 16
    np.testing.assert_array_equal(
        bits.view(np.float32), bfloat16_rounded(weights["model.embed_tokens.weight"])
    )
    assert registry["rope.freqs_cis"].dtype == np.float32  # the RoPE table stays float32


@pytest.mark.compile
def test_a_bfloat16_llama_matches_the_float64_reference_on_its_weights() -> None:
    config, weights = default_llama()
    session = InferenceSession(devices=[CPU()])
    params = cache_params(config, DType.bfloat16)
    manager = ContinuousBatchingKVCacheManager(
        params, 4, 64, config.num_hidden_layers, [CPU()], session
    )
    model = DecoderModel(config, weights, manager, session, output="logits")
    seqs = manager.claim(len(PROMPTS))
    tokens = np.concatenate(PROMPTS).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in PROMPTS])]).astype(np.uint32)
    (inputs,) = manager.fetch(seqs, active_lengths=[len(p) for p in PROMPTS])
    logits = model.execute(Buffer.from_numpy(tokens), Buffer.from_numpy(offsets), inputs)
    got = logits.to_numpy()
    assert got.dtype == np.float32 and got.shape == (len(PROMPTS), config.vocab_size)
    rounded = {name: bfloat16_rounded(w) for name, w in weights.items()}
    for row, prompt in zip(got, PROMPTS, strict=True):
        want = logits_reference(config, rounded, prompt)
        tolerance = 0.02 * np.abs(want).max()
        assert np.abs(row - want).max() < tolerance
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 2 * tolerance:
            assert int(row.argmax()) == int(want.argmax())
