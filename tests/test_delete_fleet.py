"""Deletion across a fleet: a front door and two workers (host + disk + a shared remote tier).

Real parts: two in-process workers (tiny model, real uvicorn, real ZMQ events), a real front
door with its event plane and index, the session's real Valkey server, a keys file (admin,
fleet and tenant keys) and audit files. Through the front door, under concurrent traffic, a
prompt is deleted; then every tier of every worker, the remote server's raw keys and the
router's index are scanned for the prompt's blocks and their descendants (none remain), the
next identical request is a full miss, and a late or stale event cannot bring an index entry
back. Refused deletes are audited; ``kvstrata delete`` prints the counts; a worker that cannot
be reached makes the answer partial.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from http_helpers import serving
from kvstrata.cli.main import main as cli_main
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel, ensure_checkpoint
from kvstrata.errors import ApiError
from kvstrata.events import decode_batch
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.identity import BlockKey
from kvstrata.runtime.config import WorkerConfig, disk_tier, host_tier, remote_tier
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.security import AuditLog, Authenticator, Role
from kvstrata.security.keys import generate_api_key, keys_entry_toml
from kvstrata.serve.app import create_app
from kvstrata.serve.auth import HttpAuth
from kvstrata.telemetry import KvMetrics
from kvstrata.tiers.remote_client import RemoteConfig

pytestmark = pytest.mark.timeout(240)

B = 16
MIB = 1 << 20
PROMPT = "The keeper of the lighthouse wrote down every ship that passed the rocks at night " * 3
CANARY = "lighthouse"


@dataclass
class Keys:
    admin: str
    fleet: str
    acme: str
    globex: str
    file: Path


@dataclass
class Worker:
    engine: ReferenceEngine
    emitter: KVEventEmitter
    client: httpx.Client


@dataclass
class FleetUnderTest:
    keys: Keys
    workers: list[Worker]
    fleet: Fleet
    router: httpx.Client
    remote: ValkeyServer
    namespace: str
    router_audit: Path
    worker_audit: Path

    def complete(self, prompt: str, tenant: str = "acme") -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        key = self.keys.globex if tenant == "globex" else self.keys.acme
        headers = {"Authorization": f"Bearer {key}"}
        response = self.router.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def delete(self, body: dict[str, Any], key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.keys.admin}"}
        return self.router.post("/admin/delete", json=body, headers=headers)

    def matched(self, tokens: list[int], tenant: str = "acme") -> dict[str, int]:
        decision = self.fleet.route("probe", tenant, tokens, None, False)
        return {e.worker_id: e.matched_blocks for e in decision.estimates}


def _keys(tmp_path: Path) -> Keys:
    admin, fleet, acme, globex = (generate_api_key() for _ in range(4))
    path = tmp_path / "keys.toml"
    path.write_text(
        keys_entry_toml("ops", admin, "ops", [Role.ADMIN], False)
        + keys_entry_toml("router", fleet, "ops", [Role.FLEET], False)
        + keys_entry_toml("acme-app", acme, "acme", [Role.TENANT], False)
        + keys_entry_toml("globex-app", globex, "globex", [Role.TENANT], False)
    )
    return Keys(admin, fleet, acme, globex, path)


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def fleet(
    tmp_path: Path, tiny_model: LoadedModel, remote_server: ValkeyServer, remote_namespace: str
) -> Iterator[FleetUnderTest]:
    keys = _keys(tmp_path)
    with ExitStack() as stack:
        worker_audit = AuditLog(tmp_path / "audit-workers.jsonl", component="worker").start()
        router_audit = AuditLog(tmp_path / "audit-router.jsonl", component="router").start()
        stack.callback(worker_audit.close)
        stack.callback(router_audit.close)
        workers = []
        for i in range(2):
            events = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id=f"w{i}")
            emitter = KVEventEmitter.from_config(events, block_size=B).start()
            stack.callback(emitter.close)
            remote = RemoteConfig(url=remote_server.url, namespace=remote_namespace)
            tiers = WorkerConfig(
                tiers=(
                    host_tier(4 * MIB),
                    disk_tier(tmp_path / f"disk{i}", 8 * MIB),
                    remote_tier(remote, 16 * MIB),
                )
            )
            metrics = KvMetrics()
            engine = build_engine(
                tiny_model,
                EngineConfig(block_size=B, pool_blocks=48),
                tiers,
                metrics=metrics,
                events=emitter,
            )
            stack.callback(engine.close)
            auth = HttpAuth(Authenticator(keys.file), worker_audit)
            app = create_app(engine, model_name="tiny", metrics=metrics, auth=auth)
            client = stack.enter_context(serving(app))
            workers.append(Worker(engine, emitter, client))
        urls = [str(w.client.base_url).rstrip("/") for w in workers]
        fleet = Fleet(
            FleetTokenizer(ensure_checkpoint("tiny")),
            FleetConfig(worker_urls=urls, health_interval_s=0.2, api_key=keys.fleet),
        )
        for url in urls:
            fleet.attach(url)
        app = create_frontdoor_app(fleet, HttpAuth(Authenticator(keys.file), router_audit))
        router = stack.enter_context(serving(app))
        yield FleetUnderTest(
            keys,
            workers,
            fleet,
            router,
            remote_server,
            remote_namespace,
            tmp_path / "audit-router.jsonl",
            tmp_path / "audit-workers.jsonl",
        )


def _audit_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _chain(fleet: FleetUnderTest, text: str, tenant: str = "acme") -> set[BlockKey]:
    engine = fleet.workers[0].engine
    return set(engine.block_keys(engine.encode_prompt(text), tenant))


def _leftovers(fleet: FleetUnderTest, deleted: set[BlockKey]) -> list[str]:
    """Every replica of a deleted key still anywhere: pools, store levels, raw server keys."""
    found = []
    for worker in fleet.workers:
        engine = worker.engine
        found += [
            f"device:{b.key.hex()}" for b in engine.pool.committed_blocks() if b.key in deleted
        ]
        assert engine.bridge is not None
        store = engine.bridge.store
        with store.exclusive():
            for name, metas in store.resident():
                found += [f"{name}:{m.key.hex()}" for m in metas if m.key in deleted]
    server = redis.Redis.from_url(fleet.remote.url)
    hexes = {key.hex() for key in deleted}
    for raw in server.scan_iter(match=f"{fleet.namespace}:*", count=1000):
        name = raw.decode()
        if name.endswith(":t") or ":L:x:" in name:
            continue  # a tombstone (what keeps the key deleted), not a replica
        if any(h in name for h in hexes):
            found.append(f"server:{name}")
    server.close()
    return found


def test_delete_a_prefix_under_traffic_leaves_nothing_anywhere(fleet: FleetUnderTest) -> None:
    longer = PROMPT + " and the storms of the long winter that kept the ships away" * 4
    deleted = _chain(fleet, longer)
    assert len(deleted) > len(_chain(fleet, PROMPT)) + 1  # descendants of the prompt's blocks
    tokens = fleet.workers[0].engine.encode_prompt(PROMPT)
    for worker in fleet.workers:  # both workers hold the prompt and a descendant
        for text in (PROMPT, longer):
            body = {"prompt": text, "max_tokens": 2, "temperature": 0.0}
            headers = {"Authorization": f"Bearer {fleet.keys.acme}"}
            assert worker.client.post("/v1/completions", json=body, headers=headers).is_success
    fleet.complete(PROMPT, tenant="globex")  # the same prompt, another tenant: stays
    _wait(lambda: min(fleet.matched(tokens).values()) > 0, "the index to hold the prompt")
    assert not _leftovers(fleet, set()) and _leftovers(fleet, deleted)

    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            words = " ".join(str(int(w)) for w in rng.integers(0, 999, size=40))
            try:
                fleet.complete(f"Unrelated request {seed}: {words}")
            except BaseException as exc:  # reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=traffic, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    try:
        response = fleet.delete({"tenant": "acme", "prompt": PROMPT})
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not errors, errors
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["status"] == "ok" and answer["selector"] == "prompt"
    assert [w["status"] for w in answer["workers"]] == ["ok", "ok"]
    assert answer["deleted_keys"] == len(deleted)
    for tier in ("device", "host", "disk", "remote"):
        assert answer["removed"].get(tier, 0) > 0, (tier, answer["removed"])
    # (the index may have applied the workers' BlockRemoved batches before the answer came)

    assert _leftovers(fleet, deleted) == []
    longer_tokens = fleet.workers[0].engine.encode_prompt(longer)
    assert set(fleet.matched(tokens).values()) == {0}
    assert set(fleet.matched(longer_tokens).values()) == {0}
    assert max(fleet.matched(tokens, "globex").values()) > 0  # another tenant's copy stays
    again = fleet.complete(PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Audit: one line per worker and one at the router, with counts and keys, no prompt.
    worker_lines = [a for a in _audit_lines(fleet.worker_audit) if a["audit"] == "delete"]
    router_lines = [a for a in _audit_lines(fleet.router_audit) if a["audit"] == "delete"]
    assert len(worker_lines) == 2 and len(router_lines) == 1
    assert {a["reason"] for a in worker_lines} == {"prompt_token_ids"}
    assert router_lines[0]["reason"] == "prompt" and router_lines[0]["tenant"] == "acme"
    assert router_lines[0]["key_id"] == "ops" and router_lines[0]["object_count"] == len(deleted)
    for path in (fleet.worker_audit, fleet.router_audit):
        assert CANARY not in path.read_text()


def test_late_and_stale_events_do_not_resurrect_index_entries(fleet: FleetUnderTest) -> None:
    tokens = fleet.workers[0].engine.encode_prompt(PROMPT)
    answer = fleet.complete(PROMPT)
    # the index learns from the worker's events, after the answer: wait, then read the holder
    _wait(lambda: max(fleet.matched(tokens).values()) > 0, "the index to hold the prompt")
    worker_id = next(w for w, n in fleet.matched(tokens).items() if n > 0)
    worker = fleet.workers[int(worker_id[1:])]
    # a dump taken before the deletion (with the router's fleet key)
    before = worker.client.get("/kv/dump", headers={"Authorization": f"Bearer {fleet.keys.fleet}"})
    stale = decode_batch(before.content).batch
    stale_seq = int(before.headers["X-Kvstrata-Next-Seq"])
    assert any(e for e in stale.events)

    response = fleet.delete({"tenant": "acme", "prompt": PROMPT})
    assert response.status_code == 200, response.text
    assert max(fleet.matched(tokens).values()) == 0
    position = next(w for w in response.json()["workers"] if w["worker_id"] == worker_id)
    assert position["status"] == "ok"

    index = fleet.fleet._index  # the fleet lock's state: applied as the event plane does
    assert index is not None
    with fleet.fleet._lock:
        refusals = index.stats.tombstone_refusals
        index.apply_batch(worker_id, stale, seq=stale_seq - 1)  # a late (or replayed) batch
        index.replace_worker(worker_id, stale.epoch, stale.events, next_seq=stale_seq)
        assert index.stats.tombstone_refusals > refusals
    assert max(fleet.matched(tokens).values()) == 0
    assert answer["choices"][0]["text"] == fleet.complete(PROMPT)["choices"][0]["text"]
    # Stored again after the deletion (that request recomputed it): a fact, indexed again.
    _wait(lambda: max(fleet.matched(tokens).values()) > 0, "the recomputed prompt")


def test_unauthorised_deletes_are_refused_audited_and_delete_nothing(
    fleet: FleetUnderTest,
) -> None:
    tokens = fleet.workers[0].engine.encode_prompt(PROMPT)
    fleet.complete(PROMPT)
    _wait(lambda: max(fleet.matched(tokens).values()) > 0, "the index to hold the prompt")
    body = {"tenant": "acme", "prompt": PROMPT}
    assert fleet.router.post("/admin/delete", json=body).status_code == 401
    assert fleet.delete(body, key="kvs_not-a-key").status_code == 401
    assert fleet.delete(body, key=fleet.keys.acme).status_code == 403
    assert fleet.delete(body, key=fleet.keys.fleet).status_code == 403
    direct = fleet.workers[0].client.post(
        "/admin/delete", json=body, headers={"Authorization": f"Bearer {fleet.keys.acme}"}
    )
    assert direct.status_code == 403
    assert fleet.delete({"tenant": "acme", "prompt": PROMPT, "all": True}).status_code == 400
    assert fleet.delete({"tenant": "acme", "everything": True}).status_code == 400
    assert max(fleet.matched(tokens).values()) > 0  # nothing was deleted
    assert _leftovers(fleet, _chain(fleet, PROMPT))

    refused = [a for a in _audit_lines(fleet.router_audit) if a["audit"] != "delete"]
    assert [(a["audit"], a["reason"]) for a in refused] == [
        ("auth_failure", "no_key"),
        ("auth_failure", "unknown_key"),
        ("access_denied", "forbidden"),
        ("access_denied", "forbidden"),
    ]
    assert all(a["plane"] == "http POST /admin/delete" for a in refused)
    assert [a.get("key_id") for a in refused[2:]] == ["acme-app", "router"]
    worker_refused = [a for a in _audit_lines(fleet.worker_audit) if a["audit"] == "access_denied"]
    assert [a["key_id"] for a in worker_refused] == ["acme-app"]
    assert not any(a["audit"] == "delete" for a in _audit_lines(fleet.router_audit))
    for path in (fleet.worker_audit, fleet.router_audit):
        assert CANARY not in path.read_text()


def test_cli_prints_the_counts_and_fails_on_a_partial_delete(
    fleet: FleetUnderTest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet.complete(PROMPT)
    other = "A second conversation about the price of bread in the old town market " * 2
    fleet.complete(other)
    fleet.complete(other, tenant="globex")
    key_file = tmp_path / "admin.key"
    key_file.write_text(fleet.keys.admin + "\n")
    url = str(fleet.router.base_url).rstrip("/")
    capsys.readouterr()
    args = ["delete", "--url", url, "--tenant", "acme", "--all", "--api-key-file", str(key_file)]
    assert cli_main([*args, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["status"] == "ok" and answer["selector"] == "all"
    assert answer["removed"]["device"] > 0 and answer["removed"]["host"] > 0
    for text in (PROMPT, other):
        tokens = fleet.workers[0].engine.encode_prompt(text)
        assert set(fleet.matched(tokens).values()) == {0}
    other_tokens = fleet.workers[0].engine.encode_prompt(other)
    assert max(fleet.matched(other_tokens, "globex").values()) > 0
    assert _leftovers(fleet, _chain(fleet, PROMPT) | _chain(fleet, other)) == []

    fleet.complete(PROMPT)
    assert cli_main(["delete", "--url", url, "--tenant", "acme", "--prompt", PROMPT,
                     "--api-key-file", str(key_file)]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "device" in table and "host" in table and "router index" in table
    title = " ".join(table.split())  # the table may wrap its title
    assert "keys tombstoned" in title and " 0 replicas removed" not in title

    assert cli_main(["delete", "--url", url, "--tenant", "acme", "--all"]) == 1  # no key
    assert "refused (HTTP 401)" in capsys.readouterr().err

    dead = f"http://127.0.0.1:{_closed_port()}"
    fleet.fleet.config.worker_urls.append(dead)
    assert cli_main([*args, "--json"]) == 1
    partial = json.loads(capsys.readouterr().out)
    assert partial["status"] == "partial"
    assert [w["status"] for w in partial["workers"]] == ["ok", "ok", "failed"]
    assert partial["workers"][2]["error"]["code"] == "unreachable"


def test_cli_against_one_worker_fails_when_a_tier_was_unreachable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker's own answer has no ``status``: a tier it could not reach may still hold
    replicas, so the exit status is 1 (run it again), as behind a front door."""
    answer = {"removed": {"device": 3, "host": 3, "remote": 0}, "deleted_keys": 3, "pending": 0}
    for unreachable, code in (([], 0), (["remote"], 1)):
        reply = {**answer, "unreachable": unreachable}
        monkeypatch.setattr(
            httpx, "post", lambda *a, reply=reply, **k: httpx.Response(200, json=reply)
        )
        argv = ["delete", "--url", "http://w1", "--tenant", "acme", "--all", "--json"]
        assert cli_main(argv) == code
        assert json.loads(capsys.readouterr().out)["unreachable"] == unreachable


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_the_front_door_forwards_where_a_chats_content_starts() -> None:
    """A chat's deletion reaches the workers as token ids plus ``content_from`` (the first
    token that depends on the messages), so they keep the template head every conversation
    shares; a plain prompt's whole chain goes, and ``content_from`` is refused elsewhere."""
    from kvstrata.fleet.deletion import _forwarded
    from kvstrata.serve.deletion_protocol import parse_delete_body

    chat = parse_delete_body(b'{"tenant": "acme", "messages": [{"role": "user", "content": "x"}]}')
    assert _forwarded(chat, ([5, 6, 7, 8], 3)) == {
        "tenant": "acme",
        "prompt_token_ids": [5, 6, 7, 8],
        "content_from": 3,
    }
    assert _forwarded(chat, ([5, 6], 0)) == {"tenant": "acme", "prompt_token_ids": [5, 6]}
    forwarded = parse_delete_body(json.dumps(_forwarded(chat, ([5, 6, 7, 8], 3))).encode())
    assert forwarded.content_from == 3
    with pytest.raises(ApiError, match="content_from"):
        parse_delete_body(b'{"tenant": "acme", "prompt": "x", "content_from": 1}')


def test_token_ids_a_router_cannot_hash_are_a_400_not_a_500() -> None:
    from kvstrata.errors import ApiError
    from kvstrata.serve.deletion_protocol import parse_delete_body

    body = json.dumps({"tenant": "acme", "prompt_token_ids": [2**40] * 32}).encode()
    with pytest.raises(ApiError, match=r"\[0, 2\*\*32\)") as refused:
        parse_delete_body(body)
    assert refused.value.status == 400


def test_a_worker_that_left_replicas_for_later_is_unsettled() -> None:
    """Its stream at its position does not show the whole deletion yet, so the index drops
    its entries even when the stream is already past that position (``unsettled``)."""
    from kvstrata.fleet.deletion import WorkerOutcome

    assert WorkerOutcome("w0", "http://w0").settled
    assert not WorkerOutcome("w0", "http://w0", pending=2).settled
    assert not WorkerOutcome("w0", "http://w0", unreachable=["disk"]).settled
    assert not WorkerOutcome("w0", "http://w0", error={"code": "refused"}).settled
