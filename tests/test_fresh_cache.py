"""A new manager's first step keeps what it writes.

``Buffer.zeros`` only enqueues its fill, and a graph that takes the buffer is
not ordered after that fill (the graph writes the cache through the opaque
collection, which MAX does not see as a write).  Before the managers waited
for the fill, a fresh 1 GiB cache lost every key and value its first step
wrote, and SmolLM2's first prefill on a fresh manager was wrong now and then
(layer 0's values zeroed).  A large cache makes the fill slow enough to lose
the race every time.
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
from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams, PagedKVCacheManager
from maxkv.cache.protocol import KVCacheManagerBase

pytestmark = pytest.mark.compile

PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=8, head_dim=64)
LAYERS = 4
MAX_SEQ_LEN = 1024
WIDTH = PARAMS.n_kv_heads * PARAMS.head_dim
NEW_TOKENS = 16


def make(kind: str, session: InferenceSession, slots: int) -> KVCacheManagerBase:
    """A manager of ``slots`` full-length sequences (1 GiB at 64 slots)."""
    if kind == "contiguous":
        return ContinuousBatchingKVCacheManager(
            PARAMS, slots, MAX_SEQ_LEN, LAYERS, [CPU()], session
        )
    page_size = 128
    return PagedKVCacheManager(
        PARAMS,
        page_size,
        slots * MAX_SEQ_LEN // page_size,
        slots,
        MAX_SEQ_LEN,
        LAYERS,
        [CPU()],
        session,
    )


def write_graph(manager: KVCacheManagerBase, kernels: Path) -> Model:
    """``write_kv_ragged`` of the same rows as keys and values into every layer."""
    ref = DeviceRef.CPU()
    types = [
        *manager.input_symbols()[0],
        TensorType(DType.float32, ["tokens", WIDTH], ref),
        TensorType(DType.uint32, ["offsets"], ref),
    ]
    with Graph(
        f"fresh_write_{type(manager).__name__}", input_types=types, custom_extensions=[kernels]
    ) as graph:
        *cache, rows, offsets = (v.tensor for v in graph.inputs)
        kv = manager.collection_fetcher()(*cache)
        written = [
            maxkv.ops.write_kv_ragged(PARAMS, rows, rows, offsets, kv, layer)
            for layer in range(LAYERS)
        ]
        graph.output(written[-1])
    return manager.session.load(graph)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_first_step_on_a_fresh_large_cache_keeps_its_writes(
    kind: str, session: InferenceSession, kernels: Path
) -> None:
    model = write_graph(make(kind, session, 1), kernels)
    rows = np.random.default_rng(0).standard_normal((NEW_TOKENS, WIDTH)).astype(np.float32)
    for _ in range(2):
        manager = make(kind, session, 64)
        seq = manager.max_batch_size - 1  # the end of the buffer: the fill reaches it last
        manager.external_claim([seq])
        (inputs,) = manager.fetch([seq], active_lengths=[NEW_TOKENS])
        model.execute(
            *inputs,
            Buffer.from_numpy(rows),
            Buffer.from_numpy(np.array([0, NEW_TOKENS], dtype=np.uint32)),
        )
        manager.step({seq: NEW_TOKENS})
        for layer in range(LAYERS):
            keys, values = manager_rows(manager, seq, layer)
            np.testing.assert_array_equal(keys, rows)
            np.testing.assert_array_equal(values, rows)
        del manager


def manager_rows(
    manager: KVCacheManagerBase, seq: int, layer: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first ``NEW_TOKENS`` keys and values of ``seq`` in ``layer``, read on the host."""
    if isinstance(manager, ContinuousBatchingKVCacheManager):
        block = manager._blocks[0].to_numpy()[seq, :, layer, :NEW_TOKENS]
        return block[0].reshape(NEW_TOKENS, WIDTH), block[1].reshape(NEW_TOKENS, WIDTH)
    assert isinstance(manager, PagedKVCacheManager)
    (page,) = manager.pages(seq)[:1]
    block = manager._pages[0].to_numpy()[page, :, layer, :NEW_TOKENS]
    return block[0].reshape(NEW_TOKENS, WIDTH), block[1].reshape(NEW_TOKENS, WIDTH)
