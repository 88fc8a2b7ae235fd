"""``kvstrata serve``: the OpenAI-compatible app over a real uvicorn server and the tiny model.

One server per module runs in a background thread on a free 127.0.0.1 port; httpx is the
client. Prompts carry the test's name so cache hits of one test never leak into another.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from http_helpers import serving, streamed_deltas
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import load_model
from kvstrata.runtime import tokenization
from kvstrata.serve.app import create_app
from kvstrata.serve.streaming import TextAssembler
from kvstrata.telemetry import KvMetrics

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Served:
    engine: ReferenceEngine
    metrics: KvMetrics
    client: httpx.Client


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    metrics = KvMetrics()
    engine = ReferenceEngine(load_model(MODEL), EngineConfig(pool_blocks=256), metrics=metrics)
    app = create_app(engine, model_name=MODEL, metrics=metrics)
    with serving(app) as client:
        yield Served(engine=engine, metrics=metrics, client=client)


def _chat_body(text: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant for kvstrata tests."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(extra)
    return body


def _completion_body(prompt: Any, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body.update(extra)
    return body


def _long_prompt(tag: str) -> str:
    return f"[{tag}] " + "The quick brown fox jumps over the lazy dog near the river bank. " * 4


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json())


def _sse_data(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def _metric(served: Served, name: str, labels: dict[str, str] | None = None) -> float:
    text = served.client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in (labels or {}).items()
            ):
                return float(sample.value)
    return 0.0


def _assert_error(response: httpx.Response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code


# ---- non-streaming ------------------------------------------------------------------------
def test_completion_greedy_reports_usage_and_cached_tokens(served: Served) -> None:
    body = _completion_body(_long_prompt("completion"))
    first = _ok(served.client.post("/v1/completions", json=body))
    second = _ok(served.client.post("/v1/completions", json=body))
    assert first["object"] == "text_completion"
    assert first["model"] == MODEL
    choice = first["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["text"] == second["choices"][0]["text"]
    usage, again = first["usage"], second["usage"]
    assert usage["prompt_tokens"] > served.engine.config.block_size
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"]
    # the first answer's generated blocks continue the prompt: reuse reaches the last token
    assert cached == again["prompt_tokens"] - 1


def test_ignore_eos_generates_max_tokens(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``ignore_eos`` (benchmark clients send it so every answer has the same length):
    with every token an EOS, a request stops after one token unless it sets the flag."""
    vocab = int(served.engine.model.config.vocab_size)
    monkeypatch.setattr(served.engine, "eos_token_ids", frozenset(range(vocab)))
    body = _completion_body(_long_prompt("ignore-eos"), max_tokens=5)
    stopped = _ok(served.client.post("/v1/completions", json=body))
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 5
    body["ignore_eos"] = True
    full = _ok(served.client.post("/v1/completions", json=body))
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 5


