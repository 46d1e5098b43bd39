"""The tiered block store: host memory, then local disk, then Redis, behind one lookup.

Blocks are keyed by bytes (the chained page hash of prefix caching, a
CacheBlend chunk's hash) and checked against the store's
:class:`~maxkv.tiers.blocks.BlockLayout` whenever they come back from disk or
Redis.  Where each call sits in a serving step:

- :meth:`TieredBlockStore.put` (commit time): the block goes into the host
  tier at once (the caller hands over a copy) and is queued for the disk and
  Redis tiers, which a background thread writes: the step never waits for
  them.  The queue holds at most ``write_queue_bytes``; past that a write is
  dropped and counted, never waited for.
- :meth:`TieredBlockStore.contains` (admission): which blocks some tier holds.
- :meth:`TieredBlockStore.prefetch` (a request arrives): the background
  thread brings its blocks from disk or Redis into host memory, so that
- :meth:`TieredBlockStore.get` (the request claims its prefix) is a host
  read; a block not prefetched yet is read from disk or Redis then.

Blocks that leave the process are signed when the configuration has a
secret (:mod:`maxkv.tiers.auth`), with the key of the block's *tenant* (the
``cache_salt`` of the sequence that wrote it, given to :meth:`put`,
:meth:`get` and :meth:`prefetch`).  A block that fails its check (unsigned,
signed with an unknown key or for another tenant, forged, corrupt,
truncated, another layout) is counted under its reason in
:attr:`TieredBlockStore.stats`, deleted from the tier it came from, and
reported missing, so the caller recomputes it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .. import settings
from ..events.log import DISK, HOST, GroupEvents
from .auth import Keyring, secret_bytes
from .blocks import BlockInvalid, BlockLayout, decode_block, encode_block
from .disk import DiskTier
from .host import HostTier
from .remote import RedisTier, redact_url

__all__ = ["TierConfig", "TierStats", "TieredBlockStore"]

logger = logging.getLogger("maxkv.tiers")

_GIB = 1 << 30
#: Room for a block's header, MAC and cipher tag beyond its array.
_FRAMING_BYTES = 1 << 20

#: The environment variables of the tiers' security (:meth:`TierConfig.from_env`).
SECRET_ENV = settings.TIER_SECRET.name
SECRET_FILE_ENV = settings.TIER_SECRET_FILE.name
OLD_SECRETS_ENV = settings.TIER_OLD_SECRETS.name
INSECURE_ENV = settings.TIER_INSECURE.name
ENCRYPT_ENV = settings.TIER_ENCRYPT.name

#: Warnings said once per process (the message is the key).
_said: set[str] = set()
_said_lock = threading.Lock()


def _say_once(message: str, *args: object) -> None:
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    logger.warning(message, *args)


@dataclass(frozen=True)
class TierConfig:
    """Where KV blocks live beyond the device, and how much of each tier they may use.

    The defaults are a single machine's: a host-memory tier of 1 GiB, no disk,
    no Redis.

    Attributes:
        model_id: Names the weights; part of every block's identity.  Needed
            (not ``""``) for the disk and Redis tiers, which outlive the process.
        host_bytes: Host-memory tier budget (0: no host tier).
        disk_dir: Directory of the disk tier (``None``: no disk tier).
        disk_bytes: Disk tier budget.
        redis_url: ``redis://[user:password@]host:port/db`` of the shared tier, or
            ``rediss://`` for TLS (``None``: no Redis tier).  redis-py reads it,
            TLS options included (``?ssl_ca_certs=/path/ca.pem``); the password
            never reaches a log line.
        redis_namespace: First part of every Redis key (LMCache's style).
        redis_max_value_bytes: Largest value written to Redis (blocks split above it).
        redis_retry_s: After Redis fails, how long before it is tried again.
        swap_bytes: Host memory for sequences swapped out of the device
            (:meth:`~maxkv.PagedKVCacheManager.swap_out`).
        write_queue_bytes: Most bytes waiting for the disk and Redis writer.
        redis_client: A redis-py client to use instead of connecting to
            ``redis_url`` (tests pass ``fakeredis``).
        secret: Signs every block written to disk or Redis and checks every
            block read back (:mod:`maxkv.tiers.auth`); at least 16 bytes.
            Never in ``repr``, logs, keys or block headers.
        old_secrets: Secrets of before a rotation: blocks signed with them are
            still accepted (new blocks are signed with ``secret``).
        insecure: Share unsigned blocks through Redis anyway (without a
            ``secret`` a Redis tier is refused unless this is set).
        encrypt: Also encrypt every block's payload (AES-256-GCM, the
            ``cryptography`` package); needs ``secret``.
    """

    model_id: str = ""
    host_bytes: int = _GIB
    disk_dir: str | None = None
    disk_bytes: int = 16 * _GIB
    redis_url: str | None = None
    redis_namespace: str = "maxkv"
    redis_max_value_bytes: int = 64 << 20
    redis_retry_s: float = 5.0
    swap_bytes: int = 4 * _GIB
    write_queue_bytes: int = 256 << 20
    redis_client: Any = field(default=None, compare=False, repr=False)
    secret: str | bytes | None = field(default=None, repr=False)
    old_secrets: tuple[str | bytes, ...] = field(default=(), repr=False)
    insecure: bool = False
    encrypt: bool = False

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "swap_bytes", "write_queue_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.redis_max_value_bytes < 1:
            raise ValueError("redis_max_value_bytes must be >= 1")
        if (self.disk_dir is not None or self.redis_url is not None) and not self.model_id:
            raise ValueError(
                "the disk and Redis tiers outlive the process: name the model (model_id) so "
                "that blocks of other weights are never reused"
            )
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"redis_url must be redis://host:port/db, got {redact_url(self.redis_url)!r}"
            )
        if self.secret is not None:
            secret_bytes(self.secret)  # raises if too short, never quoting it
        elif self.old_secrets:
            raise ValueError("old_secrets without a current secret: set secret too")
        elif self.encrypt:
            raise ValueError(
                f"encryption derives its keys from the secret: set {SECRET_ENV} "
                "(TierConfig(secret=...))"
            )
        for old in self.old_secrets:
            secret_bytes(old, "old secret")
        if self.redis_url is not None and self.secret is None and not self.insecure:
            raise ValueError(
                "the Redis tier is shared, and unsigned blocks there let anyone who can write "
                f"to it change this server's answers: set {SECRET_ENV} (TierConfig(secret=...)) "
                f"to sign them, or {INSECURE_ENV}=1 (TierConfig(insecure=True)) to share "
                "unsigned blocks knowingly"
            )

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        if self.redis_url is not None:
            shown["redis_url"] = redact_url(self.redis_url)
        shown["secret"] = "<set>" if self.secret is not None else None
        items = ", ".join(f"{name}={value!r}" for name, value in shown.items())
        return f"TierConfig({items})"

    def keyring(self) -> Keyring | None:
        """The keys that sign and check blocks (``None`` without a secret)."""
        if self.secret is None:
            return None
        return Keyring(self.secret, self.old_secrets, encrypt=self.encrypt)

    @classmethod
    def from_env(cls, model_id: str = "", environ: Mapping[str, str] | None = None) -> TierConfig:
        """The configuration ``max serve`` reads (defaults for unset variables):

        - ``MAXKV_HOST_TIER_GB`` (1; 0 turns the host tier off),
        - ``MAXKV_DISK_TIER_DIR`` (unset: no disk tier), ``MAXKV_DISK_TIER_GB`` (16),
        - ``MAXKV_REDIS_URL`` (unset: no Redis tier), ``MAXKV_REDIS_NAMESPACE`` (maxkv),
        - ``MAXKV_SWAP_GB`` (4),
        - ``MAXKV_TIER_SECRET`` (or ``MAXKV_TIER_SECRET_FILE``, a file holding
          it), ``MAXKV_TIER_OLD_SECRETS`` (comma-separated),
          ``MAXKV_TIER_INSECURE`` (0), ``MAXKV_TIER_ENCRYPT`` (0): see
          :attr:`secret`, :attr:`old_secrets`, :attr:`insecure`, :attr:`encrypt`.
        """
        env = environ  # None: os.environ
        secret = settings.TIER_SECRET.read(env)
        secret_file = settings.TIER_SECRET_FILE.read(env)
        if secret_file is not None:
            if secret is not None:
                raise ValueError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
            try:
                secret = Path(secret_file).read_text().strip() or None
            except OSError as error:
                raise ValueError(
                    f"{SECRET_FILE_ENV}: cannot read {secret_file} ({error.strerror})"
                ) from None
            if secret is None:
                raise ValueError(f"{SECRET_FILE_ENV}: {secret_file} is empty")
        return cls(
            model_id=model_id,
            host_bytes=int(settings.HOST_TIER_GB.read(env) * _GIB),
            disk_dir=settings.DISK_TIER_DIR.read(env),
            disk_bytes=int(settings.DISK_TIER_GB.read(env) * _GIB),
            redis_url=settings.REDIS_URL.read(env),
            redis_namespace=settings.REDIS_NAMESPACE.read(env),
            swap_bytes=int(settings.SWAP_GB.read(env) * _GIB),
            secret=secret,
            old_secrets=settings.TIER_OLD_SECRETS.read(env),
            insecure=settings.TIER_INSECURE.read(env),
            encrypt=settings.TIER_ENCRYPT.read(env),
        )

    @property
    def any_tier(self) -> bool:
        """Whether blocks go anywhere beyond the device."""
        return self.host_bytes > 0 or self.disk_dir is not None or self.redis_url is not None


#: A queued write: key, array, extra, tenant.
_Write = tuple[bytes, np.ndarray, "dict[str, Any] | None", "str | None"]


@dataclass
class _Reading:
    """One read of a block from disk or Redis, which other askers wait for."""

    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[np.ndarray, dict[str, Any]] | None = None


@dataclass
class TierStats:
    """What the store did (cumulative)."""

    puts: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    redis_hits: int = 0
    misses: int = 0
    #: Writes to disk/Redis dropped because the write queue was full.
    writes_dropped: int = 0
    disk_writes: int = 0
    redis_writes: int = 0
    #: Blocks refused on their way back, per reason (unsigned, unknown_key,
    #: signature, corrupt, truncated, layout, key): :func:`~maxkv.tiers.decode_block`.
    invalid: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["invalid"] = dict(self.invalid)
        return out


class TieredBlockStore:
    """Host, disk and Redis tiers of one :class:`BlockLayout`, as configured.

    Thread-safe.  Call :meth:`close` when done (it stops the writer thread).

    Args:
        layout: What the blocks are; blocks of another layout are refused.
        config: The tiers and budgets.
    """

    def __init__(self, layout: BlockLayout, config: TierConfig) -> None:
        self.layout = layout
        self.config = config
        self.stats = TierStats()
        #: Signs blocks on their way out and checks them on their way back.
        self.keyring = config.keyring()
        self.host = HostTier(config.host_bytes)
        #: The largest block this store writes (a page, or a chunk within the write
        #: queue) and framing: larger stored blocks are refused unread.
        largest = math.prod(layout.page_shape()) * layout.payload_dtype.itemsize
        if layout.kind != "page":
            largest = config.write_queue_bytes
        self.max_block_bytes = largest + _FRAMING_BYTES
        self.disk: DiskTier | None = None
        if config.disk_dir is not None:
            self.disk = DiskTier(
                Path(config.disk_dir) / layout.fingerprint,
                config.disk_bytes,
                max_file_bytes=self.max_block_bytes,
            )
        self.redis: RedisTier | None = None
        if config.redis_url is not None:
            self.redis = RedisTier(
                config.redis_url,
                f"{config.redis_namespace}@{layout.fingerprint}",
                max_value_bytes=config.redis_max_value_bytes,
                retry_s=config.redis_retry_s,
                client=config.redis_client,
                max_block_bytes=self.max_block_bytes,
            )
        if self.keyring is None and self.redis is not None:
            _say_once(
                "maxkv Redis tier %s: blocks are NOT signed (%s=1): anyone who can write to "
                "this Redis can change this server's answers, and anyone who can read it can "
                "read its KV; set %s",
                self.redis.safe_url,
                INSECURE_ENV,
                SECRET_ENV,
            )
        if self.keyring is None and self.disk is not None:
            _say_once(
                "maxkv disk tier %s: blocks are not signed (no %s): fine for this process's own "
                "files, not for a directory others can write",
                config.disk_dir,
                SECRET_ENV,
            )
        self._lock = threading.Lock()
        self._inflight: dict[bytes, _Reading] = {}
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._queued_bytes = 0
        self._writer: threading.Thread | None = None
        self._closed = False
        self._events: GroupEvents | None = None

    def announce_to(self, events: GroupEvents) -> None:
        """Announces from now on the blocks its host and disk tiers take and let go
        (those whose tokens ``events`` knows: announced on the device first) as KV
        events, each tier under its own lock (so in the order they happen).  The
        Redis tier's blocks are every replica's and Redis evicts them unseen: they
        are not announced."""
        self._events = events
        for tier, place in ((self.host, HOST), (self.disk, DISK)):
            if tier is not None:
                tier.on_store = events.stored_in(place)
                tier.on_evict = events.evicted_from(place)

    def announce_held(self, keys: Sequence[bytes]) -> None:
        """Announces ``keys`` in the local tiers that hold them (blocks loaded from a
        tier before their tokens were known here)."""
        if self._events is None:
            return
        for tier, place in ((self.host, HOST), (self.disk, DISK)):
            if tier is not None:
                held = [k for k in keys if k in tier]
                if held:
                    self._events.stored_again(held, place)

    @property
    def security(self) -> str:
        """How blocks leaving the process are protected, in words (for logs)."""
        if self.keyring is None:
            return "blocks unsigned"
        what = "signed and encrypted" if self.keyring.encrypt_blocks else "signed"
        return f"blocks {what} (key {self.keyring.current_id})"

    @property
    def remote_tiers(self) -> bool:
        """Whether there is a disk or Redis tier (and so a writer thread)."""
        return self.disk is not None or self.redis is not None

    # ----------------------------------------------------------------- queries

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` some tier holds (Redis: one round trip for those not local)."""
        found = [k in self.host or (self.disk is not None and k in self.disk) for k in keys]
        if self.redis is not None:
            rest = [i for i, hit in enumerate(found) if not hit]
            if rest:
                remote = self.redis.contains([keys[i] for i in rest])
                for i, hit in zip(rest, remote, strict=True):
                    found[i] = hit
        return found

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` some tier holds."""
        count = 0
        for hit in self.contains(keys):
            if not hit:
                break
            count += 1
        return count

    def get(
        self, key: bytes, *, tenant: str | None = None
    ) -> tuple[np.ndarray, dict[str, Any]] | None:
        """The block under ``key`` from the nearest tier with a valid copy (then kept in host).

        ``tenant``: the salt of the sequences the block belongs to (checked by
        its signature when it comes from disk or Redis).
        """
        entry = self.host.get(key)
        if entry is not None:
            with self._lock:
                self.stats.host_hits += 1
            return entry
        # Each block is read from disk or Redis once, however many ask at the same
        # time (a prefetch and a load): the others wait for that read, not for the
        # whole prefetch.
        with self._lock:
            reading = self._inflight.get(key)
            if reading is None:
                self._inflight[key] = reading = _Reading()
                mine = True
            else:
                mine = False
        if mine:
            try:
                reading.result = self._fetch(key, tenant)
            finally:
                with self._lock:
                    del self._inflight[key]
                reading.done.set()
            fetched = reading.result
        else:
            reading.done.wait()
            fetched = reading.result
        if fetched is not None:
            return fetched
        with self._lock:
            self.stats.misses += 1
        return None

    def _fetch(self, key: bytes, tenant: str | None) -> tuple[np.ndarray, dict[str, Any]] | None:
        """The block from disk, else Redis, checked (then kept in host); ``None`` if neither."""
        for name, tier in (("disk", self.disk), ("redis", self.redis)):
            if tier is None:
                continue
            data = tier.get(key)
            if data is None:
                continue
            try:
                array, extra = decode_block(
                    self.layout, key, data, keyring=self.keyring, tenant=tenant
                )
            except Exception as error:  # BlockInvalid; anything else is a checker's bug
                invalid = error if isinstance(error, BlockInvalid) else None
                reason = invalid.reason if invalid is not None else "corrupt"
                with self._lock:
                    self.stats.invalid[reason] += 1
                logger.warning(
                    "maxkv %s tier: dropped block %s (%s)",
                    name,
                    key.hex(),
                    invalid if invalid is not None else f"corrupt: {type(error).__name__}",
                )
                tier.drop(key)
                continue
            with self._lock:
                if name == "disk":
                    self.stats.disk_hits += 1
                else:
                    self.stats.redis_hits += 1
            self.host.put(key, array, extra)
            return array, extra
        return None

    # ----------------------------------------------------------------- changes

    def put(
        self,
        key: bytes,
        array: np.ndarray,
        extra: dict[str, Any] | None = None,
        *,
        tenant: str | None = None,
    ) -> None:
        """Keeps ``array`` (handed over, not copied): host now, disk and Redis soon
        (signed for ``tenant``, the salt of the sequences it belongs to)."""
        self.layout.check_shape(tuple(array.shape))
        with self._lock:
            self.stats.puts += 1
        self.host.put(key, array, extra)
        if not self.remote_tiers or self._closed:
            return
        with self._lock:
            if self._queued_bytes + array.nbytes > self.config.write_queue_bytes:
                self.stats.writes_dropped += 1
                return
            self._queued_bytes += array.nbytes
        self._start_writer()
        self._queue.put(("write", (key, array, extra, tenant)))

    def prefetch(self, keys: Sequence[bytes], *, tenant: str | None = None) -> None:
        """Brings ``keys`` (of ``tenant``) from disk or Redis into host memory in the
        background."""
        missing = [k for k in keys if k not in self.host]
        if missing and self.remote_tiers and not self._closed:
            self._start_writer()
            self._queue.put(("prefetch", (missing, tenant)))

    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` recently used in the host tier (blocks served from the device)."""
        self.host.touch(list(keys))

    def clear_local(self) -> None:
        """Forgets the host and disk tiers (Redis is shared: left alone)."""
        self.flush()
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def flush(self) -> None:
        """Waits until every queued write and prefetch is done."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Finishes queued work, stops the writer thread, closes the Redis client."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
        if self.redis is not None:
            self.redis.close()

    # --------------------------------------------------------------- the writer

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is None and not self._closed:
                self._writer = threading.Thread(
                    target=self._work, name="maxkv-tier-writer", daemon=True
                )
                self._writer.start()

    def _work(self) -> None:
        # Idle cycles only: the model's threads come first (nice +10, this thread alone).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            task = self._queue.get()
            tasks = [task]
            # Writes waiting together go out together: one Redis round trip.
            while task is not None and task[0] == "write" and len(tasks) < 16:
                try:
                    task = self._queue.get_nowait()
                except queue.Empty:
                    break
                tasks.append(task)
            try:
                writes = [t[1] for t in tasks if t is not None and t[0] == "write"]
                if writes:
                    self._write(writes)
                for t in tasks:
                    if t is not None and t[0] == "prefetch":
                        self._prefetch(*t[1])
            except Exception:
                logger.exception("maxkv tier writer: a task failed")
            finally:
                for _ in tasks:
                    self._queue.task_done()
            if any(t is None for t in tasks):
                return

    def _prefetch(self, keys: list[bytes], tenant: str | None) -> None:
        """Brings ``keys`` (a prefix, in order) into host memory, up to the first that no
        tier holds: what follows it could not be reused anyway."""
        for key in keys:
            if key not in self.host and self.get(key, tenant=tenant) is None:
                return

    def _write(self, writes: list[_Write]) -> None:
        try:
            encoded = [
                (key, encode_block(self.layout, key, a, extra, keyring=self.keyring, tenant=tenant))
                for key, a, extra, tenant in writes
            ]
            if self.disk is not None:
                for key, data in encoded:
                    if self.disk.put(key, data):
                        with self._lock:
                            self.stats.disk_writes += 1
            if self.redis is not None and self.redis.put_many(encoded):
                with self._lock:
                    self.stats.redis_writes += len(encoded)
        finally:
            with self._lock:
                self._queued_bytes -= sum(w[1].nbytes for w in writes)
