"""The host-memory tier: blocks as NumPy arrays under a byte budget, LRU out first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["HostTier"]

HostEntry = tuple[np.ndarray, dict[str, Any]]


class HostTier:
    """Key -> ``(array, extra)`` in process memory; ``used_bytes <= budget_bytes`` always.

    Thread-safe.  A block larger than the whole budget is not kept.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._lock = threading.Lock()
        #: Told, under its lock (so in order), the keys of the blocks it takes and of
        #: those it lets go (evicted, dropped): KV events.
        self.on_store: Callable[[list[bytes]], None] | None = None
        self.on_evict: Callable[[list[bytes]], None] | None = None

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[bytes]:
        """The keys it holds, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: bytes) -> HostEntry | None:
        """The block, now the most recently used; ``None`` if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def touch(self, keys: list[bytes]) -> None:
        """Marks ``keys`` (those present) most recently used, in order."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def put(self, key: bytes, array: np.ndarray, extra: dict[str, Any] | None = None) -> bool:
        """Keeps ``array`` (not copied: the caller hands it over) under ``key``.

        Evicts least recently used blocks until it fits; returns whether it is kept.
        """
        size = int(array.nbytes)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if size > self.budget_bytes:
                return False
            evicted = []
            while self.used_bytes + size > self.budget_bytes:
                old_key, (old, _) = self._entries.popitem(last=False)
                self.used_bytes -= int(old.nbytes)
                self.evictions += 1
                evicted.append(old_key)
            self._entries[key] = (array, dict(extra or {}))
            self.used_bytes += size
            if evicted and self.on_evict is not None:
                self.on_evict(evicted)
            if self.on_store is not None:
                self.on_store([key])
        return True

    def drop(self, key: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= int(entry[0].nbytes)
                if self.on_evict is not None:
                    self.on_evict([key])

    def clear(self) -> None:
        """Forgets every block (a prefix cache reset: its ``AllBlocksCleared`` says so)."""
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0
