"""The KV events a cache publishes say only what is true, at every step.

The stream is decoded here from the format's description (plain msgpack, read
by hand: not maxkv's structs) by a subscriber that keeps, per layer group and
medium, the blocks it was told are stored.  A hypothesis state machine claims
(with a cached prefix, salted or not, from the tiers), steps, forks, pops,
swaps, releases and resets a hybrid cache (a sliding-window group that gives
pages back, a full-attention group) with a host tier; after every call the
subscriber's view equals what the cache would serve: the pages registered in
each group's prefix cache (``"GPU"``) and the blocks of its host tier
(``"CPU"``), and every announced block's tokens are a prefix some sequence
committed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from maxkv import CacheFullError
from maxkv.events import encode_batch, event_hash
from maxkv.events.log import KVEventLog

from .conftest import RELIABILITY_COUNTS
from .fakes import paged
from .test_hybrid_cache import PAGE, PARAMS, HybridTierMachine
from .test_reliability import PrefixMachine

pytestmark = pytest.mark.unit

#: The fields each event type has on the wire (vLLM's, since events became maps).
STORED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}
STORED_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
REMOVED_KEYS = {"type", "block_hashes", "medium"}
REMOVED_OPTIONAL = {"group_idx"}


class Subscriber:
    """What a router learns from the stream: per (group, medium) the hashes stored."""

    def __init__(self, block_size: int = PAGE) -> None:
        self.block_size = block_size
        self.held: dict[tuple[int, str], set[int]] = defaultdict(set)
        #: Every block ever announced: (salt of its chain, its tokens from the start).
        self.prefix: dict[int, tuple[Any, tuple[int, ...]]] = {}
        self.batches = 0

    def __call__(self, events: list[Any]) -> None:
        """A sink: the batch as it goes on the wire, decoded by hand."""
        self.read(encode_batch(events))

    def read(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0 and events
        self.batches += 1
        for event in events:
            assert isinstance(event, dict), event
            kind = event["type"]
            if kind == "AllBlocksCleared":
                assert set(event) == {"type"}
                self.held.clear()
            elif kind == "BlockStored":
                assert STORED_KEYS <= set(event) <= STORED_KEYS | STORED_OPTIONAL, event
                self.stored(event)
            elif kind == "BlockRemoved":
                assert REMOVED_KEYS <= set(event) <= REMOVED_KEYS | REMOVED_OPTIONAL, event
                held = self.held[event.get("group_idx") or 0, event["medium"]]
                for block in event["block_hashes"]:
                    assert block in held, f"removed {block}, never stored"
                    held.remove(block)
            else:
                raise AssertionError(f"unknown event type {kind!r}")

    def stored(self, event: dict[str, Any]) -> None:
        hashes, size = event["block_hashes"], event["block_size"]
        tokens = event["token_ids"]
        assert size == self.block_size and len(tokens) == len(hashes) * size
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        assert event["lora_id"] is None and event["lora_name"] is None
        assert event["medium"] in ("GPU", "CPU", "STORAGE")
        extra = event["extra_keys"]
        assert len(extra) == len(hashes)
        group = event["group_idx"]
        window = event.get("kv_cache_spec_sliding_window")
        kind = "full_attention" if window is None else "sliding_window"
        assert event["kv_cache_spec_kind"] == kind
        parent = event["parent_block_hash"]
        for i, block in enumerate(hashes):
            own = tokens[i * size : (i + 1) * size]
            if parent is None:
                salt = extra[i][0] if extra[i] is not None else None
                prefix: tuple[Any, tuple[int, ...]] = (salt, tuple(own))
            else:
                assert extra[i] is None  # the salt goes with a chain's first block
                if parent in self.prefix:
                    salt, before = self.prefix[parent]
                    prefix = (salt, before + tuple(own))
                else:  # its parent was never announced here (another group's window)
                    prefix = (None, ())
            if prefix[1]:
                # One hash, one content: a salted chain never shares an unsalted hash.
                assert self.prefix.setdefault(block, prefix) == prefix
            held = self.held[group, event["medium"]]
            held.add(block)
            parent = block


class EventsMachine(HybridTierMachine):
    """:class:`HybridTierMachine` with KV events attached, salted prompts, and resets
    through the manager (the events say so)."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriber = Subscriber()
        self.log: KVEventLog = self.m.attach_kv_events(self.subscriber)
        #: Every token list a sequence committed, with its salt.
        self.committed: list[tuple[str | None, list[int]]] = []

    @rule(data=st.data())
    def claim_salted(self, data: st.DataObject) -> None:
        """A tenant's prompt: its blocks hash apart from the same tokens unsalted."""
        prompt = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=30))
        if len(self.tokens) == 4:
            return
        seq, cached = self.m.claim_prefix(prompt, salt="tenant-a")
        self.tokens[seq] = prompt[:cached]
        self.step_with(seq, prompt[cached:])
        RELIABILITY_COUNTS["events machine: salted claims"] += 1

    def step_with(self, seq: int, new: list[int]) -> None:
        before = len(self.tokens[seq])
        super().step_with(seq, new)
        if len(self.tokens[seq]) > before:
            salt = self.m._seqs[seq].salt  # forks and swap-ins keep their parent's
            self.committed.append((salt, list(self.tokens[seq])))

    @rule(data=st.data())
    def forget_the_device_cache(self, data: st.DataObject) -> None:
        """Now and then, a prefix cache reset (``AllBlocksCleared``)."""
        if data.draw(st.integers(0, 5), label="reset") == 0:
            self.m.reset_prefix_cache()
            RELIABILITY_COUNTS["events machine: resets"] += 1

    @invariant()
    def the_subscriber_sees_what_the_cache_serves(self) -> None:

        seen = self.subscriber
        for g, group in enumerate(self.m.groups):
            on_device = {event_hash(h) for h in group.pool.cached_hashes()}
            assert seen.held[g, "GPU"] == on_device
            assert group.tiers is not None
            in_host = {event_hash(k) for k in group.tiers.host.keys()}
            assert seen.held[g, "CPU"] == in_host
            RELIABILITY_COUNTS["events machine: blocks checked"] += len(on_device) + len(in_host)
        for block, (salt, tokens) in seen.prefix.items():
            assert any(s == salt and list(tokens) == t[: len(tokens)] for s, t in self.committed), (
                f"block {block} announces tokens no sequence committed"
            )


