"""Bad input answered as the client's fault, the same at a worker and at the front door.

A chat template that refuses a conversation (or none at all), a stop string longer than
``protocol.MAX_STOP_CHARS``, and OpenAI parameters the engine cannot honour (tool calling,
``response_format`` other than text, ``logit_bias``) are each an OpenAI-shaped 400 naming the
parameter: before, the first was a 500 with a traceback (a bare text/plain 500 at the front
door), the second cost the event loop quadratic time per token, and the third was silently
dropped. The worker runs the tiny model behind a real uvicorn; the front door has no workers,
so a body it accepts is a 503 (no worker) and one it refuses is a 400.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from http_helpers import serving, streamed_deltas
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import load_model
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.index.model import ConsistencyMode
from kvstrata.serve import protocol
from kvstrata.serve.app import create_app
from kvstrata.serve.streaming import TextAssembler
from kvstrata.telemetry import KvMetrics

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ALTERNATING = (  # as Llama-2's and Mistral's templates: roles must alternate
    "{% for m in messages %}{% if loop.index0 % 2 == 1 and m['role'] == 'user' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
    "{% endif %}{{ m['content'] }}{% endfor %}"
)
STOP_BOUND = 1024  # protocol.MAX_STOP_CHARS, stated here so the test means the same on any code
TWO_USERS = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]


class _Both:
    """The worker's client and the front door's (with its tokenizer, to change the template)."""

    def __init__(
        self, engine: ReferenceEngine, worker: httpx.Client, fleet: Fleet, door: httpx.Client
    ) -> None:
        self.engine, self.worker, self.fleet, self.door = engine, worker, fleet, door

    @contextmanager
    def template(self, template: str | None) -> Iterator[None]:
        """Both tokenizers' chat template set to ``template`` for the block."""
        tokenizers = [self.engine.tokenizer, self.fleet.tokenizer.tokenizer]
        before = [tokenizer.chat_template for tokenizer in tokenizers]
        for tokenizer in tokenizers:
            tokenizer.chat_template = template
        try:
            yield
        finally:
            for tokenizer, saved in zip(tokenizers, before, strict=True):
                tokenizer.chat_template = saved


@pytest.fixture(scope="module")
def both() -> Iterator[_Both]:
    metrics = KvMetrics()
    engine = ReferenceEngine(load_model(MODEL), EngineConfig(pool_blocks=128), metrics=metrics)
    app = create_app(engine, model_name=MODEL, metrics=metrics)
    fleet = Fleet(
        FleetTokenizer(load_model(MODEL).path),
        FleetConfig(mode=ConsistencyMode.APPROXIMATE, worker_urls=[]),
    )
    with serving(app) as worker, serving(create_frontdoor_app(fleet)) as door:
        yield _Both(engine, worker, fleet, door)


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}


