"""Who may write the blocks a process reads back: secrets, key ids, tenants, encryption.

A block that leaves the process (the disk and Redis tiers) is signed with
HMAC-SHA256 over its whole framing (header and payload,
:mod:`maxkv.tiers.blocks`), under a key derived from the operator's secret
and the block's tenant (the request's ``cache_salt``) with HKDF-SHA256 (RFC
5869).  So a block is usable only by a process that holds the secret, only
for the tenant it was written for, and only as what its header says (the
layout and the block hash are signed with it).  Optionally its payload is
also encrypted with AES-256-GCM under a key derived the same way, for Redis
servers that must not hold readable KV.

The header names the key by a *key id*, 16 hex digits of an HMAC of the
secret (nothing about the secret can be learned from it), so that secrets
can be rotated: :class:`Keyring` signs with its current secret and accepts
blocks signed with any of the old secrets still listed.

The secret itself is never written anywhere: not in block headers, keys,
``repr`` or log lines.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CIPHER",
    "MAC_BYTES",
    "MIN_SECRET_BYTES",
    "NONCE_BYTES",
    "Keyring",
    "hkdf_sha256",
    "key_id",
    "secret_bytes",
]

#: Length of a block's MAC (HMAC-SHA256).
MAC_BYTES = 32
#: Shortest secret accepted (128 bits if random).
MIN_SECRET_BYTES = 16
#: The payload encryption of an encrypted block (its header's ``cipher``).
CIPHER = "aes-256-gcm"
#: Bytes of an AES-GCM nonce (random per block).
NONCE_BYTES = 12

_HKDF_SALT = b"maxkv-tiers-v1"
_KEY_ID_LABEL = b"maxkv-tiers key id"


def secret_bytes(secret: str | bytes, what: str = "secret") -> bytes:
    """``secret`` as bytes (UTF-8 for a ``str``), checked to be long enough.

    Raises:
        ValueError: If it is shorter than :data:`MIN_SECRET_BYTES` bytes
            (the message never contains the secret).
        TypeError: If it is neither ``str`` nor ``bytes``.
    """
    if isinstance(secret, str):
        raw = secret.encode()
    elif isinstance(secret, bytes):
        raw = secret
    else:
        raise TypeError(f"the tier {what} must be str or bytes, got {type(secret).__name__}")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the tier {what} has {len(raw)} bytes, fewer than {MIN_SECRET_BYTES}: use a "
            "random one, e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return raw


def hkdf_sha256(secret: bytes, info: bytes, salt: bytes = _HKDF_SALT, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869): ``length`` bytes of key material for ``info``."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"length must be in 1..{255 * 32}, got {length}")
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def key_id(secret: bytes) -> str:
    """The public name of ``secret`` in block headers: 16 hex digits of an HMAC of it."""
    return hmac.new(secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]


def _tenant_info(purpose: bytes, tenant: str | None) -> bytes:
    # None (no cache_salt) and "" are different tenants.
    who = b"\0" if tenant is None else b"\1" + tenant.encode()
    return b"maxkv-tiers " + purpose + b"\0" + who


class Keyring:
    """The secrets of one process: the current one signs, every listed one verifies.

    Thread-safe.  Derived keys are cached per (key id, tenant), the least
    recently used dropped past ``cache_size``.

    Args:
        secret: The current secret (at least :data:`MIN_SECRET_BYTES` bytes).
        old_secrets: Secrets of before a rotation, still accepted when reading.
        encrypt: Whether :meth:`encrypt` is used for new blocks (needs the
            ``cryptography`` package).
        cache_size: Derived keys kept.

    Raises:
        ImportError: If ``encrypt`` and ``cryptography`` is missing.
    """

    def __init__(
        self,
        secret: str | bytes,
        old_secrets: Sequence[str | bytes] = (),
        *,
        encrypt: bool = False,
        cache_size: int = 4096,
    ) -> None:
        current = secret_bytes(secret)
        self._secrets: dict[str, bytes] = {key_id(current): current}
        for old in old_secrets:
            raw = secret_bytes(old, "old secret")
            self._secrets.setdefault(key_id(raw), raw)
        #: The key id new blocks are signed with.
        self.current_id = key_id(current)
        self.encrypt_blocks = bool(encrypt)
        if self.encrypt_blocks:
            _aesgcm()  # fail now, not at the first write
        self._cache: OrderedDict[tuple[str, str | None, bytes], bytes] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the secrets
        return f"Keyring(key ids {sorted(self._secrets)}, current {self.current_id})"

    @property
    def key_ids(self) -> list[str]:
        """Every key id this keyring accepts (the current one first)."""
        return [self.current_id, *(k for k in self._secrets if k != self.current_id)]

    def knows(self, kid: str) -> bool:
        return kid in self._secrets

    def _key(self, kid: str, tenant: str | None, purpose: bytes) -> bytes:
        cache_key = (kid, tenant, purpose)
        with self._lock:
            key = self._cache.get(cache_key)
            if key is not None:
                self._cache.move_to_end(cache_key)
                return key
        key = hkdf_sha256(self._secrets[kid], _tenant_info(purpose, tenant))
        with self._lock:
            self._cache[cache_key] = key
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return key

    def mac(self, kid: str, tenant: str | None, parts: Sequence[bytes | memoryview]) -> bytes:
        """HMAC-SHA256 of ``parts`` (concatenated) under the tenant's key of ``kid``.

        Raises:
            KeyError: If ``kid`` is not a key id of this keyring.
        """
        digest = hmac.new(self._key(kid, tenant, b"mac"), digestmod=hashlib.sha256)
        for part in parts:
            digest.update(part)
        return digest.digest()

    def verify(
        self, kid: str, tenant: str | None, parts: Sequence[bytes | memoryview], mac: bytes
    ) -> bool:
        """Whether ``mac`` is :meth:`mac` of ``parts`` (compared in constant time)."""
        return hmac.compare_digest(self.mac(kid, tenant, parts), mac)

    def encrypt(self, tenant: str | None, payload: bytes, aad: bytes, nonce: bytes) -> bytes:
        """The ciphertext of ``payload`` with its tag: AES-256-GCM under the tenant's
        current key, with a ``nonce`` of :data:`NONCE_BYTES` random bytes never used
        before (``os.urandom``)."""
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"an AES-GCM nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
        cipher = _aesgcm()(self._key(self.current_id, tenant, b"encrypt"))
        return bytes(cipher.encrypt(nonce, payload, aad))

    def decrypt(
        self, kid: str, tenant: str | None, nonce: bytes, data: bytes | memoryview, aad: bytes
    ) -> bytes:
        """The plaintext of :meth:`encrypt`'s output.

        Raises:
            ValueError: If the ciphertext or its tag does not verify.
            ImportError: If the ``cryptography`` package is missing.
        """
        cipher = _aesgcm()(self._key(kid, tenant, b"encrypt"))
        from cryptography.exceptions import InvalidTag

        try:
            return bytes(cipher.decrypt(nonce, bytes(data), aad))
        except InvalidTag:
            raise ValueError("the encrypted payload does not verify") from None


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ImportError(
            "encrypted KV tiers (MAXKV_TIER_ENCRYPT) need the cryptography package: "
            "pip install 'maxkv[secure]'"
        ) from None
    return AESGCM
