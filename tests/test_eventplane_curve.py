"""CURVE on a vLLM worker's connector stream (``lower``): real ZMQ CURVE sockets on 127.0.0.1.

The connector publishes through a ``KVEventEmitter``, which refuses plaintext beyond loopback,
so on another host its stream is CURVE. The router subscribed to it without keys and silently
received nothing (review finding, stop 36). Now the stream's server key travels with the
worker (``--worker …,lower_curve=KEY`` → ``VllmWorker`` → ``WorkerInfo``) and the event plane
subscribes as a CURVE client; the cases that would receive nothing, or downgrade, are refused
at attach. A real uvicorn stands in for vLLM's ``/metrics`` and ``/v1/models``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import cast

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from eventplane_helpers import BS, Worker, fresh_index, info_of, stored, wait_for
from http_helpers import serving
from kvstrata.events import ZmqEventPublisher
from kvstrata.events.curve import CurveServer, KeyPair, encode_public_key
from kvstrata.events.schema import BlockStored
from kvstrata.fleet.curve_keys import FleetKeys, lower_stream_refusal
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.vllm_workers import VllmSource, VllmWorker
from kvstrata.fleet.worker_info import WorkerProtocolError
from kvstrata.index.model import Medium


@pytest.fixture(scope="module")
def keys() -> Iterator[FleetKeys]:
    """The connector's server certificate (``worker``) admitting the router's client one."""
    generated = FleetKeys.generate()
    yield generated
    generated.remove()


@pytest.fixture(scope="module")
def vllm_http() -> Iterator[str]:
    """What the router reads from a vLLM server over HTTP: its start time and model."""
    app = FastAPI()

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return "process_start_time_seconds 1764600000.25\n"

    @app.get("/v1/models")
    def models() -> dict[str, object]:
        return {"data": [{"id": "m"}]}

    with serving(app) as client:
        yield str(client.base_url).rstrip("/")


class _Streams:
    """vLLM's own stream (plaintext: vLLM has no CURVE) and the connector's (CURVE), both
    answering replay on a thread of their own."""

    def __init__(self, keys: FleetKeys) -> None:
        curve = CurveServer.from_files(keys.worker_secret_file, keys.clients_dir)
        self.server_key = curve.public_key
        local = "tcp://127.0.0.1:*"
        self.main = ZmqEventPublisher(local, local, worker_id="v0")
        self.lower = ZmqEventPublisher(local, local, worker_id="v0", epoch=7, curve=curve)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve, args=(p,), daemon=True)
            for p in (self.main, self.lower)
        ]

    def _serve(self, publisher: ZmqEventPublisher) -> None:
        while not self._stop.is_set():
            publisher.serve_replay(timeout_ms=20)

    def __enter__(self) -> _Streams:
        self.main.start()
        self.lower.start()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.main.close()
        self.lower.close()

    def spec(self, url: str, lower_curve: str | None) -> str:
        """``--worker`` of ``kvstrata router --engine vllm`` for these streams."""
        parts = [
            url,
            f"events={self.main.endpoint}",
            f"replay={self.main.replay_endpoint}",
            f"lower={self.lower.endpoint}",
            f"lower_replay={self.lower.replay_endpoint}",
            "id=v0",
        ]
        return ",".join(parts + ([] if lower_curve is None else [f"lower_curve={lower_curve}"]))


def test_host_blocks_on_a_curve_connector_stream_reach_the_index(keys: FleetKeys) -> None:
    index, lock = fresh_index()
    with _Streams(keys) as streams:
        worker = Worker(streams.main)
        plane = EventPlane(
            index,
            lock,
            source=worker,
            subscribe_settle_s=0.3,
            curve_keys=KeyPair.from_file(keys.router_secret_file),
        )
        plane.start()
        try:
            info = info_of("w0", streams.main, streams.lower)
            plane.attach(replace(info, lower_curve_public_key=streams.server_key))
            device, tokens = stored(5, seed=5)
            worker.store(device)
            streams.lower.publish([BlockStored([6], None, tokens, BS, None, "host", None)])
            _, more = stored(7, seed=7)  # a second batch: the first, if missed, is replayed
            streams.lower.publish([BlockStored([7], None, more, BS, None, "host", None)])

            def held() -> tuple[int, int, int, int]:
                with lock:
                    return index.blocks_held("w0")

            wait_for(lambda: held()[Medium.HOST] == 2, "host blocks from the CURVE stream")
            assert held()[Medium.DEVICE] == 1 and "lower_lost" not in plane.resyncs
        finally:
            plane.close()


def _fleet(url: str, spec: str, *, router_keys: FleetKeys | None) -> Fleet:
    config = FleetConfig(
        worker_urls=[url],
        engine="vllm",
        curve_client_secret_file=None if router_keys is None else router_keys.router_secret_file,
    )
    source = VllmSource([VllmWorker.parse(spec, 0, BS)])
    return Fleet(cast(FleetTokenizer, object()), config, source=source)


def test_a_vllm_fleet_with_router_keys_reads_the_connectors_curve_stream(
    keys: FleetKeys, vllm_http: str
) -> None:
    """``--worker …,lower_curve=FILE`` (the connector's public certificate) with the router's
    keys: vLLM's own plaintext stream is accepted (it cannot be CURVE), the connector's read."""
    with _Streams(keys) as streams:
        public_file = keys.worker_secret_file.with_suffix(".key")
        fleet = _fleet(vllm_http, streams.spec(vllm_http, str(public_file)), router_keys=keys)
        try:
            info = fleet.attach(vllm_http)
            assert info.lower_curve_public_key == streams.server_key
            _, tokens = stored(3, seed=3)
            streams.lower.publish([BlockStored([3], None, tokens, BS, None, "host", None)])
            _, more = stored(4, seed=4)
            streams.lower.publish([BlockStored([4], None, more, BS, None, "host", None)])
            wait_for(lambda: fleet.worker_views()[0].blocks[Medium.HOST] == 2, "host blocks")
        finally:
            fleet.close()


@pytest.mark.parametrize(
    ("lower", "key", "router", "refusal"),
    [
        ("here", True, False, "no client certificate"),  # a CURVE stream, no router keys
        ("here", False, True, "no silent downgrade"),  # plaintext, the router requires CURVE
        ("tcp://10.1.2.3:5559", False, False, "beyond loopback"),  # it would get nothing
        ("tcp://10.1.2.3:5559", False, True, "beyond loopback"),
    ],
)
def test_a_connector_stream_the_router_cannot_read_is_refused_at_attach(
    keys: FleetKeys, vllm_http: str, lower: str, key: bool, router: bool, refusal: str
) -> None:
    with _Streams(keys) as streams:
        spec = streams.spec(vllm_http, encode_public_key(streams.server_key) if key else None)
        if lower != "here":
            spec = spec.replace(streams.lower.endpoint, lower)
        fleet = _fleet(vllm_http, spec, router_keys=keys if router else None)
        try:
            with pytest.raises(WorkerProtocolError, match=refusal):
                fleet.attach(vllm_http)
            assert fleet.worker_views() == []
        finally:
            fleet.close()


def test_the_lower_curve_part_of_a_worker_spec(keys: FleetKeys) -> None:
    public = KeyPair.from_file(keys.worker_secret_file).public_key
    base = "http://h:1,events=tcp://h:2,lower=tcp://h:4"
    by_text = VllmWorker.parse(f"{base},lower_curve={encode_public_key(public)}", 0, BS)
    by_file = VllmWorker.parse(f"{base},lower_curve={keys.worker_secret_file}", 0, BS)
    assert by_text.lower_curve_public_key == by_file.lower_curve_public_key == public
    assert VllmWorker.parse(base, 0, BS).lower_curve_public_key is None
    with pytest.raises(ValueError, match="lower_curve"):
        VllmWorker.parse(f"{base},lower_curve=not-a-key", 0, BS)
    with pytest.raises(ValueError, match="lower="):
        VllmWorker.parse(f"http://h:1,events=tcp://h:2,lower_curve={keys.clients_dir}", 0, BS)
    # what ``kvstrata router --engine vllm`` checks before it contacts any server
    assert lower_stream_refusal("v0", "tcp://h:4", None, router_has_keys=False) is not None
    assert lower_stream_refusal("v0", "tcp://127.0.0.1:4", None, router_has_keys=False) is None
    assert lower_stream_refusal("v0", "tcp://h:4", public, router_has_keys=True) is None
