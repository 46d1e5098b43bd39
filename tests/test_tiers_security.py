"""Authenticated KV tiers: signed blocks, tenants, rotation, encryption, insecure
sharing refused, Redis with ACL users and TLS.

A forger here has what anyone with write access to the shared Redis (or the
disk tier's directory) has: every stored block's bytes, and the framing's
format (CRC-32s are recomputed, since a CRC is not a secret).  Every forgery
must be refused, counted under its reason, and never used.  The MACs and the
key derivation are checked against an independent implementation
(``cryptography``'s HKDF and AES-GCM), not against the code under test.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import numpy as np
import pytest

from maxkv.tiers import (
    BlockInvalid,
    BlockLayout,
    Keyring,
    TierConfig,
    TieredBlockStore,
    decode_block,
    encode_block,
)
from maxkv.tiers import store as store_module
from maxkv.tiers.auth import MAC_BYTES, hkdf_sha256, key_id
from maxkv.tiers.blocks import MAGIC
from maxkv.tiers.local_server import LocalRedisServer as RedisServer
from maxkv.tiers.remote import redact_url

from .forgery import forge_every_block, frame, split

pytestmark = pytest.mark.unit

LAYOUT = BlockLayout("test-model", "page", 2, 2, 4, "float32", 4)
SECRET = "correct horse battery staple 0123"
OTHER_SECRET = "another secret of 32 bytes: 0123"


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.page_shape()).astype(np.float32)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def reason(data: bytes, k: bytes = key(1), **kw: object) -> str:
    """Why ``decode_block`` refuses ``data`` (it must)."""
    kw.setdefault("keyring", Keyring(SECRET))
    with pytest.raises(BlockInvalid) as caught:
        decode_block(LAYOUT, k, data, **kw)  # type: ignore[arg-type]
    return caught.value.reason


# ---------------------------------------------------------------- the framing


def reference_mac(secret: str, tenant: str | None, message: bytes) -> bytes:
    """The MAC as documented, with cryptography's HKDF (RFC 5869) and the stdlib's HMAC."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    who = b"\0" if tenant is None else b"\1" + tenant.encode()
    mac_key = HKDF(hashes.SHA256(), 32, b"maxkv-tiers-v1", b"maxkv-tiers mac\0" + who).derive(
        secret.encode()
    )
    return hmac.new(mac_key, message, hashlib.sha256).digest()


def test_signed_block_carries_the_documented_mac_and_never_the_secret() -> None:
    pytest.importorskip("cryptography")
    ring = Keyring(SECRET)
    data = encode_block(LAYOUT, key(1), block(1), {"start": 0}, keyring=ring, tenant="acme")
    header, payload, mac = split(data)
    assert len(mac) == MAC_BYTES
    assert mac == reference_mac(SECRET, "acme", data[:-MAC_BYTES])
    assert header["key_id"] == ring.current_id == key_id(SECRET.encode())
    assert payload == block(1).tobytes()  # signed, not encrypted
    assert SECRET.encode() not in data and SECRET not in repr(ring)
    back, extra = decode_block(LAYOUT, key(1), data, keyring=ring, tenant="acme")
    np.testing.assert_array_equal(back, block(1))
    assert extra == {"start": 0}
    assert len(hkdf_sha256(b"k" * 16, b"info", length=100)) == 100