def _refused(response: httpx.Response, param: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = dict(response.json()["error"])
    assert error["type"] == "invalid_request_error", error
    assert error["code"] == "invalid_value", error
    assert error["param"] == param, error
    return error


def _accepted(both: _Both, path: str, body: dict[str, Any]) -> None:
    """200 at the worker; past validation at the front door (503: it has no worker)."""
    answer = both.worker.post(path, json=body)
    assert answer.status_code == 200, answer.text
    assert both.door.post(path, json=body).status_code == 503


# ---- chat templates ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("template", "says"), [(ALTERNATING, "must alternate"), (None, "no chat template")]
)
def test_a_chat_template_refusal_is_a_400_at_the_worker_and_the_front_door(
    both: _Both, caplog: pytest.LogCaptureFixture, template: str | None, says: str
) -> None:
    """A template's ``raise_exception`` (jinja2 TemplateError) and a model without a chat
    template are the client's to fix: a 400 on ``messages``, nothing logged as a failure."""
    caplog.set_level(logging.WARNING)
    body = {"model": MODEL, "messages": TWO_USERS, "max_tokens": 2}
    with both.template(template):
        for client in (both.worker, both.door):
            assert says in _refused(client.post(CHAT, json=body), "messages")["message"]
            streamed = client.post(CHAT, json={**body, "stream": True})
            assert says in _refused(streamed, "messages")["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # the template the model has takes the same conversation; the worker still serves
    assert both.worker.post(CHAT, json=body).status_code == 200


# ---- stop strings --------------------------------------------------------------------------
def test_a_stop_string_longer_than_the_bound_is_a_400(both: _Both) -> None:
    for stop in ("\x01" * (STOP_BOUND + 1), ["ok", "x" * 100_000]):
        for client in (both.worker, both.door):
            error = _refused(client.post(COMPLETIONS, json=_completion(stop=stop)), "stop")
            assert str(STOP_BOUND) in error["message"]
    _accepted(both, COMPLETIONS, _completion(stop=["\x01" * STOP_BOUND, "\n"]))
    assert getattr(protocol, "MAX_STOP_CHARS", None) == STOP_BOUND


def test_holding_back_a_partial_stop_costs_each_token_its_own_characters() -> None:
    """Four stop strings of the longest length, never matched, over 4,000 tokens: the check
    of what to hold back sliced every tail up to 1,023 characters per token (about 2 s of
    CPU here); tracked incrementally it is a few milliseconds."""
    stops = [chr(0x100 + i) * STOP_BOUND for i in range(4)]
    pieces = ["ab"] * 4000
    assembler = TextAssembler(lambda ids: "".join(pieces[i] for i in ids), stops)
    ids: list[int] = []
    started = time.thread_time()
    for i in range(len(pieces)):
        ids.append(i)
        assert assembler.push(ids) == "ab"
    assert time.thread_time() - started < 0.5


def _brute_force_partial(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that is a proper prefix of a stop (the old definition)."""
    longest = max(len(stop) for stop in stops)
    for size in range(min(longest - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-size:]) for stop in stops):
            return size
    return 0


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4),
    pieces=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=25),
)
def test_partial_stops_match_the_brute_force_definition(
    stops: list[str], pieces: list[str]
) -> None:
    """What is held back, emitted and where the text stops are as before the change."""
    assembler = TextAssembler(lambda ids: "".join(pieces[i] for i in ids), stops)
    emitted, ids = "", []
    for i in range(len(pieces)):
        ids.append(i)
        emitted += assembler.push(ids)
        if assembler.stopped:
            break
        text = "".join(pieces[: i + 1])
        assert emitted == text[: len(text) - _brute_force_partial(text, stops)]
    emitted += assembler.finish(ids)
    # A stop ends the text as soon as it is complete in what was generated so far (one stop
    # may complete before another that starts earlier: "baa" stops at "a" before "baab").
    expected, stopped, text = "".join(pieces), False, ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        if hits:
            expected, stopped = text[: min(hits)], True
            break
    assert emitted == assembler.text == expected
    assert assembler.stopped == stopped


def test_streamed_deltas_with_stops_equal_the_whole_answer() -> None:
    rng = random.Random(7)
    for _ in range(200):
        pieces = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(30)]
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(2, 8)))]
        assembler = TextAssembler(lambda ids, p=pieces: "".join(p[i] for i in ids), stops)
        out = streamed_deltas(assembler, len(pieces))
        assert "".join(out) == assembler.text
        assert not any(stop in assembler.text for stop in stops)


# ---- parameters the engine cannot honour ---------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
UNSUPPORTED = [
    (CHAT, {"tools": [TOOL]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    (CHAT, {"logit_bias": {"1": 100}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"1": -100}}, "logit_bias"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            ]
        },
        "messages[1].tool_calls",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]},
        "messages[0].tool_call_id",
    ),
    (
        CHAT,
        {"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
        "messages[0].function_call",
    ),
    (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "function", "content": "42"}]}, "messages[0].role"),
]


@pytest.mark.parametrize(("path", "change", "param"), UNSUPPORTED)
def test_a_parameter_the_engine_cannot_honour_is_a_400(
    both: _Both, path: str, change: dict[str, Any], param: str
) -> None:
    body = {**(_chat() if path == CHAT else _completion()), **change}
    worker = _refused(both.worker.post(path, json=body), param)
    door = _refused(both.door.post(path, json=body), param)
    assert worker == door  # the same answer, whichever refused it


def test_parameters_that_ask_for_nothing_and_benign_extras_are_accepted(both: _Both) -> None:
    """What OpenAI's SDKs send by default or echo back (an assistant message with null tool
    calls) and the fields that change nothing in the answer stay accepted."""
    nothing = {
        "tools": [],
        "tool_choice": "none",
        "functions": None,
        "function_call": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "user": "u1",
        "store": False,
        "metadata": {"k": "v"},
        "parallel_tool_calls": False,
        "service_tier": "auto",
        "stream_options": None,
        "seed": 3,
    }
    messages = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "yo", "tool_calls": None, "function_call": None},
        {"role": "user", "content": "again", "tool_calls": [], "tool_call_id": None},
    ]
    _accepted(both, CHAT, _chat(messages=messages, **nothing))
    _accepted(both, COMPLETIONS, _completion(logit_bias=None, user="u1", metadata={}))
