"""The ZMQ event plane over real sockets on 127.0.0.1: delivery, bad input, gaps and replay.

Synchronisation is by polling with timeouts: the publisher's XPUB reports when a subscription
has landed, and the subscriber is polled until the expected batches arrive or a deadline passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from kvstrata.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PollResult,
    ReceivedBatch,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    encode_batch,
    make_batch,
)

TIMEOUT_S = 3.0
TOPIC = "kv"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=[False, True], ids=["replay-in-poll", "replay-in-background"])
def background(request: pytest.FixtureRequest) -> bool:
    """The gap tests run both ways a subscriber waits for its replay (``background_replay``)."""
    return bool(request.param)


def _seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _stored(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2, 3, 4], 4, None, "GPU", None)


def _receive(
    sub: ZmqEventSubscriber, count: int, *, resync: list[bool] | None = None
) -> list[ReceivedBatch]:
    """Poll until ``count`` batches arrived; fail at the deadline instead of hanging."""
    received: list[ReceivedBatch] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(received) < count and time.monotonic() < deadline:
        result = sub.poll(timeout_ms=50)
        received.extend(result.batches)
        if resync is not None and result.resync_needed:
            resync.append(True)
    assert len(received) == count, f"got {[batch.seq for batch in received]}"
    return received


def _wait_subscribed(xpub: zmq.Socket[bytes]) -> None:
    assert xpub.poll(int(TIMEOUT_S * 1000)), "no subscription reached the publisher"
    assert xpub.recv()[:1] == b"\x01"


@contextmanager
def _serving(publisher: ZmqEventPublisher) -> Iterator[None]:
    """Answer replay requests on a thread of the test's own, as an engine's loop would."""
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


@contextmanager
def _replaying_pair(
    ctx: zmq.Context[zmq.Socket[bytes]],
    publish_first: int = 0,
    *,
    background: bool = False,
    **publisher_options: int,
) -> Iterator[tuple[ZmqEventPublisher, ZmqEventSubscriber]]:
    """A publisher with a replay socket (served on a thread), ``publish_first`` batches sent
    before anyone listens, then a subscriber whose subscription has landed."""
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC, context=ctx, **publisher_options
    ) as publisher:
        for block_hash in range(publish_first):
            publisher.publish([_stored(block_hash)], ts=float(block_hash))  # nobody listening
        assert publisher.replay_endpoint is not None
        with (
            ZmqEventSubscriber(
                publisher.endpoint,
                publisher.replay_endpoint,
                topic=TOPIC,
                context=ctx,
                background_replay=background,
            ) as sub,
            _serving(publisher),
        ):
            assert publisher.wait_for_subscriber(TIMEOUT_S)
            yield publisher, sub


@contextmanager
def _scripted_replay(
    ctx: zmq.Context[zmq.Socket[bytes]], seqs: tuple[int, ...], background: bool
) -> Iterator[tuple[zmq.Socket[bytes], ZmqEventSubscriber]]:
    """A hand-built publisher: an XPUB the test sends on, and a replay ROUTER answering every
    request with batches ``seqs`` (one stored block each) and the end marker; a subscriber of
    both, its subscription landed."""
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if router.poll(10):
                client = router.recv_multipart()[0]
                for seq in seqs:
                    payload = encode_batch(make_batch([_stored(seq)], ts=float(seq)))
                    router.send_multipart([client, b"", _seq(seq), payload])
                router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    thread = threading.Thread(target=answer, name="scripted-replay")
    thread.start()
    try:
        with ZmqEventSubscriber(
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{replay_port}",
            context=ctx,
            background_replay=background,
        ) as sub:
            _wait_subscribed(xpub)
            yield xpub, sub
    finally:
        stop.set()
        thread.join(TIMEOUT_S)
        for socket in (xpub, router):
            socket.close(linger=0)


def test_malformed_messages_are_counted_and_skipped(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    topic = TOPIC.encode()
    good = encode_batch(make_batch([_stored(1)], ts=1.0))
    unknown = msgspec.msgpack.encode([1.0, [{"type": "Teleported"}, {"type": "AllBlocksCleared"}]])
    wrong_types = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": "x", "medium": 3}]]
    )
    with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", topic=TOPIC, context=ctx) as sub:
        _wait_subscribed(xpub)
        xpub.send_multipart([topic, _seq(0), good])
        xpub.send_multipart([topic, _seq(1), b"\xc1 garbage"])
        xpub.send_multipart([topic, b"\x00\x02", good])  # 2-byte seq
        xpub.send_multipart([topic, _seq(2)])  # truncated: no payload frame
        xpub.send_multipart([topic, _seq(2), msgspec.msgpack.encode(["wrong", "tag"])])
        xpub.send_multipart([topic, _seq(3), unknown])
        xpub.send_multipart([topic, _seq(4), wrong_types])
        xpub.send_multipart([topic, _seq(5), good])
        received = _receive(sub, 4)
    xpub.close(linger=0)
    assert [batch.seq for batch in received] == [0, 3, 4, 5]
    assert received[1].batch.events == [AllBlocksCleared()]
    assert received[2].batch.events == []
    assert received[3].batch.events == [_stored(1)]
    stats = sub.stats
    assert (stats.malformed_messages, stats.unknown_events, stats.malformed_events) == (4, 1, 1)
    # seq 1 (garbage), seq 2 (wrong tag) and seq 4 (a removal that does not decode) may have
    # carried removals: each flags a resync; the unknown event type (seq 3) and the broken
    # frames (no seq number to account for) do not
    assert (stats.gaps, stats.resyncs_needed, stats.batches) == (0, 3, 4)


def test_publisher_round_trips_every_event(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    events: list[KVEvent] = [
        _stored(7),
        BlockRemoved([7], "GPU", namespace="t1"),
        AllBlocksCleared(),
    ]
    with (
        ZmqEventPublisher(
            "tcp://127.0.0.1:*", topic=TOPIC, worker_id="w0", epoch=3, context=ctx
        ) as publisher,
        ZmqEventSubscriber(publisher.endpoint, topic=TOPIC, context=ctx) as sub,
    ):
        assert publisher.wait_for_subscriber(TIMEOUT_S)
        assert publisher.publish(events, ts=5.0) == 0
        (received,) = _receive(sub, 1)
    assert received.batch == make_batch(events, ts=5.0, worker_id="w0", epoch=3)
    assert not received.replayed


def test_late_subscriber_fills_gap_by_replay(
    ctx: zmq.Context[zmq.Socket[bytes]], background: bool
) -> None:
    with _replaying_pair(ctx, publish_first=3, background=background) as (publisher, sub):
        publisher.publish([_stored(3)], ts=3.0)
        resync: list[bool] = []
        received = _receive(sub, 4, resync=resync)
    assert [(batch.seq, batch.replayed) for batch in received] == [
        (0, True),
        (1, True),
        (2, True),
        (3, False),
    ]
    assert [batch.batch.events for batch in received] == [[_stored(n)] for n in range(4)]
    assert resync == []
    stats = sub.stats
    assert (stats.gaps, stats.missed_batches, stats.replay_requests) == (1, 3, 1)
    assert (stats.replayed_batches, stats.resyncs_needed, stats.duplicates) == (3, 0, 0)


def test_gap_older_than_buffer_needs_resync(
    ctx: zmq.Context[zmq.Socket[bytes]], background: bool
) -> None:
    # seq 0..4 before anyone listens; seq 5 will evict all but 4
    with _replaying_pair(ctx, 5, background=background, buffer_steps=2) as (publisher, sub):
        publisher.publish([_stored(5)])
        resync: list[bool] = []
        received = _receive(sub, 2, resync=resync)
    assert [(batch.seq, batch.replayed) for batch in received] == [(4, True), (5, False)]
    assert resync == [True]
    assert sub.stats.resyncs_needed == 1 and sub.expected_seq == 6


def test_a_live_number_its_publisher_never_sent_is_not_trusted(
    ctx: zmq.Context[zmq.Socket[bytes]], background: bool
) -> None:
    """A frame on the publisher's socket numbered far ahead (forged, or a corrupt sequence
    frame): the replay shows the publisher never sent it, so it is dropped and the stream goes
    on. Before, the subscriber jumped to it and dropped every real batch after it as a
    duplicate until a resync."""
    with _replaying_pair(ctx, background=background) as (publisher, sub):
        for block_hash in range(2):
            publisher.publish([_stored(block_hash)])
        assert [batch.seq for batch in _receive(sub, 2)] == [0, 1]
        forged = encode_batch(make_batch([AllBlocksCleared()], ts=0.0))
        assert publisher._pub is not None  # the publisher's own socket: a real frame on it
        publisher._pub.send_multipart([TOPIC.encode(), _seq(2**40), forged])
        for block_hash in range(2, 4):
            publisher.publish([_stored(block_hash)])
        resync: list[bool] = []
        received = _receive(sub, 2, resync=resync)
    assert [(batch.seq, batch.batch.events) for batch in received] == [
        (2, [_stored(2)]),
        (3, [_stored(3)]),
    ]
    assert resync == [] and sub.expected_seq == 4
    stats = sub.stats
    assert (stats.untrusted_batches, stats.gaps, stats.resyncs_needed) == (1, 0, 0)


def test_a_publisher_without_a_replay_buffer_is_trusted_on_its_next_frame(
    ctx: zmq.Context[zmq.Socket[bytes]], background: bool
) -> None:
    """A replay socket over an empty buffer (vLLM accepts a zero ``buffer_steps``) answers
    nothing for any gap: the first frame past the gap looks untrusted and is dropped, its
    successor is trusted (a resync is flagged, as for any gap replay cannot cover) and the
    stream goes on, instead of every frame after the gap being dropped for good."""
    with _scripted_replay(ctx, (), background) as (xpub, sub):
        for seq in (3, 4, 5):  # 0..2 were sent before anyone listened
            payload = encode_batch(make_batch([_stored(seq)], ts=float(seq)))
            xpub.send_multipart([b"", _seq(seq), payload])
        resync: list[bool] = []
        received = _receive(sub, 2, resync=resync)
    assert [(batch.seq, batch.batch.events) for batch in received] == [
        (4, [_stored(4)]),
        (5, [_stored(5)]),
    ]
    assert resync == [True] and sub.expected_seq == 6
    stats = sub.stats
    assert (stats.untrusted_batches, stats.resyncs_needed, stats.replay_requests) == (1, 1, 1)


def test_gap_without_replay_socket_needs_resync(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch(make_batch([AllBlocksCleared()], ts=0.0))
    with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", context=ctx) as sub:
        _wait_subscribed(xpub)
        for seq in (0, 2, 3):  # seq 1 dropped on the publisher side
            xpub.send_multipart([b"", _seq(seq), payload])
        resync: list[bool] = []
        received = _receive(sub, 3, resync=resync)
    xpub.close(linger=0)
    assert [batch.seq for batch in received] == [0, 2, 3]
    assert resync == [True]
    assert (sub.stats.gaps, sub.stats.missed_batches, sub.stats.replay_requests) == (1, 1, 0)


@pytest.mark.parametrize("history", [False, True], ids=["live", "history"])
def test_unanswered_replay_times_out_into_resync_except_in_history_mode(
    ctx: zmq.Context[zmq.Socket[bytes]], background: bool, history: bool
) -> None:
    """A replay that does not answer in time is a resync; in history mode the state was just
    emptied, so it loses only history: a resync would rewind to 0 and ask again, in a loop."""
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    mute_router = ctx.socket(zmq.ROUTER)
    replay_port = mute_router.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch(make_batch([], ts=0.0))
    with ZmqEventSubscriber(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{replay_port}",
        replay_timeout_s=0.2,
        context=ctx,
        background_replay=background,
    ) as sub:
        _wait_subscribed(xpub)
        if history:
            sub.resume_from(0, history=True)
        xpub.send_multipart([b"", _seq(4), payload])
        resync: list[bool] = []
        received = _receive(sub, 1, resync=resync)
    for socket in (xpub, mute_router):
        socket.close(linger=0)
    assert received[0].seq == 4 and resync == ([] if history else [True])
    assert sub.stats.replay_requests == 1
    assert sub.stats.history_truncated == (1 if history else 0)


def test_a_background_replay_never_holds_poll_past_its_own_timeout(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A mute replay socket: the waiting path would hold ``poll`` for the whole replay timeout;
    in the background each ``poll`` returns within its own timeout until the replay times out
    into a resync."""
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    mute_router = ctx.socket(zmq.ROUTER)
    replay_port = mute_router.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch(make_batch([], ts=0.0))
    replay_timeout_s = 2.0
    with ZmqEventSubscriber(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{replay_port}",
        replay_timeout_s=replay_timeout_s,
        context=ctx,
        background_replay=True,
    ) as sub:
        _wait_subscribed(xpub)
        xpub.send_multipart([b"", _seq(4), payload])
        started = time.monotonic()
        longest, result = 0.0, PollResult()
        while not result.batches and time.monotonic() - started < 3 * replay_timeout_s:
            before = time.monotonic()
            result = sub.poll(timeout_ms=50)
            longest = max(longest, time.monotonic() - before)
        waited = time.monotonic() - started
    for socket in (xpub, mute_router):
        socket.close(linger=0)
    assert [batch.seq for batch in result.batches] == [4] and result.resync_needed
    assert longest < replay_timeout_s / 2  # no poll waited out the replay
    assert waited >= replay_timeout_s * 0.9 and sub.stats.replay_requests == 1


