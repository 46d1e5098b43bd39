"""The shared tier on Redis: blocks any process pointed at the same server can reuse.

Keys follow LMCache's scheme, ``<namespace>@<layout fingerprint>@<block hash
hex>``: the fingerprint names the model and the KV layout
(:class:`~maxkv.tiers.blocks.BlockLayout`), so other models never collide.  A
block's bytes go in parts of at most ``max_value_bytes`` (``<key>#0``,
``<key>#1``, ...) and its metadata (part count and size) apart, under the key
itself, written last: a reader that finds the metadata finds every part, and
a block cut short anyway (a part evicted by the server) fails its length or
CRC-32 check and is dropped.

Operators' Redis: ``redis://user:password@host:port/db`` (an ACL user; the
tier needs ``GET``, ``MGET``, ``STRLEN``, ``SET``, ``EXISTS`` and ``DEL`` on keys
``<namespace>@*``), ``rediss://`` for TLS (redis-py's URL options, e.g.
``?ssl_ca_certs=/path/ca.pem``), ``unix://``.  The URL is only ever logged
with its password replaced (:func:`redact_url`).

Redis being unreachable (or refusing a command) is not an error for serving: a
failed call marks the tier down (one warning, :attr:`RedisTier.errors` counts), calls in the next
``retry_s`` seconds return at once as misses, and the first call that
succeeds after that logs the reconnection (:attr:`RedisTier.reconnects`).
The server's own memory limit (``maxmemory``, an ``allkeys-lru`` policy)
bounds what it keeps.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

__all__ = ["RedisTier", "redact_url"]

logger = logging.getLogger("maxkv.tiers")

T = TypeVar("T")

#: The most parts one block is read in (a block of 1 GiB in parts of 16 KiB).
MAX_PARTS = 65536


def redact_url(url: str) -> str:
    """``url`` with the password of its user part (and the value of any query
    option whose name holds ``password``) replaced by ``***``: what logs and error
    messages show."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name, colon, _ = user.partition(":")
        netloc = f"{name}:***@{host}" if colon else f"***@{host}"
    query = "&".join(
        f"{name}=***" if "password" in name.lower() else item
        for item in parts.query.split("&")
        if item
        for name in [item.partition("=")[0]]
    )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


