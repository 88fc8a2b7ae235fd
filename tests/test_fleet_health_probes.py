"""A health round probes every worker at once: a worker that hangs delays no other's probe."""

from __future__ import annotations

import threading

import httpx

from kvstrata.engine.model_loader import LoadedModel
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.worker_info import WorkerDump, WorkerInfo


class _MeetingSource:
    """Each probe waits until all of them are in flight (a barrier): sequential probes would
    break it. Then the workers answer as unreachable (none was attached: nothing changes)."""

    def __init__(self, workers: int) -> None:
        self.barrier = threading.Barrier(workers, timeout=10)
        self.met = 0
        self._lock = threading.Lock()

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        self.barrier.wait()
        with self._lock:
            self.met += 1
        raise httpx.ConnectError(f"{base_url} refused")

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        raise AssertionError("nothing is attached in this test")


def test_every_worker_is_probed_at_once(tiny_model: LoadedModel) -> None:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
    source = _MeetingSource(len(urls))
    fleet = Fleet(FleetTokenizer(tiny_model.path), FleetConfig(worker_urls=urls), source=source)
    try:
        fleet.check_health()
    finally:
        fleet.close()
    assert source.met == len(urls) and not source.barrier.broken


class _GarbageSource:
    """A worker whose answer breaks the source's parsing in a way it does not expect (a
    metric of NaN where an int is made, a nested body past the recursion limit)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        self.asked.append(base_url)
        if base_url.endswith(":9000"):
            raise OverflowError("cannot convert float infinity to integer")
        raise httpx.ConnectError(f"{base_url} refused")

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        raise AssertionError("nothing is attached in this test")


def test_one_workers_garbage_does_not_stop_the_health_round(tiny_model: LoadedModel) -> None:
    """Before, an error the probe did not expect (a vLLM server's NaN start time) escaped the
    round: every later round failed the same way, and no worker's health was updated."""
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(2)]
    source = _GarbageSource()
    fleet = Fleet(FleetTokenizer(tiny_model.path), FleetConfig(worker_urls=urls), source=source)
    try:
        fleet.check_health()
        fleet.check_health()
    finally:
        fleet.close()
    assert sorted(source.asked) == sorted(urls * 2)
