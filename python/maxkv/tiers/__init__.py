"""KV beyond the device: host memory, local disk and a shared Redis, behind MAX's KVConnector.

- :class:`TierConfig`: which tiers, their budgets (one place; ``from_env`` for ``max serve``).
- :class:`TieredBlockStore`: the tiers behind one lookup, with a background writer.
- :class:`TieredConnector`: MAX 26.7's ``KVConnector`` protocol over a cache's pages
  (imported on first use: it needs ``max.pipelines``).
- :class:`BlockLayout`, :func:`encode_block`, :func:`decode_block`: what makes a block
  valid to reuse, and its framing with CRC-32s and, signed, a MAC.
- :class:`Keyring` (:mod:`maxkv.tiers.auth`): the secrets that sign blocks leaving the
  process, per tenant, with rotation and optional encryption.
- :mod:`maxkv.tiers.local_server`: a throwaway ``redis-server`` on loopback, to try the
  shared tier on one machine.
"""

from __future__ import annotations

from typing import Any

from .auth import Keyring
from .blocks import BlockInvalid, BlockLayout, decode_block, encode_block
from .disk import DiskTier
from .host import HostTier
from .remote import RedisTier
from .store import TierConfig, TieredBlockStore, TierStats

__all__ = [
    "BlockInvalid",
    "BlockLayout",
    "DiskTier",
    "HostTier",
    "Keyring",
    "PageBuffers",
    "RedisTier",
    "TierConfig",
    "TierStats",
    "TieredBlockStore",
    "TieredConnector",
    "decode_block",
    "encode_block",
]


def __getattr__(name: str) -> Any:
    if name in ("TieredConnector", "PageBuffers"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'maxkv.tiers' has no attribute {name!r}")
