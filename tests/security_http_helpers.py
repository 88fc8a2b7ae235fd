"""A worker app with a keys file and an audit log, for the HTTP access-control tests.

Tenants: ``tenantA`` (key ``A``, may narrow to ``tenantA/<sub>``), ``tenantB`` (``B``),
``tenantC`` (``C``, not in the shared namespace); ``shared-sys`` is shared by A and B.
Other keys: ``OBS`` (observer of tenantA), ``FLEET`` (fleet role), ``ADMIN`` (admin).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.security import AuditLog, Authenticator, Role
from kvstrata.security.keys import keys_entry_toml
from kvstrata.serve.app import create_app
from kvstrata.serve.auth import HttpAuth
from kvstrata.telemetry import KvMetrics
from tier_helpers import worker_tiers

B = 16
BLOCK_BYTES = 2 * 2 * 2 * B * 16 * 4  # the tiny model's KV bytes per block (fp32)
KEYS = {
    "A": ("tenantA", [Role.TENANT], True),
    "B": ("tenantB", [Role.TENANT], False),
    "C": ("tenantC", [Role.TENANT], False),
    "OBS": ("tenantA", [Role.OBSERVER], False),
    "FLEET": ("fleet", [Role.FLEET], False),
    "ADMIN": ("ops", [Role.ADMIN], False),
}
SHARED = '\n[[shared]]\nnamespace = "shared-sys"\ntenants = ["tenantA", "tenantB"]\n'


def key(name: str) -> str:
    return f"kvs_test-{name.lower()}-" + "0" * 36


def auth(name: str | None) -> dict[str, str]:
    return {} if name is None else {"Authorization": f"Bearer {key(name)}"}


def keys_text(extra: dict[str, tuple[str, list[Role], bool]] | None = None) -> str:
    entries = {**KEYS, **(extra or {})}
    return (
        "".join(
            keys_entry_toml(f"id-{name}", key(name), tenant, roles, sub)
            for name, (tenant, roles, sub) in entries.items()
        )
        + SHARED
    )


def write_keys(path: Path, extra: dict[str, tuple[str, list[Role], bool]] | None = None) -> Path:
    path.write_text(keys_text(extra))
    return path


def audit_records(
    path: Path, match: Callable[[dict[str, Any]], bool], timeout_s: float = 5.0
) -> list[dict[str, Any]]:
    """The audit lines that ``match``, once at least one is written (the log writes on its
    own thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        found = [r for r in map(json.loads, lines) if match(r)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def body(prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@dataclass
class Served:
    client: httpx.Client
    audit_path: Path
    keys_path: Path
    authenticator: Authenticator
    engine: ReferenceEngine

    def audited(self, **fields: Any) -> list[dict[str, Any]]:
        return audit_records(
            self.audit_path, lambda r: all(r.get(k) == v for k, v in fields.items())
        )


@contextmanager
def worker_app(
    tiny_model: LoadedModel,
    directory: Path,
    *,
    keys_path: Path | None = None,
    tls: tuple[Path, Path] | None = None,
) -> Iterator[Served]:
    """A worker (events, a host tier, debug endpoints) guarded by the keys file."""
    keys_path = keys_path or write_keys(directory / "keys.toml")
    audit_path = directory / "audit.jsonl"
    events = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id="sec:1")
    emitter = KVEventEmitter.from_config(events, block_size=B).start()
    metrics = KvMetrics()
    audit = AuditLog(audit_path, component="worker").start()
    engine = build_engine(
        tiny_model,
        EngineConfig(block_size=B, pool_blocks=16),
        worker_tiers(host_bytes=16 * BLOCK_BYTES),
        metrics=metrics,
        events=emitter,
        audit=audit,
    )
    authenticator = Authenticator(keys_path, reload_interval_s=0.0)
    app = create_app(
        engine,
        model_name="tiny",
        metrics=metrics,
        auth=HttpAuth(authenticator, audit),
        debug_endpoints=True,
    )
    try:
        with serving(app, tls=tls) as client:
            yield Served(client, audit_path, keys_path, authenticator, engine)
    finally:
        engine.close()
        emitter.close()
        audit.close()
