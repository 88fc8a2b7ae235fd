"""Shared by the event-plane tests: workers that publish on a real ZMQ publisher and answer
dumps consistently with it (standing in for ``/kv/dump``), and polling helpers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from kvstrata.events import ZmqEventPublisher
from kvstrata.events.schema import BlockStored, KVEvent, KVEventBatch
from kvstrata.fleet.worker_info import WorkerDump, WorkerInfo
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import GlobalIndex

FP = FingerprintDigest(bytes(range(32)))
BS = 4
LIVE_EPOCH = 111


def stored(first_hash: int, seed: int) -> tuple[BlockStored, list[int]]:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(BS)]
    return BlockStored([first_hash], None, tokens, BS, None, "device", None), tokens


class Worker:
    """What the worker holds and its stream position, published and dumped consistently."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.held: list[KVEvent] = []
        self.epoch = LIVE_EPOCH
        self.lock = threading.Lock()

    def store(self, event: BlockStored) -> None:
        with self.lock:
            self.held.append(event)
            self.publisher.publish([event])

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        raise AssertionError("not asked in this test")

    def publish_batch(self, batch: KVEventBatch) -> None:
        """A batch that changes nothing held (a stray epoch), still in step with ``dump``: the
        publisher counts a batch only after sending it, so a dump taken without the lock could
        read a position the subscriber has already passed."""
        with self.lock:
            self.publisher.publish_batch(batch)

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        with self.lock:
            return WorkerDump(self.epoch, self.publisher.next_seq, list(self.held), time.time())


def matched(index: GlobalIndex, lock: threading.Lock, tokens: list[int], worker: str = "w0") -> int:
    with lock:
        match = index.match(index.request_hashes(None, tokens)).get(worker)
    return 0 if match is None else match.blocks


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class ScriptedWorker(Worker):
    """A worker whose n-th dump (counting from 1) is refused (``fail``) or taken at once but
    answered only when ``release`` is set (``stall``): a worker slow or unable to answer
    ``/kv/dump``."""

    def __init__(
        self,
        publisher: ZmqEventPublisher,
        *,
        stall: frozenset[int] = frozenset(),
        fail: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(publisher)
        self.release = threading.Event()
        self.dumps = 0
        self._stall, self._fail = stall, fail

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        snapshot = super().dump(http, info, api_key)
        self.dumps += 1
        if self.dumps in self._fail:
            raise httpx.ConnectError(f"dump {self.dumps} refused (scripted)")
        if self.dumps in self._stall:
            assert self.release.wait(20), "the test never released the dump"
        return snapshot


class Workers:
    """Dumps by worker id (the event plane asks one source for all of them)."""

    def __init__(self, workers: dict[str, Worker]) -> None:
        self.workers = workers

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        raise AssertionError("not asked in this test")

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        return self.workers[info.worker_id].dump(http, info, api_key)


def info_of(
    worker_id: str, publisher: ZmqEventPublisher, lower: ZmqEventPublisher | None = None
) -> WorkerInfo:
    """The worker's ``/kv/info`` as the event plane needs it (``lower``: a connector stream)."""
    return WorkerInfo(
        worker_id,
        "http://127.0.0.1:9",
        LIVE_EPOCH,
        "m",
        FP,
        BS,
        publisher.endpoint,
        publisher.replay_endpoint,
        publisher.next_seq,
        lower_events_endpoint=None if lower is None else lower.endpoint,
        lower_replay_endpoint=None if lower is None else lower.replay_endpoint,
    )


def fresh_index() -> tuple[GlobalIndex, threading.Lock]:
    """An empty index on the wall clock and the lock that owns it (the fleet's, in a router)."""
    return GlobalIndex(FP, BS, clock=time.time), threading.Lock()
