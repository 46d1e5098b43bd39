"""What a forger with write access to a shared Redis does to maxkv's blocks.

A forger has every stored block's bytes and the framing's format
(:mod:`maxkv.tiers.blocks`); the CRC-32s are recomputed, since a CRC is not a
secret.  Tests check that nothing written this way is ever used.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from maxkv.tiers.blocks import MAGIC


def split(data: bytes) -> tuple[dict[str, object], bytes, bytes]:
    """(header, payload, MAC) of a block, read with the format alone."""
    head_len = struct.unpack_from("<I", data, len(MAGIC))[0]
    start = len(MAGIC) + 8
    header = json.loads(data[start : start + head_len])
    payload_end = start + head_len + int(header["nbytes"])  # type: ignore[call-overload]
    return header, data[start + head_len : payload_end], data[payload_end:]


def frame(header: dict[str, object], payload: bytes, mac: bytes = b"") -> bytes:
    """A block as a forger writes it: any header and payload, every CRC-32 right."""
    header = {**header, "nbytes": len(payload), "crc32": zlib.crc32(payload)}
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<II", len(head), zlib.crc32(head)) + head + payload + mac


def forge_every_block(client: Any, prefix: str) -> int:
    """Rewrites every block under ``prefix`` with the payload of another (rotated by one),
    CRC-32s and the metadata's length recomputed, MACs kept.  Returns how many
    blocks it rewrote."""
    metas = sorted(k for k in client.keys(prefix + "*") if b"#" not in k)
    blocks = [client.get(k + b"#0") for k in metas]
    for i, name in enumerate(metas):
        header, _, mac = split(blocks[i])
        _, payload, _ = split(blocks[(i + 1) % len(blocks)])
        forged = frame(header, payload, mac)
        client.set(name + b"#0", forged)
        client.set(name, json.dumps({"parts": 1, "nbytes": len(forged)}))  # its length too
    return len(metas)
