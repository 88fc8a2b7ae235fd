"""The router's event plane against a batch of an epoch it never saw: it asks the worker's
dump which epoch is live instead of retiring the live one (real ZMQ sockets; the dump comes
from a source object standing in for the worker's ``/kv/dump``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
from prometheus_client import generate_latest

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
from kvstrata.fleet import eventplane
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.fleet.metrics import FleetMetrics
from kvstrata.fleet.worker_info import WorkerInfo
from kvstrata.index import GlobalIndex


def test_a_batch_of_an_unseen_epoch_is_checked_against_the_dump_not_taken_as_a_restart() -> None:
    index, lock = fresh_index()
    with ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w0", epoch=LIVE_EPOCH) as publisher:
        worker = Worker(publisher)
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", publisher))
            first, first_tokens = stored(1, seed=1)
            worker.store(first)
            wait_for(lambda: matched(index, lock, first_tokens) == 1, "the live batch applied")
            stray, stray_tokens = stored(9, seed=9)  # another epoch: not what the worker holds
            worker.publish_batch(make_batch([stray], worker_id="w0", epoch=99))
            wait_for(lambda: plane.resyncs.get("epoch") == 1, "the stray epoch made it resync")
            later, later_tokens = stored(2, seed=2)
            worker.store(later)
            wait_for(lambda: matched(index, lock, later_tokens) == 1, "live batches apply again")
            assert matched(index, lock, first_tokens) == 1
            assert matched(index, lock, stray_tokens) == 0
            with lock:
                assert index.epoch("w0") == LIVE_EPOCH and index.is_consistent("w0")
            tape = BlockStored([5], None, first_tokens, BS, None, "tape", None)
            publisher.publish([tape])  # a medium the index does not know: counted, skipped
            metrics = FleetMetrics()
            metrics.export_index(index, plane.stats, lock, plane.resyncs)
            wait_for(lambda: index.stats.unknown_mediums == 1, "the unknown medium counted")
            text = generate_latest(metrics.registry).decode()
            assert 'kvstrata_events_resyncs_total{reason="epoch"} 1.0' in text
            assert "kvstrata_index_unknown_mediums_total 1.0" in text
            assert "kvstrata_index_stale_batches_total" in text
        finally:
            plane.close()


def test_a_worker_slow_to_dump_in_a_resync_delays_no_other_workers_events() -> None:
    index, lock = fresh_index()
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w0", epoch=LIVE_EPOCH) as fast_pub,
        ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w1", epoch=LIVE_EPOCH) as slow_pub,
    ):
        fast, slow = Worker(fast_pub), ScriptedWorker(slow_pub, stall=frozenset({2}))
        plane = EventPlane(
            index, lock, source=Workers({"w0": fast, "w1": slow}), subscribe_settle_s=0.3
        )
        plane.start()
        try:
            for worker_id, publisher in (("w0", fast_pub), ("w1", slow_pub)):
                plane.attach(info_of(worker_id, publisher))
            stray, _ = stored(9, seed=9)
            slow.publish_batch(make_batch([stray], worker_id="w1", epoch=99))
            wait_for(lambda: slow.dumps == 2, "the stray epoch made w1 resync")
            dumping = [t for t in threading.enumerate() if t.name == "kvstrata-dump-w1"]
            assert dumping and all(t.daemon for t in dumping)  # a stalled dump never holds exit
            held, held_tokens = stored(1, seed=1)
            fast.store(held)  # while w1's dump hangs
            wait_for(lambda: matched(index, lock, held_tokens, "w0") == 1, "w0's event applied")
            with lock:
                assert not index.is_consistent("w1")  # matches nothing until its dump is in
            late, late_tokens = stored(2, seed=2)
            slow.store(late)  # after the snapshot: it waits in w1's socket until the dump is in
            slow.release.set()
            wait_for(lambda: matched(index, lock, late_tokens, "w1") == 1, "w1 caught up")
            with lock:
                assert index.is_consistent("w1") and index.epoch("w1") == LIVE_EPOCH
            assert plane.resyncs == {"epoch": 1}
        finally:
            slow.release.set()
            plane.close()


def _restart(worker: Worker, epoch: int, *held: BlockStored) -> None:
    """The worker restarts at the same sockets: a new epoch, only ``held`` in its pool."""
    with worker.lock:
        worker.epoch, worker.held = epoch, list(held)


def _store_at(worker: Worker, epoch: int, event: BlockStored) -> None:
    """Hold and publish ``event`` as the restarted worker's publisher stamps it."""
    with worker.lock:
        worker.held.append(event)
        worker.publisher.publish_batch(make_batch([event], worker_id="w0", epoch=epoch))


