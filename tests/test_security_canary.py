"""No prompt material anywhere it does not belong: the canary search of issue 12.

A real front door and a real worker (tiny model, uvicorn, ZMQ events, a host tier with a
tenant quota, a disk tier), a keys file and audit files. Every kind of security-relevant event
is driven with prompts that carry a unique canary string: authentication failures,
authorisation denials, evictions and demotions, a digest mismatch (a corrupted disk object),
a quota rejection, tier switches, deletions (front door and worker), malformed bodies that hold
the canary, and `/debug/route`. Then every log record, both audit files, both `/metrics`
pages, `/kv/info`, `/fleet/workers`, every error body and every debug answer are searched for
the canary and for any run of the prompts' token ids: zero hits. The planes that must carry
token ids (`/kv/dump`, the event sockets) refuse a client without the right key.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel, ensure_checkpoint
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.runtime.config import WorkerConfig, disk_tier, host_tier
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.security import AuditLog, Authenticator
from kvstrata.serve.app import create_app
from kvstrata.serve.auth import HttpAuth
from kvstrata.store.config import TierConfig
from kvstrata.telemetry import KvMetrics
from security_http_helpers import BLOCK_BYTES, auth, key, write_keys

pytestmark = pytest.mark.timeout(300)

B = 16
CANARY = "quokkacanary7q"
FILLER = "notes about the harbour, the tides, the boats and the weather on the coast "
PROMPTS = [f"{CANARY} entry {i}: " + FILLER * 4 for i in range(8)]
WINDOW = 5  # a run of this many of a prompt's token ids, in any common rendering, is a leak


@dataclass
class Setup:
    router: httpx.Client
    worker: httpx.Client
    engine: ReferenceEngine
    disk_dir: Path
    audit_paths: tuple[Path, Path]


@pytest.fixture
def setup(tmp_path: Path, tiny_model: LoadedModel) -> Iterator[Setup]:
    keys = write_keys(tmp_path / "keys.toml")
    disk_dir = tmp_path / "disk"
    with ExitStack() as stack:
        audit_paths = (tmp_path / "audit-worker.jsonl", tmp_path / "audit-router.jsonl")
        worker_audit = stack.enter_context(AuditLog(audit_paths[0]))
        router_audit = stack.enter_context(AuditLog(audit_paths[1], component="router"))
        events = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id="canary:1")
        emitter = KVEventEmitter.from_config(events, block_size=B).start()
        stack.callback(emitter.close)
        host = TierConfig("host", tenant_quota_bytes={"tenantC": BLOCK_BYTES // 2})
        tiers = WorkerConfig(
            tiers=(host_tier(8 * BLOCK_BYTES, host), disk_tier(disk_dir, 256 * BLOCK_BYTES))
        )
        metrics = KvMetrics()
        engine = build_engine(
            tiny_model,
            EngineConfig(block_size=B, pool_blocks=16),
            tiers,
            metrics=metrics,
            events=emitter,
            audit=worker_audit,
        )
        stack.callback(engine.close)
        guard = HttpAuth(Authenticator(keys), worker_audit)
        app = create_app(engine, model_name="tiny", metrics=metrics, auth=guard)
        worker = stack.enter_context(serving(app))
        url = str(worker.base_url).rstrip("/")
        fleet = Fleet(
            FleetTokenizer(ensure_checkpoint("tiny")),
            FleetConfig(worker_urls=[url], health_interval_s=0.2, api_key=key("FLEET")),
        )
        fleet.attach(url)
        router_app = create_frontdoor_app(fleet, HttpAuth(Authenticator(keys), router_audit))
        router = stack.enter_context(serving(router_app))
        yield Setup(router, worker, engine, disk_dir, audit_paths)


def _completion(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}


def _renderings(ids: list[int]) -> set[str]:
    out = set()
    for start in range(len(ids) - WINDOW + 1):
        run = ids[start : start + WINDOW]
        out |= {", ".join(map(str, run)), ",".join(map(str, run)), " ".join(map(str, run))}
    return out


def test_no_prompt_text_or_token_ids_in_logs_audit_metrics_errors_or_debug(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    router, worker = setup.router, setup.worker
    answers: list[str] = []  # every body a client got back that is not a completion

    def keep(response: httpx.Response, status: int) -> None:
        assert response.status_code == status, response.text
        answers.append(response.text)

    # traffic that fills the pool, evicts and demotes (host holds 8 blocks, the pool 16)
    for prompt in PROMPTS:
        assert router.post(
            "/v1/completions", json=_completion(prompt), headers=auth("A")
        ).is_success
    # authentication failures and denials, each carrying the canary
    keep(router.post("/v1/completions", json=_completion(PROMPTS[0])), 401)
    keep(
        worker.post(
            "/v1/completions",
            json=_completion(PROMPTS[0]),
            headers={"Authorization": "Bearer kvs_nope"},
        ),
        401,
    )
    keep(
        router.post(
            "/v1/completions",
            json=_completion(PROMPTS[0]),
            headers={**auth("A"), "X-Kvstrata-Tenant": "tenantB"},
        ),
        403,
    )
    keep(
        worker.post(
            "/v1/completions",
            json=_completion(PROMPTS[0], kvstrata_tenant="tenantA"),
            headers=auth("B"),
        ),
        403,
    )
    keep(worker.post("/v1/completions", json=_completion(PROMPTS[0]), headers=auth("OBS")), 403)
    # a quota rejection: tenantC may keep less than a block in host
    assert worker.post(
        "/v1/completions", json=_completion(PROMPTS[3]), headers=auth("C")
    ).is_success
    # a digest mismatch: corrupt every disk object, then ask for the oldest prompts again
    corrupted = 0
    for path in setup.disk_dir.rglob("*"):
        if path.is_file() and path.stat().st_size > 1024:
            data = bytearray(path.read_bytes())
            data[-64] ^= 0xFF
            path.write_bytes(bytes(data))
            corrupted += 1
    assert corrupted > 0
    for prompt in PROMPTS[:3]:
        assert worker.post(
            "/v1/completions", json=_completion(prompt), headers=auth("A")
        ).is_success
    # tier switches
    for enabled in (False, True):
        keep(
            worker.post("/admin/tiers/host", json={"enabled": enabled}, headers=auth("ADMIN")), 200
        )
    # malformed bodies that hold the canary: the error must not echo it
    for bad in (
        _completion(PROMPTS[0], temperature="hot"),
        _completion(PROMPTS[0], max_tokens=-1),
        _completion(PROMPTS[0], n=3),
        {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "top_p": "x"},
    ):
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        for client in (router, worker):
            response = client.post(path, json=bad, headers=auth("A"))
            assert 400 <= response.status_code < 500, response.text
            answers.append(response.text)
    raw = ('{"model": "tiny", "prompt": "' + PROMPTS[0] + '", }').encode()
    for client in (router, worker):
        answers.append(client.post("/v1/completions", content=raw, headers=auth("A")).text)
    bad_delete = {"tenant": "tenantA", "prompt": PROMPTS[0], "all": True}
    for client in (router, worker):
        keep(client.post("/admin/delete", json=bad_delete, headers=auth("ADMIN")), 400)
    # debug answers and deletions
    keep(router.post("/debug/route", json=_completion(PROMPTS[4]), headers=auth("OBS")), 200)
    keep(
        router.post(
            "/admin/delete", json={"tenant": "tenantA", "prompt": PROMPTS[5]}, headers=auth("ADMIN")
        ),
        200,
    )
    messages = {"tenant": "tenantA", "messages": [{"role": "user", "content": PROMPTS[6]}]}
    keep(worker.post("/admin/delete", json=messages, headers=auth("ADMIN")), 200)
    keep(
        router.post(
            "/admin/delete", json={"tenant": "tenantA", "prompt": PROMPTS[1]}, headers=auth("A")
        ),
        403,
    )
    # observability pages
    for client in (router, worker):
        keep(client.get("/metrics", headers=auth("OBS")), 200)
    keep(worker.get("/kv/info", headers=auth("OBS")), 200)
    keep(router.get("/fleet/workers", headers=auth("OBS")), 200)
    # the planes that carry token ids are closed to whoever lacks the role
    assert worker.get("/kv/dump").status_code == 401
    assert worker.get("/kv/dump", headers=auth("A")).status_code == 403
    assert worker.get("/kv/dump", headers=auth("OBS")).status_code == 403

    driven = {
        "auth_failure",
        "access_denied",
        "evict",
        "invalidate",
        "quota_reject",
        "tier_switch",
        "delete",
    }
    deadline = time.monotonic() + 10  # the audit logs write on their own threads
    while True:
        setup_audit = [p.read_text() if p.exists() else "" for p in setup.audit_paths]
        records = [json.loads(line) for text in setup_audit for line in text.splitlines()]
        kinds = {r["audit"] for r in records}
        if driven <= kinds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert driven <= kinds, driven - kinds
    assert any(r["audit"] == "invalidate" and r["reason"] == "digest_mismatch" for r in records)

    logs = "\n".join(caplog.text.splitlines())
    haystacks = {"logs": logs, "audit": "\n".join(setup_audit), "answers": "\n".join(answers)}
    token_runs: set[str] = set()
    for prompt in PROMPTS:
        token_runs |= _renderings(setup.engine.encode_prompt(prompt))
    for name, text in haystacks.items():
        assert CANARY not in text, f"the canary is in the {name}"
        leaked = [run for run in token_runs if run in text]
        assert not leaked, f"token ids of a prompt are in the {name}: {leaked[:3]}"
    assert CANARY in PROMPTS[0] and token_runs  # the search had something to find
