"""Paged mode: attention over pages equals the contiguous cache bit for bit.

Both managers run the same steps on the same inputs in lockstep; every
output and every cached K/V row must be identical (the contiguous path is
itself checked against NumPy in ``test_attention``, and so is this one's
first scenario).  Pages are 4 tokens, so sequences span several pages, which
the allocator interleaves between sequences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession, Model

from maxkv import CacheFullError, ContinuousBatchingKVCacheManager, PagedKVCacheManager
from maxkv import ops as kvops
from maxkv.cache.paged import UNUSED_PAGE

from .reference import ReferenceLayerCache
from .test_attention import (
    GQA_F32,
    MAX_POSITIONS,
    THETA,
    AttentionConfig,
    build_layer_graph,
    check,
    round_to,
)

pytestmark = pytest.mark.compile


PAGE_SIZE = 4
NUM_PAGES = 48


def paged_manager(
    config: AttentionConfig, session: InferenceSession, num_pages: int = NUM_PAGES
) -> PagedKVCacheManager:
    return PagedKVCacheManager(
        config.params,
        PAGE_SIZE,
        num_pages,
        config.slots,
        config.max_seq_len,
        config.num_layers,
        [CPU()],
        session,
    )


_models: dict[str, Model] = {}


@pytest.fixture(scope="session")
def twin_models(session: InferenceSession, kernels: Path) -> tuple[Model, Model]:
    """The GQA layer graph over the contiguous and over the paged cache."""
    from . import test_attention

    if GQA_F32 not in test_attention._models:  # shared with test_attention's fixture
        test_attention._models[GQA_F32] = build_layer_graph(GQA_F32, session, kernels)
    if "paged" not in _models:
        _models["paged"] = build_layer_graph(
            GQA_F32, session, kernels, paged_manager(GQA_F32, session)
        )
    return test_attention._models[GQA_F32], _models["paged"]


class Twin:
    """A contiguous and a paged manager driven in lockstep with the same inputs."""

    def __init__(self, models: tuple[Model, Model], session: InferenceSession, seed: int) -> None:
        self.config = config = GQA_F32
        self.contiguous: ContinuousBatchingKVCacheManager = config.manager(session)
        self.paged = paged_manager(config, session)
        self.models = models
        self.rng = np.random.default_rng(seed)
        rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = [
            round_to(self.rng.standard_normal((rows, config.hidden)) * 0.25, config.dtype)
            for _ in range(config.num_layers)
        ]
        self.freqs = kvops.rope_freqs_cis(config.head_dim, MAX_POSITIONS, THETA)
        self.reference: ReferenceLayerCache | None = ReferenceLayerCache()

    def both(self, method: str, *args: object) -> object:
        a = getattr(self.contiguous, method)(*args)
        b = getattr(self.paged, method)(*args)
        assert a == b, (method, a, b)
        return a

    def run(
        self, layer: int, seqs: list[int], new_tokens: list[int], x: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """One layer step on both; asserts identical outputs and returns them."""
        cfg = self.config
        if x is None:
            x = round_to(self.rng.standard_normal((sum(new_tokens), cfg.hidden)), cfg.dtype)
        offsets = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32)
        results = []
        for manager, model in zip((self.contiguous, self.paged), self.models, strict=True):
            (inputs,) = manager.fetch(seqs, active_lengths=new_tokens)
            outputs = model.execute(
                *inputs,
                Buffer.from_numpy(x.astype(np.float32)),
                Buffer.from_numpy(offsets),
                Buffer.from_numpy(self.wqkv[layer].astype(np.float32)),
                Buffer.from_numpy(self.freqs),
                Buffer.from_numpy(np.array(layer, dtype=np.uint32)),
            )
            results.append([o.to_numpy().copy() for o in outputs])
        for got, want in zip(results[1], results[0], strict=True):
            np.testing.assert_array_equal(got, want)
        if self.reference is not None:
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
            )
            check(results[1], expected, 1e-4)
        return results[1]

    def step(self, lengths: dict[int, int]) -> None:
        self.contiguous.step(lengths)
        self.paged.step(lengths)

    def check_cache(self) -> None:
        """Every committed K/V row of every sequence is identical in both caches."""
        blocks = self.contiguous._blocks[0].to_numpy()
        pages = self.paged._pages[0].to_numpy()
        for seq, length in self.paged.cache_lengths.items():
            assert self.contiguous.cache_lengths[seq] == length
            held = self.paged.pages(seq)
            assert len(held) >= -(-length // PAGE_SIZE)
            tokens = np.arange(length)
            rows = pages[
                np.array(held, dtype=np.int64)[tokens // PAGE_SIZE], :, :, tokens % PAGE_SIZE
            ]
            # rows: [length, 2, layers, heads, dim]; blocks[seq]: [2, layers, len, heads, dim]
            np.testing.assert_array_equal(rows, np.moveaxis(blocks[seq, :, :, :length], 2, 0))


def test_paged_equals_contiguous_prefill_decode_mixed(
    twin_models: tuple[Model, Model], session: InferenceSession
) -> None:
    twin = Twin(twin_models, session, seed=0)
    twin.both("claim", 6)
    seqs = [3, 0, 5]
    for layer in (0, 1):
        twin.run(layer, seqs, [5, 9, 1])
    twin.step({3: 5, 0: 9, 5: 1})
    # 9 tokens span three pages; pages of different sequences interleave.
    assert len(twin.paged.pages(0)) == 3
    for layer in (0, 1):
        twin.run(layer, seqs, [1, 1, 1])
    twin.step({3: 1, 0: 1, 5: 1})
    for layer in (1, 0):
        twin.run(layer, [5, 2, 3, 0], [1, 4, 1, 1])
    twin.step({5: 1, 2: 4, 3: 1, 0: 1})
    twin.check_cache()
    # Pages held = pages reserved for each sequence's tokens; the rest are free.
    held = sum(len(twin.paged.pages(s)) for s in twin.paged.cache_lengths)
    assert twin.paged.free_pages == NUM_PAGES - held


def test_paged_fork_pop_n_copy_on_write(
    twin_models: tuple[Model, Model], session: InferenceSession
) -> None:
    twin = Twin(twin_models, session, seed=1)
    twin.reference = None  # forks are checked against the contiguous cache
    twin.both("claim", 2)
    for layer in (0, 1):
        twin.run(layer, [0, 1], [6, 3])
    twin.step({0: 6, 1: 3})
    free = twin.paged.free_pages
    child = twin.both("fork", 0, None)  # 6 tokens: page 0 shared, page 1 copied
    assert twin.paged.pages(child)[0] == twin.paged.pages(0)[0]
    assert twin.paged.pages(child)[1] != twin.paged.pages(0)[1]
    assert twin.paged.free_pages == free - 1
    twin.check_cache()

    # The same query on parent and child: identical attention.
    x = round_to(np.random.default_rng(7).standard_normal((1, GQA_F32.hidden)), GQA_F32.dtype)
    for layer in (0, 1):
        q_attn = twin.run(layer, [0, child], [1, 1], np.concatenate([x, x]))
        np.testing.assert_array_equal(q_attn[1][0], q_attn[1][1])
    twin.step({0: 1, child: 1})

    # Rewind the parent into its shared page: the next write copies it first.
    twin.both("pop_n", 0, 5)  # 7 -> 2 tokens, inside shared page 0
    assert twin.paged.page_refcount(twin.paged.pages(0)[0]) == 2
    for layer in (0, 1):
        twin.run(layer, [0, child, 1], [3, 1, 2])
    twin.step({0: 3, child: 1, 1: 2})
    assert twin.paged.pages(0)[0] != twin.paged.pages(child)[0]
    assert twin.paged.page_refcount(twin.paged.pages(child)[0]) == 1
    twin.check_cache()
    for seq in (0, child, 1):
        twin.both("release", seq)
    assert twin.paged.free_pages == NUM_PAGES


def test_forged_page_table_is_refused(
    twin_models: tuple[Model, Model], session: InferenceSession
) -> None:
    """A page table built by hand: out-of-range pages, lengths past the pages. Nothing written."""
    twin = Twin(twin_models, session, seed=2)
    twin.reference = None
    twin.both("claim", 2)
    twin.run(0, [0, 1], [2, 3])
    twin.step({0: 2, 1: 3})
    pages_buffer = twin.paged._pages[0]
    before = pages_buffer.to_numpy().copy()
    model = twin.models[1]
    width = twin.paged.max_pages_per_seq

    def execute(lengths: list[int], table_rows: list[list[int]], offsets: list[int]) -> None:
        table = np.full((2, width), UNUSED_PAGE, dtype=np.uint32)
        for row, held in enumerate(table_rows):
            table[row, : len(held)] = held
        tokens = offsets[-1]
        model.execute(
            pages_buffer,
            Buffer.from_numpy(np.array(lengths, dtype=np.uint32)),
            Buffer.from_numpy(table),
            Buffer.from_numpy(np.array([[4, max(lengths)]], dtype=np.uint32)),
            Buffer.from_numpy(np.ones((tokens, GQA_F32.hidden), dtype=np.float32)),
            Buffer.from_numpy(np.array(offsets, dtype=np.uint32)),
            Buffer.from_numpy(twin.wqkv[0].astype(np.float32)),
            Buffer.from_numpy(twin.freqs),
            Buffer.from_numpy(np.array(0, dtype=np.uint32)),
        )

    with pytest.raises(Exception, match="is not a page"):  # page id past num_pages
        execute([2, 3], [[0], [NUM_PAGES + 5]], [0, 1, 2])
    with pytest.raises(Exception, match="is not a page"):  # 6 cached tokens, one page
        execute([6, 3], [[0], [1]], [0, 1, 2])
    with pytest.raises(Exception, match="is not a page"):  # new tokens past the pages
        execute([2, 3], [[0], [1]], [0, 3, 4])
    with pytest.raises(Exception, match="holds 8 pages"):  # past the table
        execute([2, 31], [[0], list(range(1, 9))], [0, 1, 3])
    np.testing.assert_array_equal(pages_buffer.to_numpy(), before)


def test_out_of_pages_is_a_value_error_before_any_change(session: InferenceSession) -> None:
    manager = paged_manager(GQA_F32, session, num_pages=3)
    manager.claim(2)
    manager.fetch([0], active_lengths=[8])  # 2 pages
    manager.step({0: 8})
    with pytest.raises(CacheFullError, match="out of pages: this step needs 2"):
        manager.fetch([0, 1], active_lengths=[1, 4])  # seq 0: 1 page, seq 1: 1 page... of 1
    with pytest.raises(CacheFullError, match="out of pages: this step needs 2"):
        manager.reserve({0: 9, 1: 4})  # the same room, asked ahead
    assert manager.free_pages == 1
    assert manager.pages(1) == ()
    assert len(manager.pages(0)) == 2
    manager.fetch([1], active_lengths=[4])
    assert manager.free_pages == 0
    manager.release(0)
    assert manager.free_pages == 2


@pytest.mark.parametrize("staged", [False, True])
def test_swap_and_the_host_tier_round_trip_pages(
    staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tests/test_gpu.py``'s swap and host-tier check on the CPU: in place (a CPU
    cache's path) and staged (the GPU's: pinned staging memory, MAX's copies on
    the device's queue, one event), forced here."""
    import functools

    from maxkv.tiers import connector

    from .test_gpu import check_swap_and_host_tier

    if staged:
        monkeypatch.setattr(
            connector, "PageBuffers", functools.partial(connector.PageBuffers, staged=True)
        )
    check_swap_and_host_tier(CPU())
