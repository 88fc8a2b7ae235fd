"""The fleet's routing state under concurrent requests, without worker processes.

Four fake workers answer ``/kv/info`` through an in-process transport (approximate mode: no
event streams), so many threads can call :meth:`Fleet.reserve` at once. Reserving is one
critical section (the loads, the decision and the in-flight count together), so a burst of
equal cold requests must spread exactly evenly; meanwhile other threads learn prefill times,
finish requests and read worker views, as the front door's event loop does. The same with
real ``kvstrata serve`` processes is ``test_fleet.py::test_concurrent_burst_spreads_over_workers``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import httpx
import pytest

from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer, Reservation
from kvstrata.fleet.worker_info import WorkerProtocolError
from kvstrata.fleet.workers import default_profile
from kvstrata.identity import secret_digest
from kvstrata.index.core import ConsistencyMode

pytestmark = pytest.mark.timeout(60)

WORKERS = 4
REQUESTS = 64
BLOCK_SIZE = 16


def _info(request: httpx.Request) -> httpx.Response:
    worker = request.url.host
    return httpx.Response(
        200,
        json={
            "worker_id": worker,
            "epoch": 1,
            "model": "fake",
            "fingerprint": "ab" * 32,
            "block_size": BLOCK_SIZE,
            "events_endpoint": f"tcp://{worker}:1",
            "secret_digest": secret_digest(b""),
        },
    )


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    urls = [f"http://w{i}" for i in range(WORKERS)]
    config = FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=urls)
    http = httpx.Client(transport=httpx.MockTransport(_info))
    fleet = Fleet(cast(FleetTokenizer, object()), config, http=http)
    try:
        for url in urls:
            fleet.attach(url)
        yield fleet
    finally:
        fleet.close()


def _cold_prompt(i: int) -> list[int]:
    """Distinct from the first token on: no two requests share a block."""
    return [1000 + i, *range(i * 97 % 500, i * 97 % 500 + 3 * BLOCK_SIZE)]


def test_concurrent_reservations_spread_evenly(fleet: Fleet) -> None:
    start = threading.Barrier(REQUESTS + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reserve(i: int) -> Reservation:
        start.wait(timeout=10)
        return fleet.reserve(f"r{i}", "tenant", _cold_prompt(i), 8)

    def meddle() -> None:
        """What the event loop does meanwhile: learn prefill times, read views, check health.

        The times learned are the prior's own (the refit equals it), so the placement stays
        a question of queues alone.
        """
        probe = fleet.reserve("probe", "tenant", _cold_prompt(10_000), 8)
        fleet.finish(probe, probe.started + 0.1, 8, 0.05)
        prior = default_profile(BLOCK_SIZE).prefill
        start.wait(timeout=10)
        try:
            while not stop.is_set():
                for n in range(8):
                    new_tokens = probe.prompt_tokens - n
                    fleet.observe_prefill(probe, n, prior.seconds(new_tokens, n))
                assert len(fleet.worker_views()) == WORKERS
                fleet.check_health()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            raise

    meddler = threading.Thread(target=meddle)
    meddler.start()
    with ThreadPoolExecutor(REQUESTS) as pool:
        futures = [pool.submit(reserve, i) for i in range(REQUESTS)]
        reservations = [f.result(timeout=30) for f in futures]
    stop.set()
    meddler.join(timeout=30)
    assert not errors and not meddler.is_alive()

    per_worker = Counter(r.worker_id for r in reservations)
    assert per_worker == {f"w{i}": REQUESTS // WORKERS for i in range(WORKERS)}, per_worker
    views = {v.worker_id: v for v in fleet.worker_views()}
    assert {w: v.inflight for w, v in views.items()} == per_worker
    assert all(v.healthy for v in views.values())

    for r in reservations:
        fleet.finish(r, r.started + 0.2, 4, 0.1)
    assert all(v.inflight == 0 for v in fleet.worker_views())


def test_unreachable_worker_gets_no_more_reservations(fleet: Fleet) -> None:
    first = fleet.reserve("r0", "tenant", _cold_prompt(0), 8)
    fleet.unreachable(first)
    views = {v.worker_id: v for v in fleet.worker_views()}
    assert not views[first.worker_id].healthy and views[first.worker_id].inflight == 0
    chosen = {fleet.reserve(f"r{i}", "tenant", _cold_prompt(i), 8).worker_id for i in range(12)}
    assert first.worker_id not in chosen and len(chosen) == WORKERS - 1


def test_a_worker_salting_tenants_with_another_secret_is_refused() -> None:
    """The router and its workers must derive tenant salts from the same secret, or every
    routing decision would chase hashes no worker holds (and isolation could not be reasoned
    about): the worker's ``/kv/info`` digest of its secret must equal the router's."""

    def info(request: httpx.Request) -> httpx.Response:
        response = _info(request)
        body = response.json()
        body["secret_digest"] = secret_digest(b"ours" if request.url.host == "w0" else b"theirs")
        return httpx.Response(200, json=body)

    urls = ["http://w0", "http://w1"]
    config = FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=urls, tenant_secret=b"ours")
    fleet = Fleet(
        cast(FleetTokenizer, object()),
        config,
        http=httpx.Client(transport=httpx.MockTransport(info)),
    )
    try:
        fleet.attach("http://w0")
        with pytest.raises(WorkerProtocolError, match="another secret"):
            fleet.attach("http://w1")
        fleet.check_health()  # the health round keeps refusing it
        assert [view.worker_id for view in fleet.worker_views()] == ["w0"]
        refused = fleet.metrics.worker_events.labels("w1", "refused_secret")._value.get()
        assert refused >= 2
    finally:
        fleet.close()


def test_a_second_live_worker_with_the_same_id_is_refused() -> None:
    """Two workers started by hand from one config share ``events.worker_id``: both in one
    table entry, each health round re-attached them in turn (each attach resetting the other's
    index entries) and one never got traffic, without a word. Now the second is refused with
    the reason; once the first is dead, its id may move."""

    def same_id(request: httpx.Request) -> httpx.Response:
        response = _info(request)
        body = {**response.json(), "worker_id": "twin"}
        return httpx.Response(200, json=body)

    config = FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=["http://a", "http://b"])
    http = httpx.Client(transport=httpx.MockTransport(same_id))
    fleet = Fleet(cast(FleetTokenizer, object()), config, http=http)
    try:
        fleet.attach("http://a")
        with pytest.raises(WorkerProtocolError, match="already served by http://a"):
            fleet.attach("http://b")
        assert [view.url for view in fleet.worker_views()] == ["http://a"]
        fleet.mark_dead("twin")
        fleet.attach("http://b")
        assert [view.url for view in fleet.worker_views()] == ["http://b"]
    finally:
        fleet.close()


def test_a_worker_restarted_with_another_model_gets_no_more_traffic() -> None:
    """A worker comes back at its URL (new epoch) serving another model: the health round
    refuses to attach it, and the incarnation the fleet knew (whose KV and model are gone)
    must stop getting requests. It kept them (review finding, stop 35)."""
    served = {"w0": ("ab" * 32, 1), "w1": ("ab" * 32, 1)}

    def info(request: httpx.Request) -> httpx.Response:
        fingerprint, epoch = served[request.url.host]
        body = {**_info(request).json(), "fingerprint": fingerprint, "epoch": epoch}
        return httpx.Response(200, json=body)

    urls = ["http://w0", "http://w1"]
    config = FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=urls)
    http = httpx.Client(transport=httpx.MockTransport(info))
    fleet = Fleet(cast(FleetTokenizer, object()), config, http=http)
    try:
        fleet.check_health()
        served["w1"] = ("cd" * 32, 2)
        fleet.check_health()
        assert {v.worker_id: v.healthy for v in fleet.worker_views()} == {"w0": True, "w1": False}
        chosen = {fleet.reserve(f"r{i}", "tenant", _cold_prompt(i), 8).worker_id for i in range(8)}
        assert chosen == {"w0"}
    finally:
        fleet.close()


def test_a_slow_detach_still_stops_a_dead_workers_traffic(fleet: Fleet) -> None:
    """``mark_dead`` waits on the event thread to drop the index entries; when that wait timed
    out, the worker stayed routable for good (the next rounds found it already detached)."""
    assert fleet._events is not None

    def slow(worker_id: str, timeout_s: float = 10.0) -> None:
        raise TimeoutError

    fleet._events.detach = slow  # type: ignore[method-assign]
    fleet.mark_dead("w1")
    assert not {v.worker_id: v.healthy for v in fleet.worker_views()}["w1"]
    chosen = {fleet.reserve(f"r{i}", "t", _cold_prompt(i), 8).worker_id for i in range(12)}
    assert "w1" not in chosen
