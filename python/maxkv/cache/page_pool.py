"""Reference-counted pages and the prefix cache over them (vLLM's ``BlockPool``).

A page holds ``page_size`` tokens of every layer.  The pool knows nothing of
sequences or devices; it hands out page ids and tracks, per page:

- **holders**: a reference count.  ``fork`` and prefix hits share a page by
  adding a holder; a page nobody holds is *free*.
- **content hash** (prefix caching): a full page whose tokens are known is
  registered under the chained hash of its tokens
  (:func:`maxkv.cache.prefix.block_hash`), so a later prompt with the same
  prefix finds it.  A registered page is never written again: its holders
  copy it first (copy-on-write), so the hash stays true.

Free pages wait in one queue, in eviction order: pages that hold no cached
content first (reusing them loses nothing), then cached pages, least
recently freed first.  A cached page stays findable until :meth:`allocate`
reuses it; a prefix hit on a free cached page takes it off the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class PagePoolCounters:
    """What the pool's prefix cache did (cumulative)."""

    #: Cached pages whose content was dropped to reuse the page.
    evictions: int = 0


class PagePool:
    """``num_pages`` pages, each free or held ``refcount >= 1`` times.

    Not thread-safe on its own: the manager calls it under its lock.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.counters = PagePoolCounters()
        self._refcounts = [0] * num_pages
        #: Free pages in eviction order (front first); lowest ids first at the start.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        #: Told the hashes of the cached pages :meth:`allocate` evicts (KV events).
        self.on_evict: Callable[[list[bytes]], None] | None = None

    # ------------------------------------------------------------- queries

    @property
    def free_count(self) -> int:
        """Pages held by nobody (cached or not): what :meth:`allocate` can hand out."""
        return len(self._free)

    @property
    def cached_count(self) -> int:
        """Pages registered under a content hash (held or free)."""
        return len(self._page_of_hash)

    def refcount(self, page: int) -> int:
        """How many holders ``page`` has (0: free)."""
        return self._refcounts[page]

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` is registered under a content hash (and so read-only)."""
        return page in self._hash_of_page

    def cached_hashes(self) -> set[bytes]:
        """The content hashes of the cached pages (held or free)."""
        return set(self._page_of_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        """The page registered under ``block_hash``, held or free; ``None`` if none."""
        return self._page_of_hash.get(block_hash)

    # ------------------------------------------------------------- changes

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free pages, each with one holder; cached content they held is evicted.

        Raises:
            ValueError: If fewer than ``n`` pages are free (nothing taken).
        """
        if n > len(self._free):
            raise ValueError(f"out of pages: {n} needed, {len(self._free)} free")
        pages = []
        evicted = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            block_hash = self._uncache(page)
            if block_hash is not None:
                evicted.append(block_hash)
            self._refcounts[page] = 1
            pages.append(page)
        if evicted:
            self.counters.evictions += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to each page; a free (cached) page leaves the free queue."""
        for page in pages:
            if self._refcounts[page] == 0:
                assert page in self._hash_of_page, f"page {page} is free and holds no content"
                del self._free[page]
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops a holder from each page, in order; pages nobody holds become free.

        A freed page without cached content goes to the front of the queue
        (reused first), a cached one to the back (evicted last): free a
        sequence's pages last to first so its prefix outlives its tail.
        """
        for page in pages:
            assert self._refcounts[page] > 0, f"page {page} is already free"
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._free[page] = None
                if page not in self._hash_of_page:
                    self._free.move_to_end(page, last=False)

    def register(self, page: int, block_hash: bytes) -> int:
        """Registers the held, full ``page`` under ``block_hash``.

        Returns:
            The page registered under the hash: ``page``, or the page that
            already was (same content; the caller may switch to it).
        """
        assert self._refcounts[page] > 0, f"page {page} is free"
        existing = self._page_of_hash.get(block_hash)
        if existing is not None:
            return existing
        if page in self._hash_of_page:
            # Registered under other content, which nothing may overwrite:
            # leave it (only a caller that wrote without reserving gets here).
            return page
        self._page_of_hash[block_hash] = page
        self._hash_of_page[page] = block_hash
        return page

    def reset_cache(self) -> int:
        """Forgets every content hash (pages and holders stay); returns how many."""
        dropped = len(self._page_of_hash)
        self._page_of_hash.clear()
        self._hash_of_page.clear()
        # Free pages are all equal now: keep their order, nothing to evict.
        return dropped

    def _uncache(self, page: int) -> bytes | None:
        block_hash = self._hash_of_page.pop(page, None)
        if block_hash is not None:
            del self._page_of_hash[block_hash]
        return block_hash
