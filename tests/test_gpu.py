"""maxkv on a GPU, against the float64 NumPy references (skipped without a GPU).

- The attention ops (fused QKV matmul into the cache, RoPE, flash attention)
  over both caches, four ragged steps on two layers, against
  ``tests/reference.py``.
- A model's first and last gathers alone (the embedding rows of a ragged
  step's tokens, then each sequence's last row), float32 and bfloat16, against
  NumPy.
- A two-layer Llama through the scheduler: the greedy tokens of
  :func:`maxkv.models.reference.greedy_reference`.
- fork, pop_n and copy-on-write on both caches: the rows maxkv's copy kernel
  copies on the device equal their sources, and nothing else changes (the same
  body passes on the CPU).
- Every family in bfloat16 (``tests/test_families.py``'s check, which runs the
  families with a QKV bias or q/k norms on the CPU): logits and next tokens
  against transformers.
- Swap and the host tier on a GPU cache: pages go to host memory and back
  through pinned staging memory (``PageBuffers``), token for token.

``pytest -m gpu`` on a machine with a GPU runs them; each graph compiles on
the device first (minutes).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Accelerator, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, ops

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams, PagedKVCacheManager
from maxkv import ops as kvops
from maxkv.cache.protocol import KVCacheManagerBase
from maxkv.kernels import kernels_path
from maxkv.models import DecoderModel
from maxkv.models.config import default_llama
from maxkv.models.decoder import bfloat16_buffer, cache_params, last_token_rows
from maxkv.models.reference import greedy_reference
from maxkv.serving.scheduler import ContinuousBatchingScheduler

from .family_checkpoints import FAMILIES
from .reference import ReferenceLayerCache
from .test_bfloat16 import bfloat16_rounded
from .test_families import check_bfloat16_family

pytestmark = pytest.mark.gpu

#: Query heads, KV heads, head_dim, hidden: head_dim 16, where MAX's GPU flash
#: attention computes in full precision (at 64 it uses reduced-precision products).
SHAPE = (4, 2, 16, 32)
LAYERS, POSITIONS, THETA = 2, 64, 10000.0
STEPS = ([5, 3, 7], [1, 1, 1], [1, 1, 1], [2, 1, 4])


@pytest.fixture(scope="module")
def gpu() -> Device:
    return Accelerator()


def make_manager(
    kind: str, params: KVCacheParams, device: Device, session: InferenceSession
) -> KVCacheManagerBase:
    if kind == "contiguous":
        return ContinuousBatchingKVCacheManager(params, 4, 32, LAYERS, [device], session)
    return PagedKVCacheManager(params, 8, 32, 4, 32, LAYERS, [device], session)


def attention_graph(manager: KVCacheManagerBase, session: InferenceSession) -> Model:
    heads, kv_heads, head_dim, hidden = SHAPE
    params, ref = manager.params, DeviceRef.from_device(manager.devices[0])
    types = [
        *manager.input_symbols()[0],
        TensorType(DType.float32, ["tokens", hidden], ref),
        TensorType(DType.uint32, ["offsets"], ref),
        TensorType(DType.float32, [(heads + 2 * kv_heads) * head_dim, hidden], ref),
        TensorType(DType.float32, [POSITIONS, head_dim], ref),
        TensorType(DType.uint32, [], DeviceRef.CPU()),
    ]
    with Graph("gpu_attention", input_types=types, custom_extensions=[kernels_path()]) as g:
        *cache, x, offsets, wqkv, freqs, layer = (v.tensor for v in g.inputs)
        kv = manager.collection_fetcher()(*cache)
        q = kvops.fused_qkv_ragged_matmul(params, x, offsets, wqkv, kv, layer)
        q = q.reshape(["tokens", heads, head_dim])
        q = kvops.fused_qk_ragged_rope(params, q, offsets, kv, freqs, layer, interleaved=False)
        g.output(q, kvops.flash_attention_ragged(params, q, offsets, kv, layer))
    return session.load(g)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_attention_ops_on_the_gpu_match_numpy(kind: str, gpu: Device) -> None:
    heads, kv_heads, head_dim, hidden = SHAPE
    session = InferenceSession(devices=[CPU(), gpu])
    manager = make_manager(kind, KVCacheParams(DType.float32, kv_heads, head_dim), gpu, session)
    model = attention_graph(manager, session)
    rng = np.random.default_rng(0)
    reference = ReferenceLayerCache()
    rows = (heads + 2 * kv_heads) * head_dim
    wqkv = [rng.standard_normal((rows, hidden)).astype(np.float32) * 0.25 for _ in range(LAYERS)]
    freqs = kvops.rope_freqs_cis(head_dim, POSITIONS, THETA)
    seqs = manager.claim(3)
    for new in STEPS:
        for layer in range(LAYERS):
            x = rng.standard_normal((sum(new), hidden)).astype(np.float32)
            offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
            (inputs,) = manager.fetch(seqs, active_lengths=new)
            outputs = model.execute(
                *inputs,
                *(Buffer.from_numpy(a).to(gpu) for a in (x, offsets, wqkv[layer], freqs)),
                Buffer.from_numpy(np.array(layer, dtype=np.uint32)),
            )
            expected = reference.step(
                layer, seqs, x, new, wqkv[layer], heads, kv_heads, head_dim, THETA, False
            )
            for got, want in zip(outputs, expected[:2], strict=True):
                got_host = got.to(CPU()).to_numpy().reshape(want.shape)
                np.testing.assert_allclose(got_host, want, atol=1e-4, rtol=1e-4)
        manager.step(dict(zip(seqs, new, strict=True)))


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_the_rows_a_head_reads_on_the_gpu(dtype: DType, gpu: Device) -> None:
    """A model's first and last gathers on the GPU, as its graph makes them: the
    embedding rows of a ragged step's tokens, then each sequence's last row
    (:func:`last_token_rows`), uploaded and run at once (as the scheduler and
    the families' check do), against NumPy.  On an H200 the families' bfloat16
    check once read each sequence's first row instead (the reference's
    position-0 logits)."""
    rng = np.random.default_rng(0)
    ref = DeviceRef.from_device(gpu)
    types = [
        TensorType(DType.int64, ["total_tokens"], ref),
        TensorType(DType.uint32, ["input_row_offsets_len"], ref),
        TensorType(dtype, [128, "hidden"], ref),
    ]
    with Graph(f"head_rows_{dtype}", input_types=types) as g:
        tokens, offsets, rows = (v.tensor for v in g.inputs)
        h = ops.gather(rows, tokens, axis=0)
        g.output(ops.cast(ops.gather(h, last_token_rows(offsets), axis=0), DType.float32))
    model = InferenceSession(devices=[gpu]).load(g)
    # The families' check's hidden size, then SmolLM2's.
    for hidden, lengths in itertools.product([64, 576], ([40, 21, 5], [1, 1, 1], [7])):
        table = rng.standard_normal((128, hidden)).astype(np.float32)
        if dtype == DType.bfloat16:
            host, stored = bfloat16_buffer(table), bfloat16_rounded(table)
        else:
            host, stored = Buffer.from_numpy(table), table
        ids = rng.integers(0, 128, sum(lengths))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
        (got,) = model.execute(
            Buffer.from_numpy(ids).to(gpu), Buffer.from_numpy(offsets).to(gpu), host.to(gpu)
        )
        want = stored[ids[offsets[1:] - 1]]
        np.testing.assert_array_equal(got.to(CPU()).to_numpy(), want, f"{hidden} {lengths}")


def test_a_two_layer_llama_on_the_gpu_gives_numpys_greedy_tokens(gpu: Device) -> None:
    config, weights = default_llama()
    prompts = [[1, 5, 9, 200, 3], [7, 7, 100], [42]]
    session = InferenceSession(devices=[gpu])
    manager = ContinuousBatchingKVCacheManager(
        cache_params(config), len(prompts), 64, 2, [gpu], session
    )
    model = DecoderModel(config, weights, manager, session)
    scheduler = ContinuousBatchingScheduler(model, manager, len(prompts), stop_at_eos=False)
    for prompt in prompts:
        scheduler.submit(prompt, 6)
    outputs, _ = scheduler.run()
    assert outputs == [greedy_reference(config, weights, p, 6) for p in prompts]


#: Rows no sequence has written: copies must leave them alone.
SENTINEL = -7.0


def _device_rows(buffer: Buffer) -> np.ndarray:
    return buffer.to(CPU()).to_numpy()


def check_fork_and_pop_n_copy_rows(device: Device) -> None:
    """fork (a partial page or a slot copied by maxkv's copy kernel), pop_n, then
    copy-on-write of a shared page, on ``device``'s caches: every copied row equals
    its source bit for bit, and no other row changes."""
    session = InferenceSession(devices=[CPU(), device])
    params = KVCacheParams(DType.float32, 2, 16)
    rng = np.random.default_rng(3)

    contiguous = ContinuousBatchingKVCacheManager(params, 4, 16, 2, [device], session)
    (parent,) = contiguous.claim(1)
    host = np.full(contiguous.block_shape(4), SENTINEL, np.float32)
    host[parent, :, :, :10] = rng.standard_normal(host[parent, :, :, :10].shape)
    contiguous._blocks[0].inplace_copy_from(Buffer.from_numpy(host).to(device))
    contiguous.step({parent: 10})
    child = contiguous.fork(parent, 6)
    view = _device_rows(contiguous._blocks[0])
    np.testing.assert_array_equal(view[child, :, :, :6], host[parent, :, :, :6])
    assert (view[child, :, :, 6:] == SENTINEL).all(), "nothing past fork_pos is written"
    np.testing.assert_array_equal(view[parent], host[parent])
    contiguous.pop_n(parent, 4)
    assert contiguous.cache_lengths == {parent: 6, child: 6}

    paged = PagedKVCacheManager(params, 4, 16, 4, 16, 2, [device], session)
    (parent,) = paged.claim(1)
    paged.fetch([parent], active_lengths=[10])
    host = np.full(paged.pages_shape(16), SENTINEL, np.float32)
    parent_pages = paged.pages(parent)
    for t in range(10):
        host[parent_pages[t // 4], :, :, t % 4] = rng.standard_normal(host[0, :, :, 0].shape)
    paged._pages[0].inplace_copy_from(Buffer.from_numpy(host).to(device))
    paged.step({parent: 10})
    child = paged.fork(parent, 6)  # page 0 shared, tokens 4-5 copied into a new page
    child_pages = paged.pages(child)
    assert child_pages[0] == parent_pages[0] and child_pages[1] != parent_pages[1]
    view = _device_rows(paged._pages[0])
    np.testing.assert_array_equal(view[child_pages[1], :, :, :2], host[parent_pages[1], :, :, :2])
    assert (view[child_pages[1], :, :, 2:] == SENTINEL).all()
    np.testing.assert_array_equal(view[parent_pages[0]], host[parent_pages[0]])

    paged.pop_n(parent, 8)  # 10 -> 2 tokens, inside the shared page 0
    paged.fetch([parent], active_lengths=[1])  # writing token 2 copies page 0 first
    own = paged.pages(parent)[0]
    assert own != child_pages[0] and paged.page_refcount(child_pages[0]) == 1
    view = _device_rows(paged._pages[0])
    np.testing.assert_array_equal(view[own, :, :, :2], host[parent_pages[0], :, :, :2])
    np.testing.assert_array_equal(view[child_pages[0]], host[parent_pages[0]])


def test_fork_pop_n_and_copy_on_write_copy_rows_on_the_gpu(gpu: Device) -> None:
    check_fork_and_pop_n_copy_rows(gpu)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_in_bfloat16_on_the_gpu_matches_transformers(
    family: str, gpu: Device, tmp_path: Path
) -> None:
    check_bfloat16_family(family, tmp_path, gpu, InferenceSession(devices=[CPU(), gpu]))


def test_swap_and_the_host_tier_move_a_gpu_caches_pages(gpu: Device) -> None:
    check_swap_and_host_tier(gpu)


def check_swap_and_host_tier(device: Device) -> None:
    """A bfloat16 cache's pages on ``device`` through swap (out, evicted, in) and
    the host tier (offloaded, forgotten by the device, loaded back): every row
    read back equals the bits written there.  On a GPU the pages move through
    pinned staging memory; ``tests/test_tiers_model.py`` runs this body on the
    CPU with the staged path forced."""
    from maxkv.tiers import TierConfig
    from maxkv.tiers.connector import host_view

    session = InferenceSession(devices=[CPU(), device])
    params = KVCacheParams(DType.bfloat16, 2, 16)
    manager = PagedKVCacheManager(
        params,
        4,
        8,
        4,
        64,
        2,
        [device],
        session,
        enable_prefix_caching=True,
        tiers=TierConfig(model_id="gpu-test"),
    )
    rng = np.random.default_rng(0)
    shape = list(manager._pages[0].shape)

    def host_bits() -> np.ndarray:
        return host_view(manager._pages[0].to(CPU())).copy()

    def write(seq: int, n: int) -> np.ndarray:
        host = host_bits()
        bits = rng.integers(0, 2**16, (n, *shape[1:3], *shape[4:])).astype(np.uint16)
        for t in range(n):
            host[manager.pages(seq)[t // 4], :, :, t % 4] = bits[t]
        source = Buffer.from_numpy(host).view(DType.bfloat16, shape).to(device)
        manager._pages[0].inplace_copy_from(source)
        device.synchronize()  # the copy is queued: ``host`` must outlive it
        return bits

    def rows(seq: int, n: int) -> np.ndarray:
        host = host_bits()
        return np.stack([host[manager.pages(seq)[t // 4], :, :, t % 4] for t in range(n)])

    prompt = list(range(100, 117))  # 4 full pages + 1 token
    seq, _ = manager.claim_prefix(prompt)
    manager.fetch([seq], 1, active_lengths={seq: len(prompt)})
    bits = write(seq, len(prompt))
    manager.step({seq: len(prompt)}, tokens={seq: prompt})
    swapped = manager.swap_out(seq)
    filler, _ = manager.claim_prefix(list(range(300, 329)))  # 8 pages: evicts the prompt
    manager.fetch([filler], 1, active_lengths={filler: 29})
    manager.release(filler)
    back = manager.swap_in(swapped)
    np.testing.assert_array_equal(rows(back, 17), bits)
    manager.release(back)
    manager._pool.reset_cache()  # the device forgets the prefix; the host tier has it
    again, cached = manager.claim_prefix(prompt)
    assert cached == 16 and manager.tier_hit_tokens == 16
    np.testing.assert_array_equal(rows(again, 16), bits[:16])
    manager.close()