@dataclass
class _Running:
    index: GlobalIndex
    lock: threading.Lock
    worker: ScriptedWorker
    plane: EventPlane
    restarted: WorkerInfo
    """The worker's ``/kv/info`` after its restart (same sockets, the next epoch)."""
    before_tokens: list[int]
    """A block of the first epoch, matched."""


@contextmanager
def _attached(
    stall: frozenset[int] = frozenset(), fail: frozenset[int] = frozenset()
) -> Iterator[_Running]:
    """A plane reading one worker that holds one block of its first epoch."""
    index, lock = fresh_index()
    with ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w0", epoch=LIVE_EPOCH) as publisher:
        worker = ScriptedWorker(publisher, stall=stall, fail=fail)
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", publisher))
            before, before_tokens = stored(1, seed=1)
            worker.store(before)
            wait_for(lambda: matched(index, lock, before_tokens) == 1, "the first epoch's block")
            restarted = replace(info_of("w0", publisher), epoch=LIVE_EPOCH + 1)
            yield _Running(index, lock, worker, plane, restarted, before_tokens)
        finally:
            worker.release.set()
            plane.close()


def test_a_restart_at_the_same_sockets_is_reattached_without_a_second_dump() -> None:
    """The health round attaches a restarted worker again. When the plane already reads its
    sockets and its epoch resync brought the new epoch's dump, the stream stays and the worker
    keeps matching: no second dump, no window where it matches nothing."""
    with _attached() as run:
        index, lock, worker = run.index, run.lock, run.worker
        after, after_tokens = stored(2, seed=2)
        _restart(worker, LIVE_EPOCH + 1, after)
        worker.publish_batch(make_batch([after], worker_id="w0", epoch=LIVE_EPOCH + 1))
        wait_for(lambda: matched(index, lock, after_tokens) == 1, "the new epoch's dump")
        assert worker.dumps == 2 and run.plane.resyncs == {"epoch": 1}
        stream = run.plane._streams["w0"]
        run.plane.attach(run.restarted)  # what the health round does on seeing the new epoch
        assert run.plane._streams["w0"] is stream  # kept, not torn down and subscribed again
        assert worker.dumps == 2 and matched(index, lock, after_tokens) == 1
        assert matched(index, lock, run.before_tokens) == 0
        later, later_tokens = stored(3, seed=3)
        _store_at(worker, LIVE_EPOCH + 1, later)
        wait_for(lambda: matched(index, lock, later_tokens) == 1, "the stream still read")


def test_a_restart_seen_first_by_the_health_round_drops_the_old_epoch_and_dumps_once() -> None:
    """No batch of the new epoch has arrived (or it was dropped as a duplicate: a restarted
    publisher counts from 0 again): the old epoch's entries stop counting at once, and one
    dump brings the new epoch's."""
    with _attached(stall=frozenset({2})) as run:
        index, lock, worker = run.index, run.lock, run.worker
        after, after_tokens = stored(2, seed=2)
        _restart(worker, LIVE_EPOCH + 1, after)
        stream = run.plane._streams["w0"]
        with ThreadPoolExecutor(1) as pool:
            attached = pool.submit(run.plane.attach, run.restarted)
            wait_for(lambda: worker.dumps == 2, "the re-attach asked for a dump")
            assert matched(index, lock, run.before_tokens) == 0  # stale at once
            assert not attached.done()  # returns when the dump is in
            worker.release.set()
            attached.result(timeout=10)
        assert matched(index, lock, after_tokens) == 1 and worker.dumps == 2
        assert run.plane._streams["w0"] is stream
        with lock:
            assert index.epoch("w0") == LIVE_EPOCH + 1 and index.is_consistent("w0")
        assert run.plane.resyncs == {}


def test_a_restart_during_a_failed_dumps_backoff_is_attached_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker died: its resync dump failed and the retry waits out a backoff. It comes
    back at the same sockets and the health round attaches it: the dump is asked for now, not
    after the backoff (before, the attach waited on the held-back retry, up to 30 s)."""
    monkeypatch.setattr(eventplane, "_DUMP_RETRY_S", 60.0)
    with _attached(fail=frozenset({2})) as run:
        index, lock, worker = run.index, run.lock, run.worker
        after, after_tokens = stored(2, seed=2)
        _restart(worker, LIVE_EPOCH + 1, after)
        worker.publish_batch(make_batch([after], worker_id="w0", epoch=LIVE_EPOCH + 1))
        wait_for(lambda: run.plane.resyncs.get("dump_failed") == 1, "the resync dump failed")
        run.plane.attach(run.restarted, timeout_s=5.0)
        assert worker.dumps == 3 and matched(index, lock, after_tokens) == 1
        with lock:
            assert index.epoch("w0") == LIVE_EPOCH + 1 and index.is_consistent("w0")
