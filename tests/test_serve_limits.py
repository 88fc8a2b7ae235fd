"""What a worker refuses before it computes: bad input, long outputs, large and slow bodies.

A real uvicorn server (tiny model) with small limits, so that each one is cheap to reach;
bodies that are not valid JSON text for httpx's encoder (lone surrogates) are sent as the
raw JSON escapes a client would send, and the body limits are probed with raw sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import load_model
from kvstrata.errors import ApiError, ContextTooLong
from kvstrata.runtime.config import ServeLimits
from kvstrata.runtime.config_schema import MIB
from kvstrata.serve.app import create_app
from kvstrata.serve.limits import output_budget
from kvstrata.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvstrata.telemetry import KvMetrics

MODEL = "tiny"
MAX_TOKENS = 24
BODY_TIMEOUT_S = 2.0  # wide enough for a loaded 2-core box to answer a header first
LIMITS = ServeLimits(max_tokens=MAX_TOKENS, max_body_bytes=4 * MIB, body_timeout_s=BODY_TIMEOUT_S)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class Served:
    engine: ReferenceEngine
    client: httpx.Client

    @property
    def port(self) -> int:
        return int(self.client.base_url.port or 0)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    metrics = KvMetrics()
    engine = ReferenceEngine(load_model(MODEL), EngineConfig(pool_blocks=512), metrics=metrics)
    app = create_app(engine, model_name=MODEL, metrics=metrics, limits=LIMITS)
    with serving(app) as client:
        yield Served(engine, client)


def _body(path: str, text: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body.update(extra)
    return body


def _post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` as ASCII JSON (``\\ud800`` stays an escape, as a client sends it)."""
    raw = json.dumps(body).encode("ascii")
    return served.client.post(path, content=raw, headers={"Content-Type": "application/json"})


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = dict(response.json()["error"])
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _text(path: str, response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return str(choice["message"]["content"] if path == CHAT else choice["text"])


# ---- bad input is a 400 before any stream starts ------------------------------------------
BAD_INPUT = {
    "seed-above-range": ({"seed": 1 << 64}, "seed"),
    "seed-below-range": ({"seed": -(1 << 63) - 1}, "seed"),
    "lone-surrogate-text": ({"text": "a\ud800b"}, None),
    "lone-surrogate-stop": ({"stop": ["\udc00"]}, "stop"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_400_before_the_stream(
    served: Served, case: str, path: str, stream: bool
) -> None:
    extra, param = BAD_INPUT[case]
    extra = dict(extra)
    text = extra.pop("text", "hello there")
    error = _error(_post(served, path, _body(path, text, stream=stream, **extra)), 400)
    assert error["code"] == "invalid_value"
    expected = param or ("prompt" if path == COMPLETIONS else "messages[0].content")
    assert error["param"] == expected
    if "surrogate" in case:
        assert "valid Unicode" in error["message"]
    assert served.client.get("/health").status_code == 200


def test_lone_surrogates_in_chat_content_parts_and_token_lists(served: Served) -> None:
    body = _body(CHAT, "")
    body["messages"][0]["content"] = [
        {"type": "text", "text": "fine"},
        {"type": "text", "text": "\ud83d"},
    ]
    assert _error(_post(served, CHAT, body), 400)["param"] == "messages[0].content"
    listed = _body(COMPLETIONS, "", prompt=["x\udfff"])
    assert _error(_post(served, COMPLETIONS, listed), 400)["param"] == "prompt"
    tenant = _body(COMPLETIONS, "hi", kvstrata_tenant="t\ud800")
    assert _error(_post(served, COMPLETIONS, tenant), 400)["param"] == "kvstrata_tenant"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_seeds_at_the_edges_of_the_range_are_served(served: Served, path: str) -> None:
    for seed in ((1 << 64) - 1, -(1 << 63)):
        body = _body(path, "seeded", seed=seed, temperature=0.8)
        first, again = _post(served, path, body), _post(served, path, body)
        assert _text(path, first) == _text(path, again)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_tiny_temperatures_are_greedy(served: Served, path: str, stream: bool) -> None:
    greedy = _text(path, _post(served, path, _body(path, "tiny temperature", max_tokens=6)))
    for temperature in (1e-300, 5e-324, 1e-6):
        body = _body(path, "tiny temperature", max_tokens=6, temperature=temperature)
        if not stream:
            assert _text(path, _post(served, path, body)) == greedy
            continue
        body["stream"] = True
        with served.client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(d) for d in data[:-1] if json.loads(d)["choices"]]
        key = "delta" if path == CHAT else None
        pieces = [
            c["choices"][0][key].get("content", "") if key else c["choices"][0]["text"]
            for c in chunks
        ]
        assert "".join(pieces) == greedy


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_small_temperatures_sample_without_nan(served: Served, path: str) -> None:
    for temperature in (1e-5, 1e-4, 1e-3):
        body = _body(path, "small temperature", max_tokens=6, temperature=temperature, seed=3)
        assert _text(path, _post(served, path, body)) is not None


# ---- max_tokens: the server's limit -------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("path", "field"),
    [(COMPLETIONS, "max_tokens"), (CHAT, "max_tokens"), (CHAT, "max_completion_tokens")],
)
def test_max_tokens_above_the_limit_is_a_400(
    served: Served, path: str, field: str, stream: bool
) -> None:
    body = _body(path, "too long an answer", stream=stream)
    body.pop("max_tokens")
    body[field] = MAX_TOKENS + 1
    error = _error(_post(served, path, body), 400)
    assert error["message"] == f"{field} must be at most {MAX_TOKENS}"
    assert error["param"] == field
    body[field] = MAX_TOKENS
    if not stream:
        assert _post(served, path, body).status_code == 200


def test_chat_without_max_tokens_stops_at_the_limit(served: Served) -> None:
    body = _body(CHAT, "tell me everything about foxes")
    body.pop("max_tokens")
    usage = _post(served, CHAT, body).json()["usage"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS


def test_the_context_window_still_bounds_the_output(served: Served) -> None:
    room = 3
    prompt = [100 + i % 500 for i in range(served.engine.max_model_len - room)]
    body = _body(COMPLETIONS, "", prompt=prompt)
    body.pop("max_tokens")  # the default (16) capped by the room left
    response = _post(served, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= room
    body["max_tokens"] = room + 1
    assert _error(_post(served, COMPLETIONS, body), 400)["code"] == "context_length_exceeded"


def test_output_budget_rules() -> None:
    def budget(body: dict[str, Any], prompt: int = 10) -> int:
        kind = ChatCompletionRequest if "messages" in body else CompletionRequest
        request = kind.model_validate(body)
        return output_budget(request, prompt_tokens=prompt, max_model_len=100, limit=50)

    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    text: dict[str, Any] = {"prompt": "x"}
    assert budget(chat) == 50  # chat: the limit ...
    assert budget(chat, prompt=80) == 20  # ... or the room left, whichever is less
    assert budget({**chat, "max_tokens": 7}) == 7
    assert budget(text) == 16  # completions: OpenAI's default ...
    assert budget(text, prompt=95) == 5  # ... capped by the room left
    assert budget({**text, "max_tokens": None}) == 50  # null: as long as allowed (as vLLM)
    assert budget({**text, "max_tokens": 50}) == 50
    assert budget({**text, "max_tokens": 40}, prompt=95) == 40  # the engine refuses it
    with pytest.raises(ApiError, match="max_tokens must be at most 50"):
        budget({**text, "max_tokens": 51})
    with pytest.raises(ApiError, match="max_completion_tokens must be at most 50"):
        budget({**chat, "max_tokens": 10, "max_completion_tokens": 51})
    with pytest.raises(ContextTooLong):
        budget(text, prompt=100)


# ---- request bodies: size and time ----------------------------------------------------------
def _raw_exchange(port: int, request: bytes, timeout_s: float) -> tuple[bytes, float]:
    """Send ``request`` and read until the server closes the connection (or ``timeout_s``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        started = time.monotonic()
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):  # b"": the server closed the connection
            received += chunk
        return received, time.monotonic() - started


def _status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower()
    return status, dict(json.loads(body)["error"])


def test_a_body_that_never_arrives_is_a_408_and_the_connection_closes(served: Served) -> None:
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt":'
    )
    raw, elapsed = _raw_exchange(served.port, request, timeout_s=10 * BODY_TIMEOUT_S)
    status, error = _status_and_error(raw)
    assert status == 408 and error["code"] == "request_timeout"
    assert BODY_TIMEOUT_S * 0.9 <= elapsed < 5 * BODY_TIMEOUT_S
    assert served.client.get("/health").status_code == 200


def test_a_declared_oversized_body_is_a_413_before_it_is_sent(served: Served) -> None:
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 10485760\r\n\r\n"
    )
    raw, elapsed = _raw_exchange(served.port, request, timeout_s=10 * BODY_TIMEOUT_S)
    status, error = _status_and_error(raw)
    assert status == 413 and error["code"] == "request_too_large"
    assert elapsed < BODY_TIMEOUT_S  # answered from the header, not after a timeout


@pytest.mark.parametrize("megabytes", [4.01, 10])
def test_a_body_over_the_limit_is_a_413_the_client_reads(served: Served, megabytes: float) -> None:
    """The server reads and drops the rest of the body before it answers and closes: closed
    with unread bytes, the connection would be reset and the answer lost (the client saw a
    dropped connection, a router forwarding the body a dead worker)."""
    prompt = "x" * int(megabytes * 1024 * 1024)
    for _ in range(3):
        response = served.client.post(
            COMPLETIONS,
            content=json.dumps({"model": MODEL, "prompt": prompt}).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert _error(response, 413)["code"] == "request_too_large"


def test_a_chunked_body_is_counted_as_it_arrives(served: Served) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(5 * 1024):
            yield b"x" * 1024
        yield b'"}'

    response = served.client.post(
        COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "content-length" not in response.request.headers  # sent chunked
    assert _error(response, 413)["code"] == "request_too_large"
    small = iter([b'{"model": "tiny", "prompt": "chunked", ', b'"max_tokens": 2}'])
    ok = served.client.post(
        COMPLETIONS, content=small, headers={"Content-Type": "application/json"}
    )
    assert ok.status_code == 200, ok.text


def test_refusals_are_counted_by_status(served: Served) -> None:
    def refused() -> float:
        text = served.client.get("/metrics").text
        line = 'kvstrata_requests_total{endpoint="/v1/completions",status="413"} '
        found = [row for row in text.splitlines() if row.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    before = refused()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 99999999\r\n\r\n"
    )
    _raw_exchange(served.port, request, timeout_s=10 * BODY_TIMEOUT_S)
    assert refused() == before + 1


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_prompts_are_tokenized_off_the_event_loop(
    served: Served, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A megabyte of text takes the tokenizer seconds: on the event loop it stalled every other
    request (health probes, streams) that long. The tokenizer releases the GIL in a thread."""
    seen: list[bool] = []
    name = "encode_chat" if path == CHAT else "encode_prompt"
    original = getattr(served.engine, name)

    def recording(*args: Any) -> list[int]:
        seen.append(_in_event_loop())
        return list(original(*args))

    monkeypatch.setattr(served.engine, name, recording)
    response = _post(served, path, _body(path, "tokenized in a thread"))
    assert response.status_code == 200, response.text
    assert seen == [False]
