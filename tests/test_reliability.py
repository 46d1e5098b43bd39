"""Reliability: a stateful property test against a plain-Python model of the
manager, and a multi-thread stress test.

The counts of what ran (examples, steps, rejected inputs, thread operations)
are printed in pytest's terminal summary ("maxkv reliability counts").
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from max.driver import CPU, Buffer
from max.dtype import DType

from maxkv import (
    CacheFullError,
    ContinuousBatchingKVCacheManager,
    KVCacheParams,
    PagedKVCacheManager,
)
from maxkv.cache.paged import UNUSED_PAGE, SwappedSequence
from maxkv.tiers import TierConfig

from .conftest import RELIABILITY_COUNTS
from .fakes import NumpyCacheDevice

pytestmark = pytest.mark.unit


CAPACITY = 6
MAX_SEQ_LEN = 12


def new_manager() -> ContinuousBatchingKVCacheManager:
    params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=4)
    return ContinuousBatchingKVCacheManager(
        params, CAPACITY, MAX_SEQ_LEN, 1, [CPU()], None, cache_device=NumpyCacheDevice()
    )


def offsets(new_tokens: Sequence[int]) -> Buffer:
    return Buffer.from_numpy(np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32))


class ManagerModel:
    """What the manager should do, written without looking at its code."""

    def __init__(self) -> None:
        self.lengths: dict[int, int] = {}

    def free(self) -> list[int]:
        return [i for i in range(CAPACITY) if i not in self.lengths]

    def ids_ok(self, ids: list[int], claimed: bool) -> bool:
        if not ids or len(set(ids)) != len(ids):
            return False
        return all(0 <= i < CAPACITY and (i in self.lengths) == claimed for i in ids)

    def fetch_ok(self, ids: list[int], steps: int, active: list[int]) -> bool:
        if not self.ids_ok(ids, claimed=True) or steps < 1 or min(active, default=1) < 1:
            return False
        return all(
            self.lengths[i] + a + steps - 1 <= MAX_SEQ_LEN for i, a in zip(ids, active, strict=True)
        )

    def step_ok(self, counts: dict[int, int]) -> bool:
        if counts and not self.ids_ok(list(counts), claimed=True):
            return False
        return all(n >= 0 and self.lengths[i] + n <= MAX_SEQ_LEN for i, n in counts.items())


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = new_manager()
        self.model = ManagerModel()
        RELIABILITY_COUNTS["state machine: examples"] += 1

    def rejected(self, call: object, *args: object) -> None:
        before = (dict(self.manager.cache_lengths), self.manager.slots_remaining)
        with pytest.raises(ValueError):
            call(*args)  # type: ignore[operator]
        assert (dict(self.manager.cache_lengths), self.manager.slots_remaining) == before
        RELIABILITY_COUNTS["state machine: inputs rejected"] += 1

    @rule(n=st.integers(-1, CAPACITY + 1))
    def claim(self, n: int) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        free = self.model.free()
        if not 1 <= n <= len(free):
            self.rejected(self.manager.claim, n)
            return
        assert self.manager.claim(n) == free[:n]
        self.model.lengths.update(dict.fromkeys(free[:n], 0))

    @rule(ids=st.lists(st.integers(-1, CAPACITY), max_size=3))
    def external_claim(self, ids: list[int]) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        if not self.model.ids_ok(ids, claimed=False):
            self.rejected(self.manager.external_claim, ids)
            return
        self.manager.external_claim(ids)
        self.model.lengths.update(dict.fromkeys(ids, 0))

    @rule(data=st.data())
    def fetch_increment_step(self, data: st.DataObject) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        claimed = sorted(self.model.lengths)
        if claimed and data.draw(st.booleans(), label="well-formed"):
            # Mostly valid: distinct claimed ids, sizes that often fit.
            ids = data.draw(
                st.lists(st.sampled_from(claimed), min_size=1, max_size=4, unique=True),
                label="ids",
            )
            steps = data.draw(st.integers(1, 3), label="num_steps")
            active = data.draw(
                st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)),
                label="active",
            )
        else:
            ids = data.draw(st.lists(st.integers(-1, CAPACITY), max_size=4), label="ids")
            steps = data.draw(st.integers(0, 3), label="num_steps")
            active = data.draw(
                st.lists(st.integers(0, 5), min_size=len(ids), max_size=len(ids)),
                label="active",
            )
        if not self.model.fetch_ok(ids, steps, active):
            self.rejected(lambda: self.manager.fetch(ids, steps, active_lengths=active))
            return
        (inputs,) = self.manager.fetch(ids, steps, active_lengths=active)
        lengths = np.array([self.model.lengths[i] for i in ids])
        np.testing.assert_array_equal(inputs[1].to_numpy(), lengths)
        np.testing.assert_array_equal(inputs[2].to_numpy(), ids)
        new = np.array(active)
        for row in inputs[3].to_numpy():
            assert row.tolist() == [new.max(), lengths.max()]
            lengths = lengths + new
            new = np.ones_like(new)
        # Walk the multistep inputs on the device and compare with the model.
        walked = [inputs]
        new_tokens = list(active)
        expected = np.array([self.model.lengths[i] for i in ids])
        for _ in range(steps - 1):
            walked = self.manager.increment_cache_lengths(walked, (None, offsets(new_tokens)))
            expected = expected + np.array(new_tokens)
            new_tokens = [1] * len(ids)
            np.testing.assert_array_equal(walked[0][1].to_numpy(), expected)
        RELIABILITY_COUNTS["state machine: fetch/increment/step runs"] += 1
        commit = {i: a + steps - 1 for i, a in zip(ids, active, strict=True)}
        self.manager.step(commit)
        for i, n in commit.items():
            self.model.lengths[i] += n

    @rule(counts=st.dictionaries(st.integers(-1, CAPACITY), st.integers(-1, 6), max_size=3))
    def step(self, counts: dict[int, int]) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        if not self.model.step_ok(counts):
            self.rejected(self.manager.step, counts)
            return
        self.manager.step(counts)
        for i, n in counts.items():
            self.model.lengths[i] += n

    @rule(seq_id=st.integers(-1, CAPACITY))
    def release(self, seq_id: int) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        if seq_id not in self.model.lengths:
            self.rejected(self.manager.release, seq_id)
            return
        self.manager.release(seq_id)
        del self.model.lengths[seq_id]

    @rule(parent=st.integers(-1, CAPACITY), pos=st.one_of(st.none(), st.integers(-1, 13)))
    def fork(self, parent: int, pos: int | None) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        length = self.model.lengths.get(parent)
        free = self.model.free()
        fork_pos = length if pos is None else pos
        if length is None or fork_pos is None or not 0 <= fork_pos <= length or not free:
            self.rejected(self.manager.fork, parent, pos)
            return
        assert self.manager.fork(parent, pos) == free[0]  # the lowest free slot
        self.model.lengths[free[0]] = fork_pos
        RELIABILITY_COUNTS["state machine: forks"] += 1

    @rule(data=st.data())
    def pop_n(self, data: st.DataObject) -> None:
        RELIABILITY_COUNTS["state machine: steps"] += 1
        holding = sorted(i for i, n in self.model.lengths.items() if n)
        if holding and data.draw(st.booleans(), label="well-formed"):
            seq_id = data.draw(st.sampled_from(holding), label="seq_id")
            n = data.draw(st.integers(1, self.model.lengths[seq_id]), label="n")
        else:
            seq_id = data.draw(st.integers(-1, CAPACITY), label="seq_id")
            n = data.draw(st.integers(-1, 13), label="n")
        length = self.model.lengths.get(seq_id)
        if length is None or not 0 < n <= length:
            self.rejected(self.manager.pop_n, seq_id, n)
            return
        self.manager.pop_n(seq_id, n)
        self.model.lengths[seq_id] -= n
        RELIABILITY_COUNTS["state machine: pop_n"] += 1

    @invariant()
    def matches_model(self) -> None:
        assert dict(self.manager.cache_lengths) == self.model.lengths
        assert self.manager.slots_remaining == CAPACITY - len(self.model.lengths)
        for i in range(CAPACITY):
            assert self.manager.contains(i) == (i in self.model.lengths)


ManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerStateMachine = ManagerMachine.TestCase


class PrefixModel:
    """What a prefix-caching manager should hold, written from its contract.

    Every slot keeps the token ids it was given (live or released) until it
    is reused; released slots are reused least recently released first,
    after slots holding nothing; a new prompt starts with the longest prefix
    any slot holds (at most all but its last token).
    """

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}  # slot -> tokens it holds (live or kept)
        self.live: set[int] = set()
        self.released: list[int] = []  # oldest release first

    def free(self) -> list[int]:
        return [i for i in range(CAPACITY) if i not in self.live]

    def next_slots(self, n: int) -> list[int]:
        fresh = [s for s in self.free() if not self.tokens.get(s)]
        kept = [s for s in self.released if s not in self.live]
        return (fresh + kept)[:n]

    def take(self, slot: int, keep: int = 0) -> None:
        self.tokens[slot] = self.tokens.get(slot, [])[:keep]
        if slot in self.released:
            self.released.remove(slot)
        self.live.add(slot)

    def best_prefix(self, prompt: list[int]) -> int:
        best = 0
        for held in self.tokens.values():
            n = 0
            while n < len(prompt) - 1 and n < len(held) and held[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best


class PrefixMachine(RuleBasedStateMachine):
    """claim_prefix, step with tokens, fork, pop_n and release on a prefix-caching manager."""

    def __init__(self) -> None:
        super().__init__()
        params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=4)
        self.manager = ContinuousBatchingKVCacheManager(
            params,
            CAPACITY,
            MAX_SEQ_LEN,
            1,
            [CPU()],
            None,
            enable_prefix_caching=True,
            prefix_block_size=2,
            cache_device=NumpyCacheDevice(),
        )
        self.model = PrefixModel()
        RELIABILITY_COUNTS["prefix machine: examples"] += 1

    def rejected(self, call: object, *args: object) -> None:
        before = (dict(self.manager.cache_lengths), self.manager.slots_remaining)
        with pytest.raises(ValueError):
            call(*args)  # type: ignore[operator]
        assert (dict(self.manager.cache_lengths), self.manager.slots_remaining) == before
        RELIABILITY_COUNTS["prefix machine: inputs rejected"] += 1

    @rule(data=st.data())
    def claim_prefix(self, data: st.DataObject) -> None:
        held = [t for t in self.model.tokens.values() if t]
        if held and data.draw(st.booleans(), label="reuse"):
            base = data.draw(st.sampled_from(held), label="base")
            keep = data.draw(st.integers(0, len(base)), label="keep")
            tail = data.draw(st.lists(st.integers(0, 2), max_size=3), label="tail")
            prompt = (base[:keep] + tail)[:MAX_SEQ_LEN]
        else:
            prompt = data.draw(st.lists(st.integers(0, 2), max_size=7), label="prompt")
        if not prompt or not self.model.free():
            self.rejected(self.manager.claim_prefix, prompt)
            return
        expected = self.model.best_prefix(prompt)
        free_before = set(self.model.free())
        seq_id, cached = self.manager.claim_prefix(prompt)
        assert cached == expected and seq_id in free_before
        self.model.take(seq_id, keep=0)
        self.model.tokens[seq_id] = prompt[:cached]
        RELIABILITY_COUNTS["prefix machine: hit tokens"] += cached
        # As a scheduler does: the uncached rest of the prompt is computed and committed.
        rest = prompt[cached:]
        self.manager.step({seq_id: len(rest)}, tokens={seq_id: rest})
        self.model.tokens[seq_id] = list(prompt)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        if not self.model.live:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.model.live)))
        room = MAX_SEQ_LEN - len(self.model.tokens[seq_id])
        ids = data.draw(st.lists(st.integers(0, 2), max_size=min(room, 4)))
        if data.draw(st.booleans(), label="miscounted"):
            self.rejected(self.manager.step, {seq_id: len(ids) + 1}, {seq_id: ids})
            return
        self.manager.step({seq_id: len(ids)}, tokens={seq_id: ids})
        self.model.tokens[seq_id] += ids

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        if not self.model.live or not self.model.free():
            return
        parent = data.draw(st.sampled_from(sorted(self.model.live)))
        length = len(self.model.tokens[parent])
        pos = data.draw(st.integers(0, length))
        (child,) = self.model.next_slots(1)
        assert self.manager.fork(parent, pos) == child
        held = self.model.tokens[parent][:pos]
        self.model.take(child)
        self.model.tokens[child] = held
        RELIABILITY_COUNTS["prefix machine: forks"] += 1

    @rule(data=st.data())
    def pop_n(self, data: st.DataObject) -> None:
        live = [s for s in sorted(self.model.live) if self.model.tokens[s]]
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        n = data.draw(st.integers(1, len(self.model.tokens[seq_id])))
        self.manager.pop_n(seq_id, n)
        del self.model.tokens[seq_id][-n:]
        RELIABILITY_COUNTS["prefix machine: pop_n"] += 1

    @rule(n=st.integers(1, 2))
    def claim(self, n: int) -> None:
        if n > len(self.model.free()):
            self.rejected(self.manager.claim, n)
            return
        expected = self.model.next_slots(n)
        assert self.manager.claim(n) == expected
        for slot in expected:
            self.model.take(slot)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.model.live:
            self.rejected(self.manager.release, 0)
            return
        seq_id = data.draw(st.sampled_from(sorted(self.model.live)))
        self.manager.release(seq_id)
        self.model.live.remove(seq_id)
        if self.model.tokens[seq_id]:
            self.model.released.append(seq_id)

    @invariant()
    def matches_model(self) -> None:
        lengths = {s: len(self.model.tokens[s]) for s in self.model.live}
        assert dict(self.manager.cache_lengths) == lengths
        assert self.manager.slots_remaining == CAPACITY - len(self.model.live)
        RELIABILITY_COUNTS["prefix machine: steps"] += 1


PrefixMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixStateMachine = PrefixMachine.TestCase


PAGE_SIZE = 2
NUM_PAGES = 10
PAGED_IDS = 4


class PagedMachine(RuleBasedStateMachine):
    """claim, fetch + write + step, fork, pop_n and release on a paged manager.

    The model holds each live sequence's token values.  Appends write them
    into the pages through the page table ``fetch`` returned (as a kernel
    would), so the invariant, which reads every sequence back through its
    pages, catches a page owned twice, a missed copy-on-write or a wrong
    fork copy; reference counts and the free-page count are checked against
    the pages the sequences hold (none leaked).
    """

    def __init__(self) -> None:
        super().__init__()
        params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=4)
        self.manager = PagedKVCacheManager(
            params,
            PAGE_SIZE,
            NUM_PAGES,
            PAGED_IDS,
            MAX_SEQ_LEN,
            1,
            [CPU()],
            None,
            cache_device=NumpyCacheDevice(),
        )
        self.values: dict[int, list[float]] = {}
        self.counter = 0.0
        RELIABILITY_COUNTS["paged machine: examples"] += 1

    def state(self) -> object:
        m = self.manager
        return (
            dict(m.cache_lengths),
            m.free_pages,
            {s: m.pages(s) for s in m.cache_lengths},
        )

    def rejected(self, call: object, *args: object, **kwargs: object) -> None:
        before = self.state()
        with pytest.raises(ValueError):
            call(*args, **kwargs)  # type: ignore[operator]
        assert self.state() == before
        RELIABILITY_COUNTS["paged machine: inputs rejected"] += 1

    def free_ids(self) -> list[int]:
        return [s for s in range(PAGED_IDS) if s not in self.values]

    @rule(n=st.integers(1, 2))
    def claim(self, n: int) -> None:
        if n > len(self.free_ids()):
            self.rejected(self.manager.claim, n)
            return
        expected = self.free_ids()[:n]
        assert self.manager.claim(n) == expected
        for seq in expected:
            self.values[seq] = []

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        live = sorted(self.values)
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True))
        new = [data.draw(st.integers(1, 4)) for _ in seqs]
        steps = data.draw(st.integers(1, 2))
        needed = [len(self.values[s]) + n + steps - 1 for s, n in zip(seqs, new, strict=True)]
        if max(needed) > MAX_SEQ_LEN:
            self.rejected(self.manager.fetch, seqs, steps, active_lengths=new)
            return
        m = self.manager
        pages_needed = 0
        for seq, total in zip(seqs, needed, strict=True):
            held = m.pages(seq)
            first = len(self.values[seq]) // PAGE_SIZE
            last = -(-total // PAGE_SIZE)
            shared = [i for i in range(first, min(last, len(held))) if m.page_refcount(held[i]) > 1]
            pages_needed += len(shared) + max(0, last - len(held))
        if pages_needed > m.free_pages:
            self.rejected(m.fetch, seqs, steps, active_lengths=new)
            RELIABILITY_COUNTS["paged machine: out of pages"] += 1
            return
        (inputs,) = m.fetch(seqs, steps, active_lengths=new)
        pages = inputs[0].to_numpy()
        table = inputs[2].to_numpy()
        lengths = inputs[1].to_numpy()
        # Write the first step's tokens through the table, as a kernel would.
        for row, (seq, n) in enumerate(zip(seqs, new, strict=True)):
            assert lengths[row] == len(self.values[seq])
            for t in range(len(self.values[seq]), len(self.values[seq]) + n):
                self.counter += 1
                pages[table[row, t // PAGE_SIZE], :, 0, t % PAGE_SIZE] = self.counter
                self.values[seq].append(self.counter)
        m.step(dict(zip(seqs, new, strict=True)))
        RELIABILITY_COUNTS["paged machine: appends"] += 1

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        live = sorted(self.values)
        parent = data.draw(st.sampled_from(live))
        pos = data.draw(st.integers(0, len(self.values[parent])))
        if not self.free_ids() or (pos % PAGE_SIZE and self.manager.free_pages == 0):
            self.rejected(self.manager.fork, parent, pos)
            return
        child = self.manager.fork(parent, pos)
        assert child == self.free_ids()[0]
        self.values[child] = self.values[parent][:pos]
        RELIABILITY_COUNTS["paged machine: forks"] += 1

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def pop_n(self, data: st.DataObject) -> None:
        live = sorted(self.values)
        seq = data.draw(st.sampled_from(live))
        n = data.draw(st.integers(0, len(self.values[seq]) + 1))
        if not 0 < n <= len(self.values[seq]):
            self.rejected(self.manager.pop_n, seq, n)
            return
        self.manager.pop_n(seq, n)
        del self.values[seq][-n:]
        RELIABILITY_COUNTS["paged machine: pop_n"] += 1

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.values)))
        if data.draw(st.integers(0, 9), label="bogus") == 0:
            self.rejected(self.manager.release, max(self.free_ids(), default=PAGED_IDS))
            return
        self.manager.release(seq)
        del self.values[seq]

    @invariant()
    def pages_match_model(self) -> None:
        m = self.manager
        assert dict(m.cache_lengths) == {s: len(v) for s, v in self.values.items()}
        pages = m._pages[0].to_numpy()
        holders: dict[int, int] = {}
        for seq, values in self.values.items():
            held = m.pages(seq)
            assert len(set(held)) == len(held), f"seq {seq} holds a page twice: {held}"
            assert len(held) >= -(-len(values) // PAGE_SIZE)
            for page in held:
                holders[page] = holders.get(page, 0) + 1
            tokens = np.arange(len(values))
            read = pages[
                np.array(held, dtype=np.int64)[tokens // PAGE_SIZE], 0, 0, tokens % PAGE_SIZE
            ]
            np.testing.assert_array_equal(read[:, 0, 0] if read.ndim > 1 else read, values)
        for page in range(NUM_PAGES):
            assert m.page_refcount(page) == holders.get(page, 0), f"page {page}"
        assert m.free_pages == NUM_PAGES - len(holders), "a page leaked"
        RELIABILITY_COUNTS["paged machine: steps"] += 1


PagedMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagedStateMachine = PagedMachine.TestCase


PREFIX_PAGE = 2
PREFIX_PAGES = 12
PREFIX_IDS = 4
PREFIX_SEQ_LEN = 14
SALTS = (None, "tenant-b")


def kv_value(prefix: Sequence[int], salt: str | None) -> float:
    """The value a model writes at the last position of ``prefix``: a function of the
    whole prefix (as a real K/V row is), exact in float32."""
    return float(hash((salt, *prefix)) % 2**23)


class PagedPrefixModel:
    """What a paged manager with prefix caching holds, from its contract.

    Per live sequence: token ids, salt, the prompt tokens it still has to
    prefill, and whether its page chain was built since the last
    ``reset_prefix_cache`` (only then are its full pages findable).  Every
    page-aligned prefix ever committed, per salt (since the last reset),
    bounds what a claim may find from above; the committed prefixes of live,
    registered sequences bound it from below (held pages are never evicted).
    """

    def __init__(self, window: int | None = None) -> None:
        #: Every layer attends to its last ``window`` tokens (``None``: all of them).
        self.window = window
        self.tokens: dict[int, list[int]] = {}
        self.salt: dict[int, str | None] = {}
        self.pending: dict[int, list[int]] = {}
        self.registered: dict[int, bool] = {}
        #: For a sequence live at a reset (``registered`` false): its tokens then.
        #: The pages it fills later are registered (its hash chain goes on),
        #: those it held then are not.
        self.since: dict[int, int] = {}
        self.committed: dict[str | None, set[tuple[int, ...]]] = {s: set() for s in SALTS}

    def commit(self, seq: int) -> None:
        tokens = self.tokens[seq]
        first = PREFIX_PAGE
        if not self.registered[seq]:
            first = (self.since[seq] // PREFIX_PAGE + 1) * PREFIX_PAGE
        for end in range(first, len(tokens) + 1, PREFIX_PAGE):
            self.committed[self.salt[seq]].add(tuple(tokens[:end]))

    def first_visible(self, length: int) -> int:
        """The first position a sequence of ``length`` tokens may still attend to."""
        return 0 if self.window is None else max(0, length - self.window + 1)

    def first_kept_page(self, length: int) -> int:
        """The pages before it hold no position any layer may attend to: given back."""
        return self.first_visible(length) // PREFIX_PAGE

    def bounds(self, prompt: list[int], salt: str | None) -> tuple[int, int]:
        usable = len(prompt) - 1
        upper = max(
            (n for n in range(0, usable + 1, PREFIX_PAGE)
             if n == 0 or tuple(prompt[:n]) in self.committed[salt]),
            default=0,
        )  # fmt: skip
        lower = 0
        for seq, tokens in self.tokens.items():
            if self.salt[seq] != salt or not self.registered[seq]:
                continue
            n = 0
            while n < min(usable, len(tokens)) and tokens[n] == prompt[n]:
                n += 1
            n -= n % PREFIX_PAGE
            # It holds the pages a prefix of n tokens needs unless it gave them back.
            if self.first_kept_page(len(tokens)) <= self.first_kept_page(n):
                lower = max(lower, n)
        return lower, upper


class PagedPrefixMachine(RuleBasedStateMachine):
    """claim_prefix (with salts), claim, prefill and decode, fork, pop_n, release,
    swap out and in, and resets on a paged manager with prefix caching and a host
    tier smaller than the pages (so claims also load prefixes the device evicted).

    Writes go through the page table ``fetch`` returns, with values that are
    a function of the whole prefix (as real keys and values are), so reading
    every live sequence back through its pages catches a page shared between
    different prefixes or salts, a write into a shared or cached page, and a
    wrong fork; reference counts and free pages are checked against the
    pages the sequences hold, and every claim's hit against the model's bounds.
    """

    #: The manager's sliding window (``None``: pages are kept until release).
    WINDOW: int | None = None
    #: The cache's encoding and head size.
    ENCODING = "float32"
    HEAD_DIM = 4

    def __init__(self) -> None:
        super().__init__()
        params = KVCacheParams(DType.float32, 1, self.HEAD_DIM, cache_dtype=self.ENCODING)  # type: ignore[arg-type]
        #: What a stored element holds of a value (a quantized row's storage
        #: is an integer: the value modulo its range).
        self.stored = (
            (lambda v: v % 2 ** (8 * int(params.cache_dtype.size_in_bytes)))
            if params.quantized
            else (lambda v: v)
        )
        page_bytes = PREFIX_PAGE * params.token_bytes(1)
        self.manager = PagedKVCacheManager(
            params,
            PREFIX_PAGE,
            PREFIX_PAGES,
            PREFIX_IDS,
            PREFIX_SEQ_LEN,
            1,
            [CPU()],
            None,
            enable_prefix_caching=True,
            cache_device=NumpyCacheDevice(),
            tiers=TierConfig(model_id="machine", host_bytes=PREFIX_PAGES * page_bytes),
            sliding_window=self.WINDOW,
        )
        self.model = PagedPrefixModel(self.WINDOW)
        #: Swapped-out sequences: the handle, and the model's records of the sequence.
        self.swapped: list[tuple[SwappedSequence, list[int], str | None, list[int]]] = []
        self.lookups = 0
        self.hit_tokens = 0
        self.counts = f"paged prefix machine{'' if self.WINDOW is None else ' (window)'}"
        RELIABILITY_COUNTS[f"{self.counts}: examples"] += 1

    def state(self) -> object:
        m = self.manager
        return dict(m.cache_lengths), m.free_pages, {s: m.pages(s) for s in m.cache_lengths}

    def rejected(self, call: object, *args: object, **kwargs: object) -> None:
        before = self.state()
        with pytest.raises(ValueError):
            call(*args, **kwargs)  # type: ignore[operator]
        assert self.state() == before
        RELIABILITY_COUNTS[f"{self.counts}: inputs rejected"] += 1

    def live(self) -> list[int]:
        return sorted(self.model.tokens)

    @rule(data=st.data())
    def claim_prefix(self, data: st.DataObject) -> None:
        salt = data.draw(st.sampled_from(SALTS), label="salt")
        known = [t for t in self.model.committed[salt] if t]
        if known and data.draw(st.integers(0, 3), label="reuse") > 0:
            base = list(data.draw(st.sampled_from(sorted(known)), label="base"))
            tail = data.draw(st.lists(st.integers(1, 3), max_size=4), label="tail")
            prompt = base + tail
        else:
            prompt = data.draw(st.lists(st.integers(1, 3), max_size=8), label="prompt")
        if not prompt or len(prompt) > PREFIX_SEQ_LEN or len(self.live()) == PREFIX_IDS:
            self.rejected(self.manager.claim_prefix, prompt, salt=salt)
            return
        lower, upper = self.model.bounds(prompt, salt)
        assert self.manager.cached_prefix_length(prompt, salt=salt) <= upper
        from_tiers = self.manager.tier_hit_tokens
        seq, cached = self.manager.claim_prefix(prompt, salt=salt)
        assert cached % PREFIX_PAGE == 0 and lower <= cached <= upper, (lower, cached, upper)
        if self.manager.tier_hit_tokens > from_tiers:
            RELIABILITY_COUNTS[f"{self.counts}: hits loaded from the host tier"] += 1
        self.lookups += 1
        self.hit_tokens += cached
        if cached:
            RELIABILITY_COUNTS[f"{self.counts}: hits"] += 1
        if self.manager.pages(seq)[:1] == (UNUSED_PAGE,):
            RELIABILITY_COUNTS[f"{self.counts}: hits whose first pages were given back"] += 1
        self.model.tokens[seq] = prompt[:cached]
        self.model.salt[seq] = salt
        self.model.pending[seq] = prompt[cached:]
        self.model.registered[seq] = True
        if data.draw(st.booleans(), label="prefill now"):
            self.write({seq: self.model.pending[seq]})

    @rule()
    def claim(self) -> None:
        if len(self.live()) == PREFIX_IDS:
            self.rejected(self.manager.claim, 1)
            return
        (seq,) = self.manager.claim(1)
        self.model.tokens[seq], self.model.salt[seq] = [], None
        self.model.pending[seq], self.model.registered[seq] = [], True

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seqs = data.draw(
            st.lists(st.sampled_from(self.live()), min_size=1, max_size=2, unique=True)
        )
        new_tokens = {}
        for seq in seqs:
            pending = self.model.pending[seq]
            if pending:
                new_tokens[seq] = pending[: data.draw(st.integers(1, len(pending)))]
            else:
                new_tokens[seq] = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        self.write(new_tokens)

    def write(self, new_tokens: dict[int, list[int]]) -> None:
        """fetch, write each new token's value through the page table, step with the ids."""
        m = self.manager
        seqs = list(new_tokens)
        active = [len(new_tokens[s]) for s in seqs]
        totals = {s: len(self.model.tokens[s]) + len(t) for s, t in new_tokens.items()}
        if max(totals.values()) > PREFIX_SEQ_LEN:
            self.rejected(m.fetch, seqs, 1, active_lengths=active)
            return
        try:
            m.reserve(totals)
        except ValueError:  # out of pages (CacheFullError): nothing may have changed
            RELIABILITY_COUNTS[f"{self.counts}: out of pages"] += 1
            self.rejected(m.fetch, seqs, 1, active_lengths=active)
            return
        (inputs,) = m.fetch(seqs, 1, active_lengths=active)
        pages, table = inputs[0].to_numpy(), inputs[2].to_numpy()
        for row, seq in enumerate(seqs):
            tokens = self.model.tokens[seq]
            for token in new_tokens[seq]:
                tokens.append(token)
                t = len(tokens) - 1
                value = self.stored(kv_value(tokens, self.model.salt[seq]))
                pages[table[row, t // PREFIX_PAGE], :, 0, t % PREFIX_PAGE] = value
            self.model.pending[seq] = self.model.pending[seq][len(new_tokens[seq]) :]
        m.step({s: len(t) for s, t in new_tokens.items()}, tokens=new_tokens)
        for seq in seqs:
            self.model.commit(seq)
        RELIABILITY_COUNTS[f"{self.counts}: appends"] += 1

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live()))
        length = len(self.model.tokens[parent])
        pos = data.draw(st.integers(0, length))
        needs_copy = pos % PREFIX_PAGE != 0
        given_back = self.model.first_kept_page(pos) < self.model.first_kept_page(length)
        if given_back and len(self.live()) < PREFIX_IDS:
            with pytest.raises(ValueError, match="given back"):
                self.manager.fork(parent, pos)
            RELIABILITY_COUNTS[f"{self.counts}: forks into given-back pages refused"] += 1
            return
        if (
            given_back
            or len(self.live()) == PREFIX_IDS
            or (needs_copy and self.manager.free_pages == 0)
        ):
            self.rejected(self.manager.fork, parent, pos)
            return
        child = self.manager.fork(parent, pos)
        self.model.tokens[child] = self.model.tokens[parent][:pos]
        self.model.salt[child] = self.model.salt[parent]
        self.model.pending[child] = []
        self.model.registered[child] = self.model.registered[parent]
        if not self.model.registered[parent]:
            self.model.since[child] = min(self.model.since[parent], pos)
        RELIABILITY_COUNTS[f"{self.counts}: forks"] += 1

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def pop_n(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live()))
        length = len(self.model.tokens[seq])
        n = data.draw(st.integers(0, length + 1))
        if not 0 < n <= length:
            self.rejected(self.manager.pop_n, seq, n)
            return
        if self.model.first_kept_page(length - n) < self.model.first_kept_page(length):
            before = self.state()
            with pytest.raises(ValueError, match="given back"):
                self.manager.pop_n(seq, n)
            assert self.state() == before
            RELIABILITY_COUNTS[f"{self.counts}: pop_n into given-back pages refused"] += 1
            return
        self.manager.pop_n(seq, n)
        del self.model.tokens[seq][-n:]
        self.model.pending[seq] = []
        RELIABILITY_COUNTS[f"{self.counts}: pop_n"] += 1

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live()))
        self.manager.release(seq)
        del self.model.tokens[seq], self.model.salt[seq], self.model.pending[seq]
        del self.model.registered[seq]

    @rule()
    def evict_device_cache(self) -> None:
        """A throwaway sequence takes every free page (evicting the cached ones) and lets
        go: the prefixes nobody holds are then in the host tier only."""
        m = self.manager
        free = m.free_pages
        if len(self.live()) == PREFIX_IDS or free == 0:
            return
        (seq,) = m.claim(1)
        m.reserve({seq: min(free * PREFIX_PAGE, PREFIX_SEQ_LEN)})
        m.release(seq)
        RELIABILITY_COUNTS[f"{self.counts}: device cache evicted"] += 1

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live()))
        swapped = self.manager.swap_out(seq)
        self.swapped.append(
            (swapped, self.model.tokens.pop(seq), self.model.salt.pop(seq),
             self.model.pending.pop(seq))
        )  # fmt: skip
        del self.model.registered[seq]
        RELIABILITY_COUNTS[f"{self.counts}: swapped out"] += 1

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        m = self.manager
        index = data.draw(st.integers(0, len(self.swapped) - 1))
        swapped, tokens, salt, pending = self.swapped[index]
        if len(self.live()) == PREFIX_IDS or m.swap_in_pages(swapped) > m.free_pages:
            before = self.state()
            with pytest.raises(CacheFullError):
                m.swap_in(swapped)
            assert self.state() == before
            RELIABILITY_COUNTS[f"{self.counts}: swap in refused"] += 1
            return
        seq = m.swap_in(swapped)
        del self.swapped[index]
        self.model.tokens[seq], self.model.salt[seq] = tokens, salt
        self.model.pending[seq], self.model.registered[seq] = pending, True
        self.model.commit(seq)  # its full pages are registered again
        with pytest.raises(ValueError, match="swapped in already"):
            m.swap_in(swapped)
        RELIABILITY_COUNTS[f"{self.counts}: swapped in"] += 1

    @rule(data=st.data())
    def reset_prefix_cache(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 9), label="rarely") != 0:
            return
        self.manager.reset_prefix_cache()
        self.model.committed = {s: set() for s in SALTS}
        for seq in self.model.registered:
            self.model.registered[seq] = False
            self.model.since[seq] = len(self.model.tokens[seq])
        RELIABILITY_COUNTS[f"{self.counts}: resets"] += 1

    @invariant()
    def pages_hold_every_prefix(self) -> None:
        m = self.manager
        assert dict(m.cache_lengths) == {s: len(t) for s, t in self.model.tokens.items()}
        pages = m._pages[0].to_numpy()
        holders: dict[int, int] = {}
        for seq, tokens in self.model.tokens.items():
            row = m.pages(seq)
            # Nothing before the window is held; everything after it is.
            gone = self.model.first_kept_page(len(tokens))
            assert row[:gone] == (UNUSED_PAGE,) * gone, (seq, len(tokens), row)
            held = row[gone:]
            assert UNUSED_PAGE not in held, (seq, len(tokens), row)
            assert len(held) >= -(-len(tokens) // PREFIX_PAGE) - gone
            assert len(set(held)) == len(held), f"seq {seq} holds a page twice: {held}"
            for page in held:
                holders[page] = holders.get(page, 0) + 1
            salt = self.model.salt[seq]
            # Every position a layer may still attend to reads back its own value.
            for t in range(self.model.first_visible(len(tokens)), len(tokens)):
                read = pages[row[t // PREFIX_PAGE], 0, 0, t % PREFIX_PAGE, 0, 0]
                assert read == self.stored(kv_value(tokens[: t + 1], salt)), (seq, t, tokens)
        for page in range(PREFIX_PAGES):
            assert m.page_refcount(page) == holders.get(page, 0), f"page {page}"
        assert m.free_pages == PREFIX_PAGES - len(holders), "a page leaked"
        assert m.swapped_bytes == sum(s.nbytes for s, *_ in self.swapped)
        tiers = m.tiers
        assert tiers is not None and tiers.host.used_bytes <= tiers.host.budget_bytes
        stats = m.prefix_cache_stats
        assert (stats.lookups, stats.hit_tokens) == (self.lookups, self.hit_tokens)
        RELIABILITY_COUNTS[f"{self.counts}: steps"] += 1


PagedPrefixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagedPrefixStateMachine = PagedPrefixMachine.TestCase


class WindowedPrefixMachine(PagedPrefixMachine):
    """The same machine on a cache whose layers attend to their last 3 tokens:
    pages are given back as the window passes them, claims reuse prefixes whose
    early pages are gone, and fork and pop_n that would reach back into a page
    given back are refused with nothing changed."""

    WINDOW = 3


WindowedPrefixMachine.TestCase.settings = PagedPrefixMachine.TestCase.settings
TestWindowedPrefixStateMachine = WindowedPrefixMachine.TestCase


class Int4PrefixMachine(PagedPrefixMachine):
    """The same machine on an int4 cache (uint16 storage, a row of 32 values is
    18 elements): page tables, copies, swaps and the host tier move whole
    encoded rows, scales included."""

    ENCODING = "int4"
    HEAD_DIM = 32


# The paged machine's settings, fewer examples.
Int4PrefixMachine.TestCase.settings = settings(
    PagedPrefixMachine.TestCase.settings, max_examples=60
)
TestInt4PrefixStateMachine = Int4PrefixMachine.TestCase


def test_eight_threads_share_one_manager() -> None:
    """Thousands of mixed operations from 8 threads; then every slot is back and
    no id was ever held by two threads at once."""
    manager = new_manager()
    owner: dict[int, int] = {}
    owner_lock = threading.Lock()
    count_lock = threading.Lock()

    def count(name: str) -> None:
        with count_lock:
            RELIABILITY_COUNTS[name] += 1

    errors: list[BaseException] = []
    ops_per_thread = 400
    barrier = threading.Barrier(8)

    def worker(index: int) -> None:
        rng = random.Random(index)
        mine: dict[int, int] = {}  # id -> committed length, as this thread knows it
        try:
            barrier.wait()
            for _ in range(ops_per_thread):
                count("threads: operations")
                action = rng.choice(["claim", "external", "fetch", "step", "release"])
                if action == "claim":
                    try:
                        ids = manager.claim(rng.randint(1, 2))
                    except ValueError:
                        count("threads: refused (full or taken)")
                        continue
                    with owner_lock:
                        for i in ids:
                            assert i not in owner, f"id {i} handed to two threads"
                            owner[i] = index
                    mine.update(dict.fromkeys(ids, 0))
                elif action == "external":
                    seq_id = rng.randrange(CAPACITY)
                    try:
                        manager.external_claim([seq_id])
                    except ValueError:
                        count("threads: refused (full or taken)")
                        continue
                    with owner_lock:
                        assert seq_id not in owner, f"id {seq_id} handed to two threads"
                        owner[seq_id] = index
                    mine[seq_id] = 0
                elif action == "fetch" and mine:
                    ids = [i for i in mine if mine[i] + 2 <= MAX_SEQ_LEN]
                    if not ids:
                        continue
                    inputs = manager.fetch(ids, num_steps=2)
                    np.testing.assert_array_equal(inputs[0][1].to_numpy(), [mine[i] for i in ids])
                    inputs = manager.increment_cache_lengths(
                        inputs, (None, offsets([1] * len(ids)))
                    )
                    count("threads: fetch + increment_cache_lengths")
                    np.testing.assert_array_equal(
                        inputs[0][1].to_numpy(), [mine[i] + 1 for i in ids]
                    )
                elif action == "step" and mine:
                    seq_id = rng.choice(list(mine))
                    tokens = rng.randint(0, 4)
                    try:
                        manager.step({seq_id: tokens})
                    except ValueError:
                        assert mine[seq_id] + tokens > MAX_SEQ_LEN
                        count("threads: refused (past max_seq_len)")
                        continue
                    mine[seq_id] += tokens
                    assert manager.cache_lengths[seq_id] == mine[seq_id]
                elif action == "release" and mine:
                    seq_id = rng.choice(list(mine))
                    with owner_lock:
                        del owner[seq_id]
                    del mine[seq_id]
                    manager.release(seq_id)
            for seq_id in list(mine):
                with owner_lock:
                    del owner[seq_id]
                manager.release(seq_id)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert manager.slots_remaining == CAPACITY
    assert dict(manager.cache_lengths) == {}
    assert owner == {}
