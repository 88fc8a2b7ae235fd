"""A client that leaves a non-streamed request at the front door: the front door closes its
connection to the worker, whose own watcher then stops the generation (it used to run to
``max_tokens``, counted in flight all along), and releases the reservation."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

from http_helpers import serving
from kvstrata.engine.model_loader import LoadedModel, ensure_checkpoint
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.security import Authenticator
from kvstrata.serve.auth import HttpAuth
from security_http_helpers import key, worker_app, write_keys


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(ValueError):  # only the request records are JSON
            self.records.append(json.loads(record.getMessage()))


def test_a_client_gone_from_the_front_door_stops_the_workers_generation(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    records = _Records()
    log = logging.getLogger("kvstrata.serve")
    level = log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        with worker_app(tiny_model, tmp_path, pool_blocks=128) as worker:
            url = str(worker.client.base_url).rstrip("/")
            config = FleetConfig(worker_urls=[url], api_key=key("FLEET"))
            fleet = Fleet(FleetTokenizer(ensure_checkpoint("tiny")), config)
            fleet.attach(url)
            guard = HttpAuth(Authenticator(write_keys(tmp_path / "front.toml")))
            with serving(create_frontdoor_app(fleet, guard)) as front:
                body = json.dumps(
                    {"prompt": "hello there", "max_tokens": 1500, "ignore_eos": True}
                ).encode()
                head = (
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    "Content-Type: application/json\r\n"
                    f"Authorization: Bearer {key('A')}\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                client = socket.create_connection((front.base_url.host, front.base_url.port))
                client.sendall(head.encode() + body)
                running = worker.engine.metrics.running
                deadline = time.monotonic() + 30  # the worker is generating it (slow when loaded)
                while running._value.get() < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert running._value.get() >= 1, "the request never reached the worker"
                client.close()  # the client is gone, its answer far from done
                deadline = time.monotonic() + 60
                while not records.records and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert records.records, "the worker's request never ended"
                (record,) = records.records[:1]
                assert record["finish_reason"] == "abort", record
                assert record["output_tokens"] < 1500
                deadline = time.monotonic() + 5
                while fleet.worker_views()[0].inflight and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert fleet.worker_views()[0].inflight == 0  # the reservation was released
            fleet.close()
    finally:
        log.removeHandler(records)
        log.setLevel(level)
