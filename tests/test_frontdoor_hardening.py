"""The front door and the supervisor against what a review found them doing (stop 35).

Fake workers (a Starlette app answering ``/kv/info`` and completions, served by a real
uvicorn) behind the real front door, approximate mode: what is tested is the front door's
bookkeeping, which fake answers exercise as well as a model would, and faster.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from http_helpers import serving
from kvstrata.engine.model_loader import ensure_checkpoint
from kvstrata.fleet.failover import ClientGone, unless_client_left
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.fleet.supervisor import Supervisor, WorkerSpec
from kvstrata.identity import secret_digest
from kvstrata.index.model import ConsistencyMode
from kvstrata.runtime.config import ServeLimits

pytestmark = pytest.mark.timeout(120)


class _Worker:
    """``first_token_s``: how long a stream waits before its first token; a body whose
    prompt is ``"boom"`` gets the stream's headers and then a dropped connection."""

    def __init__(self, first_token_s: float = 0.0, tokens_s: float = 0.05) -> None:
        self.first_token_s, self.tokens_s = first_token_s, tokens_s
        self.bodies: list[dict[str, Any]] = []
        self.cancelled = threading.Event()

        async def info(_request: Request) -> Response:
            return JSONResponse({
                "worker_id": "w0", "epoch": 1, "model": "tiny", "fingerprint": "ab" * 32,
                "block_size": 16, "events_endpoint": "tcp://127.0.0.1:1",
                "secret_digest": secret_digest(b""),
            })  # fmt: skip

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)

            async def tokens() -> AsyncIterator[bytes]:
                try:
                    await asyncio.sleep(self.first_token_s)
                except BaseException:
                    self.cancelled.set()
                    raise
                for i in range(int(body.get("max_tokens", 3))):
                    yield f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n'.encode()
                    await asyncio.sleep(self.tokens_s)
                yield b"data: [DONE]\n\n"

            if body.get("stream"):
                return StreamingResponse(tokens(), media_type="text/event-stream")
            usage = {"completion_tokens": 1, "prompt_tokens": 1}
            return JSONResponse({"choices": [{"text": "x"}], "usage": usage})

        routes = [
            Route("/kv/info", info),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
        self.inner = Starlette(routes=routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """The Starlette app, except that a ``"boom"`` stream's connection drops after its
        headers (what a worker killed mid-answer looks like)."""
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.inner(scope, receive, send)
            return
        message = await receive()
        if b'"boom"' in message.get("body", b""):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            raise ConnectionAbortedError("dies before its first token")
        replayed = False

        async def again() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.inner(scope, again, send)


@contextmanager
def _front(worker: _Worker, limits: ServeLimits | None = None) -> Iterator[tuple[Fleet, str]]:
    with serving(worker) as served:
        url = str(served.base_url).rstrip("/")
        config = FleetConfig(
            worker_urls=[url],
            mode=ConsistencyMode.APPROXIMATE,
            health_interval_s=0.3,
            limits=limits or ServeLimits(),
        )
        fleet = Fleet(FleetTokenizer(ensure_checkpoint("tiny")), config)
        fleet.attach(url)
        try:
            with serving(create_frontdoor_app(fleet)) as front:
                yield fleet, str(front.base_url).rstrip("/")
        finally:
            fleet.close()


def _inflight(fleet: Fleet) -> list[int]:
    return [view.inflight for view in fleet.worker_views()]


def test_the_front_door_refuses_a_body_over_the_workers_configured_limit() -> None:
    """The workers' ``[limits]`` hold at the front door: a body over them is a 413 there, and
    the worker never sees it (the front door enforced its own defaults, 4 MiB, so a worker
    configured smaller refused it by closing, and that read as a dead worker)."""
    worker = _Worker()
    body = {"prompt": "x" * 2048, "max_tokens": 2}
    with _front(worker, ServeLimits(max_body_bytes=1024)) as (fleet, base):
        refused = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 413, refused.text
        assert worker.bodies == [] and all(view.healthy for view in fleet.worker_views())
        small = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200, small.text
    with _front(worker) as (_fleet, base):  # the default, 4 MiB, lets it through
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200


def test_bodies_json_accepts_but_cannot_send_on_are_400s_and_book_nothing() -> None:
    """``NaN``, a float past its range and a lone surrogate parse, could not be sent on to
    the worker: a 500 whose reservation was never released (the worker looked busy for
    good). And a client's ``kvstrata_transfer`` (the router's field) reached the worker."""
    worker = _Worker()
    with _front(worker) as (fleet, base):
        for raw in (
            b'{"prompt":"hi","max_tokens":2,"junk":NaN}',
            b'{"prompt":"hi","max_tokens":2,"junk":1e400}',
            b'{"prompt":"hi","max_tokens":2,"junk":"\\ud800"}',
        ):
            response = httpx.post(f"{base}/v1/completions", content=raw, timeout=30)
            assert response.status_code == 400, (raw, response.text)
        assert _inflight(fleet) == [0] and worker.bodies == []
        transfer = {"request_id": "someone-elses-kv", "timeout_s": 600}
        body = {"prompt": "hi", "max_tokens": 2, "kvstrata_transfer": transfer}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
        assert "kvstrata_transfer" not in worker.bodies[-1]


def test_a_stream_whose_client_left_before_its_first_token_stops_the_worker() -> None:
    """The stream's head was awaited without watching the client: the worker computed a
    whole prefill for nobody, counted in flight all along."""
    worker = _Worker(first_token_s=8.0)
    with _front(worker) as (fleet, base):
        host, port = base.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "hello", "max_tokens": 3, "stream": True}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        client = socket.create_connection((host, int(port)))
        client.sendall(head.encode() + body)
        deadline = time.monotonic() + 30  # the request reached the worker (slow on a loaded box)
        while not worker.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        client.close()
        assert worker.cancelled.wait(5.0), "the worker kept computing for a client that left"
        deadline = time.monotonic() + 5
        while _inflight(fleet) != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _inflight(fleet) == [0]


def test_a_worker_re_attached_after_a_failed_request_keeps_its_requests_in_flight() -> None:
    """One request failing before its first token marks the worker unhealthy; the health
    round re-attaches it (same epoch) — with an empty in-flight table, so a worker still
    streaming four answers looked idle to the router."""
    worker = _Worker(tokens_s=1.0)  # each stream runs ~10 s: the checks below come well before
    with _front(worker) as (fleet, base):

        async def until(condition: Callable[[], bool], within_s: float = 4.0) -> bool:
            deadline = time.monotonic() + within_s
            while not condition() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return condition()

        async def stream(prompt: str) -> int:
            body = {"prompt": prompt, "max_tokens": 10, "stream": True}
            async with (
                httpx.AsyncClient(timeout=60) as client,
                client.stream("POST", f"{base}/v1/completions", json=body) as response,
            ):
                async for _ in response.aiter_raw():
                    pass
                return response.status_code

        async def scenario() -> list[int]:
            running = [asyncio.create_task(stream("hello")) for _ in range(4)]
            assert await until(lambda: _inflight(fleet) == [4])
            assert await stream("boom") == 503  # its only worker was flagged
            # Health rounds: re-attached, healthy again.
            assert await until(lambda: fleet.worker_views()[0].healthy)
            views = fleet.worker_views()
            assert views[0].healthy and views[0].inflight == 4
            return list(await asyncio.gather(*running))

        assert asyncio.run(scenario()) == [200] * 4
        assert _inflight(fleet) == [0]


def test_an_answer_that_arrives_as_the_client_leaves_is_closed() -> None:
    """``unless_client_left`` dropped a response that completed while it asked whether the
    client was gone, without closing it: its pooled connection stayed checked out."""

    class Answer:
        closed = False

        async def aclose(self) -> None:
            self.closed = True

    answer = Answer()

    async def send() -> Answer:
        await asyncio.sleep(0.3)
        return answer

    async def left() -> bool:
        await asyncio.sleep(0.3)  # the answer lands while the client is being checked
        return True

    async def scenario() -> None:
        with pytest.raises(ClientGone):
            await unless_client_left(left, send())

    asyncio.run(scenario())
    assert answer.closed


def test_a_failed_restart_neither_ends_the_watch_nor_kills_the_workers_it_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarted workers are children of the watch thread, and Linux SIGTERMs them when it
    ends (PDEATHSIG): one restart that raised (its log directory removed) ended the thread,
    took every worker it had restarted with it, and nothing was restarted again."""
    monkeypatch.setattr(WorkerSpec, "command", lambda self: ["sleep", "1000"])
    logs = tmp_path / "logs"
    logs.mkdir()
    specs = [WorkerSpec(name, 1, log_path=logs / f"{name}.log") for name in ("w0", "w1")]
    supervisor = Supervisor(specs, restart=True)
    for worker in supervisor.workers:
        worker.start()
    supervisor._thread = threading.Thread(target=supervisor._watch, daemon=True)
    supervisor._thread.start()  # start() without waiting for /kv/info (sleep serves none)
    w0, w1 = supervisor.workers
    try:
        assert w0.process is not None and w1.process is not None
        os.kill(w0.process.pid, signal.SIGKILL)
        _until(lambda: w0.starts == 2 and w0.alive())
        shutil.rmtree(logs)  # the next restart's log file cannot be opened
        os.kill(w1.process.pid, signal.SIGKILL)
        time.sleep(1.5)
        assert supervisor._thread.is_alive() and w0.alive()
        logs.mkdir()
        _until(lambda: w1.starts == 2 and w1.alive(), timeout_s=10.0)  # after its backoff
    finally:
        supervisor.stop()


def _until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
