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
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession

from maxkv import ContinuousBatchingKVCacheManager, KVCacheParams

from .conftest import RELIABILITY_COUNTS

CAPACITY = 6
MAX_SEQ_LEN = 12
_session: InferenceSession | None = None


def shared_session() -> InferenceSession:
    global _session
    if _session is None:
        _session = InferenceSession(devices=[CPU()])
    return _session


def new_manager() -> ContinuousBatchingKVCacheManager:
    params = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=4)
    return ContinuousBatchingKVCacheManager(
        params, CAPACITY, MAX_SEQ_LEN, 1, [CPU()], shared_session()
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
