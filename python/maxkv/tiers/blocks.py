"""What a KV block is outside the device: its layout, and its bytes with a header.

A block is the KV of one page (or one CacheBlend chunk) as a NumPy array.
Before it leaves the process (disk, Redis) it is framed as
``MAGIC | header length (u32) | CRC-32 of the header (u32) | JSON header |
payload [| MAC]``.  The header names everything that makes the block valid
to reuse (layout, block hash, shape, payload length and CRC-32) and, for a
signed block, the key id of its MAC (:mod:`maxkv.tiers.auth`): HMAC-SHA256
of everything before it under a key of the writer's secret and the block's
tenant.  With encryption on, the payload is AES-256-GCM ciphertext (the
header's ``cipher`` and ``nonce`` say so).

A reader refuses a block whose MAC is missing (when it holds a secret),
made with a key it does not hold, or wrong, before believing anything its
header says; then one whose header disagrees with its own
:class:`BlockLayout` or key, or whose payload does not match its length and
CRC-32.  A refused block is never used: the caller counts it, drops it and
recomputes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..cache.spec import kv_block_shape
from .auth import CIPHER, MAC_BYTES, NONCE_BYTES, Keyring

__all__ = ["MAGIC", "BlockInvalid", "BlockLayout", "decode_block", "encode_block"]

MAGIC = b"MAXKVB2\0"
_PREFIX = struct.Struct("<II")  # header length, header CRC-32


class BlockInvalid(Exception):
    """A stored block that must not be used; ``reason`` says why (counted per reason)."""

    def __init__(self, reason: str, detail: str) -> None:
        if len(detail) > 300:  # details may quote a stored header: anyone's text
            detail = detail[:300] + "..."
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
        dtype: The row format of the payload: its cache encoding (``"float32"``,
            ``"bfloat16"``, ...; the quantized ones marked as rotated:
            ``"int8+hadamard"``, ``KVCacheParams.row_format``): blocks of
            another format are refused.  NumPy holds the payload in the cache's
            storage dtype: bfloat16 as its bit patterns (uint16), float8 as
            uint8, int4 as uint16.
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
        _ = self.payload_dtype  # raises on an unknown encoding

    @property
    def payload_dtype(self) -> np.dtype[Any]:
        """The NumPy dtype of the payload's elements (bfloat16: its uint16 bit
        patterns; float8: uint8; int4: uint16)."""
        encoding = self.dtype.split("+")[0]  # "int8+hadamard": rows rotated, then int8
        return np.dtype(_BIT_PATTERNS.get(encoding, encoding))

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the layout: part of every key, so layouts never collide."""
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()

    def page_shape(self) -> tuple[int, ...]:
        """A page block's shape: a page per device, ``[devices, 2, layers, page_size,
        heads/devices, head_dim]`` (:func:`~maxkv.cache.spec.kv_block_shape`)."""
        heads = self.n_kv_heads // self.devices
        return (
            self.devices,
            *kv_block_shape(self.num_layers, self.page_size, heads, self.head_dim),
        )

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
            expected = kv_block_shape(self.num_layers, -1, self.n_kv_heads, self.head_dim)
            ok = len(shape) == 5 and shape[2] >= 1 and shape[:2] == expected[:2]
            ok = ok and all(e in (0, n) for e, n in zip(expected[3:], shape[3:], strict=True))
        if not ok:
            raise BlockInvalid("layout", f"shape {shape} is not a {self.kind} block {expected}")


#: Encodings NumPy has no dtype for, held as their stored elements' bits.
_BIT_PATTERNS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "int4": "uint16"}


_KEY_ID = re.compile(r"[0-9a-f]{16}")


def _is_count(value: object) -> bool:
    """An exact JSON integer >= 0 (not a bool, a float or ``Infinity``)."""
    return type(value) is int and value >= 0


def encode_block(
    layout: BlockLayout,
    key: bytes,
    array: np.ndarray,
    extra: dict[str, Any] | None = None,
    *,
    keyring: Keyring | None = None,
    tenant: str | None = None,
) -> bytes:
    """One block's bytes: header (layout, key, shape, length, CRC-32, ``extra``), payload,
    and, with a ``keyring``, the MAC of both under ``tenant``'s key (the payload
    encrypted first if the keyring encrypts)."""
    payload = np.ascontiguousarray(array, dtype=layout.payload_dtype).tobytes()
    header: dict[str, Any] = {
        "layout": asdict(layout),
        "key": key.hex(),
        "shape": list(array.shape),
        "extra": extra or {},
        "key_id": None if keyring is None else keyring.current_id,
        "cipher": None,
    }
    if keyring is not None and keyring.encrypt_blocks:
        nonce = os.urandom(NONCE_BYTES)
        header.update(cipher=CIPHER, nonce=nonce.hex())
        # The header without the payload's length and CRC (which follow from the
        # ciphertext) is the associated data: both are bound to each other.
        payload = keyring.encrypt(tenant, payload, _aad(header), nonce)
    header.update(nbytes=len(payload), crc32=zlib.crc32(payload))
    head = json.dumps(header, sort_keys=True).encode()
    parts = [MAGIC, _PREFIX.pack(len(head), zlib.crc32(head)), head, payload]
    if keyring is not None:
        parts.append(keyring.mac(keyring.current_id, tenant, parts))
    return b"".join(parts)


