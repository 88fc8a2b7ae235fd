"""Fuzzing the worker's HTTP boundary: bodies, headers and raw bytes against a real server.

One tiny-model worker (``serve.app.create_app``) runs under uvicorn for the module. Every
malformed request must be a 4xx in OpenAI's error shape — never a 5xx, never a dropped
connection — and leave the engine's pool untouched; a valid request right after the fuzzing
is served normally. ``BodyLimits`` is also driven at the ASGI level, because uvicorn's own
HTTP parser refuses some header values before any app sees them (another server might not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import FEW, dumps, json_value, odd_number, odd_text
from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.runtime.config import ServeLimits
from kvstrata.serve.app import create_app
from kvstrata.serve.limits import BodyLimits
from kvstrata.telemetry import KvMetrics

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
VALID_COMPLETION = {"model": MODEL, "prompt": "fuzz: a valid prompt", "max_tokens": 2}
VALID_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2}
pytestmark = pytest.mark.timeout(300)


@dataclass
class Worker:
    engine: ReferenceEngine
    client: httpx.Client


@pytest.fixture(scope="module")
def worker(tiny_model: LoadedModel) -> Iterator[Worker]:
    metrics = KvMetrics()
    engine = ReferenceEngine(tiny_model, EngineConfig(pool_blocks=256), metrics=metrics)
    limits = ServeLimits(max_tokens=4)  # a valid body the fuzz finds generates little
    app = create_app(engine, model_name=MODEL, metrics=metrics, limits=limits)
    with serving(app) as client:
        yield Worker(engine, client)


def _check_answer(worker: Worker, response: httpx.Response, blocks_before: int) -> None:
    """A 200 (the fuzz found a valid request) or a 4xx in OpenAI's shape that stored nothing."""
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        return
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    assert worker.engine.pool.blocks_used == blocks_before


def _post(worker: Worker, path: str, content: bytes) -> None:
    before = worker.engine.pool.blocks_used
    response = worker.client.post(
        path, content=content, headers={"content-type": "application/json"}
    )
    _check_answer(worker, response, before)


def _still_serves(worker: Worker) -> None:
    for path, body in zip(ENDPOINTS, (VALID_COMPLETION, VALID_CHAT), strict=True):
        response = worker.client.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1


# ---- bodies -------------------------------------------------------------------------------
@FEW
@given(path=st.sampled_from(ENDPOINTS), value=json_value)
@example(path=ENDPOINTS[0], value={"prompt": "\ud800", "max_tokens": 1})
@example(path=ENDPOINTS[0], value={"prompt": [10**30], "max_tokens": 1})
@example(path=ENDPOINTS[1], value={"messages": [{"role": "user", "content": [{"type": 1}]}]})
def test_random_json_bodies_are_4xx(worker: Worker, path: str, value: Any) -> None:
    _post(worker, path, dumps(value))


def _mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with some fields replaced by random values and some random fields added."""
    fields = [*base, "temperature", "top_p", "top_k", "seed", "stop", "stream", "n", "user"]
    fields += ["stream_options", "logprobs", "kvstrata_tenant", "max_completion_tokens"]
    odd = json_value | odd_number | odd_text
    return st.fixed_dictionaries(
        {}, optional={name: odd for name in fields} | {"ignore_eos": st.booleans()}
    ).map(lambda changes: {**base, **changes})


@FEW
@given(body=_mutated(VALID_COMPLETION))
@example(body={**VALID_COMPLETION, "top_k": 10**30, "temperature": 0.5})
@example(body={**VALID_COMPLETION, "seed": 1 << 64})
@example(body={**VALID_COMPLETION, "stop": ["\ud800"]})
@example(body={**VALID_COMPLETION, "kvstrata_tenant": "a\udfffb"})
def test_mutated_completion_bodies(worker: Worker, body: dict[str, Any]) -> None:
    _post(worker, ENDPOINTS[0], dumps(body))


@FEW
@given(
    body=_mutated(VALID_CHAT),
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | odd_text},
            optional={"content": odd_text | json_value, "name": odd_text},
        ),
        max_size=3,
    ),
)
def test_mutated_chat_bodies(
    worker: Worker, body: dict[str, Any], messages: list[dict[str, Any]]
) -> None:
    _post(worker, ENDPOINTS[1], dumps({**body, "messages": messages}))


@FEW
@given(path=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=200))
@example(path=ENDPOINTS[0], raw=b'{"prompt": "\xff\xfe", "max_tokens": 1}')
@example(path=ENDPOINTS[1], raw=b"[" * 50_000)
@example(path=ENDPOINTS[0], raw=b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")
def test_raw_bytes_bodies_are_4xx(worker: Worker, path: str, raw: bytes) -> None:
    _post(worker, path, raw)


# ---- headers ------------------------------------------------------------------------------
# What an HTTP/1.1 header value may hold (RFC 9110 field-value: VCHAR, obs-text, SP, HTAB).
header_value = st.text(
    st.sampled_from("\t" + "".join(map(chr, [*range(0x20, 0x7F), *range(0x80, 0x100)]))),
    max_size=200,
).map(str.strip)


@FEW
@given(
    path=st.sampled_from(ENDPOINTS),
    tenant=header_value | st.just("t" * 129),
    authorization=header_value,
    content_type=header_value,
)
def test_odd_header_values(
    worker: Worker, path: str, tenant: str, authorization: str, content_type: str
) -> None:
    body = VALID_COMPLETION if path == ENDPOINTS[0] else VALID_CHAT
    before = worker.engine.pool.blocks_used
    response = worker.client.post(
        path,
        content=dumps(body),
        headers=[
            (b"x-kvstrata-tenant", tenant.encode("latin-1")),
            (b"authorization", authorization.encode("latin-1")),
            (b"content-type", content_type.encode("latin-1")),
        ],
    )
    _check_answer(worker, response, before)


def test_the_worker_still_serves_after_the_fuzzing(worker: Worker) -> None:
    """Runs after the fuzz tests above (file order): the engine and its loop are intact."""
    _still_serves(worker)


# ---- BodyLimits at the ASGI level -----------------------------------------------------------
@FEW
@given(length=st.binary(max_size=12))
@example(length="²".encode("latin-1"))  # str.isdigit() says yes; int() says no
@example(length="\u0663".encode())
def test_any_content_length_header_is_answered(length: bytes) -> None:
    """Whatever bytes a Content-Length header holds, the middleware answers (or passes on)."""
    reached: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(b"content-length", length)],
    }
    asyncio.run(BodyLimits(app)(scope, receive, send))
    status = sent[0]["status"]
    text = length.decode("latin-1").strip()
    if text.isascii() and text.isdigit():
        assert status in (204, 413)
    else:
        assert status == 400 and not reached
