"""The ZMQ event plane: a sequenced publisher with a replay buffer, and a gap-aware subscriber.

Wire protocol (vLLM's ``ZmqEventPublisher``, so either side can talk to real vLLM):

- Live: 3 frames ``[topic, seq (8-byte big-endian, +1 per batch, from 0), msgpack batch]``.
- Replay: a DEALER sends ``[b"", start_seq (8 bytes)]`` to the publisher's ROUTER and gets one
  ``[b"", seq, batch]`` per buffered batch with ``seq >= start_seq``, then ``[b"", -1, b""]``.

Neither class starts a thread: the owner calls ``start()``, drives ``serve_replay()`` / ``poll()``
from its own loop and calls ``close()``. The publisher uses an XPUB socket (wire-compatible with
PUB) so that ``wait_for_subscriber`` can tell when a subscription has landed instead of sleeping.
``drop_next`` is a test hook: the next batches skip the live send (and, if asked, the replay
buffer too), which is how recovery tests inject a gap into a real stream.
The subscriber never raises on bad input: it counts and skips (see :class:`EventPlaneStats`).

With ``curve`` (a :class:`~kvstrata.events.curve.CurveServer`) both sockets are CURVE servers:
traffic is encrypted and only the listed client keys get through (a ZAP handler, started in
``start()`` on the publisher's own context and stopped in ``close()``); a client without the
server key or with an unlisted key completes no handshake and receives nothing, live or replay.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Final, Self

import zmq

from kvstrata.events.curve import CurveServer, ZapGuard
from kvstrata.events.schema import (
    KVEvent,
    KVEventBatch,
    encode_batch,
    make_batch,
)

END_SEQ: Final = -1
_SEQ_BYTES: Final = 8


def _seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(_SEQ_BYTES, "big", signed=seq < 0)


def _bind(socket: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind; a ``tcp://host:*`` endpoint takes a random free port. Returns the bound endpoint."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":*"):
        port = socket.bind_to_random_port(endpoint[:-2])
        return f"{endpoint[:-2]}:{port}"
    socket.bind(endpoint)
    return endpoint


class ZmqEventPublisher:
    """Publishes batches with consecutive sequence numbers and keeps the last ``buffer_steps``
    payloads so that a subscriber which missed some can ask for them again."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        worker_id: str | None = None,
        epoch: int | None = None,
        data_parallel_rank: int | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve: CurveServer | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._worker_id = worker_id
        self._epoch = epoch
        self._dp_rank = data_parallel_rank
        self._context = context
        self._curve = curve
        self._own_context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._zap: ZapGuard | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._next_seq = 0
        self._lock = threading.Lock()
        self._drop_remaining = 0
        self._drop_evicts_replay = False

    @property
    def endpoint(self) -> str:
        """The live endpoint actually bound (a random port is resolved after ``start``)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def curve_public_key(self) -> str | None:
        """The CURVE server's public key (z85) subscribers need; None without CURVE."""
        return None if self._curve is None else self._curve.public_key_z85

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def worker_id(self) -> str | None:
        return self._worker_id

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def drop_next(self, count: int, *, evict_replay: bool = False) -> None:
        """Test hook: the next ``count`` batches take a seq but are not sent live.

        They stay in the replay buffer (a subscriber fills the gap by replay) unless
        ``evict_replay``, when they are never buffered either (replay cannot fill it: the
        subscriber must resync). Call it from the thread that publishes.
        """
        if count < 0:
            raise ValueError("count must be >= 0")
        self._drop_remaining = count
        self._drop_evicts_replay = evict_replay

    def start(self) -> Self:
        """Bind the live XPUB and, if configured, the replay ROUTER (CURVE: start the ZAP
        handler first, on a context of this publisher's own unless one was given)."""
        context = self._context
        if self._curve is not None:
            if context is None:
                context = self._own_context = zmq.Context()
            self._zap = ZapGuard(context, self._curve.allowed_clients).start()
        context = context or zmq.Context.instance()
        self._pub = self._socket(context, zmq.XPUB)
        self._endpoint = _bind(self._pub, self._endpoint)
        if self._replay_endpoint is not None:
            self._replay = self._socket(context, zmq.ROUTER)
            # a ROUTER silently drops what its peer's queue cannot take (1,000 by default):
            # one whole replay (the buffer and its end marker) must fit
            self._replay.setsockopt(zmq.SNDHWM, (self._buffer.maxlen or 0) + 2)
            self._replay_endpoint = _bind(self._replay, self._replay_endpoint)
        return self

    def _socket(self, context: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
        socket = context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(socket)
        return socket

    def close(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._own_context is not None:
            self._own_context.term()
            self._own_context = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> int:
        """Send one batch stamped with this publisher's worker id and epoch; return its seq."""
        batch = make_batch(
            events,
            ts=ts,
            data_parallel_rank=self._dp_rank,
            worker_id=self._worker_id,
            epoch=self._epoch,
        )
        return self.publish_batch(batch)

    def publish_batch(self, batch: KVEventBatch) -> int:
        """Send an already built batch as-is; return its seq."""
        pub = self._require(self._pub)
        seq = self._next_seq
        payload = encode_batch(batch)
        dropped = self._drop_remaining > 0
        if dropped:
            self._drop_remaining -= 1
        if not (dropped and self._drop_evicts_replay):
            # buffered before it is sent: a subscriber that sees ``seq`` and asks for replay
            # at once finds it there (it trusts no live number its publisher's replay lacks)
            with self._lock:
                self._buffer.append((seq, payload))
        if not dropped:
            pub.send_multipart((self._topic, _seq_to_bytes(seq), payload))
        self._next_seq += 1
        return seq

    def serve_replay(self, timeout_ms: int = 0) -> int:
        """Answer the replay requests waiting (after up to ``timeout_ms``); return how many.

        Touches only the ROUTER socket and the locked buffer, so it may run on a thread other
        than the one calling ``publish`` (a ZMQ socket must stay on one thread).
        """
        replay = self._replay
        if replay is None or not replay.poll(timeout_ms):
            return 0
        served = 0
        while replay.poll(0):
            served += self._serve_one(replay, replay.recv_multipart())
        return served

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Block until a subscription reaches the XPUB (so the next batch is delivered)."""
        pub = self._require(self._pub)
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if pub.poll(int(remaining * 1000) + 1):
                frame = pub.recv()
                if frame[:1] == b"\x01":
                    return True
        return False

    def _serve_one(self, replay: zmq.Socket[bytes], frames: list[bytes]) -> int:
        """Stream the buffered batches from ``start_seq`` on, then the end marker."""
        if len(frames) != 3 or len(frames[2]) != _SEQ_BYTES:
            return 0  # not a replay request; a ROUTER cannot answer without an identity anyway
        client_id, _, start_seq_bytes = frames
        start_seq = int.from_bytes(start_seq_bytes, "big")
        with self._lock:
            buffered = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        for seq, payload in buffered:
            replay.send_multipart((client_id, b"", _seq_to_bytes(seq), payload))
        replay.send_multipart((client_id, b"", _seq_to_bytes(END_SEQ), b""))
        return 1

    @staticmethod
    def _require(socket: zmq.Socket[bytes] | None) -> zmq.Socket[bytes]:
        if socket is None:
            raise RuntimeError("publisher is not started")
        return socket
