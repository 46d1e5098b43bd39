"""Sliding windows in the paged manager: pages no layer can attend to are given back.

On a NumPy device layer (no MAX session): the bound on pages held at any
length, the page-table row the kernels get, and how prefix caching, fork,
pop_n and swap behave once a sequence has given pages back.  The hypothesis
state machine of ``test_reliability`` (``WindowedPrefixMachine``) checks the
same rules on random interleavings; ``test_families`` checks Mistral's tokens
against transformers with pages given back.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from max.dtype import DType

from maxkv import CacheFullError, KVCacheParams
from maxkv.cache.paged import UNUSED_PAGE, PagedKVCacheManager
from maxkv.cache.rotation import KeyRotation
from maxkv.cache.window import PageWindow
from maxkv.errors import ArgumentTypeError
from maxkv.models.config import default_llama
from maxkv.tiers import TierConfig

from . import fakes
from .conftest import RELIABILITY_COUNTS

pytestmark = pytest.mark.unit

PARAMS = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=2)
PAGE = 4
WINDOW = 10


def manager(num_pages: int = 16, **kw: object) -> PagedKVCacheManager:
    kw.setdefault("sliding_window", WINDOW)
    return fakes.paged(PARAMS, PAGE, num_pages, 4, 4096, **kw)


def run(m: PagedKVCacheManager, seq: int, tokens: list[int], chunk: int = 1) -> None:
    """Commits ``tokens`` in steps of ``chunk``, each token's value written at its
    position through the page table (as a kernel would)."""
    for start in range(0, len(tokens), chunk):
        ids = tokens[start : start + chunk]
        (inputs,) = m.fetch([seq], 1, active_lengths=[len(ids)])
        pages, table = inputs[0].to_numpy(), inputs[2].to_numpy()
        length = m.cache_lengths[seq]
        for i, token in enumerate(ids):
            t = length + i
            pages[table[0, t // PAGE], :, 0, t % PAGE] = token
        m.step({seq: len(ids)}, tokens={seq: ids} if m.prefix_caching else None)


def window_values(m: PagedKVCacheManager, seq: int) -> list[float]:
    """The values of the positions ``seq``'s next token attends to, read through its pages."""
    length = m.cache_lengths[seq]
    row = m.pages(seq)
    pages = m._pages[0].to_numpy()
    first = m.window.first_needed_position(length)
    return [float(pages[row[t // PAGE], 0, 0, t % PAGE, 0, 0]) for t in range(first, length)]


def test_page_window_arithmetic() -> None:
    w = PageWindow(WINDOW, PAGE)
    assert [w.first_needed_position(n) for n in (0, 9, 10, 11, 23)] == [0, 0, 1, 2, 14]
    assert [w.first_live_page(n) for n in (0, 12, 13, 23)] == [0, 0, 1, 3]
    assert w.live_pages(23) == 6 - 3
    assert w.max_live_pages() == 1 + -(-(WINDOW - 1) // PAGE)
    assert PageWindow(None, PAGE).max_live_pages() is None
    assert not PageWindow(None, PAGE).slides and w.slides
    with pytest.raises(ValueError, match="sliding_window"):
        PageWindow(0, PAGE)
    with pytest.raises(ArgumentTypeError):
        PageWindow(True, PAGE)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="sliding_window"):
        fakes.paged(PARAMS, PAGE, 8, 2, 64, sliding_window=10.0)


def test_a_sequence_holds_its_window_however_long_it_runs() -> None:
    """3,000 decode steps through 16 pages: the sequence never holds more than the
    window's pages plus one, every position its next token attends to reads back,
    and the pages before the window are free (its row shows UNUSED_PAGE there)."""
    m = manager()
    (seq,) = m.claim(1)
    bound = m.window.max_live_pages()
    assert bound == 4
    run(m, seq, list(range(1, 31)), chunk=7)  # a prefill in chunks, then decode
    for token in range(31, 3001):
        run(m, seq, [token])
        row = m.pages(seq)
        held = [p for p in row if p != UNUSED_PAGE]
        assert len(held) <= bound
        assert m.free_pages == 16 - len(held)
        assert row[: len(row) - len(held)] == (UNUSED_PAGE,) * (len(row) - len(held))
    assert window_values(m, seq) == [float(t) for t in range(3000 - WINDOW + 2, 3001)]
    m.release(seq)
    assert m.free_pages == 16


def test_the_kernels_get_a_held_page_where_pages_were_given_back() -> None:
    m = manager()
    (seq,) = m.claim(1)
    run(m, seq, list(range(1, 40)))
    (inputs,) = m.fetch([seq], 1)
    row = m.pages(seq)
    table = inputs[2].to_numpy()[0]
    gone = row.count(UNUSED_PAGE)
    assert gone == m.window.first_live_page(39) > 0
    # Valid page ids only (never read: outside the window), then the held pages.
    assert list(table[:gone]) == [row[gone]] * gone
    assert list(table[gone : len(row)]) == list(row[gone:])


def test_pop_n_and_fork_refuse_to_reach_back_into_given_back_pages() -> None:
    m = manager()
    (seq,) = m.claim(1)
    run(m, seq, list(range(1, 28)))  # 27 tokens: the next attends from 18, on page 4
    assert m.pages(seq)[:4] == (UNUSED_PAGE,) * 4
    before = (dict(m.cache_lengths), m.free_pages, m.pages(seq))
    with pytest.raises(ValueError, match="given back"):
        m.pop_n(seq, 3)  # at 24 tokens the window starts at 15, on page 3
    with pytest.raises(ValueError, match="given back"):
        m.fork(seq, 24)
    assert (dict(m.cache_lengths), m.free_pages, m.pages(seq)) == before
    m.pop_n(seq, 2)  # at 25 tokens it starts at 16: page 4 is held
    assert m.cache_lengths[seq] == 25
    child = m.fork(seq, 25)
    assert m.pages(child)[:4] == (UNUSED_PAGE,) * 4
    assert window_values(m, child) == window_values(m, seq)
    run(m, child, [100, 101])
    run(m, seq, [200])
    assert window_values(m, child)[-2:] == [100.0, 101.0]
    assert window_values(m, seq)[-1] == 200.0


def test_a_prefix_is_reused_from_its_window_when_its_start_is_gone() -> None:
    """vLLM's sliding-window hit rule: the pages of the last window - 1 tokens of the
    prefix are enough; the longest such prefix wins (searched from the right)."""
    m = manager(num_pages=24, enable_prefix_caching=True)
    prompt = list(range(1, 41))
    (seq,) = m.claim(1)
    run(m, seq, prompt, chunk=8)
    m.release(seq)
    # Pages 0..6 went back to the free queue first: a sequence taking all free
    # pages but 3 evicts them (after the pages that never held anything).
    (filler,) = m.claim(1)
    m.reserve({filler: (m.free_pages - 3) * PAGE})
    m.release(filler)
    assert m.prefix_cache_stats.cached_pages == 3  # the window's: 28..39
    follow_up = [*prompt, 41, 42]
    assert m.cached_prefix_length(follow_up) == 40
    new, cached = m.claim_prefix(follow_up)
    assert cached == 40
    row = m.pages(new)
    assert row[: m.window.first_live_page(40)] == (UNUSED_PAGE,) * 7
    assert window_values(m, new) == [float(t) for t in range(40 - WINDOW + 2, 41)]
    assert m.pages_to_claim(follow_up) == 11 - 7 - 3  # pages past the window, less held
    # A prefix whose window's pages are gone too is not found.
    (other,) = m.claim(1)
    m.reserve({other: m.free_pages * PAGE})
    m.release(other)
    m.release(new)
    (other,) = m.claim(1)
    m.reserve({other: m.free_pages * PAGE})
    assert m.cached_prefix_length(follow_up) == 0


def test_swap_keeps_only_the_window() -> None:
    m = manager(tiers=TierConfig(swap_bytes=2**20), enable_prefix_caching=True)
    (seq,) = m.claim(1)
    run(m, seq, list(range(1, 34)), chunk=5)
    values = window_values(m, seq)
    swapped = m.swap_out(seq)
    assert swapped.first_page == m.window.first_live_page(33)
    assert len(swapped.blocks) == m.window.live_pages(33)
    (filler,) = m.claim(1)
    m.reserve({filler: m.free_pages * PAGE})  # evicts the pages the device had cached
    m.release(filler)
    new = m.swap_in(swapped)
    assert window_values(m, new) == values
    run(m, new, [34])
    assert window_values(m, new)[-1] == 34.0
    m.close()


def test_cache_window_of_a_model() -> None:
    config, _ = default_llama()
    assert config.cache_window is None
    assert replace(config, layer_windows=(256, 128)).cache_window == 256
    assert replace(config, layer_windows=(256, None)).cache_window is None


def test_release_frees_only_held_pages() -> None:
    m = manager(num_pages=8)
    seqs = m.claim(2)
    for seq in seqs:
        run(m, seq, list(range(1, 30)), chunk=3)
    assert m.free_pages == 8 - sum(len([p for p in m.pages(s) if p != UNUSED_PAGE]) for s in seqs)
    for seq in seqs:
        m.release(seq)
    assert m.free_pages == 8
    assert all(m.page_refcount(p) == 0 for p in range(8))
    assert np.isfinite(m._pages[0].to_numpy()).all()


# ------------------------------------------------------------ attention sinks

HEAD_DIM = 8
ROTATION = KeyRotation.of_layers([1.0 / 100.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)] * 2)
BASE_KEY = np.linspace(-1.0, 1.0, HEAD_DIM)


def rotated(position: int, layer: int) -> np.ndarray:
    """The key a model stores at ``position``: ``BASE_KEY`` rotated by RoPE."""
    key = BASE_KEY.copy()
    ROTATION.shift(key, layer, position)
    return key


def stream_manager(num_pages: int = 16, **kw: object) -> PagedKVCacheManager:
    params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=HEAD_DIM)
    return fakes.paged(params, PAGE, num_pages, 4, 64, 2, key_rotation=ROTATION, **kw)


def stream_step(m: PagedKVCacheManager, seq: int, tokens: list[int]) -> None:
    """One step of ``tokens`` (ids >= 1), keys as a model stores them at their
    positions in the cache, values the token ids."""
    (inputs,) = m.fetch([seq], 1, active_lengths=[len(tokens)])
    pages, table = inputs[0].to_numpy(), inputs[2].to_numpy()
    start = m.cache_lengths[seq]
    for i, token in enumerate(tokens):
        t = start + i
        page, slot = table[0, t // PAGE], t % PAGE
        for layer in range(2):
            pages[page, 0, layer, slot, 0] = rotated(t, layer)
            pages[page, 1, layer, slot, 0] = token
    m.step({seq: len(tokens)}, tokens={seq: tokens} if m.prefix_caching else None)


def cached(m: PagedKVCacheManager, seq: int) -> tuple[list[int], np.ndarray]:
    """The token ids in the cache, in order, and their keys ``[tokens, layers, head_dim]``."""
    length = m.cache_lengths[seq]
    row = m.pages(seq)
    pages = m._pages[0].to_numpy()
    values = [int(pages[row[t // PAGE], 1, 0, t % PAGE, 0, 0]) for t in range(length)]
    keys = np.stack([pages[row[t // PAGE], 0, :, t % PAGE, 0] for t in range(length)])
    return values, keys


def test_sinks_keep_the_first_tokens_and_the_window_at_their_places_in_the_cache() -> None:
    """StreamingLLM: the cache holds the sink page and the last window tokens, each
    token's key as the model would store it at its place in the cache."""
    m = stream_manager()
    (seq,) = m.claim(1)
    stream_step(m, seq, list(range(1, 7)))
    m.enable_sliding_window(seq, 10, sink=3)  # sinks: the first page (4 tokens)
    assert m.sliding_window_of(seq) == (10, 4, 0)
    for token in range(7, 301):
        stream_step(m, seq, [token])
        length = m.cache_lengths[seq]
        assert length <= 4 + 10 + PAGE - 1
        values, keys = cached(m, seq)
        window = length - 4
        assert values == [1, 2, 3, 4, *range(token - window + 1, token + 1)]
        expected = np.stack([[rotated(t, layer) for layer in range(2)] for t in range(length)])
        np.testing.assert_allclose(keys, expected, atol=1e-5)
    _, sinks, evicted = m.sliding_window_of(seq)  # type: ignore[misc]
    assert sinks == 4 and evicted == 300 - m.cache_lengths[seq]
    assert m.free_pages == 16 - len(m.pages(seq))
    # pop_n within the window, then into the sinks: the sequence's first tokens again.
    m.pop_n(seq, 2)
    assert cached(m, seq)[0][-1] == 298
    m.pop_n(seq, m.cache_lengths[seq] - 3)
    assert m.sliding_window_of(seq) == (10, 4, 0) and cached(m, seq)[0] == [1, 2, 3]
    m.release(seq)
    assert m.free_pages == 16


def test_sinks_copy_shared_pages_before_moving_keys() -> None:
    m = stream_manager(num_pages=24, enable_prefix_caching=True)
    (a,) = m.claim(1)
    stream_step(m, a, list(range(1, 21)))
    b, hit = m.claim_prefix(list(range(1, 22)))
    assert hit == 20
    m.enable_sliding_window(b, 8)
    stream_step(m, b, [21])  # b slides: the pages it shares with a are copied first
    values_a, keys_a = cached(m, a)
    assert values_a == list(range(1, 21))
    expected = np.stack([[rotated(t, layer) for layer in range(2)] for t in range(20)])
    np.testing.assert_allclose(keys_a, expected, atol=1e-6)  # a's keys untouched
    values_b, _ = cached(m, b)
    assert values_b[-1] == 21 and len(values_b) <= 8 + PAGE - 1
    # A fork shares b's pages; each copies before its next move.
    child = m.fork(b)
    for token in range(22, 40):
        stream_step(m, b, [token])
        stream_step(m, child, [100 + token])
    assert cached(m, b)[0][-1] == 39 and cached(m, child)[0][-1] == 139
    assert m.sliding_window_of(child) == m.sliding_window_of(b)


def test_sinks_are_refused_where_they_cannot_work() -> None:
    m = stream_manager()
    (seq,) = m.claim(1)
    with pytest.raises(ValueError, match="window must be >= 1"):
        m.enable_sliding_window(seq, 0)
    with pytest.raises(ValueError, match="sink must be >= 0"):
        m.enable_sliding_window(seq, 8, sink=-1)
    m.enable_sliding_window(seq, 8, 2)
    with pytest.raises(ValueError, match="has a sliding window already"):
        m.enable_sliding_window(seq, 8, 2)
    plain = fakes.paged(PARAMS, PAGE, 8, 2, 64)
    (first,) = plain.claim(1)
    with pytest.raises(ValueError, match="key_rotation"):
        plain.enable_sliding_window(first, 8)
    windowed = fakes.paged(PARAMS, PAGE, 8, 2, 64, sliding_window=8)
    (other,) = windowed.claim(1)
    with pytest.raises(ValueError, match="slide already"):
        windowed.enable_sliding_window(other, 8)
    with pytest.raises(ValueError, match="layers"):
        fakes.paged(PARAMS, PAGE, 8, 2, 64, key_rotation=ROTATION)  # 1 layer, rotation of 2


def test_swap_keeps_a_sequence_with_sinks() -> None:
    m = stream_manager(tiers=TierConfig(swap_bytes=2**20), enable_prefix_caching=True)
    (seq,) = m.claim(1)
    m.enable_sliding_window(seq, 8, 4)
    for token in range(1, 40):
        stream_step(m, seq, [token])
    before = cached(m, seq)
    swapped = m.swap_out(seq)
    new = m.swap_in(swapped)
    after = cached(m, new)
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1], before[1])
    assert m.sliding_window_of(new) == m.sliding_window_of(seq if m.contains(seq) else new)
    stream_step(m, new, [40])
    assert cached(m, new)[0][-1] == 40
    m.close()


class StreamMachine(RuleBasedStateMachine):
    """Sequences with and without attention sinks on one paged cache with prefix
    caching and swap space: claims (cached prefixes reused), steps of one or more
    tokens, enabling sinks, forks, pop_n, swap out and in, releases.  The model is
    each sequence's tokens and what its cache holds: the sink page and the last
    tokens; every position reads back its token and the key a model would store
    at that place in the cache, nothing else is held, and refcounts agree."""

    def __init__(self) -> None:
        super().__init__()
        self.m = stream_manager(
            num_pages=20, enable_prefix_caching=True, tiers=TierConfig(swap_bytes=2**22)
        )
        #: Per live sequence: the tokens its cache holds, in cache order.
        self.held: dict[int, list[int]] = {}
        self.streams: dict[int, tuple[int, int]] = {}
        self.swapped: list[tuple[object, list[int], tuple[int, int] | None]] = []
        self.next_token = 1

    def new_tokens(self, n: int) -> list[int]:
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    def slide(self, seq: int) -> None:
        """The manager's documented rule, applied to the model."""
        if seq not in self.streams:
            return
        window, sink_pages = self.streams[seq]
        kept = sink_pages * PAGE
        held = self.held[seq]
        drop = (len(held) - kept - window) // PAGE
        if drop > 0:
            del held[kept : kept + drop * PAGE]
            RELIABILITY_COUNTS["stream machine: pages dropped (keys moved)"] += drop

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        if len(self.held) == 4:
            return
        if self.held and data.draw(st.booleans(), label="as a prefix of another"):
            other = data.draw(st.sampled_from(sorted(self.held)))
            prompt = [*self.held[other], *self.new_tokens(1)]
        else:
            prompt = self.new_tokens(data.draw(st.integers(1, 12)))
        seq, cached = self.m.claim_prefix(prompt)
        self.held[seq] = prompt[:cached]
        if cached:
            RELIABILITY_COUNTS["stream machine: prefix hits"] += 1
        self.step_with(seq, prompt[cached:])

    def step_with(self, seq: int, tokens: list[int]) -> None:
        try:
            self.m.reserve({seq: self.m.cache_lengths[seq] + len(tokens)})
        except CacheFullError:
            return
        stream_step(self.m, seq, tokens)
        self.held[seq] += tokens
        self.slide(seq)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.held)))
        self.step_with(seq, self.new_tokens(data.draw(st.integers(1, 8))))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def enable_sinks(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.held)))
        window = data.draw(st.integers(1, 10))
        sink = data.draw(st.integers(0, 5))
        if seq in self.streams:
            with pytest.raises(ValueError, match="already"):
                self.m.enable_sliding_window(seq, window, sink)
            return
        self.m.enable_sliding_window(seq, window, sink)
        self.streams[seq] = (window, -(-sink // PAGE))
        self.slide(seq)
        RELIABILITY_COUNTS["stream machine: sinks enabled"] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def fork_or_pop(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.held)))
        held = self.held[seq]
        pos = data.draw(st.integers(0, len(held)))
        if data.draw(st.booleans(), label="fork"):
            if len(self.held) == 4:
                return
            try:
                child = self.m.fork(seq, pos)
            except CacheFullError:
                return
            self.held[child] = held[:pos]
            if seq in self.streams:
                self.streams[child] = self.streams[seq]
            RELIABILITY_COUNTS["stream machine: forks"] += 1
        elif pos < len(held):
            self.m.pop_n(seq, len(held) - pos)
            del held[pos:]
            RELIABILITY_COUNTS["stream machine: pop_n"] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.held)))
        swapped = self.m.swap_out(seq)
        self.swapped.append((swapped, self.held.pop(seq), self.streams.pop(seq, None)))
        RELIABILITY_COUNTS["stream machine: swapped out"] += 1

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self) -> None:
        swapped, held, stream = self.swapped[0]
        if len(self.held) == 4 or self.m.swap_in_pages(swapped) > self.m.free_pages:  # type: ignore[arg-type]
            return
        seq = self.m.swap_in(swapped)  # type: ignore[arg-type]
        self.swapped.pop(0)
        self.held[seq] = held
        if stream is not None:
            self.streams[seq] = stream

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.held)))
        self.m.release(seq)
        del self.held[seq]
        self.streams.pop(seq, None)

    @invariant()
    def the_cache_holds_the_sinks_and_the_window_at_their_places(self) -> None:
        m = self.m
        assert dict(m.cache_lengths) == {s: len(h) for s, h in self.held.items()}
        holders: dict[int, int] = {}
        for seq, held in self.held.items():
            row = m.pages(seq)
            assert len(row) >= -(-len(held) // PAGE) and UNUSED_PAGE not in row
            for page in row:
                holders[page] = holders.get(page, 0) + 1
            if held:
                values, keys = cached(m, seq)
                assert values == held
                expected = np.stack(
                    [[rotated(t, layer) for layer in range(2)] for t in range(len(held))]
                )
                np.testing.assert_allclose(keys, expected, atol=1e-4)
        for page in range(m.num_pages):
            assert m.page_refcount(page) == holders.get(page, 0)
        assert m.free_pages == m.num_pages - len(holders)
        RELIABILITY_COUNTS["stream machine: steps"] += 1


StreamMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStreamStateMachine = StreamMachine.TestCase
