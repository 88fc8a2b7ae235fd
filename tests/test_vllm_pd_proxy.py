"""The vLLM P/D proxy (``fleet/vllm_pd_proxy.py``) against fake producer and consumer servers."""

from __future__ import annotations

import json
from typing import Any

import httpx

from kvstrata.fleet.vllm_pd_proxy import pd_request, prefill_body

PARAMS = {"kvstrata_offer": "AAAA"}


def _client(producer_status: int, seen: list[tuple[str, dict[str, Any]]]) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "producer":
            if producer_status != 200:
                return httpx.Response(producer_status, json={"error": "down"})
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": PARAMS})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_the_producer_prefills_one_token_and_the_consumer_gets_its_params() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "stream": True}
    response, params = pd_request(_client(200, seen), "http://producer", "http://consumer", body)
    assert response.json()["choices"][0]["text"] == "ok" and params == PARAMS
    (_, first), (_, second) = seen
    assert first["max_tokens"] == 1 and "stream" not in first
    assert first["kv_transfer_params"] == {"do_remote_decode": True}
    assert second == {**body, "kv_transfer_params": PARAMS}
    assert body["max_tokens"] == 20  # the caller's body is not changed
    assert prefill_body({"max_completion_tokens": 9})["max_tokens"] == 1


def test_a_failing_producer_leaves_a_local_prefill_on_the_consumer() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    body = {"model": "m", "prompt": "hi"}
    response, params = pd_request(_client(503, seen), "http://producer", "http://consumer", body)
    assert params is None and response.status_code == 200
    assert seen[-1] == ("consumer", body)