def _aad(header: dict[str, Any]) -> bytes:
    fixed = {k: v for k, v in header.items() if k not in ("nbytes", "crc32")}
    return json.dumps(fixed, sort_keys=True).encode()


def decode_block(
    layout: BlockLayout,
    key: bytes,
    data: bytes | memoryview,
    *,
    keyring: Keyring | None = None,
    tenant: str | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The array and ``extra`` of a block's bytes, checked against ``layout`` and ``key``,
    and, with a ``keyring``, authenticated as written for ``tenant``.

    The signature is checked before anything the header says is believed
    (only its framing is read first).

    Raises:
        BlockInvalid: ``"truncated"``, ``"corrupt"`` (magic, a CRC-32, the header),
            ``"unsigned"`` (no MAC, and this reader has a keyring),
            ``"unknown_key"`` (signed with a key this reader does not hold, or
            signed and this reader has no keyring), ``"signature"`` (a MAC or
            an encrypted payload that does not verify: forged, altered, or
            another tenant's), ``"layout"`` (other model, dtype, layout or
            shape) or ``"key"`` (stored under another hash).
    """
    view = memoryview(data)
    start = len(MAGIC) + _PREFIX.size
    if len(view) < start:
        raise BlockInvalid("truncated", f"{len(view)} bytes, not even a header")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise BlockInvalid("corrupt", "not a maxkv block of this version (magic)")
    head_len, head_crc = _PREFIX.unpack(view[len(MAGIC) : start])
    if len(view) < start + head_len:
        raise BlockInvalid("truncated", "header cut short")
    head = view[start : start + head_len]
    if zlib.crc32(head) != head_crc:
        raise BlockInvalid("corrupt", "CRC-32 of the header does not match")
    # Only the framing is read before the MAC is checked: the key id, the payload's
    # length and CRC-32, each of an exact type (the JSON is anyone's until then).
    try:
        header = json.loads(bytes(head))
    except (ValueError, RecursionError) as error:
        raise BlockInvalid("corrupt", f"unreadable header ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise BlockInvalid("corrupt", "the header is not a JSON object")
    kid, nbytes, crc = header.get("key_id"), header.get("nbytes"), header.get("crc32")
    if kid is not None and not (isinstance(kid, str) and _KEY_ID.fullmatch(kid)):
        raise BlockInvalid("corrupt", "the header's key id is not 16 hex digits")
    if not (_is_count(nbytes) and _is_count(crc)):
        raise BlockInvalid("corrupt", "the header's payload length or CRC-32 is not a count")
    # The framing's length first (a file cut short is "truncated", not "forged").
    end = start + head_len + nbytes
    expected = end + (MAC_BYTES if kid is not None else 0)
    if len(view) < expected:
        raise BlockInvalid("truncated", f"{len(view)} bytes, the header says {expected}")
    if len(view) > expected:
        raise BlockInvalid("corrupt", f"{len(view)} bytes, the header says {expected}")
    if kid is None:
        if keyring is not None:
            raise BlockInvalid("unsigned", "the block carries no MAC; this reader needs one")
    else:
        if keyring is None:
            raise BlockInvalid(
                "unknown_key",
                f"signed with key {kid}, and this process has no secret (MAXKV_TIER_SECRET)",
            )
        if not keyring.knows(kid):
            raise BlockInvalid("unknown_key", f"signed with key {kid}, not one of this keyring's")
        if not keyring.verify(kid, tenant, [view[:end]], bytes(view[end:])):
            if zlib.crc32(view[start + head_len : end]) != crc:  # damaged, not forged
                raise BlockInvalid("corrupt", "CRC-32 of the payload does not match")
            raise BlockInvalid(
                "signature", "the MAC does not verify (altered, or another tenant's)"
            )
    try:
        stored = BlockLayout(**header["layout"])
        shape = tuple(header["shape"])
        if not all(_is_count(n) for n in shape):
            raise TypeError("shape")
        stored_key = str(header["key"])
        extra = dict(header["extra"])
        cipher = header.get("cipher")
        nonce = bytes.fromhex(header["nonce"]) if cipher is not None else b""
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as error:
        raise BlockInvalid("corrupt", f"unreadable header ({type(error).__name__})") from None
    if stored != layout:
        raise BlockInvalid("layout", f"block of {stored}, expected {layout}")
    if stored_key != key.hex():
        raise BlockInvalid("key", f"block of {stored_key}, asked for {key.hex()}")
    layout.check_shape(shape)
    payload: bytes | memoryview = view[start + head_len : end]
    # A verified MAC covers the payload already: its CRC-32 would say nothing more.
    if kid is None and zlib.crc32(payload) != crc:
        raise BlockInvalid("corrupt", "CRC-32 of the payload does not match")
    if cipher is not None:
        if cipher != CIPHER or keyring is None or kid is None:
            raise BlockInvalid("corrupt", f"cipher {cipher!r} of an unsigned block, or unknown")
        try:
            payload = keyring.decrypt(kid, tenant, nonce, payload, _aad(header))
        except ValueError as error:
            raise BlockInvalid("signature", str(error)) from None
        except ImportError as error:  # a replica without the cryptography package
            raise BlockInvalid("unknown_key", f"encrypted, and {error}") from None
    dtype = layout.payload_dtype
    if len(payload) != math.prod(shape) * dtype.itemsize:
        raise BlockInvalid("truncated", f"payload of {len(payload)} bytes for shape {shape}")
    return np.frombuffer(payload, dtype=dtype).reshape(shape), extra
