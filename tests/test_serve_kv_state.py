"""``/kv/info``, ``/kv/dump`` and event-gap injection against a real uvicorn server.

The worker publishes on real ZMQ sockets (random 127.0.0.1 ports); the test subscribes with a
real ``ZmqEventSubscriber`` whose replay requests are answered by the server's replay thread.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from http_helpers import serving
from kvstrata.cli.serve_cmd import register, worker_config
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.errors import InvalidInput
from kvstrata.events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    ReceivedBatch,
    ZmqEventSubscriber,
    decode_batch,
)
from kvstrata.identity.keys import event_block_hash
from kvstrata.router.placement import ComputePlace
from kvstrata.runtime.events import DEVICE_MEDIUM, KVEventEmitter, KVEventsConfig
from kvstrata.serve.app import create_app
from kvstrata.serve.kv_state import EPOCH_HEADER, NEXT_SEQ_HEADER
from kvstrata.telemetry import KvMetrics
from security_helpers import ADMIN_KEY, admin_auth, bearer
from tier_helpers import worker_tiers

B = 16
TIMEOUT_S = 5.0
BLOCK_BYTES = 2 * 2 * 2 * B * 16 * 4  # the tiny model's KV bytes per block (fp32)


@dataclass
class Worker:
    engine: ReferenceEngine
    emitter: KVEventEmitter
    client: httpx.Client


@pytest.fixture(scope="module")
def worker(tiny_model: LoadedModel) -> Iterator[Worker]:
    config = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id="kv-test:1")
    emitter = KVEventEmitter.from_config(config, block_size=B).start()
    metrics = KvMetrics()
    engine = build_engine(
        tiny_model,
        EngineConfig(block_size=B, pool_blocks=12),
        worker_tiers(host_bytes=16 * BLOCK_BYTES),
        metrics=metrics,
        events=emitter,
    )
    app = create_app(
        engine, model_name="tiny", metrics=metrics, auth=admin_auth(), debug_endpoints=True
    )
    try:
        with serving(app, headers=bearer(ADMIN_KEY)) as client:
            yield Worker(engine, emitter, client)
    finally:
        engine.close()
        emitter.close()


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def complete(client: httpx.Client, prompt: list[int], tenant: str = "default") -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = client.post("/v1/completions", json=body, headers={"X-Kvstrata-Tenant": tenant})
    assert response.status_code == 200, response.text


def subscribe(worker: Worker, expected_seq: int | None) -> ZmqEventSubscriber:
    info = worker.client.get("/kv/info").json()
    return ZmqEventSubscriber(
        info["events_endpoint"], info["replay_endpoint"], expected_seq=expected_seq
    ).start()


def join(worker: Worker, sub: ZmqEventSubscriber, seed: int) -> tuple[list[ReceivedBatch], bool]:
    """Send requests until a live batch reaches ``sub`` (its subscription has landed: no
    sleeping on a guess); what arrived, and whether a resync was asked."""
    for attempt in range(50):
        complete(worker.client, tokens(40, seed=seed * 100 + attempt))
        result = sub.poll(timeout_ms=100)
        if result.batches:
            return result.batches, result.resync_needed
    raise AssertionError("the subscription never received a batch")


def collect(
    sub: ZmqEventSubscriber, next_seq: int, batches: list[ReceivedBatch] | None = None
) -> tuple[list[ReceivedBatch], bool]:
    """Poll until every batch before ``next_seq`` arrived; report whether a resync was asked."""
    batches = list(batches or [])
    resync = False
    deadline = time.monotonic() + TIMEOUT_S
    while (not batches or batches[-1].seq < next_seq - 1) and time.monotonic() < deadline:
        result = sub.poll(timeout_ms=50)
        batches.extend(result.batches)
        resync |= result.resync_needed
    assert batches and batches[-1].seq == next_seq - 1, [b.seq for b in batches]
    return batches, resync


def apply(state: set[tuple[str, int]], events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            state.update((str(event.medium), int(h)) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            state.difference_update((str(event.medium), int(h)) for h in event.block_hashes)
        else:
            state.clear()


def resident(engine: ReferenceEngine) -> set[tuple[str, int]]:
    out = {(DEVICE_MEDIUM, event_block_hash(b.key)) for b in engine.pool.committed_blocks()}
    assert engine.bridge is not None
    for name, metas in engine.bridge.store.resident():
        out.update((name, event_block_hash(m.key)) for m in metas)
    return out


def test_info_names_the_bound_endpoints(worker: Worker) -> None:
    response = worker.client.get("/kv/info")
    assert response.status_code == 200
    info = response.json()
    publisher = worker.emitter.publisher
    assert info["worker_id"] == "kv-test:1"
    assert info["epoch"] == worker.emitter.epoch
    assert info["model"] == "tiny"
    assert info["fingerprint"] == worker.engine.model_id and len(info["fingerprint"]) == 64
    assert info["block_size"] == B
    assert info["events_endpoint"] == publisher.endpoint
    assert info["replay_endpoint"] == publisher.replay_endpoint
    assert not info["events_endpoint"].endswith(":*")
    assert not info["replay_endpoint"].endswith(":*")
    assert info["tiers"] == ["device", "host"]
    assert isinstance(info["next_seq"], int)
    place = ComputePlace.from_json(info["compute"])  # this process: same host, its CPUs
    assert place.device == "cpu" and place.cpus == frozenset(os.sched_getaffinity(0))
    assert place.host.startswith(socket.gethostname() + "/")


def test_dump_plus_live_stream_equals_resident_blocks(worker: Worker) -> None:
    prompt = tokens(100, seed=7)
    complete(worker.client, prompt, tenant="dumped")
    response = worker.client.get("/kv/dump")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/msgpack"
    next_seq = int(response.headers[NEXT_SEQ_HEADER])
    assert int(response.headers[EPOCH_HEADER]) == worker.emitter.epoch
    batch = decode_batch(response.content).batch
    assert (batch.worker_id, batch.epoch) == ("kv-test:1", worker.emitter.epoch)
    keys = worker.engine.block_keys(prompt, "dumped")
    dumped = [e for e in batch.events if isinstance(e, BlockStored) and e.namespace == "dumped"]
    by_medium = {e.medium: e for e in dumped}
    assert set(by_medium) == {"device", "host"}
    for event in dumped:
        assert event.block_hashes == [event_block_hash(k) for k in keys]
        assert event.token_ids == prompt[: len(keys) * B]
    state: set[tuple[str, int]] = set()
    apply(state, batch.events)
    assert state == resident(worker.engine)

    # A consumer that joins now applies the dump, then live batches from next_seq (the ones
    # sent before its subscription landed come from the server's replay thread).
    sub = subscribe(worker, expected_seq=next_seq)
    try:
        first, resync = join(worker, sub, seed=8)
        for seed in range(20, 26):  # a 12-block pool and a 16-block host tier both evict
            complete(worker.client, tokens(70, seed=seed))
        batches, more_resync = collect(sub, worker.emitter.publisher.next_seq, first)
        assert not (resync or more_resync)
        assert [b.seq for b in batches] == list(range(next_seq, batches[-1].seq + 1))
        apply(state, [e for b in batches for e in b.batch.events])
        assert state == resident(worker.engine)
        assert any(isinstance(e, BlockRemoved) for b in batches for e in b.batch.events)
    finally:
        sub.close()


@pytest.mark.parametrize("evict_replay", [False, True])
def test_dropped_events_make_a_gap_the_subscriber_detects(
    worker: Worker, evict_replay: bool
) -> None:
    sub = subscribe(worker, expected_seq=None)
    try:
        join(worker, sub, seed=30 + evict_replay)
        while sub.poll(timeout_ms=50).batches:
            pass
        expected = sub.expected_seq
        assert expected == worker.emitter.publisher.next_seq
        flag = "1" if evict_replay else "0"
        response = worker.client.post(f"/kv/debug/drop-events?count=2&evict_replay={flag}")
        assert response.status_code == 200, response.text
        assert response.json() == {
            "dropping": 2,
            "evict_replay": evict_replay,
            "next_seq": expected,
        }
        for seed in range(3):
            complete(worker.client, tokens(40, seed=400 + 10 * evict_replay + seed))
        batches, resync = collect(sub, worker.emitter.publisher.next_seq)
        assert sub.stats.gaps == 1
        assert sub.stats.missed_batches == 2
        if evict_replay:
            assert resync and sub.stats.resyncs_needed == 1
            assert [b.replayed for b in batches] == [False] * len(batches)
            assert batches[0].seq == expected + 2
        else:
            assert not resync
            assert [b.seq for b in batches] == list(range(expected, batches[-1].seq + 1))
            assert [b.replayed for b in batches[:3]] == [True, True, False]
    finally:
        sub.close()


def test_drop_events_rejects_a_negative_count(worker: Worker) -> None:
    response = worker.client.post("/kv/debug/drop-events?count=-1")
    assert response.status_code == 400


def test_without_events_kv_endpoints_say_so(tiny_model: LoadedModel) -> None:
    metrics = KvMetrics()
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=B, pool_blocks=8), metrics=metrics)
    app = create_app(engine, model_name="tiny", metrics=metrics, auth=admin_auth())
    with serving(app, headers=bearer(ADMIN_KEY)) as client:
        info = client.get("/kv/info")
        assert info.status_code == 404
        assert info.json()["error"]["code"] == "kv_events_disabled"
        assert client.get("/kv/dump").status_code == 404
        assert client.post("/kv/debug/drop-events?count=1").status_code == 404  # not registered


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_parse_into_an_events_config() -> None:
    assert worker_config(_serve_args()).events is None
    args = _serve_args("--port", "8123", "--events-endpoint", "tcp://127.0.0.1:*")
    config = worker_config(args).events
    assert config is not None
    assert config.worker_id == f"{socket.gethostname()}:8123"
    assert config.replay_endpoint is None
    with pytest.raises(InvalidInput, match=r"events\.endpoint"):
        worker_config(_serve_args("--replay-endpoint", "tcp://127.0.0.1:*"))
    with pytest.raises(InvalidInput, match="ZMQ endpoint"):
        worker_config(_serve_args("--events-endpoint", "127.0.0.1:5555"))


def test_info_reports_each_tiers_measured_fetch_per_block(worker: Worker) -> None:
    """After the host tier served loads, ``/kv/info`` says what a block costs to fetch from
    it: the store's own measurement (the router prices fetches with it)."""
    prompt = tokens(6 * B + 3, seed=70)
    complete(worker.client, prompt)  # written through to host
    worker.engine.call(worker.engine.pool.clear).result(TIMEOUT_S)  # gone from the pool
    assert worker.engine.bridge is not None
    host = worker.engine.bridge.store.levels[0]
    hits = host.tier.counters.loads
    complete(worker.client, prompt)
    assert host.tier.counters.loads > hits
    figures = worker.client.get("/kv/info").json()["fetch_s_per_block"]
    assert set(figures) == {"host"}
    assert figures["host"] > 0
    assert figures["host"] == pytest.approx(host.fetch_s_per_byte * BLOCK_BYTES)
