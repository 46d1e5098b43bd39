"""The disk tier: one file per block under a byte budget; survives restarts.

Files are written to a temporary name in the same directory and renamed, so a
reader sees a whole block or none; a crash leaves only ``*.tmp`` files, which
the next start removes.  Only regular files of at most a block's size are read
back (not a link, a FIFO or a device planted in the directory).  Each process
should have its own directory (the index of what is there, and so the budget,
lives in the process).  When the
disk is full (``ENOSPC``, or any other write error) the tier stops accepting
blocks for ``retry_s`` seconds, with one warning per episode; blocks already
there stay readable.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

__all__ = ["DiskTier"]

logger = logging.getLogger("maxkv.tiers")

_SUFFIX = ".kvb"


class DiskTier:
    """Key -> a file ``<directory>/<key hex>.kvb``; file bytes ``<= budget_bytes`` always.

    Args:
        directory: Where the files go (created, readable by its owner only); one
            per layout and process.
        budget_bytes: Most bytes of block files kept (the least recently
            used are deleted to make room).
        retry_s: After a failed write, how long to refuse blocks.
        max_file_bytes: The largest file read back: a file found larger (or
            anything not a regular file: a link, a FIFO, a device) is not read.
    """

    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        retry_s: float = 30.0,
        *,
        max_file_bytes: int = 1 << 30,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.max_file_bytes = int(max_file_bytes)
        self.budget_bytes = int(budget_bytes)
        self.retry_s = retry_s
        self.used_bytes = 0
        self.evictions = 0
        #: Writes that failed (disk full or another I/O error).
        self.write_errors = 0
        #: Blocks not written because the tier was refusing them.
        self.refused = 0
        self._refuse_until = 0.0
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        #: Told, under its lock (so in order), the keys of the blocks it takes and of
        #: those it deletes (evicted, dropped): KV events.
        self.on_store: Callable[[list[bytes]], None] | None = None
        self.on_evict: Callable[[list[bytes]], None] | None = None
        self._scan()

    def _scan(self) -> None:
        """Rebuilds the index from the directory (oldest first); removes half-written files."""
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.suffix == _SUFFIX:
                try:
                    key = bytes.fromhex(path.stem)
                    stat = path.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        with self._lock:
            self._evict_to(self.budget_bytes)

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{_SUFFIX}"

    @property
    def accepting(self) -> bool:
        """Whether a write would be tried now (not refusing after a failed one)."""
        return time.monotonic() >= self._refuse_until

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, now the most recently used; ``None`` if absent or unreadable."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        data = self._read(self._path(key))
        if data is None:
            self.drop(key)
        return data

    def _read(self, path: Path) -> bytes | None:
        """The bytes of ``path`` if it is a regular file (not followed if a link; a FIFO
        never waited on) of at most :attr:`max_file_bytes`; else ``None``."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > self.max_file_bytes:
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(self.max_file_bytes + 1)
            return data if len(data) <= self.max_file_bytes else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def put(self, key: bytes, data: bytes) -> bool:
        """Writes ``data`` under ``key`` (a temporary file, renamed); returns whether it is kept."""
        size = len(data)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self.budget_bytes:
                return False
            if not self.accepting:
                self.refused += 1
                return False
            # Room for the new file counts from before it is written.
            evicted = self._evict_to(self.budget_bytes - size)
            self.used_bytes += size
            if evicted and self.on_evict is not None:
                self.on_evict(evicted)
        tmp = self.directory / f"{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as error:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used_bytes -= size
                self.write_errors += 1
                first = self.accepting
                self._refuse_until = time.monotonic() + self.retry_s
            if first:
                logger.warning(
                    "maxkv disk tier %s: write failed (%s); refusing blocks for %.0f s",
                    self.directory,
                    error,
                    self.retry_s,
                )
            return False
        with self._lock:
            self._index[key] = size
            if self.on_store is not None:
                self.on_store([key])
        return True

    def drop(self, key: bytes) -> None:
        """Deletes ``key``'s file (a block found invalid, or evicted)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
                if self.on_evict is not None:
                    self.on_evict([key])
        if size is not None:
            self._path(key).unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            keys = list(self._index)
        for key in keys:
            self.drop(key)

    def _evict_to(self, limit: int) -> list[bytes]:
        """Deletes least recently used files until ``used_bytes <= limit`` (lock held);
        returns their keys."""
        evicted = []
        while self.used_bytes > limit and self._index:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1
            self._path(key).unlink(missing_ok=True)
            evicted.append(key)
        return evicted
