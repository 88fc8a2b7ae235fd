"""Fuzzing the front door: the router's own parsing (``frontdoor._parse``, ``tenant_of``).

A real front door (``create_frontdoor_app`` over a ``Fleet`` in approximate mode, no event
plane) runs in front of one real tiny-model worker, both under uvicorn. A malformed request
is a 4xx in OpenAI's shape from the front door itself — never a 5xx, never forwarded (the
worker's request counter does not move) — and the worker stays healthy in the router's eyes:
no client input may make the router believe a worker is unreachable.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import FEW, FUZZ, deeply_nested, dumps, json_value, odd_text
from http_helpers import tiny_fleet
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.errors import ApiError
from kvstrata.fleet.answers import only_role_preamble, usage_of
from kvstrata.fleet.fleet import Fleet
from kvstrata.fleet.frontdoor import _parse
from kvstrata.fleet.worker_info import MAX_STEP_TOKENS, WorkerInfo, WorkerProtocolError
from kvstrata.runtime.config import ServeLimits
from kvstrata.telemetry import KvMetrics

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
VALID = (
    {"model": MODEL, "prompt": "front door fuzz", "max_tokens": 2},
    {"model": MODEL, "messages": [{"role": "user", "content": "front door"}], "max_tokens": 2},
)
pytestmark = pytest.mark.timeout(300)


@dataclass
class FrontDoor:
    fleet: Fleet
    worker_metrics: KvMetrics
    client: httpx.Client


@pytest.fixture(scope="module")
def front_door(tiny_model: LoadedModel) -> Iterator[FrontDoor]:
    with tiny_fleet(tiny_model, worker_id="fuzz:1", limits=ServeLimits(max_tokens=4)) as tiny:
        yield FrontDoor(tiny.fleet, tiny.worker_metrics, tiny.front)


def _forwarded(door: FrontDoor) -> float:
    total = 0.0
    for sample in door.worker_metrics.requests.collect()[0].samples:
        if sample.name.endswith("_total") and sample.labels["endpoint"] in ENDPOINTS:
            total += sample.value
    return total


def _post(
    door: FrontDoor, path: str, content: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    before = _forwarded(door)
    response = door.client.post(
        path, content=content, headers=[(b"content-type", b"application/json"), *(headers or [])]
    )
    assert response.status_code < 500, response.text
    assert all(view.healthy for view in door.fleet.worker_views())
    if response.status_code == 200:
        return
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS, error
    if "x-kvstrata-worker" not in response.headers:  # refused by the front door itself
        assert _forwarded(door) == before


@FEW
@given(path=st.sampled_from(ENDPOINTS), value=json_value)
@example(path=ENDPOINTS[0], value={"prompt": "x", "max_tokens": 1, "seed": 1 << 64})
@example(path=ENDPOINTS[0], value={"prompt": [1 << 32], "max_tokens": 1})  # no u32: unhashable
@example(path=ENDPOINTS[0], value={"prompt": [1 << 63], "max_tokens": 1, "stream": True})
def test_random_json_bodies(front_door: FrontDoor, path: str, value: Any) -> None:
    _post(front_door, path, dumps(value))


@FEW
@given(path=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=200))
@example(path=ENDPOINTS[0], raw=deeply_nested())  # RecursionError in json.loads
@example(path=ENDPOINTS[1], raw=b'{"max_tokens": ' + b"9" * 5000 + b"}")  # int digit limit
@example(path=ENDPOINTS[0], raw=b'{"prompt": "\xc3\x28"}')
def test_raw_bytes_bodies(front_door: FrontDoor, path: str, raw: bytes) -> None:
    _post(front_door, path, raw)


@FEW
@given(
    path=st.sampled_from(ENDPOINTS),
    tenant=odd_text,
    in_header=st.booleans(),
)
@example(path=ENDPOINTS[0], tenant="中文", in_header=False)  # not latin-1: cannot be a header
@example(path=ENDPOINTS[0], tenant="a\nX-Injected: 1", in_header=False)
@example(path=ENDPOINTS[1], tenant="\x00", in_header=False)
def test_tenant_names(front_door: FrontDoor, path: str, tenant: str, in_header: bool) -> None:
    """A tenant from the body is forwarded as a header: any name must be refused or carried."""
    body = dict(VALID[ENDPOINTS.index(path)])
    if in_header:
        try:
            value = tenant.encode("latin-1")
        except UnicodeEncodeError:
            return
        if any((c < 0x20 and c != 0x09) or c == 0x7F for c in value) or value != value.strip():
            return  # the client library refuses to send it
        _post(front_door, path, dumps(body), [(b"x-kvstrata-tenant", value)])
    else:
        _post(front_door, path, dumps({**body, "kvstrata_tenant": tenant}))


@FEW
@given(raw=st.binary(max_size=100) | json_value.map(dumps))
@example(raw=deeply_nested())
def test_parse_raises_only_api_errors(raw: bytes) -> None:
    for endpoint in ENDPOINTS:
        try:
            _parse(endpoint, raw)
        except ApiError as exc:
            assert exc.status == 400


FLOAT_LAYOUT = {
    "num_layers": 2.0,
    "num_kv_heads": 1,
    "head_dim": 8,
    "block_size": 16,
    "dtype": "float32",
}
"""A layout with a size that is no integer: it passed, then failed every disaggregated
request to that worker with a ``TypeError`` (a 500) when its KV bytes were priced."""

INFO = {
    "worker_id": "w1",
    "epoch": 1,
    "model": MODEL,
    "fingerprint": "ab" * 32,
    "block_size": 16,
    "events_endpoint": "tcp://127.0.0.1:1",
    "replay_endpoint": None,
    "next_seq": 0,
    "tiers": ["device", "host"],
    "fetch_s_per_block": {"host": 1e-5},
    "secret_digest": "x",
    "step_tokens": 512,
}


@FUZZ
@given(
    changes=st.dictionaries(st.sampled_from(sorted(INFO)), json_value, max_size=3),
    body=st.none() | json_value,
)
@example(changes={"epoch": float("inf")}, body=None)
@example(changes={"fetch_s_per_block": [1]}, body=None)
@example(changes={"fetch_s_per_block": {"host": 10**400}}, body=None)
@example(changes={"transfer": {"host": "h", "port": 1, "layout": FLOAT_LAYOUT}}, body=None)
@example(changes={"step_tokens": True}, body=None)
@example(changes={"step_tokens": 0}, body=None)
@example(changes={"step_tokens": 10**400}, body=None)
def test_worker_info_from_any_json(changes: dict[str, Any], body: Any) -> None:
    """What a worker's ``/kv/info`` says: a ``WorkerInfo`` or a ``WorkerProtocolError``."""
    try:
        info = WorkerInfo.from_json("http://w", {**INFO, **changes} if body is None else body)
    except WorkerProtocolError:
        return
    assert len(info.fingerprint) == 32 and info.block_size > 0 and info.events_endpoint
    assert all(f is None or (math.isfinite(f) and f >= 0) for f in info.fetch_s_per_block)
    budget = info.step_tokens
    assert budget is None or (type(budget) is int and 0 < budget <= MAX_STEP_TOKENS)
    if info.transfer is not None:  # what pricing a transfer to this worker needs
        assert type(info.transfer.layout.block_bytes()) is int


