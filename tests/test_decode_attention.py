"""maxkv's CPU decode-attention kernel (one new token per sequence, or a few
while verifying speculative drafts) against NumPy.

``flash_attention_ragged`` takes maxkv's kernel when every sequence of the step
has 1 to 8 new tokens.  The grid covers contexts 1 to 4096, batches 1 to 64 with
mixed lengths, GQA ratios 1, 3 and 4, head_dim 64 and 128, float32 and
bfloat16, and contexts long enough to be split over workers and merged.  Cache
rows past each sequence's context hold NaN, and layer 0 holds other values
than layer 1 (the layer read): a read out of range shows up in the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType

from maxkv import (
    ContinuousBatchingKVCacheManager,
    FetchContinuousBatchingKVCacheCollection,
    KVCacheParams,
    kernels_path,
)
from maxkv import ops as kvops

from .reference import attention
from .test_attention import as_numpy, round_to, to_buffer

pytestmark = pytest.mark.compile


NUM_LAYERS = 2
LAYER = 1


@dataclass(frozen=True)
class DecodeConfig:
    dtype: DType
    q_heads: int
    kv_heads: int
    head_dim: int
    #: A sliding window (the causal mask limited to this many tokens).
    window: int | None = None

    @property
    def params(self) -> KVCacheParams:
        return KVCacheParams(self.dtype, self.kv_heads, self.head_dim)


MHA_64 = DecodeConfig(DType.float32, 8, 8, 64)  # GQA ratio 1
GQA3_128 = DecodeConfig(DType.float32, 6, 2, 128)  # ratio 3
GQA4_64 = DecodeConfig(DType.float32, 12, 3, 64)  # ratio 4, SmolLM2's 3 KV heads
GQA4_BF16 = DecodeConfig(DType.bfloat16, 8, 2, 64)
GQA3_WINDOW = DecodeConfig(DType.float32, 6, 2, 128, window=300)  # splits inside the window


@pytest.fixture(scope="session")
def decode_model(session: InferenceSession) -> Callable[[DecodeConfig], Model]:
    """One compiled decode-attention graph per config (batch and context are runtime)."""
    models: dict[DecodeConfig, Model] = {}

    def get(config: DecodeConfig) -> Model:
        if config not in models:
            manager = ContinuousBatchingKVCacheManager(
                config.params, 1, 2, NUM_LAYERS, [CPU()], session
            )
            types = [
                *manager.input_symbols()[0],
                TensorType(
                    config.dtype, ["batch", config.q_heads, config.head_dim], DeviceRef.CPU()
                ),
                TensorType(DType.uint32, ["offsets"], DeviceRef.CPU()),
            ]
            with Graph(
                "decode_attention", input_types=types, custom_extensions=[kernels_path()]
            ) as graph:
                *cache, q, offsets = (v.tensor for v in graph.inputs)
                kv = FetchContinuousBatchingKVCacheCollection(config.params)(*cache)
                graph.output(
                    kvops.flash_attention_ragged(
                        config.params, q, offsets, kv, LAYER, window=config.window
                    )
                )
            models[config] = session.load(graph)
        return models[config]

    return get


def run_case(
    config: DecodeConfig,
    model: Model,
    session: InferenceSession,
    contexts: list[int],
    seed: int,
    new: list[int] | None = None,
) -> float:
    """Attends ``new[b]`` (default 1) new tokens per sequence over ``contexts``
    cached tokens (the new ones included); returns the worst absolute error
    against NumPy."""
    rng = np.random.default_rng(seed)
    batch = len(contexts)
    new = new or [1] * batch
    manager = ContinuousBatchingKVCacheManager(
        config.params, batch, max(contexts), NUM_LAYERS, [CPU()], session
    )
    ids = manager.claim(batch)
    shape = manager.block_shape(batch)
    blocks = np.full(shape, np.nan, dtype=np.float32)
    blocks[:, :, 0] = rng.standard_normal(blocks[:, :, 0].shape, dtype=np.float32) * 3
    for slot, context, n in zip(ids, contexts, new, strict=True):
        blocks[slot, :, LAYER, :context] = rng.standard_normal(
            (2, context, config.kv_heads, config.head_dim), dtype=np.float32
        )
        if config.window:  # rows outside every new token's window must not be read
            blocks[slot, :, LAYER, : max(0, context - n - config.window + 1)] = np.nan
    q = rng.standard_normal((sum(new), config.q_heads, config.head_dim), dtype=np.float32)
    manager.fetch(ids)
    manager.step({seq: c - n for seq, c, n in zip(ids, contexts, new, strict=True)})
    (inputs,) = manager.fetch(ids, active_lengths=new)  # cache_length = context - new
    source = to_buffer(blocks, config.dtype)
    inputs[0].inplace_copy_from(source)
    manager.devices[0].synchronize()  # the copy may run asynchronously: wait before `source` goes
    del source
    starts = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    offsets = Buffer.from_numpy(starts)
    (out,) = model.execute(*inputs, to_buffer(q, config.dtype), offsets)
    actual = as_numpy(out)
    stored = round_to(blocks, config.dtype)
    queries = round_to(q, config.dtype)
    scale = 1 / math.sqrt(config.head_dim)
    worst = 0.0
    for b, (slot, context) in enumerate(zip(ids, contexts, strict=True)):
        k = stored[slot, 0, LAYER, :context]
        v = stored[slot, 1, LAYER, :context]
        rows = slice(int(starts[b]), int(starts[b + 1]))
        expected = attention(queries[rows], k, v, context - new[b], True, scale, config.window)
        error = np.abs(actual[rows] - expected)
        if not np.isfinite(error).all():  # a NaN row was read
            return math.inf
        worst = max(worst, float(error.max()))
    return worst


F32_ATOL = 1e-5
# bf16 as in test_attention: the output is rounded to bf16 once (|values| < 1 here).
BF16_ATOL = 8e-3

#: Shapes the default run leaves to ``--sweeps`` (one graph compile each): the
#: default run checks SmolLM2's grouping (4) and, with a window, grouping 3 at
#: head size 128.
SWEEP_CONFIGS = (MHA_64, GQA3_128, GQA4_BF16)


def cases(rows: list[tuple[Any, ...]]) -> list[Any]:
    """``rows`` as parameters, those of a sweep shape marked ``sweep``."""
    return [
        pytest.param(*row, marks=[pytest.mark.sweep] if row[0] in SWEEP_CONFIGS else [])
        for row in rows
    ]


CASES = [
    (MHA_64, [1]),
    (MHA_64, [2, 63, 64, 65]),
    (MHA_64, [4096]),
    (MHA_64, [4096, 1, 777]),
    (GQA3_128, [1, 17, 64, 255, 256, 257, 1000, 2049]),
    (GQA3_128, [4096]),
    (GQA4_64, [3000, 5, 1300]),
    (GQA4_BF16, [4096, 129, 1]),
    (GQA3_WINDOW, [1, 299, 300, 301, 4096]),
]


@pytest.mark.parametrize(
    ("config", "contexts"),
    cases(CASES),
    ids=[f"{c.dtype}-q{c.q_heads}-kv{c.kv_heads}-d{c.head_dim}-w{c.window}-{x}" for c, x in CASES],
)
def test_decode_matches_numpy(
    decode_model: Callable[[DecodeConfig], Model],
    session: InferenceSession,
    config: DecodeConfig,
    contexts: list[int],
) -> None:
    worst = run_case(config, decode_model(config), session, contexts, seed=len(contexts))
    assert worst <= (BF16_ATOL if config.dtype == DType.bfloat16 else F32_ATOL), worst


@pytest.mark.parametrize("config", [pytest.param(MHA_64, marks=pytest.mark.sweep), GQA4_64])
def test_decode_batch_64_mixed_lengths(
    decode_model: Callable[[DecodeConfig], Model],
    session: InferenceSession,
    config: DecodeConfig,
) -> None:
    contexts = [int(c) for c in np.random.default_rng(7).integers(1, 600, size=64)]
    contexts[0], contexts[1] = 1, 2048
    assert run_case(config, decode_model(config), session, contexts, seed=64) <= F32_ATOL


#: Steps that verify speculative drafts: 1 to 8 new tokens per sequence take
#: maxkv's kernel (an item per token), 9 and more MAX's (or, over another
#: encoding, maxkv's blocks of 4 query tokens).
VERIFY_CASES = [
    (GQA4_64, [300, 1000, 40, 2049], [5, 2, 8, 1]),
    (GQA3_128, [5000, 9], [3, 9]),
    (MHA_64, [700, 64], [4, 6]),
    (GQA4_BF16, [1500, 2], [7, 2]),
    (GQA3_WINDOW, [299, 303, 4096], [4, 8, 5]),
]


@pytest.mark.parametrize(
    ("config", "contexts", "new"),
    cases(VERIFY_CASES),
    ids=[f"{c.dtype}-q{c.q_heads}-kv{c.kv_heads}-w{c.window}-{n}" for c, _, n in VERIFY_CASES],
)
def test_verify_steps_match_numpy(
    decode_model: Callable[[DecodeConfig], Model],
    session: InferenceSession,
    config: DecodeConfig,
    contexts: list[int],
    new: list[int],
) -> None:
    worst = run_case(config, decode_model(config), session, contexts, seed=len(new), new=new)
    assert worst <= (BF16_ATOL if config.dtype == DType.bfloat16 else F32_ATOL), worst
