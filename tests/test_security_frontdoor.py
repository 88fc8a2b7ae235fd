"""Access control through the front door, HTTPS, and the security CLI.

A real worker (uvicorn, tiny model, ZMQ events) and a real front door in front of it: the
front door authenticates clients as the worker does, forwards their key, namespace and
request id, and the worker checks them again; the router reads ``/kv/info`` and ``/kv/dump``
with its own fleet key. HTTPS with a self-signed certificate made by ``openssl``.
"""

from __future__ import annotations

import argparse
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from http_helpers import serving
from kvstrata.cli import serve_cmd
from kvstrata.cli.main import build_parser, main
from kvstrata.engine.model_loader import LoadedModel, ensure_checkpoint
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.fleet.worker_info import fetch_info, worker_tls
from kvstrata.security import AuditLog, Authenticator, Role
from kvstrata.serve.auth import HttpAuth
from security_http_helpers import (
    Served,
    audit_records,
    auth,
    body,
    cached,
    key,
    worker_app,
    write_keys,
)

PROMPT = "Front door prompt about harbours, tides and the keepers of old lighthouses. " * 3


@dataclass
class Front:
    client: httpx.Client
    worker: Served
    audit_path: Path


@pytest.fixture(scope="module")
def front(tiny_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    directory = tmp_path_factory.mktemp("front")
    checkpoint = ensure_checkpoint("tiny")
    with worker_app(tiny_model, directory) as worker:
        url = str(worker.client.base_url).rstrip("/")
        fleet = Fleet(
            FleetTokenizer(checkpoint), FleetConfig(worker_urls=[url], api_key=key("FLEET"))
        )
        fleet.attach(url)
        # The front door knows one key more than the worker: the worker must refuse it.
        front_keys = write_keys(directory / "front.toml", {"X": ("tenantX", [Role.TENANT], False)})
        audit_path = directory / "front-audit.jsonl"
        with AuditLog(audit_path, component="frontdoor") as audit:
            guard = HttpAuth(Authenticator(front_keys), audit)
            with serving(create_frontdoor_app(fleet, guard)) as client:
                yield Front(client, worker, audit_path)


def test_front_door_completions_are_authenticated_and_audited(front: Front) -> None:
    client = front.client
    ok = client.post("/v1/completions", json=body("hi there"), headers=auth("A"))
    assert ok.status_code == 200 and ok.headers["x-kvstrata-worker"] == "sec:1"
    none = client.post("/v1/completions", json=body(PROMPT), headers={"X-Request-Id": "fd-none"})
    assert none.status_code == 401
    records = audit_records(front.audit_path, lambda r: r.get("request_id") == "fd-none")
    assert records and records[0]["component"] == "frontdoor"
    assert records[0]["reason"] == "no_key" and "harbours" not in front.audit_path.read_text()
    other = {**auth("A"), "X-Kvstrata-Tenant": "tenantB"}
    assert client.post("/v1/completions", json=body(PROMPT), headers=other).status_code == 403
    claim = body(PROMPT, kvstrata_tenant="tenantA")
    assert client.post("/v1/completions", json=claim, headers=auth("B")).status_code == 403


def test_front_door_routes_in_the_keys_namespace_and_the_worker_agrees(front: Front) -> None:
    client, prompt = front.client, PROMPT + "tenant A only"
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("A"))) == 0
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("A"))) > 0
    assert cached(client.post("/v1/completions", json=body(prompt), headers=auth("B"))) == 0
    # The worker ran it in tenantA's namespace: A's key finds it there directly, C's does not.
    direct = front.worker.client
    assert cached(direct.post("/v1/completions", json=body(prompt), headers=auth("A"))) > 0
    assert cached(direct.post("/v1/completions", json=body(prompt), headers=auth("C"))) == 0


def test_the_worker_authenticates_forwarded_requests_again(front: Front) -> None:
    """Defence in depth: a key the front door accepts but the worker does not know is a 401,
    and the worker's audit record carries the front door's request id."""
    headers = {**auth("X"), "X-Request-Id": "fd-forwarded-1"}
    response = front.client.post("/v1/completions", json=body("hi"), headers=headers)
    assert response.status_code == 401
    assert front.worker.audited(request_id="fd-forwarded-1", reason="unknown_key")


def test_debug_route_answers_observers_in_their_own_namespace_only(front: Front) -> None:
    client = front.client
    explained = client.post("/debug/route", json={"prompt": PROMPT}, headers=auth("OBS"))
    assert explained.status_code == 200 and explained.json()["decision"]["worker_id"] == "sec:1"
    assert (
        client.post("/debug/route", json={"prompt": PROMPT}, headers=auth("A")).status_code == 403
    )
    assert client.post("/debug/route", json={"prompt": PROMPT}).status_code == 401
    own = client.post(
        "/debug/route", json={"prompt": "x", "kvstrata_tenant": "tenantA"}, headers=auth("OBS")
    )
    assert own.status_code == 200
    probe = client.post(
        "/debug/route",
        json={"prompt": PROMPT},
        headers={**auth("OBS"), "X-Kvstrata-Tenant": "tenantB"},
    )
    assert probe.status_code == 403 and probe.json()["error"]["code"] == "namespace_denied"
    # no GET form: a prompt in a URL ends up in access logs and proxies
    get = client.get("/debug/route", params={"prompt": "x"}, headers=auth("OBS"))
    assert get.status_code == 405
    assert audit_records(front.audit_path, lambda r: r.get("reason") == "namespace_denied")