def test_replay_socket_ignores_bad_requests(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4, context=ctx
    ) as publisher:
        for _ in range(2):
            publisher.publish([AllBlocksCleared()])
        assert publisher.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", b"\x01"])  # seq not 8 bytes
        assert publisher.serve_replay(timeout_ms=int(TIMEOUT_S * 1000)) == 0
        dealer.send_multipart([b"", _seq(1)])
        assert publisher.serve_replay(timeout_ms=int(TIMEOUT_S * 1000)) == 1
        frames = [dealer.recv_multipart() for _ in range(2)]
        dealer.close(linger=0)
    assert [frame[1] for frame in frames] == [_seq(1), (-1).to_bytes(8, "big", signed=True)]
    assert frames[1][2] == b""


def test_binding_subscriber_accepts_connecting_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """vLLM connects to a ``tcp://host:port`` endpoint, so the consumer must bind.

    A connecting publisher gets no subscription notice to wait on, so the test re-sends seq 0
    until it lands; the subscriber counts the extra copies as duplicates.
    """
    payload = encode_batch(make_batch([], ts=0.0))
    with ZmqEventSubscriber("tcp://127.0.0.1:*", bind=True, context=ctx) as sub:
        pub = ctx.socket(zmq.PUB)
        pub.connect(sub.endpoint)
        received: list[ReceivedBatch] = []
        deadline = time.monotonic() + TIMEOUT_S
        while not received and time.monotonic() < deadline:
            pub.send_multipart([b"", _seq(0), payload])
            received = sub.poll(timeout_ms=20).batches
        pub.send_multipart([b"", _seq(1), payload])
        received += _receive(sub, 1)
        pub.close(linger=0)
    assert [batch.seq for batch in received] == [0, 1]


