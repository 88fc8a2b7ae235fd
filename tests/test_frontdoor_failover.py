"""The front door re-routes a request whose worker fails before the client got anything.

Two real tiny-model workers under uvicorn behind a real front door (approximate mode). The
stand-in for a failing worker is an ASGI wrapper around the real worker app
(``_Faulty``), armed to fail the next completion request whichever worker the router picks:

* *dies*: it answers 200 with the stream's headers (and, for a chat, the opening role event)
  and then its connection closes without the rest of the body — what a SIGKILLed worker
  looks like from the front door;
* *hangs*: it never answers, and from then on neither do its health probes — what a SIGSTOPped
  worker looks like (its kernel still accepts connections). The health round declares it
  dead after ``health_failures`` probes of ``health_timeout_s``, and the waiting request is
  re-routed instead of waiting for ``request_timeout_s``.

Until the first token nothing has reached the client, so the client must get the whole
answer from the other worker, and the failed one must be counted.
"""

from __future__ import annotations

import asyncio
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
    """Which failure the next completion request meets (on whichever worker gets it)."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.failed_on: list[str] = []
        self.hung: set[str] = set()
        self._lock = threading.Lock()

    def take(self, worker: str) -> str | None:
        with self._lock:
            mode, self.mode = self.mode, None
            if mode is not None:
                self.failed_on.append(worker)
                if mode == "hangs":
                    self.hung.add(worker)
            return mode


class _Faulty:
    """The real worker app, except for the failure ``budget`` arms (see the module)."""

    def __init__(self, app: Any, name: str, budget: _Budget) -> None:
        self.app, self.name, self.budget = app, name, budget

    async def _hang(self) -> None:
        while self.name in self.budget.hung:  # released by the test: uvicorn can then stop
            await asyncio.sleep(0.05)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.name in self.budget.hung:
            await self._hang()  # probes too: a stopped process answers nothing
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
        mode = self.budget.take(self.name)
        if mode == "dies" and json.loads(raw).get("stream"):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if scope["path"].endswith("chat/completions"):
                await send({"type": "http.response.body", "body": _ROLE_EVENT, "more_body": True})
            raise ConnectionAbortedError(f"{self.name} dies before its first token")
        if mode == "hangs":
            await self._hang()
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"released"})
            return
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
        apps[name] = _Faulty(app, name, budget)
    try:
        with serving(apps["a"]) as worker_a, serving(apps["b"]) as worker_b:
            urls = {
                "a": str(worker_a.base_url).rstrip("/"),
                "b": str(worker_b.base_url).rstrip("/"),
            }
            config = FleetConfig(
                mode=ConsistencyMode.APPROXIMATE,
                worker_urls=list(urls.values()),
                health_interval_s=0.2,
                health_timeout_s=1.0,
            )
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


CASES = [
    ("/v1/completions", {"model": MODEL, "prompt": "a failover", "max_tokens": 3}),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "fail over"}], "max_tokens": 3},
    ),
]


def _content(events: list[str]) -> bool:
    chunks = [json.loads(event[len("data: ") :]) for event in events if event != "data: [DONE]"]
    return any(
        choice.get("text")
        or (choice.get("delta") or {}).get("content")
        or (choice.get("message") or {}).get("content")
        for chunk in chunks
        for choice in chunk["choices"]
    )


def _arm(door: Door, mode: str) -> dict[str, float]:
    for url in door.urls.values():  # both healthy again (a previous case flagged one)
        door.fleet.attach(url)
    door.budget.mode = mode
    return {name: _retries(door.fleet, f"{name}:1") for name in door.urls}


def _check_failover(door: Door, retries: dict[str, float], served_by: str) -> None:
    assert door.budget.mode is None and door.budget.failed_on
    failed = door.budget.failed_on[-1]
    assert served_by != f"{failed}:1"
    # the failed worker was counted (the health round may have re-attached it since)
    assert _retries(door.fleet, f"{failed}:1") == retries[failed] + 1


@pytest.mark.parametrize(("path", "body"), CASES)
def test_a_stream_whose_worker_dies_before_its_first_token_is_re_routed(
    door: Door, path: str, body: dict[str, Any]
) -> None:
    retries = _arm(door, "dies")
    with door.client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and _content(events)
    _check_failover(door, retries, response.headers["x-kvstrata-worker"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), CASES)
def test_a_request_whose_worker_hangs_is_re_routed_when_it_is_declared_dead(
    door: Door, path: str, body: dict[str, Any], stream: bool
) -> None:
    """Without the failover the request waited the front door's request_timeout_s (600 s);
    the client's own timeout here is 60 s."""
    retries = _arm(door, "hangs")
    try:
        if stream:
            with door.client.stream(
                "POST", path, json={**body, "stream": True}, timeout=60
            ) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]" and _content(events)
        else:
            response = door.client.post(path, json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert _content([f"data: {json.dumps(response.json())}"])
        _check_failover(door, retries, response.headers["x-kvstrata-worker"])
    finally:
        door.budget.hung.clear()
