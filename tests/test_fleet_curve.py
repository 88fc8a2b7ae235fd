"""A router attaching CURVE workers: an in-process worker (tiny model, real uvicorn, real ZMQ
sockets with CURVE) and a real ``Fleet``; the index fills from the encrypted stream. The
mismatched cases are refused at attach (no silent downgrade), and a worker whose plaintext
event sockets would be reachable from other machines refuses to start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.errors import ConfigError
from kvstrata.fleet.curve_keys import FleetKeys
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.worker_info import WorkerProtocolError
from kvstrata.runtime.event_exposure import is_local_endpoint
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.runtime.scheduler import SchedulerConfig
from kvstrata.serve.app import create_app
from kvstrata.telemetry import KvMetrics
from security_helpers import ADMIN_KEY, admin_auth
from tier_helpers import worker_tiers

B = 16
SCHEDULER = {"max_num_batched_tokens": 256}
"""Not the default: ``/kv/info`` must report the worker's own step budget."""
BLOCK_BYTES = 2 * 2 * 2 * B * 16 * 4  # the tiny model's KV bytes per block (fp32)


@dataclass
class Worker:
    engine: ReferenceEngine
    client: httpx.Client

    @property
    def url(self) -> str:
        return str(self.client.base_url).rstrip("/")


@pytest.fixture(scope="module")
def keys() -> Iterator[FleetKeys]:
    generated = FleetKeys.generate()
    yield generated
    generated.remove()
    assert not generated.run_dir.exists()


def _worker(tiny_model: LoadedModel, events: KVEventsConfig) -> Iterator[Worker]:
    emitter = KVEventEmitter.from_config(events, block_size=B).start()
    metrics = KvMetrics()
    engine = build_engine(
        tiny_model,
        EngineConfig(block_size=B, pool_blocks=12, scheduler=SchedulerConfig(**SCHEDULER)),
        worker_tiers(host_bytes=16 * BLOCK_BYTES),
        metrics=metrics,
        events=emitter,
    )
    try:
        app = create_app(engine, model_name="tiny", metrics=metrics, auth=admin_auth())
        with serving(app) as client:
            yield Worker(engine, client)
    finally:
        engine.close()
        emitter.close()


@pytest.fixture(scope="module")
def curve_worker(tiny_model: LoadedModel, keys: FleetKeys) -> Iterator[Worker]:
    events = KVEventsConfig(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        worker_id="curve-w0",
        curve_secret_file=keys.worker_secret_file,
        curve_clients_dir=keys.clients_dir,
    )
    yield from _worker(tiny_model, events)


@pytest.fixture(scope="module")
def plain_worker(tiny_model: LoadedModel) -> Iterator[Worker]:
    yield from _worker(tiny_model, KVEventsConfig("tcp://127.0.0.1:*", worker_id="plain-w1"))


def _fleet(worker: Worker, router_secret: Path | None) -> Fleet:
    config = FleetConfig(
        worker_urls=[worker.url], curve_client_secret_file=router_secret, api_key=ADMIN_KEY
    )
    return Fleet(cast(FleetTokenizer, object()), config)


def _complete(worker: Worker, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = worker.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_router_with_the_fleet_keys_fills_its_index_from_a_curve_worker(
    curve_worker: Worker, keys: FleetKeys
) -> None:
    info = curve_worker.client.get("/kv/info").json()
    assert isinstance(info["curve_public_key"], str) and len(info["curve_public_key"]) == 40
    fleet = _fleet(curve_worker, keys.router_secret_file)
    try:
        attached = fleet.attach(curve_worker.url)
        assert attached.curve_public_key is not None
        assert info["step_tokens"] == attached.step_tokens == 256  # its scheduler's budget
        assert fleet.worker_views()[0].step_tokens == 256  # what /fleet/workers shows
        _complete(curve_worker, list(range(300, 300 + 3 * B + 1)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(fleet.worker_views()[0].blocks) < 3:
            time.sleep(0.05)
        view = fleet.worker_views()[0]
        assert view.consistent and sum(view.blocks) >= 3, view
    finally:
        fleet.close()


def test_router_without_keys_refuses_a_curve_worker(curve_worker: Worker) -> None:
    fleet = _fleet(curve_worker, None)
    try:
        with pytest.raises(WorkerProtocolError, match="--curve-secret-file"):
            fleet.attach(curve_worker.url)
        assert fleet.worker_views() == []
    finally:
        fleet.close()


def test_router_with_keys_refuses_a_plaintext_worker(plain_worker: Worker, keys: FleetKeys) -> None:
    assert plain_worker.client.get("/kv/info").json()["curve_public_key"] is None
    fleet = _fleet(plain_worker, keys.router_secret_file)
    try:
        with pytest.raises(WorkerProtocolError, match="no silent downgrade"):
            fleet.attach(plain_worker.url)
    finally:
        fleet.close()


def test_generated_run_directory_is_private(keys: FleetKeys) -> None:
    assert keys.run_dir.stat().st_mode & 0o777 == 0o700
    assert keys.router_secret_file.stat().st_mode & 0o077 == 0
    assert [p.name for p in keys.clients_dir.iterdir()] == ["router.key"]
    assert "--curve-clients-dir" in keys.worker_args()


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:*", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/x.ipc", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:*", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_local_endpoints(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


def test_exposed_plaintext_events_refuse_to_start(keys: FleetKeys) -> None:
    with pytest.raises(ConfigError, match="curve_secret_file"):
        KVEventEmitter.from_config(KVEventsConfig("tcp://0.0.0.0:*"), block_size=B)
    with pytest.raises(ConfigError, match="plaintext"):
        config = KVEventsConfig("tcp://127.0.0.1:*", "tcp://*:*")
        KVEventEmitter.from_config(config, block_size=B)
    exposed_with_curve = KVEventsConfig(
        "tcp://0.0.0.0:*",
        curve_secret_file=keys.worker_secret_file,
        curve_clients_dir=keys.clients_dir,
    )
    emitter = KVEventEmitter.from_config(exposed_with_curve, block_size=B)
    assert emitter.publisher.curve_public_key is not None