def test_a_replay_longer_than_zmqs_default_queue_arrives_whole(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A ROUTER drops what its peer's queue (1,000 messages by default) cannot take: a replay
    of 3,000 batches lost a middle run and ended in a resync (review finding, stop 35)."""
    stored = BlockStored(list(range(256)), None, list(range(4096)), 16, None, "GPU", None)
    with _replaying_pair(ctx, 0, buffer_steps=3010) as (publisher, _sub):
        for _ in range(3000):
            publisher.publish([stored])
        assert publisher.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)  # as the subscriber's: only the sender may drop
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", _seq(0)])
        time.sleep(1.0)  # the publisher sends the whole replay while nobody reads it
        seqs: list[int] = []
        while dealer.poll(int(TIMEOUT_S * 1000)):
            seq = int.from_bytes(dealer.recv_multipart()[1], "big", signed=True)
            if seq < 0:
                break
            seqs.append(seq)
        dealer.close(linger=0)
    assert seqs == list(range(3000))


def test_a_hole_inside_a_replay_is_a_resync_even_in_history_mode(
    ctx: zmq.Context[zmq.Socket[bytes]], background: bool
) -> None:
    """A replay buffer evicts its oldest batches first, so a hole *before* the first batch a
    replay returns is an eviction (history mode: counted, no resync); a hole after it is a
    lost reply. In history mode that was counted as truncation and the index kept the blocks
    the lost batches had removed."""
    with _scripted_replay(ctx, (1, 3, 4, 5), background) as (xpub, sub):  # 0 evicted, 2 lost
        sub.resume_from(0, history=True)
        payload = encode_batch(make_batch([_stored(5)], ts=5.0))
        xpub.send_multipart([b"", _seq(5), payload])
        resync: list[bool] = []
        received = _receive(sub, 4, resync=resync)
    assert [batch.seq for batch in received] == [1, 3, 4, 5]
    assert resync == [True] and sub.stats.resyncs_needed == 1


def test_history_without_a_replay_socket_resumes_at_the_next_frame(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A vLLM worker given without a replay endpoint: its dump is empty and resumes at 0 in
    history mode, so the next live frame (numbered past 0) is history nobody can send. That
    is lost history, not a resync: a resync would rewind to 0 and meet the same gap again,
    so every batch was applied and then wiped by the next dump. A gap after the first frame
    is still a resync."""
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch(make_batch([_stored(1)], ts=0.0))
    with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", context=ctx) as sub:
        _wait_subscribed(xpub)
        sub.resume_from(0, history=True)
        for seq in (7, 8):
            xpub.send_multipart([b"", _seq(seq), payload])
        resync: list[bool] = []
        assert [b.seq for b in _receive(sub, 2, resync=resync)] == [7, 8]
        assert resync == [] and sub.stats.history_truncated == 1
        xpub.send_multipart([b"", _seq(10), payload])  # 9 lost after history ended
        assert [b.seq for b in _receive(sub, 1, resync=resync)] == [10]
        assert resync == [True]
        sub.resume_from(0, history=True)  # the resync's (empty) dump
        xpub.send_multipart([b"", _seq(11), payload])
        assert [b.seq for b in _receive(sub, 1, resync=resync)] == [11]
    xpub.close(linger=0)
    assert resync == [True] and sub.stats.history_truncated == 2


def test_a_malformed_batch_replayed_while_rebuilding_history_is_not_a_resync(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A malformed live batch flags a resync; the rebuild that follows (history mode) replays
    the same batch, and flagging it again would loop for as long as the buffer holds it."""
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC, context=ctx
    ) as publisher:
        assert publisher.replay_endpoint is not None
        with (
            ZmqEventSubscriber(
                publisher.endpoint, publisher.replay_endpoint, topic=TOPIC, context=ctx
            ) as sub,
            _serving(publisher),
        ):
            assert publisher.wait_for_subscriber(TIMEOUT_S)
            publisher.publish([_stored(0)], ts=0.0)
            bad = BlockRemoved(["not-a-hash"], "GPU")  # type: ignore[list-item]
            publisher.publish([bad], ts=1.0)
            resync: list[bool] = []
            _receive(sub, 2, resync=resync)
            assert resync == [True]
            sub.resume_from(0, history=True)  # vLLM's empty dump
            publisher.publish([_stored(2)], ts=2.0)
            rebuilt = _receive(sub, 3, resync=resync)
    assert [b.seq for b in rebuilt] == [0, 1, 2]
    assert resync == [True] and sub.stats.malformed_events == 2


def test_a_newer_producers_fields_and_a_malformed_store_are_not_a_resync(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A store with a field appended by a newer producer decodes; a malformed store leaves a
    block unknown (a miss). Neither may flag a resync: flagged on every batch, each resync
    emptied the worker's entries (a review measured 20 resyncs for 20 batches)."""
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    known = ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", None]
    newer = [*known, None, None, None, None, None, "a field of a newer producer"]
    broken = {"type": "BlockStored", "block_hashes": [2]}
    payload = msgspec.msgpack.encode([1.0, [newer, broken]])
    with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", context=ctx) as sub:
        _wait_subscribed(xpub)
        for seq in range(5):
            xpub.send_multipart([b"", _seq(seq), payload])
        resync: list[bool] = []
        received = _receive(sub, 5, resync=resync)
    xpub.close(linger=0)
    assert resync == [] and sub.stats.malformed_events == 5
    assert all(len(batch.batch.events) == 1 for batch in received)
