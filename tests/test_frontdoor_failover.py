"""The front door re-routes a streamed request whose worker fails before its first token.

Two real tiny-model workers under uvicorn behind a real front door (approximate mode). A
worker "dies" the way a SIGKILLed one looks from the front door: it answers 200 with the
stream's headers (and, for a chat, the opening role event) and then its connection closes
without the rest of the body. The stand-in is an ASGI wrapper around the real worker app
(``_DiesMidStream``) that raises after those bytes, so uvicorn drops the connection; it
fails the first streamed request it sees, on whichever worker the router picked.

Until the first token nothing has reached the client, so the client must get the whole
answer from the other worker, and the dead one must be flagged.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.index.model import ConsistencyMode
from kvstrata.runtime.config import ServeLimits
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.serve.app import create_app
from kvstrata.telemetry import KvMetrics

MODEL = "tiny"
pytestmark = pytest.mark.timeout(300)

_ROLE_EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n'
)


class _Budget:
    """How many streamed requests are still to fail, shared by every worker's wrapper."""

    def __init__(self) -> None:
        self.left = 0
        self.failed_on: list[str] = []
        self._lock = threading.Lock()

    def take(self, worker: str) -> bool:
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            self.failed_on.append(worker)
            return True


class _DiesMidStream:
    """The real worker app, except that a streamed completion it is told to fail sends its
    headers (and a chat's role event) and then loses its connection."""

    def __init__(self, app: Any, name: str, budget: _Budget) -> None:
        self.app, self.name, self.budget = app, name, budget

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        if json.loads(raw).get("stream") and self.budget.take(self.name):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if scope["path"].endswith("chat/completions"):
                await send({"type": "http.response.body", "body": _ROLE_EVENT, "more_body": True})
            raise ConnectionAbortedError(f"{self.name} dies before its first token")
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)


@dataclass
class Door:
    fleet: Fleet
    client: httpx.Client
    budget: _Budget
    urls: dict[str, str]


@pytest.fixture(scope="module")
def door(tiny_model: LoadedModel) -> Iterator[Door]:
    budget = _Budget()
    emitters: list[KVEventEmitter] = []
    apps = {}
    for name in ("a", "b"):
        events = KVEventsConfig("tcp://127.0.0.1:*", None, worker_id=f"{name}:1")
        emitter = KVEventEmitter.from_config(events, block_size=16).start()
        emitters.append(emitter)
        metrics = KvMetrics()
        engine = ReferenceEngine(
            tiny_model, EngineConfig(pool_blocks=128), metrics=metrics, events=emitter
        )
        app = create_app(engine, model_name=MODEL, metrics=metrics, limits=ServeLimits())
        apps[name] = _DiesMidStream(app, name, budget)
    try:
        with serving(apps["a"]) as worker_a, serving(apps["b"]) as worker_b:
            urls = {
                "a": str(worker_a.base_url).rstrip("/"),
                "b": str(worker_b.base_url).rstrip("/"),
            }
            config = FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=list(urls.values()))
            fleet = Fleet(FleetTokenizer(tiny_model.path), config)
            for url in urls.values():
                fleet.attach(url)
            with serving(create_frontdoor_app(fleet)) as client:
                yield Door(fleet, client, budget, urls)
    finally:
        for emitter in emitters:
            emitter.close()


def _retries(fleet: Fleet, worker_id: str) -> float:
    return sum(
        sample.value
        for sample in fleet.metrics.retries.collect()[0].samples
        if sample.name.endswith("_total") and sample.labels.get("worker") == worker_id
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "a streamed failover", "max_tokens": 3}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "fail over"}],
             "max_tokens": 3},
        ),
    ],
)  # fmt: skip
def test_a_stream_whose_worker_dies_before_its_first_token_is_re_routed(
    door: Door, path: str, body: dict[str, Any]
) -> None:
    for url in door.urls.values():  # both healthy again (a previous case flagged one)
        door.fleet.attach(url)
    retries = {name: _retries(door.fleet, f"{name}:1") for name in door.urls}
    door.budget.left = 1
    with door.client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert door.budget.left == 0 and len(door.budget.failed_on) >= 1
    dead = door.budget.failed_on[-1]
    served_by = response.headers["x-kvstrata-worker"]
    assert served_by != f"{dead}:1"
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(event[len("data: ") :]) for event in events[:-1]]
    assert any(
        choice.get("text") or (choice.get("delta") or {}).get("content")
        for chunk in texts
        for choice in chunk["choices"]
    )
    # the dead worker was flagged (the front door's health round may have re-attached it
    # since: it is alive, only its connection was lost)
    assert _retries(door.fleet, f"{dead}:1") == retries[dead] + 1
