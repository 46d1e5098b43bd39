"""KV tiers: block framing and checks, host / disk / Redis tiers, the store, MAX's
KVConnector protocol, prefix caching across tiers and swap on the paged manager.

Unit tier: a NumPy device layer (``tests/fakes.py``) and ``fakeredis``; the
tests marked ``redis`` use a real ``redis-server`` (faults, other processes).
Every check compares KV read back against the arrays written, never against
the code under test.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import fakeredis
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from max.dtype import DType

from maxkv import CacheFullError, KVCacheParams
from maxkv.tiers import (
    BlockInvalid,
    BlockLayout,
    DiskTier,
    HostTier,
    Keyring,
    TierConfig,
    TieredBlockStore,
    decode_block,
    encode_block,
)
from maxkv.tiers import disk as disk_module
from maxkv.tiers.local_server import LocalRedisServer as RedisServer

from . import fakes

pytestmark = pytest.mark.unit

LAYOUT = BlockLayout(
    "test-model", "page", num_layers=2, n_kv_heads=2, head_dim=4, dtype="float32", page_size=4
)
PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=4)


def block(seed: int, layout: BlockLayout = LAYOUT) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(layout.page_shape()).astype(np.float32)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ------------------------------------------------------------------ blocks


def test_block_round_trip_and_every_refusal() -> None:
    array = block(1)
    data = encode_block(LAYOUT, key(1), array, {"start": 3})
    back, extra = decode_block(LAYOUT, key(1), data)
    np.testing.assert_array_equal(back, array)
    assert extra == {"start": 3}

    def reason(layout: BlockLayout, k: bytes, raw: bytes) -> str:
        with pytest.raises(BlockInvalid) as caught:
            decode_block(layout, k, raw)
        return caught.value.reason

    assert reason(LAYOUT, key(1), data[:-1]) == "truncated"
    assert reason(LAYOUT, key(1), data[:10]) == "truncated"
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    assert reason(LAYOUT, key(1), bytes(flipped)) == "corrupt"
    assert reason(LAYOUT, key(1), b"NOTMAXKV" + data[8:]) == "corrupt"
    start = bytes(data).index(b'"start": 3')  # a valid header saying something else
    forged_start = data[:start] + b'"start": 4' + data[start + 10 :]
    assert reason(LAYOUT, key(1), forged_start) == "corrupt"  # the header's own CRC-32
    assert reason(LAYOUT, key(2), data) == "key"
    for other in (
        BlockLayout("other-model", "page", 2, 2, 4, "float32", 4),
        BlockLayout("test-model", "page", 2, 2, 4, "float16", 4),
        BlockLayout("test-model", "page", 3, 2, 4, "float32", 4),
        BlockLayout("test-model", "page", 2, 2, 4, "float32", 8),
    ):
        assert other.fingerprint != LAYOUT.fingerprint
        assert reason(other, key(1), data) == "layout"


def test_layout_rejects_wrong_shapes() -> None:
    with pytest.raises(BlockInvalid):
        LAYOUT.check_shape((1, 2, 2, 4, 2, 5))
    chunk = BlockLayout("m", "chunk", 2, 2, 4, "float32")
    chunk.check_shape((2, 2, 7, 2, 4))
    with pytest.raises(BlockInvalid):
        chunk.check_shape((2, 2, 0, 2, 4))
    with pytest.raises(ValueError):
        BlockLayout("m", "page", 2, 2, 4, "float32", page_size=0)


# ------------------------------------------------------------------- tiers


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), max_size=60), st.integers(0, 40))
def test_host_tier_never_exceeds_its_budget(puts: list[tuple[int, int]], budget: int) -> None:
    tier = HostTier(budget * 8)
    for k, size in puts:
        kept = tier.put(key(k), np.zeros(size, np.float64))
        assert tier.used_bytes <= tier.budget_bytes
        assert kept == (key(k) in tier)
    assert tier.used_bytes == sum(int(a.nbytes) for a, _ in tier._entries.values())


def test_host_tier_evicts_least_recently_used() -> None:
    tier = HostTier(3 * 8)
    for i in range(3):
        tier.put(key(i), np.zeros(1))
    tier.get(key(0))
    tier.put(key(3), np.zeros(1))
    assert [key(i) in tier for i in range(4)] == [True, False, True, True]
    assert tier.evictions == 1


def test_disk_tier_survives_a_restart_and_keeps_its_budget(tmp_path: Path) -> None:
    data = [encode_block(LAYOUT, key(i), block(i)) for i in range(5)]
    size = len(data[0])
    tier = DiskTier(tmp_path, budget_bytes=3 * size)
    for i, d in enumerate(data):
        assert tier.put(key(i), d)
        assert tier.used_bytes <= tier.budget_bytes
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
        assert on_disk == tier.used_bytes <= 3 * size
    assert [key(i) in tier for i in range(5)] == [False, False, True, True, True]
    (tmp_path / "deadbeef.1.2.tmp").write_bytes(b"half a block")  # a crash mid-write
    restarted = DiskTier(tmp_path, budget_bytes=3 * size)
    assert not list(tmp_path.glob("*.tmp"))
    assert len(restarted) == 3 and restarted.get(key(4)) == data[4]


def test_disk_full_stops_accepting_and_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, budget_bytes=1 << 30, retry_s=60)
    real_open = open

    class FullDisk:
        def __init__(self, path: Path, mode: str) -> None:
            self.file = real_open(path, mode)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, data: bytes) -> int:
            self.file.write(data[: len(data) // 2])  # half of it lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "open", FullDisk, raising=False)
    payload = encode_block(LAYOUT, key(1), block(1))
    with caplog.at_level(logging.WARNING, logger="maxkv.tiers"):
        assert not tier.put(key(1), payload)
        assert not tier.put(key(2), payload)  # refused without trying
    assert tier.write_errors == 1 and tier.refused == 1 and not tier.accepting
    assert sum("write failed" in r.message for r in caplog.records) == 1
    assert list(tmp_path.iterdir()) == [] and tier.used_bytes == 0
    assert tier.get(key(1)) is None
    monkeypatch.undo()
    tier._refuse_until = 0.0  # the retry time has passed
    assert tier.put(key(1), payload) and tier.get(key(1)) == payload


#: The secret the tests' stores sign their blocks with.
SECRET = "test-secret-0123456789abcdef"


def store_with(tmp_path: Path, **kw: object) -> TieredBlockStore:
    """A store of ``LAYOUT`` (blocks signed with :data:`SECRET` unless ``kw`` says)."""
    config = TierConfig(model_id="test-model", **{"secret": SECRET, **kw})  # type: ignore[arg-type]
    return TieredBlockStore(LAYOUT, config)


def test_store_reads_through_disk_and_redis_and_drops_bad_blocks(tmp_path: Path) -> None:
    client = fakeredis.FakeRedis()
    kw = dict(
        disk_dir=str(tmp_path),
        redis_url="redis://fake:0/0",
        redis_client=client,
        redis_max_value_bytes=100,
    )
    first = store_with(tmp_path, **kw)
    arrays = [block(i) for i in range(4)]
    for i, a in enumerate(arrays):
        first.put(key(i), a.copy())
    first.flush()
    assert first.stats.disk_writes == 4 and first.stats.redis_writes == 4
    prefix = f"maxkv@{LAYOUT.fingerprint}@{key(0).hex()}"
    assert int(client.exists(prefix)) and int(client.exists(prefix + "#5"))  # split in parts
    assert all(len(client.get(k)) <= 100 for k in client.keys(prefix + "#*"))
    first.close()

    # Another process: nothing in host memory, a disk of its own (empty), the same Redis.
    other = store_with(tmp_path / "other", **{**kw, "disk_dir": str(tmp_path / "other")})
    assert other.contains([key(0), key(9)]) == [True, False]
    assert other.prefix_length([key(0), key(1), key(9), key(2)]) == 2
    np.testing.assert_array_equal(other.get(key(0))[0], arrays[0])  # type: ignore[index]
    assert other.stats.redis_hits == 1 and key(0) in other.host
    other.prefetch([key(0), key(3)])  # on the store's thread
    other.flush()
    assert key(3) in other.host and other.stats.redis_hits == 2
    # A corrupt part, a block of another layout under the right key: refused, dropped, missing.
    client.set(f"maxkv@{LAYOUT.fingerprint}@{key(1).hex()}#3", b"x" * 100)
    forged = BlockLayout("test-model", "page", 2, 2, 4, "float32", 4, devices=1)
    other_layout = BlockLayout("other", "page", 2, 2, 4, "float32", 4)
    wrong = encode_block(other_layout, key(2), block(2), keyring=Keyring(SECRET))
    assert forged == LAYOUT
    other.redis.put(key(2), wrong)  # type: ignore[union-attr]
    assert other.get(key(1)) is None and other.get(key(2)) is None
    assert other.stats.invalid == {"corrupt": 1, "layout": 1}
    assert other.contains([key(1), key(2)]) == [False, False]  # deleted for every process
    other.close()

    # The first process restarted: its disk tier still has every block.
    restarted = store_with(tmp_path, disk_dir=str(tmp_path))
    np.testing.assert_array_equal(restarted.get(key(3))[0], arrays[3])  # type: ignore[index]
    assert restarted.stats.disk_hits == 1
    path = next(restarted.disk.directory.glob("*.kvb"))  # type: ignore[union-attr]
    path.write_bytes(path.read_bytes()[:-7])  # truncated on disk
    restarted.host.clear()
    got = [restarted.get(key(i)) for i in range(4)]
    assert sum(g is None for g in got) == 1 and restarted.stats.invalid == {"truncated": 1}
    restarted.close()


def test_a_command_redis_refuses_is_an_outage_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import redis

    class RefusingClient(fakeredis.FakeRedis):  # an ACL user who may not read
        def get(self, *args: object, **kwargs: object) -> None:
            raise redis.exceptions.NoPermissionError("NOPERM this user has no permissions")

    store = store_with(Path("."), redis_url="redis://fake:0/0", redis_client=RefusingClient())
    with caplog.at_level(logging.WARNING, logger="maxkv.tiers"):
        assert store.get(key(1)) is None and store.get(key(2)) is None
    assert store.redis.errors == 1 and not store.redis.up  # type: ignore[union-attr]
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    store.close()
    store.put(key(3), block(3))  # after close: host memory only, and flush returns
    store.flush()
    assert key(3) in store.host


def test_write_queue_never_waits(tmp_path: Path) -> None:
    store = store_with(tmp_path, disk_dir=str(tmp_path), write_queue_bytes=LAYOUT_BYTES)
    store._start_writer = lambda: None  # type: ignore[method-assign]  # nothing drains
    store.put(key(1), block(1))
    store.put(key(2), block(2))  # the queue is full: dropped, not waited for
    assert store.stats.writes_dropped == 1 and key(2) in store.host


LAYOUT_BYTES = int(np.prod(LAYOUT.page_shape())) * 4


def test_tier_config_checks_and_environment() -> None:
    with pytest.raises(ValueError, match="model_id"):
        TierConfig(redis_url="redis://localhost:6379/0", insecure=True)
    with pytest.raises(ValueError, match="redis://"):
        TierConfig(model_id="m", redis_url="localhost:6379", insecure=True)
    with pytest.raises(ValueError, match="host_bytes"):
        TierConfig(host_bytes=-1)
    assert TierConfig().host_bytes == 1 << 30 and TierConfig().redis_url is None
    env = {
        "MAXKV_HOST_TIER_GB": "0.5",
        "MAXKV_REDIS_URL": "redis://h:1/0",
        "MAXKV_DISK_TIER_DIR": "/tmp/x",
        "MAXKV_DISK_TIER_GB": "2",
        "MAXKV_TIER_INSECURE": "1",
    }
    config = TierConfig.from_env("m", env)
    assert (config.host_bytes, config.redis_url, config.disk_dir, config.disk_bytes) == (
        1 << 29,
        "redis://h:1/0",
        "/tmp/x",
        2 << 30,
    )
    with pytest.raises(ValueError, match="MAXKV_HOST_TIER_GB"):
        TierConfig.from_env("m", {"MAXKV_HOST_TIER_GB": "lots"})


# ------------------------------------------------------- the paged manager


@pytest.fixture(params=["in place", "staged"])
def page_copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the manager's pages reach the tiers and swap space: NumPy views of host
    buffers (a CPU cache), or staged (a GPU cache's path: pinned staging memory and
    MAX's copies on the device's queue, here the CPU's)."""
    if request.param == "staged":
        from maxkv.tiers import connector

        monkeypatch.setattr(
            connector, "PageBuffers", functools.partial(connector.PageBuffers, staged=True)
        )
    return str(request.param)


