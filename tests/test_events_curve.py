"""CURVE on the event plane, over real sockets on 127.0.0.1: who gets batches and who does not.

An authorised subscriber (the server's public key and a client certificate in the clients
directory) receives live batches and replays; a plain subscriber, one with an unlisted client
key, and a replay DEALER without credentials receive nothing while the publisher keeps serving
the authorised one. A TCP relay between subscriber and publisher shows the bytes on the wire
carry no token ids with CURVE (and do without it: the check can fail).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstrata.events import BlockStored, ReceivedBatch, ZmqEventPublisher, ZmqEventSubscriber
from kvstrata.events.curve import (
    CurveClient,
    CurveKeyError,
    CurveServer,
    create_certificate,
    decode_public_key,
    load_key_pair,
)

TIMEOUT_S = 3.0
REFUSED_WAIT_MS = 600  # a handshake on 127.0.0.1 takes ~1 ms: nothing after this means no
TOKENS = list(range(48_611, 48_611 + 16))


@dataclass(frozen=True)
class Keys:
    server: CurveServer
    client: CurveClient
    intruder: CurveClient


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    clients = tmp_path / "clients"
    clients.mkdir()
    _, server_secret = create_certificate(tmp_path, "server")
    client_public, client_secret = create_certificate(tmp_path, "router")
    client_public.rename(clients / client_public.name)
    _, intruder_secret = create_certificate(tmp_path, "intruder")
    server = CurveServer.from_files(server_secret, clients)
    return Keys(
        server,
        CurveClient.from_file(client_secret, server.public_key),
        CurveClient.from_file(intruder_secret, server.public_key),
    )


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _stored(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, TOKENS, 16, None, "host", None)


def _receive(sub: ZmqEventSubscriber, count: int) -> list[ReceivedBatch]:
    received: list[ReceivedBatch] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(received) < count and time.monotonic() < deadline:
        received.extend(sub.poll(timeout_ms=50).batches)
    assert len(received) == count, [b.seq for b in received]
    return received


@contextmanager
def _serving(publisher: ZmqEventPublisher) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            publisher.serve_replay(timeout_ms=10)

    thread = threading.Thread(target=loop, name="replay-server")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(TIMEOUT_S)


def _publisher(keys: Keys | None) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        epoch=1,
        curve=None if keys is None else keys.server,
    )


def test_authorised_subscriber_gets_live_batches_and_replay(
    keys: Keys, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    with _publisher(keys) as publisher, _serving(publisher):
        assert publisher.curve_public_key == keys.server.public_key_z85
        sub = ZmqEventSubscriber(
            publisher.endpoint, publisher.replay_endpoint, context=ctx, curve=keys.client
        )
        with sub:
            assert publisher.wait_for_subscriber(TIMEOUT_S)
            publisher.publish([_stored(0)])
            publisher.drop_next(2)  # seqs 1 and 2 only reach the replay buffer
            publisher.publish([_stored(1)])
            publisher.publish([_stored(2)])
            publisher.publish([_stored(3)])
            received = _receive(sub, 4)
    assert [b.seq for b in received] == [0, 1, 2, 3]
    assert [b.replayed for b in received] == [False, True, True, False]
    assert sub.stats.resyncs_needed == 0
    assert received[1].batch.events == [_stored(1)]


@pytest.mark.parametrize("who", ["plain", "intruder"])
def test_unauthorised_subscriber_gets_nothing_and_the_publisher_keeps_serving(
    keys: Keys, ctx: zmq.Context[zmq.Socket[bytes]], who: str
) -> None:
    """``plain``: no server key at all; ``intruder``: the server key, an unlisted client key."""
    curve = None if who == "plain" else keys.intruder
    with (
        _publisher(keys) as publisher,
        ZmqEventSubscriber(publisher.endpoint, context=ctx, curve=curve) as outsider,
    ):
        assert not publisher.wait_for_subscriber(REFUSED_WAIT_MS / 1000)
        with ZmqEventSubscriber(publisher.endpoint, context=ctx, curve=keys.client) as member:
            assert publisher.wait_for_subscriber(TIMEOUT_S)
            for block_hash in range(3):
                publisher.publish([_stored(block_hash)])
            assert [b.seq for b in _receive(member, 3)] == [0, 1, 2]
            assert outsider.poll(timeout_ms=REFUSED_WAIT_MS).batches == []
    assert outsider.stats.batches == 0


@pytest.mark.parametrize("who", ["plain", "intruder", "member"])
def test_replay_answers_only_the_authorised(
    keys: Keys, ctx: zmq.Context[zmq.Socket[bytes]], who: str
) -> None:
    with _publisher(keys) as publisher, _serving(publisher):
        publisher.publish([_stored(0)])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if who != "plain":
            (keys.client if who == "member" else keys.intruder).apply(dealer)
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answered = bool(dealer.poll(REFUSED_WAIT_MS if who != "member" else TIMEOUT_S * 1000))
        frames = dealer.recv_multipart() if answered else []
        dealer.close(linger=0)
    if who == "member":
        assert len(frames) == 3 and int.from_bytes(frames[1], "big") == 0
    else:
        assert not answered


class _Relay:
    """A TCP relay that records every byte the publisher sends to the subscriber."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> _Relay:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def _accept(self) -> None:
        inbound, _ = self.listener.accept()
        outbound = socket.create_connection(("127.0.0.1", self.target_port))
        for src, dst, record in ((inbound, outbound, False), (outbound, inbound, True)):
            thread = threading.Thread(target=self._pump, args=(src, dst, record), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    with self._lock:
                        self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()

    def close(self) -> None:
        self.listener.close()

    def bytes_seen(self) -> bytes:
        with self._lock:
            return bytes(self.seen)


@pytest.mark.parametrize("encrypted", [True, False])
def test_wire_carries_no_token_ids_with_curve(
    keys: Keys, ctx: zmq.Context[zmq.Socket[bytes]], encrypted: bool
) -> None:
    token_bytes = msgspec.msgpack.encode(TOKENS)[1:]  # the ids as msgpack writes them in a batch
    with _publisher(keys if encrypted else None) as publisher:
        port = int(publisher.endpoint.rsplit(":", 1)[1])
        relay = _Relay(port).start()
        curve = keys.client if encrypted else None
        try:
            endpoint = f"tcp://127.0.0.1:{relay.port}"
            with ZmqEventSubscriber(endpoint, context=ctx, curve=curve) as sub:
                assert publisher.wait_for_subscriber(TIMEOUT_S)
                publisher.publish([_stored(9)])
                (received,) = _receive(sub, 1)
        finally:
            relay.close()
    event = received.batch.events[0]
    assert isinstance(event, BlockStored) and event.token_ids == TOKENS
    assert (token_bytes in relay.bytes_seen()) is not encrypted


def test_bad_keys_are_refused(tmp_path: Path) -> None:
    public, secret = create_certificate(tmp_path, "only-public")
    with pytest.raises(CurveKeyError, match="no secret key"):
        load_key_pair(public)
    with pytest.raises(CurveKeyError):
        load_key_pair(tmp_path / "missing.key_secret")
    with pytest.raises(CurveKeyError):
        decode_public_key("too short")
    with pytest.raises(CurveKeyError, match="no such directory"):
        CurveServer.from_files(secret, tmp_path / "nope")