def test_every_forgery_is_refused() -> None:
    ring = Keyring(SECRET)
    honest = [encode_block(LAYOUT, key(i), block(i), keyring=ring) for i in range(3)]
    header, payload, mac = split(honest[1])
    _, other_payload, _ = split(honest[2])

    # Another block's payload, both CRC-32s recomputed, the old MAC kept.
    assert reason(frame(header, other_payload, mac)) == "signature"
    # The header edited to another layout (the shape follows), CRCs recomputed.
    edited = {**header, "layout": {**header["layout"], "page_size": 2}}  # type: ignore[dict-item]
    assert reason(frame(edited, payload, mac)) == "signature"
    # The MAC of another block.
    assert reason(frame(header, payload, split(honest[2])[2])) == "signature"
    # A block copied under another key: it names its own, signed with it.
    assert reason(honest[2], key(1)) == "key"
    # Its key field edited to the key it is stored under.
    assert reason(frame({**header, "key": key(2).hex()}, payload, mac), key(2)) == "signature"
    # Signed with another secret, or for another tenant.
    assert reason(encode_block(LAYOUT, key(1), block(1), keyring=Keyring(OTHER_SECRET))) == (
        "unknown_key"
    )
    assert reason(encode_block(LAYOUT, key(1), block(1), keyring=ring, tenant="b")) == "signature"
    assert reason(honest[1], tenant="b") == "signature"
    assert reason(honest[1], tenant="") == "signature"  # "" is not "no salt"
    # The MAC stripped: the header still names a key, the bytes are short.
    assert reason(honest[1][:-MAC_BYTES]) == "truncated"
    # The signature removed altogether (an unsigned block), for a reader with a secret.
    unsigned = frame({**header, "key_id": None}, payload)
    assert reason(unsigned) == "unsigned"
    assert reason(encode_block(LAYOUT, key(1), block(1))) == "unsigned"
    # A signed block, for a reader without any secret: refused, and it says why.
    with pytest.raises(BlockInvalid, match="MAXKV_TIER_SECRET") as caught:
        decode_block(LAYOUT, key(1), honest[1])
    assert caught.value.reason == "unknown_key"
    # One bit of the payload flipped: damage (the CRC-32 says so), or a forgery (with the
    # CRC-32 recomputed).
    damaged = bytearray(honest[1])
    damaged[-MAC_BYTES - 7] ^= 1
    assert reason(bytes(damaged)) == "corrupt"
    flipped = bytearray(payload)
    flipped[3] ^= 1
    assert reason(frame(header, bytes(flipped), mac)) == "signature"
    # The honest block still passes.
    np.testing.assert_array_equal(
        decode_block(LAYOUT, key(1), honest[1], keyring=ring)[0], block(1)
    )


def test_rotation_accepts_listed_old_keys_only() -> None:
    old_block = encode_block(LAYOUT, key(1), block(1), keyring=Keyring(OTHER_SECRET))
    rotated = Keyring(SECRET, [OTHER_SECRET])
    assert rotated.key_ids == [key_id(SECRET.encode()), key_id(OTHER_SECRET.encode())]
    np.testing.assert_array_equal(
        decode_block(LAYOUT, key(1), old_block, keyring=rotated)[0], block(1)
    )
    new_block = encode_block(LAYOUT, key(1), block(1), keyring=rotated)
    assert split(new_block)[0]["key_id"] == key_id(SECRET.encode())  # new blocks: new key
    assert reason(old_block, keyring=Keyring(SECRET)) == "unknown_key"  # old key delisted


def test_encrypted_block_hides_the_kv_and_decrypts_with_an_independent_aes_gcm() -> None:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    ring = Keyring(SECRET, encrypt=True)
    data = encode_block(LAYOUT, key(1), block(1), keyring=ring, tenant="acme")
    header, payload, _ = split(data)
    assert header["cipher"] == "aes-256-gcm"
    plain = block(1).tobytes()
    assert plain[:64] not in data and len(payload) == len(plain) + 16
    enc_key = HKDF(hashes.SHA256(), 32, b"maxkv-tiers-v1", b"maxkv-tiers encrypt\0\1acme").derive(
        SECRET.encode()
    )
    aad = {k: v for k, v in header.items() if k not in ("nbytes", "crc32")}
    aad_bytes = json.dumps(aad, sort_keys=True).encode()
    nonce = bytes.fromhex(str(header["nonce"]))
    assert AESGCM(enc_key).decrypt(nonce, payload, aad_bytes) == plain
    np.testing.assert_array_equal(
        decode_block(LAYOUT, key(1), data, keyring=ring, tenant="acme")[0], block(1)
    )
    # A reader that signs only reads encrypted blocks too (same secret).
    np.testing.assert_array_equal(
        decode_block(LAYOUT, key(1), data, keyring=Keyring(SECRET), tenant="acme")[0], block(1)
    )
    assert reason(data, tenant="other") == "signature"
    two = encode_block(LAYOUT, key(1), block(1), keyring=ring, tenant="acme")
    assert split(two)[0]["nonce"] != header["nonce"]  # a fresh nonce per block


