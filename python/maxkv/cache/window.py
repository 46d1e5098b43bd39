"""Which pages of a sequence its layers can still attend to: a sliding window.

A layer with a window of ``w`` tokens lets the token at position ``p``
attend to positions ``p - w + 1 .. p`` (transformers' ``sliding_window``,
MAX's ``SLIDING_WINDOW_CAUSAL_MASK``).  Once a sequence has committed
``length`` tokens, its next token is at position ``length`` or later, so no
layer will read a position below ``length - w + 1`` again: the pages wholly
below it can go back to the pool (TVM's ``SlideWindowForSequence``, vLLM's
``SlidingWindowManager.remove_skipped_blocks``).

This module holds that arithmetic, once; the paged manager
(:class:`~maxkv.PagedKVCacheManager`) applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..validation import require_int

__all__ = ["PageWindow"]


@dataclass(frozen=True)
class PageWindow:
    """The pages a sliding window of ``window`` tokens keeps, with pages of ``page_size``.

    ``window=None``: every layer attends to every token, and every page is kept.
    """

    window: int | None
    page_size: int

    def __post_init__(self) -> None:
        require_int("page_size", self.page_size, 1)
        if self.window is not None:
            object.__setattr__(self, "window", require_int("sliding_window", self.window, 1))

    @property
    def slides(self) -> bool:
        """Whether pages are ever given back."""
        return self.window is not None

    def first_needed_position(self, length: int) -> int:
        """The first position a sequence of ``length`` committed tokens can still attend to."""
        if self.window is None:
            return 0
        return max(0, length - self.window + 1)

    def first_live_page(self, length: int) -> int:
        """Index of the first page a sequence of ``length`` committed tokens keeps; the
        pages before it are given back."""
        return self.first_needed_position(length) // self.page_size

    def live_pages(self, length: int) -> int:
        """Pages a sequence of ``length`` committed tokens holds."""
        return math.ceil(length / self.page_size) - self.first_live_page(length)

    def max_live_pages(self) -> int | None:
        """Most pages a sequence holds while it decodes (one new token a step), however
        long it runs (``None``: unbounded): the ``window`` positions its next token
        attends to, itself included, starting anywhere in a page."""
        if self.window is None:
            return None
        return 1 + math.ceil((self.window - 1) / self.page_size)
