"""Reference-counted pages: the storage pool of :class:`~maxkv.PagedKVCacheManager`.

A page holds ``page_size`` tokens of every layer.  Pages are shared by
reference count (``fork`` shares the parent's full pages); a page returns to
the free list when its last holder lets go.  The pool knows nothing of
sequences or devices: allocation only, as vLLM's ``BlockPool``.
"""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """``num_pages`` pages, each free or held ``refcount >= 1`` times.

    Not thread-safe on its own: the manager calls it under its lock.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        # Lowest ids first: pop() from the end of a descending list.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        """Pages held by nobody."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        """How many holders ``page`` has (0: free)."""
        return self._refcounts[page]

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free pages, each with one holder.

        Raises:
            ValueError: If fewer than ``n`` pages are free (nothing taken).
        """
        if n > len(self._free):
            raise ValueError(f"out of pages: {n} needed, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to each (held) page."""
        for page in pages:
            assert self._refcounts[page] > 0, f"page {page} is free"
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops a holder from each page; pages nobody holds become free."""
        for page in pages:
            assert self._refcounts[page] > 0, f"page {page} is already free"
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._free.append(page)