# ------------------------------------------------------------- the store


def config(**kw: object) -> TierConfig:
    return TierConfig(model_id="test-model", **kw)  # type: ignore[arg-type]


@pytest.fixture
def said() -> Iterator[None]:
    """Forgets the store's once-per-process warnings around a test."""
    store_module._said.clear()
    yield
    store_module._said.clear()


def test_config_refuses_unsigned_redis_and_keeps_the_secret_out_of_sight(
    said: None, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    url = "redis://maxkv:hunter2hunter2@127.0.0.1:1/0"
    with pytest.raises(ValueError, match=r"MAXKV_TIER_SECRET.*MAXKV_TIER_INSECURE=1") as caught:
        config(redis_url=url)
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ValueError, match="fewer than 16") as short:
        config(secret="short-secret")
    assert "short-secret" not in str(short.value)
    with pytest.raises(ValueError, match="secret"):
        config(encrypt=True)
    with pytest.raises(ValueError, match="secret"):
        config(old_secrets=(SECRET,))
    signed = config(redis_url=url, secret=SECRET, old_secrets=(OTHER_SECRET,))
    assert SECRET not in repr(signed) and OTHER_SECRET not in repr(signed)
    assert "hunter2" not in repr(signed) and "maxkv:***@127.0.0.1" in repr(signed)
    client = fakeredis.FakeRedis()
    with caplog.at_level(logging.INFO, logger="maxkv.tiers"):
        for _ in range(2):  # the warnings are said once per process
            TieredBlockStore(LAYOUT, config(redis_url=url, insecure=True, redis_client=client))
            TieredBlockStore(LAYOUT, config(disk_dir=str(tmp_path)))
        store = TieredBlockStore(LAYOUT, config(redis_url=url, secret=SECRET, redis_client=client))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("NOT signed" in m for m in messages) == 1
    assert sum("disk tier" in m and "not signed" in m for m in messages) == 1
    assert not any("hunter2" in m or SECRET in m for m in messages)
    assert store.security == f"blocks signed (key {key_id(SECRET.encode())})"


def test_config_from_environment(tmp_path: Path) -> None:
    env = {"MAXKV_REDIS_URL": "redis://h:1/0", "MAXKV_TIER_SECRET": SECRET}
    c = TierConfig.from_env("m", env)
    assert (c.secret, c.insecure, c.encrypt, c.old_secrets) == (SECRET, False, False, ())
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    c = TierConfig.from_env(
        "m",
        {
            "MAXKV_TIER_SECRET_FILE": str(secret_file),
            "MAXKV_TIER_OLD_SECRETS": f"{OTHER_SECRET}, {'z' * 20}",
            "MAXKV_TIER_ENCRYPT": "1",
        },
    )
    assert (c.secret, c.old_secrets, c.encrypt) == (SECRET, (OTHER_SECRET, "z" * 20), True)
    assert TierConfig.from_env(
        "m", {"MAXKV_REDIS_URL": "redis://h/0", "MAXKV_TIER_INSECURE": "yes"}
    )
    with pytest.raises(ValueError, match="MAXKV_TIER_SECRET"):
        TierConfig.from_env("m", {"MAXKV_REDIS_URL": "redis://h:1/0"})
    with pytest.raises(ValueError, match="MAXKV_TIER_INSECURE"):
        TierConfig.from_env("m", {"MAXKV_TIER_INSECURE": "maybe"})
    with pytest.raises(ValueError, match="not both"):
        TierConfig.from_env(
            "m", {"MAXKV_TIER_SECRET": SECRET, "MAXKV_TIER_SECRET_FILE": str(secret_file)}
        )
    with pytest.raises(ValueError, match="cannot read"):
        TierConfig.from_env("m", {"MAXKV_TIER_SECRET_FILE": str(tmp_path / "missing")})


def test_redact_url() -> None:
    assert redact_url("redis://u:p@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://:p@h/0") == "redis://:***@h/0"
    assert redact_url("rediss://h:1/0?ssl_ca_certs=/ca&password=p") == (
        "rediss://h:1/0?ssl_ca_certs=/ca&password=***"
    )
    assert redact_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"
    assert redact_url("rediss://h/0?ssl_password=p&ssl_certfile=/c") == (
        "rediss://h/0?ssl_password=***&ssl_certfile=/c"
    )


