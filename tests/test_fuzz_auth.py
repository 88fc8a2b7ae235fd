"""Fuzzing the HTTP guard (``serve.auth.HttpAuth``) over a real server, with a real audit log.

Any ``Authorization``, ``X-Kvstrata-Tenant`` and ``X-Request-Id`` header values: the answer is
a 200 for the one real key (in a namespace the key allows) or a 4xx in OpenAI's shape, and the
audit log gets one JSON line per refusal whose fields hold no client text — the header values a
client chose never appear in it (a request id is kept only when it looks like one), and its
plane names the route, not the path the client wrote.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import FEW
from http_helpers import serving
from kvstrata.errors import ApiError
from kvstrata.security import AuditLog, Authenticator, Role
from kvstrata.security.keys import generate_api_key, keys_entry_toml
from kvstrata.serve import protocol
from kvstrata.serve.auth import HttpAuth

ERROR_KEYS = {"message", "type", "param", "code"}
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what serve.auth keeps of an incoming X-Request-Id
KEY = generate_api_key()
pytestmark = pytest.mark.timeout(120)


@dataclass
class Guarded:
    client: httpx.Client
    audit: AuditLog
    audit_path: Path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    root = tmp_path_factory.mktemp("auth")
    keys_file = root / "keys.toml"
    keys_file.write_text(keys_entry_toml("k1", KEY, "acme", [Role.TENANT], True))
    audit = AuditLog(root / "audit.jsonl").start()
    auth = HttpAuth(Authenticator(keys_file), audit)
    app = FastAPI()
    app.exception_handler(ApiError)(protocol.api_error_handler)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, str]:
        principal = auth.check(request, {Role.TENANT}, "complete")
        return {"namespace": auth.namespace(request, principal, None)}

    with serving(app) as client:
        yield Guarded(client, audit, root / "audit.jsonl")
    audit.close()


# RFC 9110 field-value characters (what an HTTP/1.1 client can send)
header_value = st.text(
    st.sampled_from("\t" + "".join(map(chr, [*range(0x20, 0x7F), *range(0x80, 0x100)]))),
    max_size=120,
).map(str.strip)


def _audit_lines(guarded: Guarded, at_least: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 5
    while True:
        text = guarded.audit_path.read_text(encoding="utf-8")
        lines = [json.loads(line) for line in text.splitlines()]
        if len(lines) >= at_least or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)  # the audit listener thread writes asynchronously


@FEW
@given(
    authorization=header_value
    | st.just(f"Bearer {KEY}")
    | header_value.map(lambda v: f"Bearer {v}".strip()),
    tenant=st.none() | header_value | st.sampled_from(["acme", "acme/chat-1", "acme/a/b", "other"]),
    request_id=st.none() | header_value | st.just("0b5e-77aa-4c1d"),
)
@example(authorization=f"Bearer {KEY}", tenant="acme/chat-1", request_id=None)
@example(authorization="Bearer nope", tenant=None, request_id="CANARY secret prompt text")
@example(authorization="00000000", tenant=None, request_id="00000000")
def test_any_auth_headers(
    guarded: Guarded, authorization: str, tenant: str | None, request_id: str | None
) -> None:
    headers = [(b"authorization", authorization.encode("latin-1"))]
    if tenant is not None:
        headers.append((b"x-kvstrata-tenant", tenant.encode("latin-1")))
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    before = guarded.audit.records
    response = guarded.client.post("/v1/completions", headers=headers)
    if response.status_code == 200:
        assert authorization.strip() == f"Bearer {KEY}"
        assert response.json()["namespace"].split("/")[0] == "acme"
        return
    assert response.status_code in (400, 401, 403), response.text
    assert set(response.json()["error"]) == ERROR_KEYS
    if response.status_code == 400:
        return
    assert guarded.audit.records == before + 1
    lines = _audit_lines(guarded, guarded.audit.records)
    assert len(lines) == guarded.audit.records, "the audit line was not written"
    record = lines[-1]
    assert record["audit"] in ("auth_failure", "access_denied")
    assert record["plane"] == "http POST /v1/completions"
    kept = record.get("request_id")
    assert kept == request_id or re.fullmatch(r"[0-9a-f]{32}", str(kept)), kept  # or a new id
    client_text = [authorization, tenant]
    if request_id is not None and not ID.fullmatch(request_id):
        client_text.append(request_id)  # an id-shaped one is kept on purpose (correlation)
    for value in client_text:
        if value and len(value) >= 8 and value != kept:  # the kept id may equal another header
            assert value not in json.dumps(record, ensure_ascii=False), record