def test_completion_accepts_token_ids_and_single_item_list(served: Served) -> None:
    text = _long_prompt("token-ids")
    ids = served.engine.encode_prompt(text)
    by_text = _ok(served.client.post("/v1/completions", json=_completion_body(text)))
    by_ids = _ok(served.client.post("/v1/completions", json=_completion_body(ids)))
    by_list = _ok(served.client.post("/v1/completions", json=_completion_body([text])))
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_list["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_explicit_nulls_mean_the_defaults_as_in_openais_api(served: Served) -> None:
    nulls = dict.fromkeys(
        ("top_p", "top_k", "stream", "n", "frequency_penalty", "presence_penalty", "ignore_eos")
    )
    text = _long_prompt("nulls")
    plain = _ok(served.client.post("/v1/completions", json=_completion_body(text)))
    nulled = _ok(served.client.post("/v1/completions", json={**_completion_body(text), **nulls}))
    assert nulled["choices"][0]["text"] == plain["choices"][0]["text"]
    sampled = _completion_body(text, temperature=None, max_tokens=2)
    assert served.client.post("/v1/completions", json=sampled).status_code == 200


def test_chat_completion_greedy_reports_cached_tokens(served: Served) -> None:
    body = _chat_body(_long_prompt("chat"))
    first = _ok(served.client.post("/v1/chat/completions", json=body))
    second = _ok(served.client.post("/v1/chat/completions", json=body))
    assert first["object"] == "chat.completion"
    message = first["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == second["choices"][0]["message"]["content"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_chat_text_parts_equal_plain_content(served: Served) -> None:
    text = _long_prompt("parts")
    plain = _ok(served.client.post("/v1/chat/completions", json=_chat_body(text)))
    parts = _chat_body("")
    parts["messages"][1]["content"] = [{"type": "text", "text": text}]
    as_parts = _ok(served.client.post("/v1/chat/completions", json=parts))
    assert as_parts["choices"][0]["message"] == plain["choices"][0]["message"]
    assert as_parts["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_stop_string_ends_and_trims_output(served: Served) -> None:
    body = _completion_body(_long_prompt("stop"), max_tokens=12)
    full = _ok(served.client.post("/v1/completions", json=body))["choices"][0]["text"]
    assert len(full) > 8
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    stopped = _ok(served.client.post("/v1/completions", json={**body, "stop": [stop]}))
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    with served.client.stream(
        "POST", "/v1/completions", json={**body, "stop": stop, "stream": True}
    ) as r:
        data = _sse_data(r)
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- streaming ------------------------------------------------------------------------------
def test_chat_stream_equals_non_streaming_text(served: Served) -> None:
    body = _chat_body(_long_prompt("stream"), max_tokens=10)
    expected = _ok(served.client.post("/v1/chat/completions", json=body))
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with served.client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
        data = _sse_data(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *with_choices, usage_chunk = chunks
    deltas = [c["choices"][0]["delta"].get("content", "") for c in with_choices]
    assert "".join(deltas) == expected["choices"][0]["message"]["content"]
    assert (
        with_choices[-1]["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"]
    )
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_completion_stream_equals_non_streaming_text(served: Served) -> None:
    body = _completion_body(_long_prompt("completion-stream"))
    expected = _ok(served.client.post("/v1/completions", json=body))["choices"][0]["text"]
    with served.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        data = _sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_client_disconnect_mid_stream_does_not_wedge_the_server(served: Served) -> None:
    body = _chat_body(_long_prompt("disconnect"), max_tokens=400, stream=True)
    with served.client.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    assert served.client.get("/health").status_code == 200
    after = _ok(served.client.post("/v1/chat/completions", json=_chat_body("still there?")))
    assert after["usage"]["completion_tokens"] > 0


# ---- discovery and metrics --------------------------------------------------------------------
def test_models_and_health(served: Served) -> None:
    models = _ok(served.client.get("/v1/models"))
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    assert _ok(served.client.get("/health")) == {"status": "ok"}


def test_metrics_expose_and_grow(served: Served) -> None:
    labels = {"endpoint": "/v1/chat/completions", "status": "200"}
    requests_before = _metric(served, "kvstrata_requests_total", labels)
    matched_before = _metric(served, "kvstrata_matched_tokens_total", {"tier": "device"})
    ttft_before = _metric(served, "kvstrata_ttft_seconds_count")
    body = _chat_body(_long_prompt("metrics"))
    _ok(served.client.post("/v1/chat/completions", json=body))
    _ok(served.client.post("/v1/chat/completions", json=body))
    text = served.client.get("/metrics").text
    for name in (
        "kvstrata_requests_total",
        "kvstrata_matched_tokens_total",
        "kvstrata_ttft_seconds",
        "kvstrata_pool_blocks_used",
    ):
        assert name in text
    assert _metric(served, "kvstrata_requests_total", labels) == requests_before + 2
    assert _metric(served, "kvstrata_matched_tokens_total", {"tier": "device"}) > matched_before
    assert _metric(served, "kvstrata_ttft_seconds_count") == ttft_before + 2
    assert _metric(served, "kvstrata_pool_blocks_used") > 0


def test_request_log_is_one_json_line_without_prompt_text(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvstrata.serve")
    secret = "zebra-quartz-4711"
    reply = _ok(served.client.post("/v1/chat/completions", json=_chat_body(f"say {secret}")))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvstrata.serve"]
    mine = [line for line in lines if reply["id"] == f"chatcmpl-{line['request_id']}"]
    assert len(mine) == 1
    assert mine[0]["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert mine[0]["tenant"] == "default"
    assert all(secret not in r.getMessage() for r in caplog.records)


# ---- errors ---------------------------------------------------------------------------------
_TOO_LONG = list(range(100, 100 + 4090))
BAD_REQUESTS = [
    ("negative-max-tokens", "/v1/completions", _completion_body("hi", max_tokens=-1), 400, None),
    ("temperature", "/v1/chat/completions", _chat_body("hi", temperature=2.5), 400, None),
    ("n", "/v1/chat/completions", _chat_body("hi", n=2), 400, None),
    ("top-logprobs", "/v1/chat/completions", _chat_body("hi", top_logprobs=3), 400, None),
    ("empty-messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
    ("messages-type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, None),
    ("max-tokens-type", "/v1/completions", _completion_body("hi", max_tokens="5"), 400, None),
    ("prompt-type", "/v1/completions", _completion_body(5), 400, None),
    ("batched-prompts", "/v1/completions", _completion_body(["a", "b"]), 400, None),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, 400, None),
    ("body-not-object", "/v1/completions", [1, 2], 400, None),
    ("token-out-of-vocab", "/v1/completions", _completion_body([10**9]), 400, None),
    (
        "image-part",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ],
        },
        400,
        "unsupported_content_type",
    ),
    (
        "unknown-model",
        "/v1/chat/completions",
        _chat_body("hi", model="gpt-9"),
        404,
        "model_not_found",
    ),
    (
        "context-too-long",
        "/v1/completions",
        _completion_body(_TOO_LONG, max_tokens=16),
        400,
        "context_length_exceeded",
    ),
    (
        "context-too-long-stream",
        "/v1/completions",
        _completion_body(_TOO_LONG, max_tokens=16, stream=True),
        400,
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_get_openai_errors(
    served: Served, path: str, body: Any, status: int, code: str | None
) -> None:
    _assert_error(served.client.post(path, json=body), status, code)
    assert served.client.get("/health").status_code == 200


def test_tenant_header_and_body_must_agree(served: Served) -> None:
    body = _completion_body("hi", kvstrata_tenant="a")
    response = served.client.post("/v1/completions", json=body, headers={"X-Kvstrata-Tenant": "b"})
    _assert_error(response, 400)
    agreeing = served.client.post("/v1/completions", json=body, headers={"X-Kvstrata-Tenant": "a"})
    assert agreeing.status_code == 200


def test_malformed_json_is_a_400(served: Served) -> None:
    response = served.client.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    _assert_error(response, 400, "invalid_json")
    assert served.client.get("/health").status_code == 200


def test_text_far_too_long_for_the_context_is_refused_before_tokenizing(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = served.engine
    bound = tokenization.max_token_bytes(engine.tokenizer)
    text = "a" * (2 * engine.max_model_len * bound + 1)

    def never(*args: object) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(engine, "encode_prompt", never)
    monkeypatch.setattr(engine, "encode_chat", never)
    response = served.client.post("/v1/completions", json=_completion_body(text))
    _assert_error(response, 400, "context_length_exceeded")
    chat = served.client.post("/v1/chat/completions", json=_chat_body(text))
    _assert_error(chat, 400, "context_length_exceeded")
    monkeypatch.undo()
    assert served.client.post("/v1/completions", json=_completion_body("hi")).status_code == 200


def test_unknown_route_is_an_openai_404(served: Served) -> None:
    _assert_error(served.client.get("/v1/nothing"), 404)


def test_engine_failure_is_a_500_and_the_next_request_succeeds(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = _chat_body(_long_prompt("engine-error"))
    expected = _ok(served.client.post("/v1/chat/completions", json=body))
    model = served.engine.model
    original = model.forward
    calls = 0

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected forward failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", fail_once)
    _assert_error(served.client.post("/v1/chat/completions", json=body), 500, "internal_error")
    after = _ok(served.client.post("/v1/chat/completions", json=body))
    assert after["choices"][0]["message"] == expected["choices"][0]["message"]
    assert after["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


def test_engine_failure_mid_stream_ends_the_stream_with_an_error(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = _chat_body(_long_prompt("stream-error"), max_tokens=8)
    expected = _ok(served.client.post("/v1/chat/completions", json=body))
    assert expected["usage"]["completion_tokens"] > 2
    model = served.engine.model
    original = model.forward
    calls = 0

    def fail_on_second_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # prefill, first decode step, then fail
            raise RuntimeError("injected decode failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", fail_on_second_step)
    with served.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        data = _sse_data(r)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "internal_error"
    monkeypatch.undo()
    after = _ok(served.client.post("/v1/chat/completions", json=body))
    assert after["choices"][0]["message"] == expected["choices"][0]["message"]


# ---- tenants --------------------------------------------------------------------------------
def test_tenants_do_not_share_cached_prefixes(served: Served) -> None:
    # A raw prompt that starts with a unique tag: no other request shares even its first block.
    body = _completion_body(_long_prompt("tenants"))
    path = "/v1/completions"

    def cached(response: httpx.Response) -> int:
        return int(_ok(response)["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(served.client.post(path, json=body, headers={"X-Kvstrata-Tenant": "A"})) == 0
    assert cached(served.client.post(path, json=body, headers={"X-Kvstrata-Tenant": "A"})) > 0
    assert cached(served.client.post(path, json={**body, "kvstrata_tenant": "B"})) == 0
    assert cached(served.client.post(path, json=body)) == 0  # the default tenant


# ---- incremental detokenisation ----------------------------------------------------------------
def test_text_assembler_holds_back_partial_stop_and_trims() -> None:
    pieces = ["Hel", "lo ", "wo", "rld", "!"]

    def decode(ids: Any) -> str:
        return "".join(pieces[i] for i in ids)

    assembler = TextAssembler(decode, ["world"])
    out = streamed_deltas(assembler, len(pieces))
    assert out == ["Hel", "lo ", "", "", ""]
    assert assembler.text == "Hello " and assembler.stopped
