"""The event plane's dumps off its loop: an attach whose worker is slow to dump holds up no
other worker's events, an attach whose dump fails raises and leaves nothing behind, a failed
resync dump is retried until the worker is consistent again, and a vLLM worker's connector
stream is replayed from its start after a resync replaced every medium's entries (real ZMQ
publishers and replay sockets; dumps come from source objects standing in for ``/kv/dump``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from eventplane_helpers import (
    BS,
    LIVE_EPOCH,
    ScriptedWorker,
    Worker,
    Workers,
    fresh_index,
    info_of,
    matched,
    stored,
    wait_for,
)
from kvstrata.events import ZmqEventPublisher
from kvstrata.events.schema import BlockStored, make_batch
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.fleet.worker_info import WorkerDump, WorkerInfo, WorkerProtocolError
from kvstrata.index import GlobalIndex


def _publisher(worker_id: str, *, replay: bool = False) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*" if replay else None,
        worker_id=worker_id,
        epoch=LIVE_EPOCH,
    )


def test_an_attach_slow_to_dump_delays_no_other_workers_events() -> None:
    index, lock = fresh_index()
    with _publisher("w0") as fast_pub, _publisher("w1") as slow_pub:
        fast, slow = Worker(fast_pub), ScriptedWorker(slow_pub, stall=frozenset({1}))
        plane = EventPlane(
            index, lock, source=Workers({"w0": fast, "w1": slow}), subscribe_settle_s=0.3
        )
        plane.start()
        try:
            plane.attach(info_of("w0", fast_pub))
            with ThreadPoolExecutor(1) as pool:
                attaching = pool.submit(plane.attach, info_of("w1", slow_pub))
                wait_for(lambda: slow.dumps == 1, "w1's attach asked for its dump")
                held, held_tokens = stored(1, seed=1)
                fast.store(held)  # while w1's attach hangs on its dump
                wait_for(lambda: matched(index, lock, held_tokens, "w0") == 1, "w0 applied")
                assert not attaching.done()  # attach returns only once the dump is in
                late, late_tokens = stored(2, seed=2)
                slow.store(late)  # after w1's snapshot: waits in its socket
                slow.release.set()
                attaching.result(timeout=10)
            wait_for(lambda: matched(index, lock, late_tokens, "w1") == 1, "w1 caught up")
            with lock:
                assert index.is_consistent("w1")
        finally:
            slow.release.set()
            plane.close()


def test_an_attach_whose_dump_fails_raises_and_leaves_no_stream() -> None:
    index, lock = fresh_index()
    with _publisher("w0") as publisher:
        worker = ScriptedWorker(publisher, fail=frozenset({1}))
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            with pytest.raises(httpx.ConnectError, match="refused"):
                plane.attach(info_of("w0", publisher))
            assert plane.attached() == []
            plane.attach(info_of("w0", publisher))  # the worker answers now
            assert plane.attached() == ["w0"]
            block, tokens = stored(1, seed=1)
            worker.store(block)
            wait_for(lambda: matched(index, lock, tokens) == 1, "events flow after the retry")
        finally:
            plane.close()


def test_a_failed_resync_dump_is_retried_until_the_worker_is_consistent() -> None:
    index, lock = fresh_index()
    with _publisher("w0") as publisher:
        worker = ScriptedWorker(publisher, fail=frozenset({2, 3}))
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", publisher))
            first, first_tokens = stored(1, seed=1)
            worker.store(first)
            wait_for(lambda: matched(index, lock, first_tokens) == 1, "the live batch applied")
            stray, _ = stored(9, seed=9)
            worker.publish_batch(make_batch([stray], worker_id="w0", epoch=99))
            wait_for(lambda: plane.resyncs.get("dump_failed") == 1, "the resync's dump failed")
            with lock:
                assert not index.is_consistent("w0")  # matches nothing meanwhile
            assert matched(index, lock, first_tokens) == 0
            # retried after 0.5 s, then 1 s: the third resync dump answers
            wait_for(lambda: worker.dumps == 4, "the dump was retried")
            wait_for(lambda: matched(index, lock, first_tokens) == 1, "consistent again")
            assert plane.resyncs == {"epoch": 1, "dump_failed": 2}
            later, later_tokens = stored(2, seed=2)
            worker.store(later)
            wait_for(lambda: matched(index, lock, later_tokens) == 1, "live batches apply")
        finally:
            plane.close()


def _consistent(index: GlobalIndex, lock: threading.Lock, worker_id: str) -> bool:
    with lock:
        return index.is_consistent(worker_id)


def _serve_replay(publisher: ZmqEventPublisher, stop: threading.Event) -> None:
    while not stop.is_set():
        publisher.serve_replay(timeout_ms=20)


def test_a_resync_replays_the_connector_stream_it_wiped() -> None:
    """vLLM: device blocks come on the main stream (whose dump is empty at seq 0, the replay
    brings the history), host blocks on the connector's. A main-stream resync replaces every
    medium's entries, so the connector's history must be replayed again."""
    index, lock = fresh_index()
    stop = threading.Event()
    with _publisher("w0") as main_pub, _publisher("w0-lower", replay=True) as lower_pub:
        worker = Worker(main_pub)
        replay = threading.Thread(target=_serve_replay, args=(lower_pub, stop), daemon=True)
        replay.start()
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", main_pub, lower=lower_pub))
            _, saved_tokens = stored(1, seed=1)
            lower_pub.publish([BlockStored([1], None, saved_tokens, BS, None, "host", None)])
            wait_for(lambda: matched(index, lock, saved_tokens) == 1, "the host block applied")
            stray, _ = stored(9, seed=9)
            worker.publish_batch(make_batch([stray], worker_id="w0", epoch=99))
            wait_for(lambda: plane.resyncs.get("epoch") == 1, "the main stream resynced")
            wait_for(lambda: _consistent(index, lock, "w0"), "the dump is in")
            assert matched(index, lock, saved_tokens) == 0  # the dump replaced every medium
            _, next_tokens = stored(2, seed=2)
            lower_pub.publish([BlockStored([2], None, next_tokens, BS, None, "host", None)])
            wait_for(lambda: matched(index, lock, next_tokens) == 1, "the next host block")
            assert matched(index, lock, saved_tokens) == 1  # replayed, not lost
            assert "lower_lost" not in plane.resyncs
        finally:
            stop.set()
            plane.close()
            replay.join(timeout=5)


class _HistoryWorker(Worker):
    """A vLLM-like worker: no snapshot, its replay history from seq 0 is the state."""

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        return WorkerDump(LIVE_EPOCH, 0, [], time.time(), history_by_replay=True)


def test_a_history_rebuild_past_the_replay_buffer_keeps_what_it_holds_without_resyncing() -> None:
    """A worker without a snapshot whose buffer has evicted seq 0: the rebuild takes what the
    buffer holds (counted as truncated). Flagging a resync instead would fetch the same empty
    dump, rewind to 0, find the same buffer, and never become consistent."""
    index, lock = fresh_index()
    stop = threading.Event()
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4, worker_id="w0", epoch=LIVE_EPOCH
    )
    with publisher:
        worker = _HistoryWorker(publisher)
        chains = [stored(i, seed=i) for i in range(1, 11)]
        for event, _ in chains[:9]:
            worker.store(event)  # seqs 0–8
        replay = threading.Thread(target=_serve_replay, args=(publisher, stop), daemon=True)
        replay.start()
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", publisher))
            worker.store(chains[9][0])  # seq 9: the buffer now holds 6–9, the gap from 0 asks
            wait_for(lambda: matched(index, lock, chains[9][1]) == 1, "the live batch applied")
            held = [matched(index, lock, tokens) for _, tokens in chains]
            assert held == [0] * 6 + [1] * 4  # evicted history unknown, the rest known
            assert _consistent(index, lock, "w0")
            assert plane.stats.history_truncated == 1 and plane.stats.resyncs_needed == 0
            assert plane.resyncs == {}
        finally:
            stop.set()
            plane.close()
            replay.join(timeout=5)


def test_a_detach_fails_an_attach_still_waiting_for_its_dump() -> None:
    index, lock = fresh_index()
    with _publisher("w0") as publisher:
        worker = ScriptedWorker(publisher, stall=frozenset({1}))
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            with ThreadPoolExecutor(1) as pool:
                attaching = pool.submit(plane.attach, info_of("w0", publisher))
                wait_for(lambda: worker.dumps == 1, "the attach asked for its dump")
                plane.detach("w0")
                with pytest.raises(WorkerProtocolError, match="detached before its dump"):
                    attaching.result(timeout=10)
            assert plane.attached() == []
            worker.release.set()  # the stale dump answers: applied nowhere
            time.sleep(0.2)
            assert plane.attached() == [] and _consistent(index, lock, "w0") is False
        finally:
            worker.release.set()
            plane.close()


def test_a_replay_slow_to_answer_delays_no_other_workers_events() -> None:
    """w1 loses a live batch; its replay socket is not served until w0's event is in. A replay
    waited for on the loop thread would hold w0's event for the whole replay timeout."""
    index, lock = fresh_index()
    stop = threading.Event()
    with _publisher("w0") as fast_pub, _publisher("w1", replay=True) as slow_pub:
        fast, slow = Worker(fast_pub), Worker(slow_pub)
        plane = EventPlane(
            index,
            lock,
            source=Workers({"w0": fast, "w1": slow}),
            subscribe_settle_s=0.3,
            replay_timeout_s=30.0,
        )
        plane.start()
        replay = threading.Thread(target=_serve_replay, args=(slow_pub, stop), daemon=True)
        try:
            plane.attach(info_of("w0", fast_pub))
            plane.attach(info_of("w1", slow_pub))
            (lost, lost_tokens), (after, after_tokens) = stored(1, seed=1), stored(2, seed=2)
            slow_pub.drop_next(1)  # buffered for replay, never sent live
            slow.store(lost)
            slow.store(after)  # a gap: w1's subscriber asks for a replay nobody serves yet
            wait_for(lambda: plane.stats.replay_requests == 1, "w1 asked for the replay")
            held, held_tokens = stored(3, seed=3)
            fast.store(held)
            wait_for(lambda: matched(index, lock, held_tokens, "w0") == 1, "w0's event applied")
            assert matched(index, lock, after_tokens, "w1") == 0  # w1 waits, in order
            replay.start()  # now the replay is answered
            wait_for(lambda: matched(index, lock, after_tokens, "w1") == 1, "w1 caught up")
            assert matched(index, lock, lost_tokens, "w1") == 1  # filled by the replay
            assert plane.stats.replayed_batches == 1 and plane.resyncs == {}
            assert _consistent(index, lock, "w1")
        finally:
            stop.set()
            plane.close()
            if replay.is_alive():
                replay.join(timeout=5)