def test_malformed_headers_are_refused_not_raised() -> None:
    """Headers no writer makes (JSON's Infinity, deep nesting, wrong types, negative or
    huge lengths, a key id that is not one): each a BlockInvalid, never another error,
    before any MAC is computed."""
    ring = Keyring(SECRET)
    header, payload, mac = split(encode_block(LAYOUT, key(1), block(1), keyring=ring))

    def raw_header(text: bytes) -> bytes:
        return MAGIC + struct.pack("<II", len(text), zlib.crc32(text)) + text + payload + mac

    bad = [
        raw_header(b'{"key_id": null, "nbytes": Infinity, "crc32": 0}'),
        raw_header(b'{"key_id": null, "nbytes": 1e400, "crc32": 0}'),
        raw_header(b"[" * 100_000),
        raw_header(b'"just a string"'),
        raw_header(b"{}"),
        raw_header(json.dumps({**header, "nbytes": -5}).encode()),
        raw_header(json.dumps({**header, "nbytes": True}).encode()),
        raw_header(json.dumps({**header, "crc32": 1.5}).encode()),
        frame({**header, "key_id": "x" * 10_000}, payload, mac),
        frame({**header, "key_id": 7}, payload, mac),
        frame({**header, "key_id": None, "shape": [2**70, 1]}, payload),
        frame({**header, "key_id": None, "shape": "page"}, payload),
        frame({**header, "key_id": None, "layout": "page"}, payload),
        frame({**header, "key_id": None, "layout": {"kind": "page", "x": 1}}, payload),
    ]
    for data in bad:
        for keyring in (ring, None):
            with pytest.raises(BlockInvalid) as caught:
                decode_block(LAYOUT, key(1), data, keyring=keyring)
            assert len(str(caught.value)) < 400  # no stored text repeated at length
    huge = raw_header(json.dumps({**header, "nbytes": 2**62}).encode())
    with pytest.raises(BlockInvalid, match="truncated"):
        decode_block(LAYOUT, key(1), huge, keyring=ring)


def test_redis_metadata_no_writer_makes_is_refused_unread() -> None:
    client = fakeredis.FakeRedis()
    store = TieredBlockStore(
        LAYOUT, config(redis_url="redis://fake:0/0", redis_client=client, secret=SECRET)
    )
    name = f"maxkv@{LAYOUT.fingerprint}@{key(1).hex()}"
    for meta in (
        b'{"parts": Infinity, "nbytes": 10}',
        b"[" * 100_000,
        b'{"parts": 1000000000, "nbytes": 1000000000}',  # a billion names: never built
        b'{"parts": 2, "nbytes": 10}',  # parts missing
        b'{"parts": 1, "nbytes": 10}',  # a part larger than said
        b"not json",
    ):
        client.set(name, meta)
        client.set(name + "#0", b"x" * 20)
        assert store.get(key(1)) is None
        assert not client.exists(name)  # dropped
    assert store.stats.invalid["truncated"] == 6
    store.close()


def test_disk_tier_reads_regular_files_only(tmp_path: Path) -> None:
    store = TieredBlockStore(LAYOUT, config(disk_dir=str(tmp_path), secret=SECRET, host_bytes=0))
    for i in range(3):
        store.put(key(i), block(i))
    store.flush()
    assert store.disk is not None
    files = {k: store.disk._path(k) for k in (key(0), key(1), key(2))}
    assert oct(store.disk.directory.stat().st_mode & 0o777) == "0o700"
    files[key(0)].unlink()
    os.mkfifo(files[key(0)])  # would block a reader forever
    files[key(1)].unlink()
    files[key(1)].symlink_to("/dev/zero")  # would never end
    assert store.get(key(0)) is None and store.get(key(1)) is None
    np.testing.assert_array_equal(store.get(key(2))[0], block(2))  # type: ignore[index]
    store.close()


def test_encrypted_block_without_cryptography_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cryptography")
    data = encode_block(LAYOUT, key(1), block(1), keyring=Keyring(SECRET, encrypt=True))
    reader = Keyring(SECRET)  # signs only: no cryptography needed to start
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(BlockInvalid, match="cryptography") as caught:
        decode_block(LAYOUT, key(1), data, keyring=reader)
    assert caught.value.reason == "unknown_key"


