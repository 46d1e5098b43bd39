"""A ZMQ publisher of KV event batches, as vLLM's ``ZmqEventPublisher`` sends them.

- **Live stream:** a PUB socket; one multipart message per batch, ``(topic,
  seq, payload)``: the topic's bytes (default empty), the batch's sequence
  number as 8 bytes big-endian (0, 1, 2, ...), the msgpack payload
  (:func:`maxkv.events.wire.encode_batch`).
- **Replay:** a ROUTER socket.  A request ``[identity, b"", start_seq]`` (8
  bytes big-endian) is answered with ``[identity, b"", topic, seq, payload]``
  per batch still buffered from ``start_seq`` on, then ``[identity, b"",
  b"", -1 (8 bytes, signed), b""]``.

Both sockets are bound (a router connects to them), on every endpoint given.
:meth:`ZmqEventPublisher.publish` never blocks: batches go through a bounded
queue to the publisher's own thread, which owns the sockets; a batch that
finds the queue full is dropped, counted and logged.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

try:
    import zmq
except ImportError as error:  # pragma: no cover (the extra is missing)
    raise ImportError(
        'maxkv\'s KV event publisher needs pyzmq: pip install "maxkv[events]"'
    ) from error

from .. import settings
from .wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

__all__ = ["EventPublisherStats", "ZmqEventPublisher"]

logger = logging.getLogger("maxkv.events")

#: The replay's end marker: sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class EventPublisherStats:
    """What a publisher did (cumulative)."""

    batches_published: int = 0
    events_published: int = 0
    #: Batches dropped because the queue was full (publishing never blocks a step).
    batches_dropped: int = 0
    replays_served: int = 0


class ZmqEventPublisher:
    """Publishes KV event batches on ZMQ sockets of its own thread.

    Args:
        endpoints: Where the PUB socket binds (``tcp://*:5557``,
            ``tcp://127.0.0.1:5557``, ``ipc://...``).
        replay_endpoints: Where the replay ROUTER socket binds (none: no replay).
        topic: The first frame of every message.
        buffer_steps: Batches kept for replay.
        max_queue_size: Batches waiting for the thread before new ones are dropped.
        hwm: The PUB socket's high-water mark.
        data_parallel_rank: The batches' ``data_parallel_rank``.

    Raises:
        ValueError: On no endpoint or a size below 1.
        zmq.ZMQError: If an endpoint cannot be bound (in use, malformed).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        replay_endpoints: Sequence[str] = (),
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        if not endpoints:
            raise ValueError("a KV event publisher needs at least one endpoint")
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("max_queue_size", max_queue_size),
            ("hwm", hwm),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.topic = topic.encode("utf-8")
        self.endpoints = tuple(endpoints)
        self.replay_endpoints = tuple(replay_endpoints)
        self.stats = EventPublisherStats()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[list[BlockStored | BlockRemoved | AllBlocksCleared] | None] = (
            queue.Queue(maxsize=max_queue_size)
        )
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            for endpoint in endpoints:
                self._pub.bind(endpoint)
            if replay_endpoints:
                self._replay = self._context.socket(zmq.ROUTER)
                for endpoint in replay_endpoints:
                    self._replay.bind(endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="maxkv-kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ZmqEventPublisher | None:
        """The publisher ``MAXKV_KV_EVENTS_ENDPOINT`` asks for (with
        ``MAXKV_KV_EVENTS_REPLAY_ENDPOINT`` and ``MAXKV_KV_EVENTS_TOPIC``), bound;
        ``None`` when it is unset.

        Raises:
            SettingError: If a variable holds a value it cannot take.
            zmq.ZMQError: If an endpoint cannot be bound (in use).
        """
        endpoints = settings.KV_EVENTS_ENDPOINT.read(environ)
        replay = settings.KV_EVENTS_REPLAY_ENDPOINT.read(environ)
        topic = settings.KV_EVENTS_TOPIC.read(environ)
        if not endpoints:
            if replay:
                raise settings.SettingError(
                    f"{settings.KV_EVENTS_REPLAY_ENDPOINT.name} needs "
                    f"{settings.KV_EVENTS_ENDPOINT.name}"
                )
            return None
        return cls(endpoints, replay, topic=topic)

    def describe(self) -> str:
        """Where it publishes, in words (for logs)."""
        replay = f", replay on {', '.join(self.replay_endpoints)}" if self.replay_endpoints else ""
        topic = f", topic {self.topic.decode()!r}" if self.topic else ""
        return f"KV events on {', '.join(self.endpoints)}{replay}{topic}"

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> bool:
        """Queues one batch (nothing to do for none); ``False`` if it was dropped."""
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        if not events:
            return True
        try:
            self._queue.put_nowait(list(events))
        except queue.Full:
            self.stats.batches_dropped += 1
            if self.stats.batches_dropped in (1, 10, 100) or self.stats.batches_dropped % 1000 == 0:
                logger.warning(
                    "maxkv: KV event queue full, %d batches dropped so far (routers may see "
                    "stale prefixes until they replay)",
                    self.stats.batches_dropped,
                )
            return False
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is queued (for up to ``timeout`` seconds) and closes the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)  # the thread closes the sockets as it ends
        stats = self.stats
        logger.info(
            "maxkv: KV events: %d batches published (%d events), %d dropped, %d replays served",
            stats.batches_published,
            stats.events_published,
            stats.batches_dropped,
            stats.replays_served,
        )

    # ------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            self._serve_replays()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                break
            seq = next(self._seq)
            payload = encode_batch(events, data_parallel_rank=self._rank)
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.stats.batches_published += 1
            self.stats.events_published += len(events)
        self._close_sockets()

    def _serve_replays(self) -> None:
        replay = self._replay
        if replay is None:
            return
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("maxkv: a KV event replay request of %d frames ignored", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart(
                        (identity, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            self.stats.replays_served += 1  # counted before the end marker: then it is true
            replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
