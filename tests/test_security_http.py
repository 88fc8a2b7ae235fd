"""Access control on the worker's HTTP plane: paired tests, authorised vs refused and audited.

A real uvicorn server over the tiny model, a keys file in tmp (``security_http_helpers``):
every refusal is a 401/403 in OpenAI's error shape and one audit line (action, reason, key
id, request id: never the body); a tenant's key cannot name another tenant's namespace, so
another tenant's identical prompt misses; without any credential the privileged endpoints
are off, not open.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.events import decode_batch
from kvstrata.security import Role
from kvstrata.serve.app import create_app
from kvstrata.serve.protocol import ChatCompletionRequest
from kvstrata.telemetry import KvMetrics
from security_http_helpers import (
    Served,
    auth,
    body,
    cached,
    key,
    keys_text,
    worker_app,
    write_keys,
)

CANARY = "zebra-canary-7731 "
PROMPT = CANARY + "the quick brown fox jumps over the lazy dog again and again " * 3


@pytest.fixture(scope="module")
def served(tiny_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with worker_app(tiny_model, tmp_path_factory.mktemp("sec")) as worker:
        yield worker


def _refused(served: Served, code: str, **fields: object) -> None:
    """An audit line with this reason (and fields) exists, and no audit line holds the
    prompt."""
    records = served.audited(reason=code, **fields)
    assert records, f"no audit record {code} {fields}"
    assert CANARY.strip() not in served.audit_path.read_text()


# ---- completions ----------------------------------------------------------------------------
def test_completions_need_a_known_key_with_the_tenant_role(served: Served) -> None:
    client = served.client
    assert cached(client.post("/v1/completions", json=body("hello"), headers=auth("A"))) == 0
    none = client.post("/v1/completions", json=body(PROMPT), headers={"X-Request-Id": "rq-none"})
    assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
    assert none.json()["error"]["code"] == "no_key"
    _refused(served, "no_key", audit="auth_failure", request_id="rq-none")
    unknown = client.post(
        "/v1/completions",
        json=body(PROMPT),
        headers={"Authorization": "Bearer kvs_nobody", "X-Request-Id": "rq-unknown"},
    )
    assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "unknown_key"
    _refused(served, "unknown_key", request_id="rq-unknown")
    fleet = client.post(
        "/v1/completions", json=body(PROMPT), headers={**auth("FLEET"), "X-Request-Id": "rq-f"}
    )
    assert fleet.status_code == 403 and fleet.json()["error"]["type"] == "permission_error"
    _refused(served, "forbidden", key_id="id-FLEET", request_id="rq-f")
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
        lower = {"Authorization": f"{scheme} {key('A')}"}
        assert client.post("/v1/completions", json=body("hi"), headers=lower).status_code == 200


def test_a_bad_request_id_is_replaced_and_a_good_one_echoed(served: Served) -> None:
    ok = served.client.post(
        "/v1/completions", json=body("hi"), headers={**auth("A"), "X-Request-Id": "my-id_1"}
    )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "my-id_1"
    bad = "bad id\u00e9" + "x" * 70
    served.client.post(
        "/v1/completions", json=body("hi"), headers={"X-Request-Id": bad.encode().hex()[:80]}
    )
    refused = served.audited(audit="auth_failure")
    assert refused and all(len(r["request_id"]) <= 64 for r in refused)


def test_a_key_cannot_name_another_tenants_namespace(served: Served) -> None:
    client = served.client
    header = {**auth("A"), "X-Kvstrata-Tenant": "tenantB", "X-Request-Id": "rq-hdr"}
    response = client.post("/v1/completions", json=body(PROMPT), headers=header)
    assert response.status_code == 403 and response.json()["error"]["code"] == "namespace_denied"
    _refused(served, "namespace_denied", key_id="id-A", tenant="tenantA", request_id="rq-hdr")
    claim = body(PROMPT, kvstrata_tenant="tenantA")
    response = client.post("/v1/completions", json=claim, headers=auth("B"))
    assert response.status_code == 403
    assert served.audited(reason="namespace_denied", key_id="id-B")


def test_another_tenants_identical_prompt_misses(served: Served) -> None:
    """The attack of the issue: B sends A's prompt (or claims A's tenant) and learns nothing
    from ``cached_tokens``."""
    client, prompt = served.client, PROMPT + "private to A"
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("A"))) == 0
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("A"))) > 0
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("B"))) == 0
    claim = client.post(
        "/v1/completions", json=body(prompt, kvstrata_tenant="tenantA"), headers=auth("B")
    )
    assert claim.status_code == 403 and "usage" not in claim.json()


def test_shared_namespace_works_for_members_only(served: Served) -> None:
    client, prompt = served.client, "You are a helpful assistant. " * 6
    shared = {"X-Kvstrata-Tenant": "shared-sys"}
    assert (
        cached(client.post("/v1/completions", json=body(prompt), headers={**auth("A"), **shared}))
        == 0
    )
    assert (
        cached(client.post("/v1/completions", json=body(prompt), headers={**auth("B"), **shared}))
        > 0
    )
    outsider = client.post("/v1/completions", json=body(prompt), headers={**auth("C"), **shared})
    assert outsider.status_code == 403


def test_sub_namespaces_narrow_only_where_the_key_allows(served: Served) -> None:
    client, prompt = served.client, "A conversation about lighthouses and their keepers. " * 3
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("A"))) == 0
    chat = {**auth("A"), "X-Kvstrata-Tenant": "tenantA/chat-1"}
    assert cached(client.post("/v1/completions", json=body(prompt), headers=chat)) == 0
    assert cached(client.post("/v1/completions", json=body(prompt), headers=chat)) > 0
    deeper = {**auth("A"), "X-Kvstrata-Tenant": "tenantA/chat-1/x"}
    assert client.post("/v1/completions", json=body(prompt), headers=deeper).status_code == 403
    no_subs = {**auth("B"), "X-Kvstrata-Tenant": "tenantB/chat-1"}
    assert client.post("/v1/completions", json=body(prompt), headers=no_subs).status_code == 403


# ---- admin, dump, debug, observability --------------------------------------------------------
def test_admin_tiers_need_the_admin_role_and_a_switch_is_audited(served: Served) -> None:
    client = served.client
    assert client.get("/admin/tiers", headers=auth("ADMIN")).status_code == 200
    assert client.get("/admin/tiers").status_code == 401
    for name in ("OBS", "FLEET", "A"):
        assert client.get("/admin/tiers", headers=auth(name)).status_code == 403
    denied = client.post("/admin/tiers/host", json={"enabled": False}, headers=auth("OBS"))
    assert denied.status_code == 403
    assert served.audited(reason="forbidden", key_id="id-OBS", audit="access_denied")
    switch = client.post(
        "/admin/tiers/host",
        json={"enabled": False},
        headers={**auth("ADMIN"), "X-Request-Id": "rq-switch"},
    )
    assert switch.status_code == 200
    assert not next(t for t in switch.json()["tiers"] if t["name"] == "host")["enabled"]
    (record,) = served.audited(audit="tier_switch", reason="disabled")
    assert (record["tier"], record["key_id"], record["request_id"]) == (
        "host",
        "id-ADMIN",
        "rq-switch",
    )
    client.post("/admin/tiers/host", json={"enabled": True}, headers=auth("ADMIN"))
    assert served.audited(audit="tier_switch", reason="enabled")


@pytest.mark.parametrize("path", ["/admin/tiers/host", "/admin/delete"])
@pytest.mark.parametrize(
    "raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000]
)
def test_admin_bodies_nested_too_deep_are_a_400_not_a_500(
    served: Served, path: str, raw: bytes
) -> None:
    client = served.client
    response = client.post(
        path, content=raw, headers={**auth("ADMIN"), "content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"


def test_deleting_a_prompt_that_is_not_text_is_a_400(served: Served) -> None:
    client = served.client
    raw = b'{"tenant": "alice", "prompt": "\\ud800"}'  # a lone surrogate: not Unicode text
    response = client.post(
        "/admin/delete", content=raw, headers={**auth("ADMIN"), "content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_kv_dump_needs_the_fleet_or_admin_role(served: Served) -> None:
    client = served.client
    client.post("/v1/completions", json=body(PROMPT), headers=auth("A"))
    for name in ("FLEET", "ADMIN"):
        response = client.get("/kv/dump", headers=auth(name))
        assert response.status_code == 200
        assert decode_batch(response.content).batch.events
    for name in ("OBS", "A"):
        response = client.get("/kv/dump", headers=auth(name))
        assert response.status_code == 403 and response.headers["content-type"].startswith(
            "application/json"
        )
    assert client.get("/kv/dump").status_code == 401
    assert served.audited(reason="forbidden", key_id="id-A", plane="http GET /kv/dump")


def test_debug_endpoint_needs_the_admin_role(served: Served) -> None:
    client = served.client
    assert client.post("/kv/debug/drop-events?count=0", headers=auth("ADMIN")).status_code == 200
    assert client.post("/kv/debug/drop-events?count=0", headers=auth("FLEET")).status_code == 403
    assert client.post("/kv/debug/drop-events?count=0").status_code == 401


@pytest.mark.parametrize("path", ["/metrics", "/kv/info"])
def test_observability_needs_an_observer(served: Served, path: str) -> None:
    client = served.client
    for name in ("OBS", "FLEET", "ADMIN"):
        assert client.get(path, headers=auth(name)).status_code == 200
    assert client.get(path, headers=auth("A")).status_code == 403
    assert client.get(path).status_code == 401
    if path == "/kv/info":
        assert "secret_digest" in client.get(path, headers=auth("OBS")).json()


# ---- the keys file is reloaded ----------------------------------------------------------------
def test_a_new_key_works_without_restart_and_a_bad_file_keeps_the_old_keys(
    served: Served,
) -> None:
    client, path = served.client, served.keys_path
    original = path.read_text()
    try:
        assert client.post("/v1/completions", json=body("hi"), headers=auth("D")).status_code == 401
        write_keys(path, {"D": ("tenantD", [Role.TENANT], False)})
        os.utime(path, ns=(1, 2_000_000_000_000_000_000))  # a new mtime, whatever the clock
        response = client.post("/v1/completions", json=body("hi"), headers=auth("D"))
        assert response.status_code == 200, response.text
        errors = served.authenticator.reload_errors
        path.write_text(keys_text() + "\n[[keys]]\nid = 'broken\n")
        os.utime(path, ns=(1, 3_000_000_000_000_000_000))
        assert client.post("/v1/completions", json=body("hi"), headers=auth("D")).status_code == 200
        assert served.authenticator.reload_errors == errors + 1
    finally:
        path.write_text(original)
        os.utime(path, ns=(1, 4_000_000_000_000_000_000))
    # taking a key away applies once the file has stayed the same for one more check (a
    # rewrite in progress reads as a subset of itself)
    assert client.post("/v1/completions", json=body("hi"), headers=auth("D")).status_code == 200
    assert client.post("/v1/completions", json=body("hi"), headers=auth("D")).status_code == 401


# ---- secure by default ------------------------------------------------------------------------
def test_without_any_credential_privileged_endpoints_are_off(tiny_model: LoadedModel) -> None:
    metrics = KvMetrics()
    engine = ReferenceEngine(
        tiny_model, EngineConfig(block_size=16, pool_blocks=8), metrics=metrics
    )
    app = create_app(engine, model_name="tiny", metrics=metrics, debug_endpoints=True)
    try:
        with serving(app) as client:
            for method, path in (
                ("GET", "/admin/tiers"),
                ("GET", "/kv/dump"),
                ("POST", "/kv/debug/drop-events?count=1"),
            ):
                response = client.request(method, path, headers={"Authorization": "Bearer x"})
                assert response.status_code == 403, path
                assert response.json()["error"]["code"] == "disabled"
            answer = client.post(
                "/v1/completions", json=body("hi"), headers={"X-Kvstrata-Tenant": "t"}
            )
            assert answer.status_code == 200
            assert client.get("/metrics").status_code == 200
    finally:
        engine.close()


def test_an_admin_token_alone_keeps_clients_anonymous(tiny_model: LoadedModel) -> None:
    from security_helpers import ADMIN_KEY, admin_auth, bearer

    metrics = KvMetrics()
    engine = ReferenceEngine(
        tiny_model, EngineConfig(block_size=16, pool_blocks=8), metrics=metrics
    )
    app = create_app(engine, model_name="tiny", metrics=metrics, auth=admin_auth())
    try:
        with serving(app) as client:
            openai_client = {"Authorization": "Bearer EMPTY"}  # what OpenAI clients send
            assert (
                client.post("/v1/completions", json=body("hi"), headers=openai_client).status_code
                == 200
            )
            assert client.get("/admin/tiers", headers=openai_client).status_code == 401
            assert client.get("/admin/tiers", headers=bearer(ADMIN_KEY)).status_code == 200
    finally:
        engine.close()


def test_deleting_one_conversation_keeps_the_tenants_other_conversations(served: Served) -> None:
    """A chat is deleted from its first block of message content: the template's head (its
    default system prompt), which every conversation shares and which tells nothing of
    this one, stays — and with it the tenant's other conversations."""
    client = served.client

    def chat(words: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": f"{words} " * 40}]
        return {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}

    gone, kept = chat("alpha"), chat("bravo")
    for request in (gone, kept):
        client.post("/v1/chat/completions", json=request, headers=auth("A"))
    kept_before = cached(client.post("/v1/chat/completions", json=kept, headers=auth("A")))
    gone_before = cached(client.post("/v1/chat/completions", json=gone, headers=auth("A")))
    _, start = served.engine.chat_content_start(ChatCompletionRequest(**gone).template_messages())
    head = start // served.engine.config.block_size * served.engine.config.block_size
    assert 0 < head < gone_before  # a shared template head, then the conversation's blocks
    erase = {"tenant": "tenantA", "messages": gone["messages"]}
    assert client.post("/admin/delete", json=erase, headers=auth("ADMIN")).status_code == 200
    assert cached(client.post("/v1/chat/completions", json=kept, headers=auth("A"))) == kept_before
    assert cached(client.post("/v1/chat/completions", json=gone, headers=auth("A"))) == head
