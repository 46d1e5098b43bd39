"""What a KV block is outside the device: its layout, and its bytes with a header.

A block is the KV of one page (or one CacheBlend chunk) as a NumPy array.
Before it leaves the process (disk, Redis) it is framed as
``MAGIC | header length (u32) | CRC-32 of the header (u32) | JSON header |
payload``; the header names
everything that makes the block valid to reuse, and a reader refuses a block
whose header disagrees with its own :class:`BlockLayout` or whose payload
does not match its length and CRC-32.  A refused block is never used: the
caller counts it, drops it and recomputes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["MAGIC", "BlockInvalid", "BlockLayout", "decode_block", "encode_block"]

MAGIC = b"MAXKVB1\0"
_PREFIX = struct.Struct("<II")  # header length, header CRC-32


class BlockInvalid(Exception):
    """A stored block that must not be used; ``reason`` says why (counted per reason)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """What a block's bytes mean: equal layouts, interchangeable blocks.

    Attributes:
        model_id: Names the weights (a repository id with its revision, a
            path with a content hash): blocks of other weights are refused.
        kind: ``"page"`` (a page of the paged cache) or ``"chunk"`` (a
            CacheBlend chunk, any number of tokens).
        num_layers: Transformer layers in a block.
        n_kv_heads: KV heads (all devices together; chunks: 0 takes any).
        head_dim: Size of one head (chunks: 0 takes any).
        dtype: NumPy dtype name of the payload (``"float32"``, ...).
        page_size: Tokens per block (pages); ``0`` for chunks.
        devices: Tensor-parallel shards a block holds (pages: one per device).
    """

    model_id: str
    kind: str
    num_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int = 0
    devices: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("page", "chunk"):
            raise ValueError(f"kind must be 'page' or 'chunk', got {self.kind!r}")
        if self.kind == "page" and self.page_size < 1:
            raise ValueError("a page layout needs page_size >= 1")
        np.dtype(self.dtype)  # raises on an unknown dtype name

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the layout: part of every key, so layouts never collide."""
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()

    def page_shape(self) -> tuple[int, ...]:
        """A page block's shape: ``[devices, 2, layers, page_size, heads/devices, head_dim]``."""
        heads = self.n_kv_heads // self.devices
        return (self.devices, 2, self.num_layers, self.page_size, heads, self.head_dim)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raises :class:`BlockInvalid` unless ``shape`` is a block of this layout.

        Pages have :meth:`page_shape`; chunks ``[2, num_layers, tokens,
        n_kv_heads, head_dim]`` with any ``tokens >= 1``.
        """
        if any(n < 1 for n in shape):
            raise BlockInvalid("layout", f"shape {shape} has an empty or negative dimension")
        if self.kind == "page":
            expected = self.page_shape()
            ok = shape == expected
        else:
            expected = (2, self.num_layers, -1, self.n_kv_heads, self.head_dim)
            ok = len(shape) == 5 and shape[2] >= 1 and shape[:2] == expected[:2]
            ok = ok and all(e in (0, n) for e, n in zip(expected[3:], shape[3:], strict=True))
        if not ok:
            raise BlockInvalid("layout", f"shape {shape} is not a {self.kind} block {expected}")


def encode_block(
    layout: BlockLayout, key: bytes, array: np.ndarray, extra: dict[str, Any] | None = None
) -> bytes:
    """One block's bytes: header (layout, key, shape, length, CRC-32, ``extra``), payload."""
    payload = np.ascontiguousarray(array, dtype=np.dtype(layout.dtype)).tobytes()
    header = {
        "layout": asdict(layout),
        "key": key.hex(),
        "shape": list(array.shape),
        "nbytes": len(payload),
        "crc32": zlib.crc32(payload),
        "extra": extra or {},
    }
    head = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, _PREFIX.pack(len(head), zlib.crc32(head)), head, payload])


def decode_block(
    layout: BlockLayout, key: bytes, data: bytes | memoryview
) -> tuple[np.ndarray, dict[str, Any]]:
    """The array and ``extra`` of a block's bytes, checked against ``layout`` and ``key``.

    Raises:
        BlockInvalid: ``"truncated"``, ``"corrupt"`` (magic, a CRC-32, the header),
            ``"layout"`` (other model, dtype, layout or shape) or ``"key"``
            (stored under another hash).
    """
    view = memoryview(data)
    start = len(MAGIC) + _PREFIX.size
    if len(view) < start:
        raise BlockInvalid("truncated", f"{len(view)} bytes, not even a header")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise BlockInvalid("corrupt", "not a maxkv block (magic)")
    head_len, head_crc = _PREFIX.unpack(view[len(MAGIC) : start])
    if len(view) < start + head_len:
        raise BlockInvalid("truncated", "header cut short")
    head = view[start : start + head_len]
    if zlib.crc32(head) != head_crc:
        raise BlockInvalid("corrupt", "CRC-32 of the header does not match")
    try:
        header = json.loads(bytes(head))
        stored = BlockLayout(**header["layout"])
        shape = tuple(int(n) for n in header["shape"])
        nbytes, crc = int(header["nbytes"]), int(header["crc32"])
        stored_key = str(header["key"])
        extra = dict(header["extra"])
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise BlockInvalid("corrupt", f"unreadable header ({error})") from None
    if stored != layout:
        raise BlockInvalid("layout", f"block of {stored}, expected {layout}")
    if stored_key != key.hex():
        raise BlockInvalid("key", f"block of {stored_key}, asked for {key.hex()}")
    layout.check_shape(shape)
    payload = view[start + head_len :]
    dtype = np.dtype(layout.dtype)
    if len(payload) != nbytes or nbytes != int(np.prod(shape)) * dtype.itemsize:
        raise BlockInvalid("truncated", f"payload of {len(payload)} bytes, header says {nbytes}")
    if zlib.crc32(payload) != crc:
        raise BlockInvalid("corrupt", "CRC-32 of the payload does not match")
    return np.frombuffer(payload, dtype=dtype).reshape(shape), extra
