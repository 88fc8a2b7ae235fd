"""The emitter's replay thread (``KVEventEmitter.start_replay``), the one every owner of an
emitter uses — ``kvstrata serve`` and the vLLM connector — over real ZMQ sockets on 127.0.0.1.

A gap in the live stream (batches sent while nobody heard them, or dropped on purpose) is
filled by replay only while the thread runs; ``close`` stops it before the sockets close.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstrata.events import BlockStored, ReceivedBatch, ZmqEventSubscriber
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig

TIMEOUT_S = 3.0


def _emitter() -> KVEventEmitter:
    config = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id="v0")
    return KVEventEmitter.from_config(config, block_size=4).start()


def _stored(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2, 3, 4], 4, None, "host", None)


Received = tuple[list[ReceivedBatch], bool]


def _poll(sub: ZmqEventSubscriber, count: int, timeout_s: float) -> Received:
    received: list[ReceivedBatch] = []
    resync = False
    deadline = time.monotonic() + timeout_s
    while len(received) < count and time.monotonic() < deadline:
        result = sub.poll(timeout_ms=50)
        received.extend(result.batches)
        resync |= result.resync_needed
    return received, resync


def _gap_then_live(emitter: KVEventEmitter, timeout_s: float) -> Received:
    publisher = emitter.publisher
    for block_hash in range(3):
        publisher.publish([_stored(block_hash)])  # nobody listens yet: seq 0..2 are a gap
    assert publisher.replay_endpoint is not None
    sub = ZmqEventSubscriber(
        publisher.endpoint, publisher.replay_endpoint, expected_seq=0, replay_timeout_s=2.0
    ).start()
    try:
        assert publisher.wait_for_subscriber(TIMEOUT_S)
        publisher.publish([_stored(3)])
        return _poll(sub, 4, timeout_s)
    finally:
        sub.close()


def test_replay_thread_fills_a_gap_and_stops_on_close() -> None:
    emitter = _emitter().start_replay()
    assert emitter.serving_replay
    emitter.start_replay()  # idempotent: still one thread
    assert [t.name for t in threading.enumerate()].count("kvstrata-kv-replay") >= 1
    try:
        received, resync = _gap_then_live(emitter, TIMEOUT_S)
    finally:
        emitter.close()
    assert [(b.seq, b.replayed) for b in received] == [(0, True), (1, True), (2, True), (3, False)]
    assert not resync
    assert not emitter.serving_replay


def test_without_the_thread_a_gap_needs_a_resync() -> None:
    emitter = _emitter()
    try:
        received, resync = _gap_then_live(emitter, 1.5)
    finally:
        emitter.close()
    assert resync, "nobody answered the replay request: the subscriber must ask for a resync"
    assert all(not b.replayed for b in received)


def test_replay_thread_needs_a_started_emitter() -> None:
    config = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id="v0")
    emitter = KVEventEmitter.from_config(config, block_size=4)
    with pytest.raises(RuntimeError, match="start"):
        emitter.start_replay()
    emitter.close()
