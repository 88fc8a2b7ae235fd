"""A real uvicorn server in a background thread on a free 127.0.0.1 port, for HTTP tests."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kvstrata.serve.streaming import TextAssembler


class ThreadedServer(uvicorn.Server):
    """A uvicorn server that signals once startup (lifespan included) has finished."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


@contextmanager
def serving(
    app: Any,
    *,
    headers: dict[str, str] | None = None,
    tls: tuple[Path, Path] | None = None,
) -> Iterator[httpx.Client]:
    """Run ``app`` until the block ends; yield an httpx client bound to it (sending
    ``headers`` on every request). ``tls``: (certificate, key) to serve HTTPS with; the
    client then trusts that certificate."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
        ssl_certfile=None if tls is None else str(tls[0]),
        ssl_keyfile=None if tls is None else str(tls[1]),
    )
    server = ThreadedServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert server.ready.wait(timeout=30), "server did not start in time"
        assert server.started, "server failed to start"
        scheme = "http" if tls is None else "https"
        verify: Any = True if tls is None else ssl.create_default_context(cafile=str(tls[0]))
        base_url = f"{scheme}://127.0.0.1:{port}"
        with httpx.Client(base_url=base_url, timeout=60, headers=headers, verify=verify) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive(), "server did not shut down"


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds; HTTP and socket errors count as "not yet" (a server
    still starting, a worker restarting). ``AssertionError`` naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def streamed_deltas(assembler: TextAssembler, tokens: int) -> list[str]:
    """The deltas a streamed answer of ``tokens`` tokens (ids 0, 1, …) sends through
    ``assembler``: one per token until a stop, then the final flush."""
    out: list[str] = []
    ids: list[int] = []
    for i in range(tokens):
        ids.append(i)
        out.append(assembler.push(ids))
        if assembler.stopped:
            break
    out.append(assembler.finish(ids))
    return out


@dataclass
class TinyFleet:
    """One real worker (its engine's metrics beside it) behind a real front door."""

    fleet: Any  # kvstrata.fleet.fleet.Fleet (imported where used: this module stays light)
    worker_metrics: Any  # KvMetrics
    worker: httpx.Client
    front: httpx.Client


@contextmanager
def tiny_fleet(model: Any, *, worker_id: str, limits: Any) -> Iterator[TinyFleet]:
    """A worker serving ``model`` (a ``LoadedModel``) as ``tiny`` with ``limits`` (its
    ``ServeLimits``), with an event emitter for ``/kv/info``, behind a front door over a
    ``Fleet`` in approximate mode (no event plane), both under uvicorn."""
    from kvstrata.engine.engine import EngineConfig, ReferenceEngine
    from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
    from kvstrata.fleet.frontdoor import create_frontdoor_app
    from kvstrata.index.model import ConsistencyMode
    from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
    from kvstrata.serve.app import create_app
    from kvstrata.telemetry import KvMetrics

    events = KVEventsConfig("tcp://127.0.0.1:*", None, worker_id=worker_id)
    emitter = KVEventEmitter.from_config(events, block_size=16).start()
    metrics = KvMetrics()
    engine = ReferenceEngine(model, EngineConfig(pool_blocks=256), metrics=metrics, events=emitter)
    worker_app = create_app(engine, model_name="tiny", metrics=metrics, limits=limits)
    try:
        with serving(worker_app) as worker:
            url = str(worker.base_url).rstrip("/")
            config = FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=[url])
            fleet = Fleet(FleetTokenizer(model.path), config)
            fleet.attach(url)
            with serving(create_frontdoor_app(fleet)) as front:
                yield TinyFleet(fleet, metrics, worker, front)
    finally:
        emitter.close()