def test_store_uses_no_forged_or_foreign_block_and_counts_each(said: None) -> None:
    client = fakeredis.FakeRedis()
    shared = dict(redis_url="redis://fake:0/0", redis_client=client, host_bytes=0)
    writer = TieredBlockStore(LAYOUT, config(secret=SECRET, **shared))
    for i in range(4):
        writer.put(key(i), block(i), tenant="acme")
    writer.put(key(10), block(10))  # no tenant
    writer.close()

    # Same secret, same tenant: reused.
    reader = TieredBlockStore(LAYOUT, config(secret=SECRET, **shared))
    np.testing.assert_array_equal(reader.get(key(0), tenant="acme")[0], block(0))  # type: ignore[index]
    # Another tenant asking for the same hash (a collision or a guess): refused.
    assert reader.get(key(1), tenant="globex") is None
    # Unsalted requests are a tenant of their own.
    assert reader.get(key(10), tenant="acme") is None
    assert reader.stats.invalid == {"signature": 2}
    reader.close()

    writer = TieredBlockStore(LAYOUT, config(secret=SECRET, **shared))
    for i in range(4, 8):
        writer.put(key(i), block(i), tenant="acme")
    writer.close()
    # Another secret; no secret at all (an insecure reader): refused and counted.
    other = TieredBlockStore(LAYOUT, config(secret=OTHER_SECRET, **shared))
    assert other.get(key(4), tenant="acme") is None
    assert other.stats.invalid == {"unknown_key": 1}
    other.close()
    insecure = TieredBlockStore(LAYOUT, config(insecure=True, **shared))
    assert insecure.get(key(5), tenant="acme") is None
    assert insecure.stats.invalid == {"unknown_key": 1}
    insecure.close()

    # Every stored block rewritten with another's payload: none is used.
    assert forge_every_block(client, f"maxkv@{LAYOUT.fingerprint}@") >= 4
    forged = TieredBlockStore(LAYOUT, config(secret=SECRET, **shared))
    assert all(forged.get(key(i), tenant="acme") is None for i in (6, 7))
    assert forged.stats.invalid == {"signature": 2} and forged.stats.redis_hits == 0
    assert forged.contains([key(6), key(7)]) == [False, False]  # dropped for every process
    forged.close()


# ------------------------------------------------------------ real Redis


_WRITER = """
import sys, numpy as np
from maxkv.tiers import BlockLayout, TierConfig, TieredBlockStore
layout = BlockLayout("test-model", "page", 2, 2, 4, "float32", 4)
secret = sys.argv[2]
store = TieredBlockStore(layout, TierConfig(model_id="test-model", redis_url=sys.argv[1],
    secret=secret))
for i in range(3):
    a = np.random.default_rng(i).standard_normal(layout.page_shape()).astype(np.float32)
    store.put(i.to_bytes(16, "big"), a, tenant="acme")
store.close()
print(store.stats.redis_writes)
"""


def write_in_another_process(url: str, secret: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WRITER, url, secret],
        check=True,
        timeout=120,
        env=dict(os.environ),
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "3", out.stderr[-2000:]


@pytest.mark.redis
def test_processes_share_signed_blocks_and_rotate_keys(
    redis_server: RedisServer, said: None, caplog: pytest.LogCaptureFixture
) -> None:
    write_in_another_process(redis_server.url, OTHER_SECRET)

    def read(**kw: object) -> TieredBlockStore:
        store = TieredBlockStore(LAYOUT, config(redis_url=redis_server.url, host_bytes=0, **kw))
        return store

    # Rotation: the writer's secret is now the old one, still listed.
    rotated = read(secret=SECRET, old_secrets=(OTHER_SECRET,))
    np.testing.assert_array_equal(rotated.get(key(0), tenant="acme")[0], block(0))  # type: ignore[index]
    rotated.close()
    # A process without the secret cannot use them, and says so.
    with caplog.at_level(logging.WARNING, logger="maxkv.tiers"):
        blind = read(insecure=True)
        assert blind.get(key(1), tenant="acme") is None
    assert blind.stats.invalid == {"unknown_key": 1}
    assert any("no secret (MAXKV_TIER_SECRET)" in r.getMessage() for r in caplog.records)
    blind.close()
    # After the rotation is over (the old secret delisted): refused, counted, dropped.
    delisted = read(secret=SECRET)
    assert delisted.get(key(2), tenant="acme") is None
    assert delisted.stats.invalid == {"unknown_key": 1}
    assert delisted.contains([key(0), key(2)]) == [True, False]
    delisted.close()


