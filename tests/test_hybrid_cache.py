"""The hybrid cache: layer groups by sliding window, each a paged cache of its own.

On a NumPy device layer (no MAX session).  Gemma 3's tokens on it are
checked against transformers in ``test_families``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from max.driver import CPU, Buffer
from max.dtype import DType

from maxkv import CacheFullError, HybridKVCacheManager, KVCacheParams
from maxkv.cache.hybrid import layer_groups
from maxkv.cache.paged import UNUSED_PAGE, SwappedSequence
from maxkv.errors import ArgumentTypeError
from maxkv.tiers import TierConfig

from .conftest import RELIABILITY_COUNTS
from .fakes import NumpyCacheDevice

pytestmark = pytest.mark.unit

PARAMS = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=2)
PAGE = 4
WINDOW = 6
#: Gemma 3's pattern, shortened: two sliding layers, one full, one sliding.
LAYERS = (WINDOW, WINDOW, None, WINDOW)


def hybrid(pages: tuple[int, int] = (16, 16), **kw: object) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        PARAMS,
        PAGE,
        list(pages),
        4,
        256,
        LAYERS,
        [CPU()],
        None,
        cache_device=NumpyCacheDevice(),
        **kw,  # type: ignore[arg-type]
    )


def prefix_value(prefix: list[int]) -> float:
    """A value that is a function of the whole prefix (as a real K/V row is), exact
    in float32."""
    return float(hash(tuple(prefix)) % 2**23)


def write(
    m: HybridKVCacheManager,
    tokens: dict[int, list[int]],
    history: dict[int, list[int]] | None = None,
) -> None:
    """fetch, write each token's value into every layer of every group through its
    page table (as the kernels would), step.  The value is the token id, or with
    ``history`` (each sequence's tokens so far) :func:`prefix_value`."""
    seqs = list(tokens)
    (inputs,) = m.fetch(seqs, 1, active_lengths=[len(tokens[s]) for s in seqs])
    assert len(inputs) == 4 * len(m.groups)
    for g in range(len(m.groups)):
        pages, table = inputs[4 * g].to_numpy(), inputs[4 * g + 2].to_numpy()
        for row, seq in enumerate(seqs):
            start = m.cache_lengths[seq]
            for i, token in enumerate(tokens[seq]):
                t = start + i
                value = (
                    token if history is None else prefix_value(history[seq] + tokens[seq][: i + 1])
                )
                pages[table[row, t // PAGE], :, :, t % PAGE] = value
    m.step({s: len(t) for s, t in tokens.items()}, tokens=tokens if m.prefix_caching else None)


def visible(m: HybridKVCacheManager, seq: int) -> list[list[float]]:
    """Per group, what its layers can still attend to, read back through its pages."""
    length = m.cache_lengths[seq]
    out = []
    for group in m.groups:
        row = group.pages(seq)
        pages = group.buffers[0].to_numpy()
        first = group.window.first_needed_position(length)
        out.append(
            [float(pages[row[t // PAGE], 0, -1, t % PAGE, 0, 0]) for t in range(first, length)]
        )
    return out


def test_layer_groups() -> None:
    assert layer_groups(LAYERS) == ((WINDOW, None), ((0, 0), (0, 1), (1, 0), (0, 2)))
    assert layer_groups([None, None]) == ((None,), ((0, 0), (0, 1)))
    with pytest.raises(ValueError, match="at least one"):
        layer_groups([])
    with pytest.raises(ValueError, match="layer window"):
        layer_groups([0])
    with pytest.raises(ArgumentTypeError):
        layer_groups("ab")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 layer groups"):
        hybrid(pages=(4,))  # type: ignore[arg-type]


def test_groups_share_ids_and_lengths_and_the_sliding_group_gives_pages_back() -> None:
    m = hybrid(pages=(16, 32))
    sliding, full = m.groups
    assert m.layer_windows == LAYERS
    assert (sliding.num_layers, full.num_layers) == (3, 1)
    a, b = m.claim(2)
    for token in range(1, 61):
        write(m, {a: [token], b: [100 + token]})
    assert dict(m.cache_lengths) == {a: 60, b: 60}
    assert visible(m, a) == [[float(t) for t in range(56, 61)], [float(t) for t in range(1, 61)]]
    held = [sum(p != UNUSED_PAGE for p in row) for row in m.group_pages(a)]
    assert held == [sliding.window.live_pages(60), 15]
    # Bytes: the sliding group's three layers hold 2 pages, the full layer 15.
    per_layer_page = 2 * PAGE * 2 * 4
    assert m.held_bytes(a) == (3 * 2 + 1 * 15) * per_layer_page
    m.release(a)
    m.release(b)
    assert m.free_pages == m.num_pages == 48


def test_a_step_one_group_cannot_take_changes_nothing() -> None:
    m = hybrid(pages=(16, 5))  # the full-attention group runs out first
    (a,) = m.claim(1)
    write(m, {a: list(range(1, 17))})  # 4 pages in each group
    before = (dict(m.cache_lengths), m.free_pages, m.group_pages(a))
    with pytest.raises(CacheFullError, match=r"layer group 1 \(full attention\)"):
        m.fetch([a], 1, active_lengths=[8])
    with pytest.raises(CacheFullError):
        m.reserve({a: 30})
    assert (dict(m.cache_lengths), m.free_pages, m.group_pages(a)) == before
    write(m, {a: [17, 18, 19, 20]})  # 5 pages: still fits
    assert m.cache_lengths[a] == 20


def test_fork_and_pop_n_run_in_every_group_or_none() -> None:
    m = hybrid()
    (a,) = m.claim(1)
    write(m, {a: list(range(1, 23))})  # 22 tokens: the sliding group kept 17.. (page 4)
    before = (dict(m.cache_lengths), m.free_pages, m.group_pages(a))
    with pytest.raises(ValueError, match="given back"):
        m.pop_n(a, 7)
    with pytest.raises(ValueError, match="given back"):
        m.fork(a, 10)
    assert (dict(m.cache_lengths), m.free_pages, m.group_pages(a)) == before
    m.pop_n(a, 1)
    child = m.fork(a, 21)
    assert visible(m, child) == visible(m, a)
    write(m, {child: [500], a: [600]})
    assert visible(m, child)[1][-2:] == [21.0, 500.0] and visible(m, a)[0][-1] == 600.0


def test_a_prefix_is_reused_as_far_as_every_group_holds_it() -> None:
    m = hybrid(pages=(12, 24), enable_prefix_caching=True)
    prompt = list(range(1, 41))
    (a,) = m.claim(1)
    write(m, {a: prompt})
    m.release(a)
    follow_up = [*prompt, 41]
    assert m.cached_prefix_length(follow_up) == 40
    # A sequence that takes every free page of the sliding group evicts its
    # cached pages: then no prefix is whole in every group.
    (b,) = m.claim(1)
    write(m, {b: list(range(900, 900 + 4 * 12))})  # passes 12 pages through the group
    assert m.cached_prefix_length(follow_up) == 0
    m.release(b)
    # Computed again, it is found again, and a claim shares its pages.
    (c,) = m.claim(1)
    write(m, {c: prompt})
    seq, cached = m.claim_prefix(follow_up)
    assert cached == 40 and m.prefix_hits(follow_up) == (10, 0)
    assert visible(m, seq) == visible(m, c)
    assert m.prefix_cache_stats.hit_tokens == 40


def test_increment_between_steps_advances_every_group() -> None:
    m = hybrid()
    a, b = m.claim(2)
    write(m, {a: [1, 2, 3], b: [4]})
    kv = m.fetch([a, b], 3)
    offsets = Buffer.from_numpy(np.array([0, 1, 2], dtype=np.uint32))
    kv = m.increment_cache_lengths(kv, (None, offsets))
    (inputs,) = kv
    for g in range(2):
        assert inputs[4 * g + 1].to_numpy().tolist() == [4, 2]
        assert inputs[4 * g + 3].to_numpy().shape == (2, 2)
    with pytest.raises(ValueError, match="expected 2 x 4 values"):
        m.increment_cache_lengths([inputs[:4]], (None, offsets))


def test_plan_pages_gives_the_windows_what_they_need_and_the_rest_to_full_attention() -> None:
    devices = [CPU()]
    page_bytes = 2 * PAGE * 2 * 4  # one layer's page
    budget = 1000 * page_bytes
    sliding, full = HybridKVCacheManager.plan_pages(
        PARAMS, PAGE, LAYERS, devices, budget, max_batch_size=4, max_seq_len=256, step_tokens=16
    )
    window_pages = 1 + -(-(WINDOW - 1) // PAGE)
    assert sliding == 4 * window_pages + 4 + 4
    assert full == (budget - sliding * 3 * page_bytes) // page_bytes
    # Never more than the sequences' own length takes.
    short = HybridKVCacheManager.plan_pages(PARAMS, PAGE, LAYERS, devices, budget, 4, 8, 4096)
    assert short[0] == 4 * 2
    with pytest.raises(ValueError, match="sliding-window layer groups need"):
        HybridKVCacheManager.plan_pages(PARAMS, PAGE, LAYERS, devices, 10 * page_bytes, 4, 256, 16)


class HybridMachine(RuleBasedStateMachine):
    """claim (with and without a cached prefix), steps, fork, pop_n, swap out and in,
    and release on a hybrid cache; the model is each live sequence's tokens.  Every
    position each group's layers may still attend to reads back through that
    group's pages (after a swap-in too), nothing else is held, and reference counts
    and free pages agree."""

    #: KV tiers behind the groups (a host tier each): a prefix evicted from the
    #: device comes back from them.
    tiers: TierConfig | None = None

    def __init__(self) -> None:
        super().__init__()
        self.m = hybrid(pages=(10, 14), enable_prefix_caching=True, tiers=self.tiers)
        self.tokens: dict[int, list[int]] = {}
        #: Sequences swapped out, with their tokens.
        self.swapped: list[tuple[SwappedSequence, list[int]]] = []
        #: The tokens of released sequences; tokens loaded from the tiers so far.
        self.released: list[list[int]] = []
        self.loaded = 0
        RELIABILITY_COUNTS["hybrid machine: examples"] += 1

    def state(self) -> object:
        m = self.m
        return dict(m.cache_lengths), m.free_pages, {s: m.group_pages(s) for s in self.tokens}

    def refused(self, call: object, *args: object) -> None:
        before = self.state()
        with pytest.raises(ValueError):
            call(*args)  # type: ignore[operator]
        assert self.state() == before
        RELIABILITY_COUNTS["hybrid machine: refused, nothing changed"] += 1

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        prompt = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=30))
        if len(self.tokens) == 4:
            self.refused(self.m.claim_prefix, prompt)
            return
        seq, cached = self.m.claim_prefix(prompt)
        assert cached % PAGE == 0 and cached < len(prompt)
        self.tokens[seq] = prompt[:cached]
        if cached:
            RELIABILITY_COUNTS["hybrid machine: prefix hits"] += 1
        self.step_with(seq, prompt[cached:])

    def step_with(self, seq: int, new: list[int]) -> None:
        try:
            self.m.reserve({seq: len(self.tokens[seq]) + len(new)})
        except CacheFullError:
            RELIABILITY_COUNTS["hybrid machine: out of pages"] += 1
            return
        write(self.m, {seq: new}, self.tokens)
        self.tokens[seq] += new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.step_with(seq, data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=9)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork_or_pop(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        length = len(self.tokens[seq])
        pos = data.draw(st.integers(0, length))
        window = self.m.groups[0].window
        reaches_back = window.first_live_page(pos) < window.first_live_page(length)
        if data.draw(st.booleans(), label="fork"):
            if reaches_back or len(self.tokens) == 4:
                self.refused(self.m.fork, seq, pos)
                return
            try:
                child = self.m.fork(seq, pos)
            except CacheFullError:
                return
            self.tokens[child] = self.tokens[seq][:pos]
            RELIABILITY_COUNTS["hybrid machine: forks"] += 1
        elif pos < length:
            if reaches_back:
                self.refused(self.m.pop_n, seq, length - pos)
                return
            self.m.pop_n(seq, length - pos)
            del self.tokens[seq][pos:]
            RELIABILITY_COUNTS["hybrid machine: pop_n"] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.release(seq)
        self.released.append(self.tokens.pop(seq))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        swapped = self.m.swap_out(seq)
        assert len(swapped.groups) == len(self.m.groups)
        assert swapped.length == len(self.tokens[seq])
        self.swapped.append((swapped, self.tokens.pop(seq)))
        assert not self.m.contains(seq)
        RELIABILITY_COUNTS["hybrid machine: swapped out"] += 1

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.swapped) - 1))
        swapped, tokens = self.swapped[index]
        before = self.state()
        try:
            seq = self.m.swap_in(swapped)
        except CacheFullError:
            assert self.state() == before
            RELIABILITY_COUNTS["hybrid machine: swap in refused"] += 1
            return
        del self.swapped[index]
        self.tokens[seq] = tokens
        self.refused(self.m.swap_in, swapped)  # once only
        RELIABILITY_COUNTS["hybrid machine: swapped in"] += 1

    @invariant()
    def groups_hold_what_their_layers_attend_to(self) -> None:
        m = self.m
        assert dict(m.cache_lengths) == {s: len(t) for s, t in self.tokens.items()}
        for group in m.groups:
            holders: dict[int, int] = {}
            for seq, tokens in self.tokens.items():
                row = group.pages(seq)
                gone = group.window.first_live_page(len(tokens))
                assert row[:gone] == (UNUSED_PAGE,) * gone
                assert UNUSED_PAGE not in row[gone:]
                for page in row[gone:]:
                    holders[page] = holders.get(page, 0) + 1
            for page in range(group.num_pages):
                assert group.page_refcount(page) == holders.get(page, 0)
            assert group.free_pages == group.num_pages - len(holders)
        for seq, tokens in self.tokens.items():
            for g, values in enumerate(visible(m, seq)):
                first = m.groups[g].window.first_needed_position(len(tokens))
                assert values == [prefix_value(tokens[: t + 1]) for t in range(first, len(tokens))]
        assert m.swapped_bytes == sum(s.nbytes for s, _ in self.swapped)
        loaded = sum(g.tier_hit_tokens for g in m.groups)
        RELIABILITY_COUNTS["hybrid machine with tiers: tokens from the tiers"] += (
            loaded - self.loaded
        )
        self.loaded = loaded
        RELIABILITY_COUNTS["hybrid machine: steps"] += 1


HybridMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHybridStateMachine = HybridMachine.TestCase


class HybridTierMachine(HybridMachine):
    """:class:`HybridMachine` with a host tier per group: pages evicted from a
    group's device pool come back from its tier, and read back the same."""

    tiers = TierConfig(model_id="hybrid-machine")

    @precondition(lambda self: self.released and len(self.tokens) < 4)
    @rule(data=st.data())
    def claim_a_released_prompt(self, data: st.DataObject) -> None:
        """A prompt that starts with a released sequence's tokens: its full pages are
        in the tiers (and on the device unless forgotten or evicted)."""
        before = data.draw(st.sampled_from(self.released))
        prompt = before + data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=5))
        seq, cached = self.m.claim_prefix(prompt)
        assert cached % PAGE == 0 and cached < len(prompt)
        self.tokens[seq] = prompt[:cached]
        self.step_with(seq, prompt[cached:])

    @rule()
    def forget_the_device_cache(self) -> None:
        """The devices forget every registered page (as eviction would); the tiers
        still hold them, and the next claims load them back."""
        for group in self.m.groups:
            group.pool.reset_cache()
        RELIABILITY_COUNTS["hybrid machine with tiers: device caches forgotten"] += 1

    def teardown(self) -> None:
        self.m.close()


HybridTierMachine.TestCase.settings = HybridMachine.TestCase.settings
TestHybridTierStateMachine = HybridTierMachine.TestCase


def test_every_kind_of_cache_reports_its_occupancy_the_same_way() -> None:
    """The interface schedulers and MAX's adapter read (``units_for``,
    ``free_units``, ``total_units``, ``units_held``, ``longest_sequence``, ``prefix_hits``,
    ``describe``), on a contiguous, a paged and a hybrid cache."""
    from . import fakes

    slots = fakes.contiguous(PARAMS, 3, 32, num_layers=2, enable_prefix_caching=True)
    (seq,) = slots.claim(1)
    assert (slots.free_units, slots.total_units, slots.units_held(seq)) == (2, 3, [seq])
    assert slots.units_for(32) == 1  # a slot, whatever the length
    assert slots.longest_sequence == 32
    assert slots.describe().startswith("contiguous cache: 3 slots x 32 tokens")

    pages = fakes.paged(PARAMS, PAGE, 6, 4, 64, num_layers=2, enable_prefix_caching=True)
    (seq,) = pages.claim(1)
    pages.reserve({seq: 9})  # 3 pages of 4 tokens
    assert (pages.free_units, pages.total_units) == (3, 6)
    assert (pages.units_for(8), pages.units_for(9)) == (2, 3)
    assert pages.units_held(seq) == list(pages.pages(seq)) and len(pages.units_held(seq)) == 3
    assert pages.longest_sequence == 6 * PAGE  # the pages hold fewer than max_seq_len
    assert pages.prefix_hits([1, 2, 3, 4, 5]) == (0, 0)
    assert pages.describe().startswith("paged cache: 6 pages of 4 tokens (")

    m = hybrid(pages=(8, 5))
    (seq,) = m.claim(1)
    m.reserve({seq: 6})
    # Units are the full-attention group's pages (8 in the sliding group, 5 here):
    # they bound how many tokens fit; the sliding group's pages are raw pages.
    held = m.units_held(seq)
    assert held == list(m.group_pages(seq)[1]) and len(held) == 2
    assert (m.free_units, m.total_units) == (5 - 2, 5)
    assert m.free_pages == 13 - 2 * 2  # two pages in each group
    assert [g.window.window for g in m.groups] == [WINDOW, None]
    assert m.longest_sequence == 5 * PAGE  # the full-attention group's 5 pages
    assert m.describe().startswith(f"hybrid paged cache, pages of {PAGE} tokens")


def test_a_hybrid_cache_whose_groups_all_slide_holds_any_length() -> None:
    m = HybridKVCacheManager(
        PARAMS, PAGE, [8], 4, 256, (WINDOW, WINDOW), [CPU()], None, cache_device=NumpyCacheDevice()
    )
    assert [g.window.slides for g in m.groups] == [True]
    assert m.longest_sequence == 256  # no full-attention group bounds it


def test_each_group_gets_tiers_of_its_own_and_a_share_of_the_budgets() -> None:
    tiers = TierConfig(model_id="m", host_bytes=3 << 20, swap_bytes=4 << 20)
    m = hybrid(enable_prefix_caching=True, tiers=tiers)
    try:
        configs = [g.tiers.config for g in m.groups if g.tiers is not None]
        assert [c.model_id for c in configs] == [f"m#window={WINDOW}", "m#window=none"]
        # Three sliding layers to one full: the budgets split 3:1, never above the total.
        assert [c.host_bytes for c in configs] == [(3 << 20) * 3 // 4, (3 << 20) // 4]
        assert m.groups[0].block_layout("m#window=6") != m.groups[1].block_layout("m#window=6")
        assert "(per group, 2 groups)" in m.describe()
    finally:
        m.close()
    with pytest.raises(ValueError, match="need enable_prefix_caching"):
        hybrid(tiers=tiers)