EventsMachine.TestCase.settings = HybridTierMachine.TestCase.settings
TestEventsStateMachine = EventsMachine.TestCase


def test_events_come_one_batch_per_call_and_chain_runs_join() -> None:
    """A prompt of 3 full pages committed in one step: one batch, one ``BlockStored``
    of 3 chained blocks with the prompt's tokens; eviction sends ``BlockRemoved``."""
    batches: list[bytes] = []
    m = paged(PARAMS, PAGE, 4, 2, 64, enable_prefix_caching=True)
    m.attach_kv_events(lambda events: batches.append(encode_batch(events)))
    prompt = list(range(1, 14))  # 3 full pages and one token
    (seq,) = m.claim(1)
    m.fetch([seq], 1, active_lengths=[13])
    m.step({seq: 13}, tokens={seq: prompt})
    assert len(batches) == 1
    (stored,) = msgspec.msgpack.decode(batches[0])[1]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["token_ids"] == prompt[:12] and len(stored["block_hashes"]) == 3
    assert stored["extra_keys"] == [None, None, None] and stored["medium"] == "GPU"
    assert (stored["group_idx"], stored["kv_cache_spec_kind"]) == (0, "full_attention")
    m.release(seq)
    (other,) = m.claim(1)
    with pytest.raises(CacheFullError):
        m.reserve({other: 4 * PAGE + 1})  # refused: nothing evicted, nothing said
    assert len(batches) == 1
    m.reserve({other: 2 * PAGE})  # evicts the 2 cached pages freed last... first out
    removed = msgspec.msgpack.decode(batches[-1])[1]
    assert [e["type"] for e in removed] == ["BlockRemoved"]
    assert len(removed[0]["block_hashes"]) == 1  # one free page held no content
    assert set(removed[0]["block_hashes"]) <= set(stored["block_hashes"])