def _openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        pytest.skip("needs openssl to make a throwaway certificate")
    return path


def _redis_supports_tls(binary: str) -> bool:
    probe = subprocess.run(
        [binary, "--tls-port", "0", "--port", "0", "--test-memory", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return "not supported" not in (probe.stdout + probe.stderr).lower()


@pytest.mark.redis
def test_acl_user_restricted_to_the_prefix_and_requirepass(
    tmp_path: Path, said: None, caplog: pytest.LogCaptureFixture
) -> None:
    acl = "user maxkv on >s3cret-pass ~maxkv@* +get +mget +strlen +set +exists +del +ping\n"
    (tmp_path / "users.acl").write_text(acl + "user default on >admin-pass ~* +@all\n")
    server = RedisServer(tmp_path, extra_args=["--aclfile", str(tmp_path / "users.acl")]).start()
    try:
        url = f"redis://maxkv:s3cret-pass@127.0.0.1:{server.port}/0"
        store = TieredBlockStore(LAYOUT, config(redis_url=url, secret=SECRET, host_bytes=0))
        store.put(key(1), block(1))
        store.flush()
        assert store.stats.redis_writes == 1
        np.testing.assert_array_equal(store.get(key(1))[0], block(1))  # type: ignore[index]
        store.close()
        # requirepass style (the default user's password, no user name) works the same.
        admin = f"redis://:admin-pass@127.0.0.1:{server.port}/0"
        store = TieredBlockStore(LAYOUT, config(redis_url=admin, secret=SECRET, host_bytes=0))
        np.testing.assert_array_equal(store.get(key(1))[0], block(1))  # type: ignore[index]
        assert "admin-pass" not in repr(store.config) and store.redis is not None
        assert store.redis.safe_url.startswith("redis://:***@")
        store.close()
        # Outside its prefix the user may do nothing (checked with redis-py directly).
        import redis

        client = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("elsewhere", b"x")
        client.close()
        # A wrong password is an outage (serving goes on), and no password is logged.
        bad = f"redis://maxkv:wrong-pass@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.WARNING, logger="maxkv.tiers"):
            wrong = TieredBlockStore(LAYOUT, config(redis_url=bad, secret=SECRET, host_bytes=0))
            assert wrong.get(key(1)) is None
            wrong.close()
        assert wrong.redis is not None and wrong.redis.errors == 1
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "unreachable" in text and "maxkv:***@" in text
        assert "wrong-pass" not in text and "s3cret-pass" not in text
    finally:
        server.stop()


@pytest.mark.redis
def test_tls_redis(tmp_path: Path, said: None) -> None:
    openssl = _openssl()
    from maxkv.tiers.local_server import BINARY

    assert BINARY is not None
    if not _redis_supports_tls(BINARY):
        pytest.skip("this redis-server was built without TLS")
    cert, private = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(private), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server = RedisServer(tmp_path, tls=(cert, private)).start()
    try:
        url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
        store = TieredBlockStore(LAYOUT, config(redis_url=url, secret=SECRET, host_bytes=0))
        store.put(key(1), block(1))
        store.flush()
        assert store.stats.redis_writes == 1 and store.redis is not None and store.redis.up
        np.testing.assert_array_equal(store.get(key(1))[0], block(1))  # type: ignore[index]
        store.close()
        # Plain text to the TLS port gets nothing: the tier is down, serving goes on.
        plain = f"redis://127.0.0.1:{server.port}/0"
        clear = TieredBlockStore(LAYOUT, config(redis_url=plain, secret=SECRET, host_bytes=0))
        assert clear.get(key(1)) is None and clear.redis is not None and not clear.redis.up
        clear.close()
    finally:
        server.stop()
