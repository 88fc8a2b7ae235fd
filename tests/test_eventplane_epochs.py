"""The router's event plane against a batch of an epoch it never saw: it asks the worker's
dump which epoch is live instead of retiring the live one (real ZMQ sockets; the dump comes
from a source object standing in for the worker's ``/kv/dump``)."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client import generate_latest

from kvstrata.events import ZmqEventPublisher
from kvstrata.events.schema import BlockStored, KVEvent, make_batch
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.fleet.metrics import FleetMetrics
from kvstrata.fleet.workers import WorkerDump, WorkerInfo
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import GlobalIndex

FP = FingerprintDigest(bytes(range(32)))
BS = 4
LIVE_EPOCH = 111


def _stored(first_hash: int, seed: int) -> tuple[BlockStored, list[int]]:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(BS)]
    return BlockStored([first_hash], None, tokens, BS, None, "device", None), tokens


class _Worker:
    """What the worker holds and its stream position, published and dumped consistently."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.held: list[KVEvent] = []
        self.lock = threading.Lock()

    def store(self, event: BlockStored) -> None:
        with self.lock:
            self.held.append(event)
            self.publisher.publish([event])

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        raise AssertionError("not asked in this test")

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        with self.lock:
            return WorkerDump(LIVE_EPOCH, self.publisher.next_seq, list(self.held), time.time())


def _matched(
    index: GlobalIndex, lock: threading.Lock, tokens: list[int], worker: str = "w0"
) -> int:
    with lock:
        match = index.match(index.request_hashes(None, tokens)).get(worker)
    return 0 if match is None else match.blocks


def _wait(condition: object, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_batch_of_an_unseen_epoch_is_checked_against_the_dump_not_taken_as_a_restart() -> None:
    index, lock = GlobalIndex(FP, BS, clock=time.time), threading.Lock()
    with ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w0", epoch=LIVE_EPOCH) as publisher:
        worker = _Worker(publisher)
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            info = WorkerInfo(
                "w0", "http://127.0.0.1:9", LIVE_EPOCH, "m", FP, BS, publisher.endpoint, None,
                publisher.next_seq,
            )  # fmt: skip
            plane.attach(info)
            first, first_tokens = _stored(1, seed=1)
            worker.store(first)
            _wait(lambda: _matched(index, lock, first_tokens) == 1, "the live batch applied")
            stray, stray_tokens = _stored(9, seed=9)  # another epoch: not what the worker holds
            publisher.publish_batch(make_batch([stray], worker_id="w0", epoch=99))
            _wait(lambda: plane.resyncs.get("epoch") == 1, "the stray epoch made it resync")
            later, later_tokens = _stored(2, seed=2)
            worker.store(later)
            _wait(lambda: _matched(index, lock, later_tokens) == 1, "live batches apply again")
            assert _matched(index, lock, first_tokens) == 1
            assert _matched(index, lock, stray_tokens) == 0
            with lock:
                assert index.epoch("w0") == LIVE_EPOCH and index.is_consistent("w0")
            tape = BlockStored([5], None, first_tokens, BS, None, "tape", None)
            publisher.publish([tape])  # a medium the index does not know: counted, skipped
            metrics = FleetMetrics()
            metrics.export_index(index, plane.stats, lock, plane.resyncs)
            _wait(lambda: index.stats.unknown_mediums == 1, "the unknown medium counted")
            text = generate_latest(metrics.registry).decode()
            assert 'kvstrata_events_resyncs_total{reason="epoch"} 1.0' in text
            assert "kvstrata_index_unknown_mediums_total 1.0" in text
            assert "kvstrata_index_stale_batches_total" in text
        finally:
            plane.close()


class _StallingWorker(_Worker):
    """A worker whose dumps after the first (the attach's) are taken at once but answered only
    when ``release`` is set: a worker slow to answer ``/kv/dump`` during a resync."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        super().__init__(publisher)
        self.release = threading.Event()
        self.dumps = 0

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        snapshot = super().dump(http, info, api_key)
        self.dumps += 1
        if self.dumps > 1:
            assert self.release.wait(20), "the test never released the dump"
        return snapshot


class _Workers:
    """Dumps by worker id (the event plane asks one source for all of them)."""

    def __init__(self, workers: dict[str, _Worker]) -> None:
        self.workers = workers

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        raise AssertionError("not asked in this test")

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        return self.workers[info.worker_id].dump(http, info, api_key)


def test_a_worker_slow_to_dump_in_a_resync_delays_no_other_workers_events() -> None:
    index, lock = GlobalIndex(FP, BS, clock=time.time), threading.Lock()
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w0", epoch=LIVE_EPOCH) as fast_pub,
        ZmqEventPublisher("tcp://127.0.0.1:*", worker_id="w1", epoch=LIVE_EPOCH) as slow_pub,
    ):
        fast, slow = _Worker(fast_pub), _StallingWorker(slow_pub)
        plane = EventPlane(
            index, lock, source=_Workers({"w0": fast, "w1": slow}), subscribe_settle_s=0.3
        )
        plane.start()
        try:
            for worker_id, publisher in (("w0", fast_pub), ("w1", slow_pub)):
                plane.attach(
                    WorkerInfo(
                        worker_id,
                        "http://127.0.0.1:9",
                        LIVE_EPOCH,
                        "m",
                        FP,
                        BS,
                        publisher.endpoint,
                        None,
                        publisher.next_seq,
                    )
                )
            stray, _ = _stored(9, seed=9)
            slow_pub.publish_batch(make_batch([stray], worker_id="w1", epoch=99))
            _wait(lambda: slow.dumps == 2, "the stray epoch made w1 resync")
            dumping = [t for t in threading.enumerate() if t.name == "kvstrata-dump-w1"]
            assert dumping and all(t.daemon for t in dumping)  # a stalled dump never holds exit
            held, held_tokens = _stored(1, seed=1)
            fast.store(held)  # while w1's dump hangs
            _wait(lambda: _matched(index, lock, held_tokens, "w0") == 1, "w0's event applied")
            with lock:
                assert not index.is_consistent("w1")  # matches nothing until its dump is in
            late, late_tokens = _stored(2, seed=2)
            slow.store(late)  # after the snapshot: it waits in w1's socket until the dump is in
            slow.release.set()
            _wait(lambda: _matched(index, lock, late_tokens, "w1") == 1, "w1 caught up")
            with lock:
                assert index.is_consistent("w1") and index.epoch("w1") == LIVE_EPOCH
            assert plane.resyncs == {"epoch": 1}
        finally:
            slow.release.set()
            plane.close()
