"""KV events in vLLM's wire format, checked against a batch vLLM 0.26 sent
(captured in volcano-sh/kthena issue #1535) and through real ZMQ sockets."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from maxkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    event_hash,
)

pytestmark = pytest.mark.unit

#: What vLLM 0.26.0 published for one block (decoded generically), token ids and
#: timestamp as captured.
VLLM_CAPTURE = [
    1789095808.8378847,
    [
        {
            "type": "BlockStored",
            "block_hashes": [15760518052499183552],
            "parent_block_hash": None,
            "token_ids": list(range(100, 116)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    ],
    0,
]


def test_a_batch_is_encoded_as_vllm_sends_it() -> None:
    event = BlockStored(
        block_hashes=[15760518052499183552],
        parent_block_hash=None,
        token_ids=list(range(100, 116)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    payload = encode_batch([event], ts=1789095808.8378847)
    generic = msgspec.msgpack.decode(payload)
    assert generic == VLLM_CAPTURE
    assert list(generic[1][0]) == list(VLLM_CAPTURE[1][0])  # key order too
    assert payload[0] == 0x93  # a 3-element array, not a map
    assert b"\xcf" + (15760518052499183552).to_bytes(8, "big") in payload  # uint64
    # vLLM's payload decodes into these structs.
    batch = decode_batch(msgspec.msgpack.encode(VLLM_CAPTURE))
    assert batch.events == [event] and batch.data_parallel_rank == 0


def test_defaults_are_left_out_and_required_fields_kept_as_nil() -> None:
    stored = BlockStored([1], None, [5] * 4, 4, None, None, None)
    removed = BlockRemoved([1], "CPU")
    generic = msgspec.msgpack.decode(encode_batch([stored, removed, AllBlocksCleared()], ts=1.0))
    assert list(generic[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert generic[1][1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}
    assert generic[1][2] == {"type": "AllBlocksCleared"}
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [1]]], 0]))  # array events


def test_event_hash_is_the_last_eight_bytes_unsigned() -> None:
    digest = bytes(range(24)) + b"\xff" * 8
    assert event_hash(digest) == 2**64 - 1
    with pytest.raises(ValueError, match="8 bytes"):
        event_hash(b"short")


def test_publisher_streams_numbered_batches_and_replays_them() -> None:
    context = zmq.Context.instance()
    publisher = ZmqEventPublisher(
        ["tcp://127.0.0.1:0"], ["tcp://127.0.0.1:0"], topic="kv", max_queue_size=8
    )
    try:
        endpoint = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        assert publisher._replay is not None
        replay_endpoint = publisher._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVTIMEO, 20_000)  # a hang would be a failure, not a stall
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        # A subscription reaches the publisher after a while (ZMQ's slow joiner):
        # publish until one batch arrives, then check the stream from there.
        first = None
        for _ in range(200):
            assert publisher.publish([AllBlocksCleared()])
            if sub.poll(50):
                first = int.from_bytes(sub.recv_multipart()[1], "big")
                break
        assert first is not None, "no batch reached the subscriber"
        while sub.poll(200):  # the probes still in flight
            first = int.from_bytes(sub.recv_multipart()[1], "big")
        batches = [[BlockRemoved([7], "GPU")], [BlockRemoved([8], "GPU")], [AllBlocksCleared()]]
        for events in batches:
            assert publisher.publish(events)
        assert publisher.publish([])  # nothing to send
        received = [sub.recv_multipart() for _ in batches]
        assert [r[0] for r in received] == [b"kv"] * 3
        seqs = [int.from_bytes(r[1], "big") for r in received]
        assert seqs == [first + 1, first + 2, first + 3]
        assert [decode_batch(r[2]).events for r in received] == batches

        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 20_000)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", seqs[1].to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(r[2], "big") for r in replies[:2]] == seqs[1:]
        assert [r[1] for r in replies[:2]] == [b"kv", b"kv"]
        assert [decode_batch(r[3]).events for r in replies[:2]] == batches[1:]
        assert replies[2] == [b"", b"", b"\xff" * 8, b""]
        assert publisher.stats.batches_published == seqs[-1] + 1
        assert publisher.stats.replays_served == 1
        sub.close(linger=0)
        dealer.close(linger=0)
    finally:
        publisher.close()
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([AllBlocksCleared()])


def test_publisher_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        ZmqEventPublisher([])
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher(["tcp://127.0.0.1:0"], buffer_steps=0)
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(["not-an-endpoint"])