def test_attaching_events_needs_prefix_caching_and_happens_once() -> None:
    m = paged(PARAMS, PAGE, 4, 2, 64)
    with pytest.raises(ValueError, match="prefix caching is off"):
        m.attach_kv_events(lambda events: None)
    m = paged(PARAMS, PAGE, 4, 2, 64, enable_prefix_caching=True)
    m.attach_kv_events(lambda events: None)
    with pytest.raises(ValueError, match="attached to this cache already"):
        m.attach_kv_events(lambda events: None)


def test_a_sink_that_fails_never_fails_the_step() -> None:
    def broken(events: list[Any]) -> None:
        raise RuntimeError("publisher closed")

    m = paged(PARAMS, PAGE, 4, 2, 64, enable_prefix_caching=True)
    log = m.attach_kv_events(broken)
    (seq,) = m.claim(1)
    m.fetch([seq], 1, active_lengths=[5])
    m.step({seq: 5}, tokens={seq: [1, 2, 3, 4, 5]})
    assert (log.events_sent, log.events_lost) == (1, 1)
    assert m.cache_lengths[seq] == 5


class ContiguousEventsMachine(PrefixMachine):
    """:class:`~tests.test_reliability.PrefixMachine` (the contiguous cache's prefix
    index over live and released slots) with KV events attached: a block is
    announced while some slot the index searches holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.subscriber = Subscriber(block_size=2)
        self.manager.attach_kv_events(self.subscriber)

    @invariant()
    def the_subscriber_sees_what_the_index_finds(self) -> None:

        index = self.manager._prefix
        assert index is not None
        indexed = {event_hash(h) for h in index._slots_by_hash}
        assert self.subscriber.held[0, "GPU"] == indexed
        RELIABILITY_COUNTS["contiguous events machine: blocks checked"] += len(indexed)


ContiguousEventsMachine.TestCase.settings = PrefixMachine.TestCase.settings
TestContiguousEventsStateMachine = ContiguousEventsMachine.TestCase


def test_the_disk_tier_announces_its_blocks_as_storage_and_redis_is_not_announced(
    tmp_path: Path,
) -> None:
    """Committed pages go to disk and Redis from the tiers' writer thread: the disk's
    are announced ``STORAGE`` with the next protocol call's batch, and removed when
    the disk evicts them; Redis's are not announced (every replica's, evicted by
    Redis unseen)."""
    import fakeredis

    from maxkv.tiers import TierConfig

    disk_dir = tmp_path / "disk"
    tiers = TierConfig(
        model_id="events-storage",
        host_bytes=0,
        disk_dir=str(disk_dir),
        redis_url="redis://fake:0/0",
        redis_client=fakeredis.FakeRedis(),
        secret="events-test-secret-0123456789",
    )
    subscriber = Subscriber()
    m = paged(PARAMS, PAGE, 8, 2, 64, enable_prefix_caching=True, tiers=tiers)
    try:
        m.attach_kv_events(subscriber)
        (seq,) = m.claim(1)
        prompt = list(range(1, 3 * PAGE + 2))  # 3 full pages
        m.fetch([seq], 1, active_lengths=[len(prompt)])
        m.step({seq: len(prompt)}, tokens={seq: prompt})
        assert len(subscriber.held[0, "GPU"]) == 3 and not subscriber.held[0, "STORAGE"]
        store = m.tiers
        assert store is not None and store.disk is not None
        store.flush()  # the writer thread wrote them
        assert len(store.disk) == 3
        assert m.cache_lengths[seq] == len(prompt)  # a call: the writer's events go out
        assert subscriber.held[0, "STORAGE"] == subscriber.held[0, "GPU"]
        # The disk lets one go (its budget shrank): no longer STORAGE (Redis has it).
        store.disk.budget_bytes = store.disk.used_bytes - 1
        store.disk.put(b"x" * 16, b"")  # evicts the least recently written
        on_disk = {h for h in m.groups[0].pool.cached_hashes() if h in store.disk}
        assert len(on_disk) == 2
        assert m.cache_lengths[seq] == len(prompt)
        assert subscriber.held[0, "STORAGE"] == {event_hash(h) for h in on_disk}
    finally:
        m.close()