@FUZZ
@given(usage=json_value)
@example(usage={"completion_tokens": float("inf")})
@example(usage={"completion_tokens": 10**400})
@example(usage={"completion_tokens": 3, "prompt_tokens_details": None})
@example(usage={"completion_tokens": True})
def test_a_workers_usage_is_whole_counts_in_range_or_nothing(usage: Any) -> None:
    """The front door learns output lengths and cached tokens from a worker's answer. A broken
    worker's ``Infinity`` failed the answer with a 500 and left the request in flight for
    good; a huge count overflowed the running mean of every later answer from that worker."""
    found = usage_of(dumps({"usage": usage}))
    if found is not None:
        assert all(type(n) is int and 0 <= n < 1 << 31 for n in found)
    if usage == {"completion_tokens": 3, "prompt_tokens_details": None}:
        assert found == (3, 0)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_text_far_too_long_for_the_context_is_refused_before_it_is_tokenized(
    front_door: FrontDoor, path: str
) -> None:
    """The worker refuses such text at once (400) from its size; the front door tokenized
    it first (3 MiB: 2.4 s of a thread the event loop's other work shares)."""
    text = "lorem ipsum " * (3 * 1024 * 1024 // 12)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    if path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    before = _forwarded(front_door)
    response = front_door.client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert _forwarded(front_door) == before


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_body_over_the_limit_is_a_413_here_and_no_worker_is_flagged(
    front_door: FrontDoor, path: str
) -> None:
    """A worker refuses such a body before reading it (413, closing): forwarded, that read as
    a dead worker, and the retries flagged every worker in turn (503 for everyone)."""
    raw = b'{"prompt": "' + b"a" * (4 * 1024 * 1024 + 16) + b'", "max_tokens": 1}'
    before = _forwarded(front_door)
    response = front_door.client.post(path, content=raw)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert _forwarded(front_door) == before
    assert all(view.healthy for view in front_door.fleet.worker_views())


def test_a_chat_streams_opening_role_event_is_not_taken_for_its_first_token(
    front_door: FrontDoor,
) -> None:
    body = {**VALID[1], "stream": True}
    with front_door.client.stream("POST", ENDPOINTS[1], json=body) as response:
        events = [line.encode() for line in response.iter_lines() if line.startswith("data:")]
    assert len(events) >= 3 and events[-1] == b"data: [DONE]"
    assert only_role_preamble(events[0] + b"\n\n")  # the worker's bytes, as relayed
    assert not any(only_role_preamble(event + b"\n\n") for event in events[1:])
    assert not only_role_preamble(events[0] + b"\n\n" + events[1] + b"\n\n")


def test_the_front_door_still_routes(front_door: FrontDoor) -> None:
    for path, body in zip(ENDPOINTS, VALID, strict=True):
        response = front_door.client.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvstrata-worker"]