class RedisTier:
    """Blocks on a Redis server (redis-py), shared by every process that uses the same keys.

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or
            ``unix://``; kept only as :attr:`safe_url`.
        prefix: Key prefix, ``<namespace>@<layout fingerprint>``.
        max_value_bytes: Largest single value written (blocks are split above it).
        retry_s: How long calls return at once after a failure.
        timeout_s: Socket connect and read timeout.
        client: A redis-py client to use instead of connecting to ``url``
            (tests pass ``fakeredis``).
        max_block_bytes: The largest block a reader accepts: stored metadata
            or parts that add up to more are refused before they are read.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        max_value_bytes: int = 64 << 20,
        retry_s: float = 5.0,
        timeout_s: float = 1.0,
        client: Any = None,
        max_block_bytes: int = 1 << 30,
    ) -> None:
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be >= 1, got {max_value_bytes}")
        try:
            import redis
        except ImportError:
            raise ImportError("the Redis tier needs redis-py: pip install 'maxkv[redis]'") from None

        # Every Redis error, not only a lost connection: a refused command (ACL,
        # a cluster's MOVED, READONLY, OOM) must not reach serving either.
        self._errors_caught: tuple[type[BaseException], ...] = (
            redis.exceptions.RedisError,
            OSError,
        )
        #: The URL without its password: what this tier logs.
        self.safe_url = redact_url(url)
        self.prefix = prefix
        self.max_value_bytes = int(max_value_bytes)
        self.max_block_bytes = int(max_block_bytes)
        self.retry_s = retry_s
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        #: Calls that failed because the server could not be reached.
        self.errors = 0
        #: Times the server answered again after being down.
        self.reconnects = 0
        self._down_until: float | None = None
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        """Whether the last call reached the server."""
        return self._down_until is None

    def key(self, block: bytes) -> str:
        return f"{self.prefix}@{block.hex()}"

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        with self._lock:
            if self._down_until is not None and time.monotonic() < self._down_until:
                return default
        try:
            result = fn()
        except self._errors_caught as error:
            with self._lock:
                self.errors += 1
                first = self._down_until is None
                self._down_until = time.monotonic() + self.retry_s
            if first:
                logger.warning(
                    "maxkv Redis tier %s unreachable (%s: %s); going on with the local tiers, "
                    "retrying every %.0f s",
                    self.safe_url,
                    what,
                    error,
                    self.retry_s,
                )
            return default
        with self._lock:
            if self._down_until is not None:
                self._down_until = None
                self.reconnects += 1
                logger.warning("maxkv Redis tier %s reachable again", self.safe_url)
        return result

    def contains(self, blocks: Sequence[bytes]) -> list[bool]:
        """Which of ``blocks`` the server holds (one round trip); all ``False`` while down."""
        if not blocks:
            return []

        def ask() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for block in blocks:
                pipe.exists(self.key(block))
            return [bool(n) for n in pipe.execute()]

        return self._call("EXISTS", ask, [False] * len(blocks))

    def get(self, block: bytes) -> bytes | None:
        """The block's bytes (parts joined, not yet checked); ``None`` if absent or down."""

        def read() -> bytes | None:
            meta = self.client.get(self.key(block))
            if meta is None:
                return None
            layout = self._parts(meta)
            if layout is None:
                return b""  # metadata no writer made: the caller's check refuses it
            parts, nbytes = layout
            names = [f"{self.key(block)}#{i}" for i in range(parts)]
            # The parts' sizes before their bytes: what is read stays within a block.
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            if sum(int(n) for n in pipe.execute()) != nbytes:
                return b""  # a part missing, cut or grown
            values = self.client.mget(names)
            return b"".join(v for v in values if isinstance(v, bytes))

        return self._call("GET", read, None)

    def _parts(self, meta: bytes | str) -> tuple[int, int] | None:
        """``(parts, nbytes)`` of stored metadata, or ``None`` unless both are counts
        a writer could have made (at most :attr:`max_block_bytes` bytes, parts of at
        least one byte, at most :data:`MAX_PARTS` of them)."""
        try:
            fields = json.loads(meta)
        except (ValueError, RecursionError):
            return None
        if not isinstance(fields, dict):
            return None
        parts, nbytes = fields.get("parts"), fields.get("nbytes")
        if type(parts) is not int or type(nbytes) is not int:
            return None
        if not (
            0 <= nbytes <= self.max_block_bytes and 1 <= parts <= min(MAX_PARTS, max(nbytes, 1))
        ):
            return None
        return parts, nbytes

    def put(self, block: bytes, data: bytes) -> bool:
        """Writes the parts, then the metadata; returns whether the server took them."""
        return self.put_many([(block, data)])

    def put_many(self, blocks: Sequence[tuple[bytes, bytes]]) -> bool:
        """:meth:`put` of several blocks in one round trip (each block's parts before
        its metadata)."""
        step = self.max_value_bytes

        def write() -> bool:
            pipe = self.client.pipeline(transaction=False)
            for block, data in blocks:
                view = memoryview(data)
                parts = [view[i : i + step] for i in range(0, len(view), step)] or [view]
                for i, part in enumerate(parts):
                    pipe.set(f"{self.key(block)}#{i}", part)
                pipe.set(self.key(block), json.dumps({"parts": len(parts), "nbytes": len(data)}))
            pipe.execute()
            return True

        return self._call("SET", write, False)

    def drop(self, block: bytes) -> None:
        """Deletes a block found invalid (so no process reads it again)."""

        def delete() -> None:
            meta = self.client.get(self.key(block))
            layout = self._parts(meta) if meta is not None else None
            parts = layout[0] if layout is not None else 1
            keys = [self.key(block)] + [f"{self.key(block)}#{i}" for i in range(parts)]
            self.client.delete(*keys)

        self._call("DEL", delete, None)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
