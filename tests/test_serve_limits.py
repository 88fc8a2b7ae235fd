"""What a worker refuses before it computes: bad input.

A real uvicorn server (tiny model); bodies that are not valid JSON text for httpx's encoder
(lone surrogates) are sent as the raw JSON escapes a client would send.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import load_model
from kvstrata.serve.app import create_app
from kvstrata.telemetry import KvMetrics

MODEL = "tiny"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class Served:
    engine: ReferenceEngine
    client: httpx.Client


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    metrics = KvMetrics()
    engine = ReferenceEngine(load_model(MODEL), EngineConfig(pool_blocks=128), metrics=metrics)
    app = create_app(engine, model_name=MODEL, metrics=metrics)
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
