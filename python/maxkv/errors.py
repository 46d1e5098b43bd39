"""The exceptions maxkv raises for a mistake, one type per kind.

Every public function and method checks its input first and raises, before
it changes any state or runs any kernel:

- :class:`ArgumentTypeError` when an argument is not of the kind asked for
  (a str where ids go, a float where an int goes, an array where a graph
  value goes).  It is a ``TypeError`` and also a ``ValueError``, so code
  that catches either sees it.
- ``ValueError`` when an argument has the right kind and a wrong value: an
  unknown or released sequence id, a length past ``max_seq_len``, a wrong
  dtype, rank or static dim, a tensor on the wrong device.
- :class:`CacheFullError` (a ``ValueError``) when the input is fine but the
  cache has no room for it now: no free sequence id, too few free pages.
  Retry after a release.
"""

from __future__ import annotations


class ArgumentTypeError(TypeError, ValueError):
    """An argument is not of the kind asked for."""


class CacheFullError(ValueError):
    """The request is valid but the cache has no room for it now (no free
    sequence id, too few free pages): retry after a release."""


class UnsupportedEncodingError(ValueError):
    """A KV cache encoding maxkv knows by name but does not implement
    (``float4_e2m1fn``, MAX's NVFP4); the message names the ones it does."""