def test_page_buffers_staged_copies_equal_host_views() -> None:
    """The staged path (runs of consecutive pages as one copy, pinned staging
    memory, one event) reads and writes the same bytes as NumPy views, across
    devices' buffers and for bfloat16 (uint16 bit patterns)."""
    from max.driver import Buffer

    from maxkv.tiers.connector import PageBuffers, _page_runs

    assert _page_runs([4, 5, 6, 2, 3, 9]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1)]
    assert _page_runs([]) == []
    rng = np.random.default_rng(0)
    for dtype in (DType.float32, DType.bfloat16):
        bits = [rng.integers(0, 2**16, (10, 2, 2, 4, 2, 8)).astype(np.uint16) for _ in range(2)]
        arrays = [b.astype(np.float32) if dtype == DType.float32 else b for b in bits]

        def buffers(arrays: list[np.ndarray], dtype: DType) -> list[Buffer]:
            made = [Buffer.from_numpy(a.copy()) for a in arrays]
            return made if dtype == DType.float32 else [b.view(dtype, list(b.shape)) for b in made]

        host = PageBuffers(buffers(arrays, dtype))
        staged = PageBuffers(buffers(arrays, dtype), staged=True)
        assert not host.staged and staged.staged and host.page_nbytes == staged.page_nbytes
        pages = [7, 8, 1, 3, 4, 5, 0]
        want = np.stack([np.stack([a[p] for a in arrays]) for p in pages])
        np.testing.assert_array_equal(staged.read_pages(pages), want)
        np.testing.assert_array_equal(host.read_pages(pages), want)
        blocks = want[::-1].copy()
        for io in (host, staged):
            io.write_pages(pages, blocks)
            np.testing.assert_array_equal(io.read_pages(pages), blocks)
            untouched = [p for p in range(10) if p not in pages]
            np.testing.assert_array_equal(
                io.read_pages(untouched),
                np.stack([np.stack([a[p] for a in arrays]) for p in untouched]),
            )
        with pytest.raises(ValueError, match="2 blocks for 1 pages"):
            staged.write_pages([1], blocks[:2])