@pytest.mark.parametrize("path", ["/metrics", "/fleet/workers"])
def test_front_door_observability_needs_an_observer(front: Front, path: str) -> None:
    assert front.client.get(path, headers=auth("OBS")).status_code == 200
    assert front.client.get(path, headers=auth("A")).status_code == 403
    assert front.client.get(path).status_code == 401


def test_a_router_without_the_fleet_key_cannot_read_workers(front: Front) -> None:
    url = str(front.worker.client.base_url).rstrip("/")
    with httpx.Client() as http:
        assert fetch_info(http, url, key("FLEET")).worker_id == "sec:1"
        with pytest.raises(httpx.HTTPStatusError) as refused:
            fetch_info(http, url)
        assert refused.value.response.status_code == 401
        dump = http.get(f"{url}/kv/dump", headers=auth("OBS"))
        assert dump.status_code == 403


# ---- HTTPS ------------------------------------------------------------------------------------
def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, private = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "/usr/bin/openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(private),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, private


def test_https_round_trip_and_plain_http_fails(tiny_model: LoadedModel, tmp_path: Path) -> None:
    cert, private = _self_signed(tmp_path)
    with worker_app(tiny_model, tmp_path, tls=(cert, private)) as worker:
        base = str(worker.client.base_url).rstrip("/")
        assert base.startswith("https://")
        assert (
            cached(worker.client.post("/v1/completions", json=body("hi"), headers=auth("A"))) == 0
        )
        with httpx.Client(verify=worker_tls(cert)) as router_http:  # the router's tls_ca_file
            assert fetch_info(router_http, base, key("FLEET")).worker_id == "sec:1"
        with httpx.Client(verify=worker_tls(None)) as system_cas, pytest.raises(httpx.ConnectError):
            fetch_info(system_cas, base, key("FLEET"))
        with pytest.raises(httpx.TransportError):
            httpx.get(base.replace("https://", "http://") + "/health", timeout=5)


def test_front_door_delete_reaches_https_workers_signed_by_the_fleet_ca(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    """The deletion fan-out trusts ``tls_ca_file`` as every other client of the workers does
    (it used the system CAs: every worker "unreachable", nothing deleted, a 502)."""
    cert, private = _self_signed(tmp_path)
    with worker_app(tiny_model, tmp_path, tls=(cert, private)) as worker:
        url = str(worker.client.base_url).rstrip("/")
        config = FleetConfig(worker_urls=[url], api_key=key("FLEET"), tls_ca_file=cert)
        fleet = Fleet(FleetTokenizer(ensure_checkpoint("tiny")), config)
        fleet.attach(url)
        guard = HttpAuth(Authenticator(write_keys(tmp_path / "front.toml")))
        with serving(create_frontdoor_app(fleet, guard)) as front:
            answer = front.post(
                "/admin/delete",
                json={"tenant": "tenantA", "all": True},
                headers=auth("ADMIN"),
                timeout=60,
            )
        assert answer.status_code == 200, answer.json()
        assert answer.json()["status"] == "ok"
        fleet.close()


# ---- CLI --------------------------------------------------------------------------------------
def test_keys_add_appends_a_hash_and_prints_the_key_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.toml"
    argv = ["keys", "add", "--file", str(path), "--tenant", "acme", "--role", "tenant"]
    assert main([*argv, "--role", "observer", "--sub-namespaces", "--id", "acme-1"]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["keys", "add", "--file", str(path), "--tenant", "globex"]) == 0
    second = capsys.readouterr().out.strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert first not in text and second not in text and text.count("sha256:") == 2
    authenticator = Authenticator(path)
    acme = authenticator.authenticate(f"Bearer {first}")
    assert (acme.key_id, acme.tenant, acme.sub_namespaces) == ("acme-1", "acme", True)
    assert acme.roles == {Role.TENANT, Role.OBSERVER}
    assert authenticator.authenticate(f"Bearer {second}").tenant == "globex"
    assert main([*argv, "--id", "acme-1"]) == 2  # a duplicate id: refused, file unchanged
    assert path.read_text() == text


def test_serve_flags_set_the_security_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, private = _self_signed(tmp_path)
    keys = write_keys(tmp_path / "keys.toml")
    args: argparse.Namespace = build_parser().parse_args(
        [
            "serve",
            "--keys-file",
            str(keys),
            "--audit-path",
            str(tmp_path / "a.jsonl"),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(private),
        ]
    )
    security = serve_cmd.worker_config(args).security
    assert (security.keys_file, security.tls_cert_file, security.tls_key_file) == (
        keys.resolve(),
        cert.resolve(),
        private.resolve(),
    )
    from kvstrata.cli.security_args import worker_auth
    from kvstrata.security import NULL_AUDIT

    worker_auth(security, None, NULL_AUDIT)
    assert "6 keys, 5 tenants" in capsys.readouterr().out
    worker_auth(
        serve_cmd.worker_config(build_parser().parse_args(["serve"])).security, None, NULL_AUDIT
    )
    assert "single-tenant: no keys file" in capsys.readouterr().out
