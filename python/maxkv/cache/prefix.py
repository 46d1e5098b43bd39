"""Prefix caching's hashes and counters, and the slot index of the contiguous cache.

Both managers hash committed tokens in blocks the same way, vLLM's scheme
(:func:`block_hash`): the hash of block *i* chains the hash of block *i - 1*,
so equal hashes mean equal prefixes.  The chain of a sequence with a salt
(vLLM's ``cache_salt``) starts from the salt's digest (:func:`root_hash`), so
sequences with different salts never share a block, and a prompt cannot be
probed by timing from another tenant.  The paged manager registers whole
pages under these hashes (:class:`maxkv.cache.page_pool.PagePool`).

:class:`PrefixIndex` is the contiguous cache's side: every slot's committed
token ids, hashed in blocks of ``block_size`` tokens.  A slot's records stay
after the sequence is released (its KV stays in the cache) until the slot is
reused; released slots are reused least recently released first.

:meth:`PrefixIndex.longest_prefix` finds, for a new prompt, the slot holding
the longest prefix of it (live or released): whole blocks through the hash
index, then token by token within that slot.  This module only keeps
records; the manager moves the KV.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..events.log import GroupEvents


@dataclass
class PrefixCacheStats:
    """Counters of a prefix cache."""

    #: ``claim_prefix`` calls.
    lookups: int = 0
    #: Prompt tokens found in the cache (not recomputed).
    hit_tokens: int = 0
    #: Cached blocks dropped to reuse their storage (a released slot, a free page).
    evictions: int = 0
    #: Blocks findable now: registered pages (paged), indexed blocks (contiguous).
    cached_pages: int = 0


def root_hash(salt: str | None) -> bytes:
    """The parent hash of a sequence's first block: empty, or the digest of its salt."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"maxkv-cache-salt\0" + salt.encode(), digest_size=16).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of one block of token ids, chained to its ``parent`` block's hash."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


def block_hashes(
    tokens: Sequence[int], block_size: int, parent: bytes = b"", start: int = 0
) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens[start:]`` (``start`` on a block edge).

    ``parent`` is the hash of the block before ``start`` (or :func:`root_hash`).
    """
    hashes = []
    for begin in range(start, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[begin : begin + block_size])
        hashes.append(parent)
    return hashes


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixIndex:
    """Token ids, salt and chained block hashes per slot; an index from hash to slots."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._tokens: dict[int, list[int]] = {}
        self._salts: dict[int, str] = {}
        self._hashes: dict[int, list[bytes]] = {}
        self._slots_by_hash: dict[bytes, set[int]] = {}
        #: Released slots whose records (and KV) are kept, oldest release first.
        self._released: OrderedDict[int, None] = OrderedDict()
        #: Where a block is announced when a first slot indexes it and removed when the
        #: last one drops it (KV events), or ``None``.
        self.events: GroupEvents | None = None

    @property
    def indexed_blocks(self) -> int:
        """Blocks findable now, over all slots (live and released)."""
        return sum(len(h) for h in self._hashes.values())

    def tokens(self, slot: int) -> list[int]:
        """The token ids ``slot`` holds (a copy)."""
        return list(self._tokens.get(slot, []))

    def set_salt(self, slot: int, salt: str | None) -> None:
        """``slot`` (holding nothing) starts a sequence whose blocks chain from ``salt``."""
        assert not self._tokens.get(slot), f"slot {slot} holds tokens"
        if salt is None:
            self._salts.pop(slot, None)
        else:
            self._salts[slot] = salt

    def append(self, slot: int, tokens: list[int]) -> None:
        """``slot``'s sequence committed ``tokens``."""
        held = self._tokens.setdefault(slot, [])
        held.extend(tokens)
        hashes = self._hashes.setdefault(slot, [])
        parent = hashes[-1] if hashes else root_hash(self._salts.get(slot))
        for block in block_hashes(held, self.block_size, parent, len(hashes) * self.block_size):
            holders = self._slots_by_hash.setdefault(block, set())
            if not holders and self.events is not None:
                begin = len(hashes) * self.block_size
                self.events.stored(
                    block,
                    hashes[-1] if hashes else None,
                    held[begin : begin + self.block_size],
                    self._salts.get(slot),
                )
            hashes.append(block)
            holders.add(slot)

    def truncate(self, slot: int, length: int) -> None:
        """``slot`` now holds only its first ``length`` tokens."""
        held = self._tokens.get(slot, [])
        del held[length:]
        hashes = self._hashes.get(slot, [])
        while len(hashes) * self.block_size > length:
            self._unindex(slot, hashes.pop())

    def copy(self, source: int, destination: int, length: int) -> None:
        """``destination`` (emptied first) now holds ``source``'s first ``length`` tokens."""
        self.forget(destination)
        self.set_salt(destination, self._salts.get(source))
        self.append(destination, self._tokens.get(source, [])[:length])

    def forget(self, slot: int) -> int:
        """Drops ``slot``'s records; returns the blocks dropped."""
        hashes = self._hashes.pop(slot, [])
        for block in hashes:
            self._unindex(slot, block)
        self._tokens.pop(slot, None)
        self._salts.pop(slot, None)
        self._released.pop(slot, None)
        return len(hashes)

    def release(self, slot: int) -> None:
        """``slot``'s sequence was released; its records stay until the slot is reused."""
        if self._tokens.get(slot):
            self._released[slot] = None
            self._released.move_to_end(slot)

    def reuse(self, slot: int) -> None:
        """``slot`` is taken by a new sequence: its records are evicted."""
        self.stats.evictions += self.forget(slot)

    def keep(self, slot: int) -> None:
        """``slot`` (released) is taken for the prefix it holds: no eviction."""
        self._released.pop(slot, None)

    def released_lru(self) -> list[int]:
        """Released slots holding records, least recently released first."""
        return list(self._released)

    def longest_prefix(
        self, prompt: list[int], candidates: set[int], salt: str | None = None
    ) -> tuple[int | None, int]:
        """The slot among ``candidates`` holding the longest prefix of ``prompt``.

        Only slots whose sequence has the same ``salt`` count.  Returns
        ``(slot, tokens)``; ``(None, 0)`` when no slot shares a token.
        """
        best: tuple[int | None, int] = (None, 0)
        alive = {s for s in candidates if self._salts.get(s) == salt}
        parent = root_hash(salt)
        blocks = 0
        for i in range(len(prompt) // self.block_size):
            block = block_hash(parent, prompt[i * self.block_size : (i + 1) * self.block_size])
            holders = self._slots_by_hash.get(block, set()) & alive
            if not holders:
                break
            alive, parent, blocks = holders, block, i + 1
        start = blocks * self.block_size
        for slot in sorted(alive):  # extend token by token within a slot
            held = self._tokens.get(slot, [])
            if blocks == 0 and (not held or not prompt or held[0] != prompt[0]):
                continue
            n = start
            while n < len(prompt) and n < len(held) and held[n] == prompt[n]:
                n += 1
            if n > best[1]:
                best = (slot, n)
        return best

    def _unindex(self, slot: int, block: bytes) -> None:
        holders = self._slots_by_hash.get(block)
        if holders is not None:
            holders.discard(slot)
            if not holders:
                del self._slots_by_hash[block]
                if self.events is not None:
                    self.events.removed([block])