def manager(num_pages: int = 8, **tiers: object) -> fakes.PagedKVCacheManager:
    config = TierConfig(model_id="test-model", **tiers) if tiers is not None else None  # type: ignore[arg-type]
    return fakes.paged(
        PARAMS, 4, num_pages, 4, 64, num_layers=2, enable_prefix_caching=True, tiers=config
    )


def fill(m: fakes.PagedKVCacheManager, prompt: list[int], seed: int) -> tuple[int, np.ndarray]:
    """Claims ``prompt``, writes random KV for its uncached tokens, commits them."""
    seq, cached = m.claim_prefix(prompt)
    m.fetch([seq], 1, active_lengths={seq: len(prompt) - cached})
    pages = m._pages[0].to_numpy()
    kv = (
        np.random.default_rng(seed).standard_normal((len(prompt), 2, 2, 2, 4)).astype(np.float32)
    )  # [token, k/v, layer, head, dim]
    for t in range(cached, len(prompt)):
        page = m.pages(seq)[t // 4]
        pages[page, :, :, t % 4] = kv[t]
    m.step({seq: len(prompt) - cached}, tokens={seq: prompt[cached:]})
    return seq, kv


def read_tokens(m: fakes.PagedKVCacheManager, seq: int, n: int) -> np.ndarray:
    pages = m._pages[0].to_numpy()
    return np.stack([pages[m.pages(seq)[t // 4], :, :, t % 4] for t in range(n)])


def test_connector_follows_max_kv_connector_protocol(page_copies: str) -> None:
    from max.pipelines.kv_cache.kv_connector import KVConnector, KVLoadRefused

    m = manager()
    conn = m.connector
    assert isinstance(conn, KVConnector)
    seq, _ = fill(m, list(range(9)), seed=0)
    held = list(m.pages(seq)[:2])
    blocks = m._seqs[seq].hashes
    assert conn.lookup([*blocks, key(7)]) == {"maxkv": [True, True, False]}
    target = m._pool.allocate(2)
    assert conn.load({"maxkv": target}, {"maxkv": blocks}).is_complete()
    pages = m._pages[0].to_numpy()
    np.testing.assert_array_equal(pages[target], pages[held])
    with pytest.raises(KVLoadRefused) as refused:
        conn.load({"maxkv": target[:1]}, {"maxkv": [key(7)]})
    assert refused.value.block_hash == key(7)
    assert conn.host_byte_count.used == 2 * LAYOUT_BYTES
    assert conn.take_metrics().connector_loads_refused == 1
    m.close()


def test_prefix_evicted_from_the_device_comes_back_from_the_host_tier(page_copies: str) -> None:
    m = manager(num_pages=6)
    prompt = list(range(100, 117))  # 4 full pages + 1 token
    seq, kv = fill(m, prompt, seed=1)
    m.release(seq)
    assert len(m.tiers.host) == 4  # type: ignore[union-attr]
    other, _ = fill(m, list(range(500, 521)), seed=2)  # takes every page: evicts the prefix
    assert m.prefix_cache_stats.evictions >= 4
    m.release(other)
    assert m.cached_prefix_length(prompt) == 16
    seq, cached = m.claim_prefix(prompt)
    assert cached == 16 and m.tier_hit_tokens == 16
    np.testing.assert_array_equal(read_tokens(m, seq, 16), kv[:16])
    assert all(m.page_is_cached(p) for p in m.pages(seq))  # loaded pages are shared again
    m.close()


def test_a_bad_block_in_a_tier_is_recomputed(tmp_path: Path, page_copies: str) -> None:
    m = manager(num_pages=6, disk_dir=str(tmp_path))
    prompt = list(range(100, 117))
    seq, kv = fill(m, prompt, seed=1)
    m.release(seq)
    m.tiers.flush()  # type: ignore[union-attr]
    m._pool.reset_cache()  # the device forgets the prefix
    m.tiers.host.clear()  # type: ignore[union-attr]
    third = sorted(m.tiers.disk.directory.iterdir())  # type: ignore[union-attr]
    hashes = block_hashes_of(prompt)
    bad = m.tiers.disk._path(hashes[2])  # type: ignore[union-attr]
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 1
    bad.write_bytes(bytes(raw))
    assert len(third) == 4 and m.cached_prefix_length(prompt) == 16  # presence only
    seq, cached = m.claim_prefix(prompt)
    assert cached == 8  # blocks 0 and 1 loaded; block 2 refused: recompute from there
    np.testing.assert_array_equal(read_tokens(m, seq, 8), kv[:8])
    assert m.tiers.stats.invalid == {"corrupt": 1}  # type: ignore[union-attr]
    assert not bad.exists()
    m.close()


def block_hashes_of(prompt: list[int]) -> list[bytes]:
    from maxkv.cache.prefix import block_hashes, root_hash

    return block_hashes(prompt[:-1], 4, root_hash(None))


def test_swap_out_and_in_keeps_every_token(page_copies: str) -> None:
    m = manager(num_pages=8, swap_bytes=6 * LAYOUT_BYTES)
    seq, kv = fill(m, list(range(10)), seed=3)  # 3 pages, the last partial
    free = m.free_pages
    swapped = m.swap_out(seq)
    assert not m.contains(seq) and m.free_pages == free + 3  # free (the full two still cached)
    assert m.swapped_bytes == 3 * LAYOUT_BYTES
    filler, _ = fill(m, list(range(300, 329)), seed=4)  # 8 pages: evicts everything cached
    with pytest.raises(CacheFullError):
        m.swap_in(swapped)
    m.release(filler)
    new = m.swap_in(swapped)
    assert m.cache_lengths[new] == 10 and m.swapped_bytes == 0
    np.testing.assert_array_equal(read_tokens(m, new, 10), kv)
    with pytest.raises(ValueError, match="swapped in already"):
        m.swap_in(swapped)
    # It goes on as if never preempted: its next token lands after the tenth.
    m.fetch([new], 1)
    m.step({new: 1}, tokens={new: [10]})
    assert m.cache_lengths[new] == 11
    m.swap_out(new)  # 3 pages of the 6 the swap space has
    big, _ = fill(m, list(range(700, 716)), seed=6)  # 4 pages
    with pytest.raises(CacheFullError, match="swap space"):
        m.swap_out(big)
    assert m.contains(big) and m.swapped_bytes == 3 * LAYOUT_BYTES  # nothing changed
    m.close()


def test_swap_in_shares_pages_still_cached_on_the_device(page_copies: str) -> None:
    m = manager(num_pages=8)
    seq, kv = fill(m, list(range(10)), seed=3)
    full = m.pages(seq)[:2]
    swapped = m.swap_out(seq)
    new = m.swap_in(swapped)
    assert m.pages(new)[:2] == full  # no copy for the pages the device kept
    np.testing.assert_array_equal(read_tokens(m, new, 10), kv)
    m.close()


def test_tiers_need_prefix_caching() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        fakes.paged(PARAMS, 4, 8, 4, 64, tiers=TierConfig())


# ------------------------------------------------------- real Redis server


@pytest.mark.redis
def test_redis_killed_mid_run_and_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path).start()
    try:
        store = store_with(tmp_path, redis_url=server.url, redis_retry_s=0.2)
        store.put(key(0), block(0))
        store.flush()
        assert store.stats.redis_writes == 1
        server.stop()
        with caplog.at_level(logging.WARNING, logger="maxkv.tiers"):
            for i in range(1, 6):  # serving goes on: host tier only
                store.put(key(i), block(i))
                store.flush()
                assert store.contains([key(i), key(99)]) == [True, False]
        assert store.redis.errors >= 1  # type: ignore[union-attr]
        assert sum("unreachable" in r.message for r in caplog.records) == 1
        np.testing.assert_array_equal(store.get(key(3))[0], block(3))  # type: ignore[index]
        server = RedisServer(tmp_path, port=server.port).start()  # back on its port
        time.sleep(0.3)  # past redis_retry_s
        store.put(key(7), block(7))
        store.flush()
        assert store.redis.up and store.redis.reconnects == 1  # type: ignore[union-attr]
        store.host.clear()
        np.testing.assert_array_equal(store.get(key(7))[0], block(7))  # type: ignore[index]
        store.close()
    finally:
        server.stop()


_WRITER = """
import sys, numpy as np
from maxkv.tiers import BlockLayout, TierConfig, TieredBlockStore
layout = BlockLayout("test-model", "page", 2, 2, 4, "float32", 4)
config = TierConfig(model_id="test-model", redis_url=sys.argv[1], secret=sys.argv[2])
store = TieredBlockStore(layout, config)
for i in range(3):
    a = np.random.default_rng(i).standard_normal(layout.page_shape()).astype(np.float32)
    store.put(i.to_bytes(16, "big"), a)
store.close()
"""


@pytest.mark.redis
def test_another_process_reads_what_one_wrote(redis_server: RedisServer) -> None:
    # os.environ, not the inherited C environment: MAX's import sets PYTHONEXECUTABLE
    # there, which would start the child as the base interpreter, outside this venv.
    subprocess.run(
        [sys.executable, "-c", _WRITER, redis_server.url, SECRET],
        check=True,
        timeout=120,
        env=dict(os.environ),
    )
    store = store_with(Path("."), redis_url=redis_server.url)
    for i in range(3):
        np.testing.assert_array_equal(store.get(key(i))[0], block(i))  # type: ignore[index]
    assert store.stats.redis_hits == 3
    store.close()
