"""Prefix caching by page sharing: the page pool's eviction order, read-only cached
pages, salts, and checks before any change (on the NumPy device layer).

The stateful model of page ownership and hashes is ``PagedPrefixMachine`` in
``test_reliability``; here are the cases a random walk reaches rarely.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType

from maxkv import CacheFullError, KVCacheParams, PagedKVCacheManager
from maxkv.cache.page_pool import PagePool
from maxkv.cache.prefix import block_hash, block_hashes, root_hash

from . import fakes

pytestmark = pytest.mark.unit


PAGE = 4


def test_hash_chain_depends_on_every_earlier_token_and_the_salt() -> None:
    tokens = list(range(12))
    chain = block_hashes(tokens, PAGE)
    assert len(chain) == 3 and len(set(chain)) == 3
    assert chain[1] == block_hash(chain[0], tokens[4:8])
    changed = block_hashes([99, *tokens[1:]], PAGE)  # the first token differs
    assert all(a != b for a, b in zip(chain, changed, strict=True))
    salted = block_hashes(tokens, PAGE, root_hash("tenant-a"))
    assert all(a != b for a, b in zip(chain, salted, strict=True))
    assert salted == block_hashes(tokens, PAGE, root_hash("tenant-a"))
    assert root_hash(None) == b"" and root_hash("a") != root_hash("b")
    assert block_hashes(tokens[:7], PAGE) == chain[:1]  # only full pages


def test_page_pool_evicts_uncached_pages_first_then_least_recently_freed() -> None:
    pool = PagePool(4)
    a, b, c, d = pool.allocate(4)
    assert (a, b, c, d) == (0, 1, 2, 3) and pool.free_count == 0
    for page, name in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.register(page, name) == page
    assert pool.cached_count == 3 and pool.lookup(b"b") == b
    pool.free([c, d])  # c: cached (back of the queue); d: no content (front)
    pool.free([a])  # a is freed after c
    assert pool.free_count == 3
    assert pool.allocate(1) == [d] and pool.counters.evictions == 0  # nothing lost
    assert pool.allocate(1) == [c] and pool.counters.evictions == 1  # oldest cached
    assert pool.lookup(b"c") is None and pool.lookup(b"a") == a
    pool.share([a])  # a hit revives a free cached page
    assert pool.refcount(a) == 1 and pool.free_count == 0
    assert pool.register(d, b"a") == a  # the same content is cached already
    pool.free([b, a])
    assert pool.allocate(2) == [b, a] and pool.counters.evictions == 3
    assert pool.reset_cache() == 0 and pool.cached_count == 0
    with pytest.raises(ValueError, match="out of pages"):
        pool.allocate(1)


@pytest.fixture
def manager() -> PagedKVCacheManager:
    params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=4)
    return fakes.paged(params, PAGE, 8, 4, 32, enable_prefix_caching=True)


def write(manager: PagedKVCacheManager, seq: int, tokens: list[int], value: float) -> None:
    """fetch, write ``value`` at each new token's rows through the page table, step."""
    (inputs,) = manager.fetch([seq], active_lengths=[len(tokens)])
    pages, table, start = inputs[0].to_numpy(), inputs[2].to_numpy(), int(inputs[1].to_numpy()[0])
    for t in range(start, start + len(tokens)):
        pages[table[0, t // PAGE], :, 0, t % PAGE] = value
    manager.step({seq: len(tokens)}, tokens={seq: tokens})


def read(manager: PagedKVCacheManager, seq: int) -> np.ndarray:
    pages = manager._pages[0].to_numpy()
    held = manager.pages(seq)
    t = np.arange(manager.cache_lengths[seq])
    return pages[np.array(held)[t // PAGE], 0, 0, t % PAGE, 0, 0]


def test_a_cached_page_is_copied_before_it_is_written(manager: PagedKVCacheManager) -> None:
    prompt = list(range(1, 10))
    a, cached = manager.claim_prefix(prompt)
    assert cached == 0
    write(manager, a, prompt, 1.0)
    first_pages = manager.pages(a)[:2]
    assert all(manager.page_is_cached(p) for p in first_pages)
    assert manager.page_refcount(first_pages[1]) == 1  # held once, yet read-only

    manager.pop_n(a, 3)  # back into the second page, which stays cached
    write(manager, a, [50, 51, 52], 2.0)  # a speculative branch rewrites tokens 6..8
    assert manager.pages(a)[1] != first_pages[1]  # copied, then written
    np.testing.assert_array_equal(read(manager, a), [1.0] * 6 + [2.0] * 3)

    b, cached = manager.claim_prefix(prompt)  # the original tokens are still cached
    assert cached == 8 and manager.pages(b) == first_pages
    np.testing.assert_array_equal(read(manager, b), [1.0] * 8)
    stats = manager.prefix_cache_stats
    assert (stats.lookups, stats.hit_tokens, stats.evictions) == (2, 8, 0)
    assert stats.cached_pages == 3  # a's two pages, and a's rewritten second page


def test_salts_fork_and_release_keep_pages_findable(manager: PagedKVCacheManager) -> None:
    prompt = list(range(1, 14))  # 3 full pages of the first 12 tokens
    a, _ = manager.claim_prefix(prompt, salt="tenant-a")
    write(manager, a, prompt, 3.0)
    assert manager.cached_prefix_length(prompt, salt="tenant-a") == 12
    assert manager.cached_prefix_length(prompt) == 0  # no salt: nothing shared
    assert manager.cached_prefix_length(prompt, salt="tenant-b") == 0

    child = manager.fork(a, 6)  # one shared page and a copy of the partial second
    assert manager.pages(child)[0] == manager.pages(a)[0]
    write(manager, child, [70, 71], 4.0)  # fills the child's own second page
    assert manager.cached_prefix_length([*prompt[:6], 70, 71, 0], salt="tenant-a") == 8
    manager.release(a)
    manager.release(child)
    assert manager.free_pages == 8  # all free; the cached ones evictable
    b, cached = manager.claim_prefix(prompt, salt="tenant-a")
    assert cached == 12
    np.testing.assert_array_equal(read(manager, b), [3.0] * 12)
    with pytest.raises(ValueError, match="salt must be a str"):
        manager.claim_prefix(prompt, salt=7)  # type: ignore[arg-type]
    manager.reset_prefix_cache()
    assert manager.cached_prefix_length(prompt, salt="tenant-a") == 0
    assert manager.prefix_cache_stats.cached_pages == 0


def test_claims_and_commits_are_checked_before_any_change(manager: PagedKVCacheManager) -> None:
    with pytest.raises(ValueError, match="prompt must not be empty"):
        manager.claim_prefix([])
    with pytest.raises(ValueError, match="longer than max_seq_len 32"):
        manager.claim_prefix(list(range(33)))
    a, _ = manager.claim_prefix([1, 2, 3])
    with pytest.raises(ValueError, match="pass tokens= for seq_ids"):
        manager.step({a: 0 + 1})
    with pytest.raises(ValueError, match="past the 0 reserved"):
        manager.step({a: 1}, tokens={a: [1]})  # nothing fetched or reserved yet
    manager.reserve({a: 3})
    manager.step({a: 3}, tokens={a: [1, 2, 3]})
    for _ in range(3):
        manager.claim(1)
    with pytest.raises(CacheFullError, match="all 4 sequences are in use"):
        manager.claim_prefix([1, 2, 3])
    with pytest.raises(CacheFullError, match="out of pages"):
        manager.reserve({a: 32, 1: 8})
    assert manager.free_pages == 7 and manager.cache_lengths == {a: 3, 1: 0, 2: 0, 3: 0}
