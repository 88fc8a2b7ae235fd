"""One configuration for a worker: a TOML file, with command-line flags as overrides.

``kvstrata serve --config F``, ``kvstrata up --config F`` (which hands the same file to every
worker) and the vLLM connector (``kv_connector_extra_config = {"config": F, ...}``) all build
the same frozen ``WorkerConfig`` here, so their defaults cannot disagree. The schema is the
``KEYS`` table of ``config_schema``: it validates files, names every key in errors, and
generates the reference page ``docs/configuration.md`` (a test checks the page is current).

A file looks like ``examples/worker.toml``: top-level keys, a ``[pool]`` table, one
``[[tiers]]`` table per tier below the device pool (fastest first: ``host`` then ``disk``),
each with an optional ``[tiers.rollout]`` table, an ``[events]`` table (KV events for a fleet
index), a ``[connector]`` table (vLLM only) and a ``[limits]`` table (``serve`` only).

Overrides (``OVERRIDES``) are flat names — the ``serve`` flags without dashes, and the flat keys
the connector has always taken (``host_gib``, ``disk_dir``, ...) — applied to the parsed
file before validation, in the phases of ``override_phase`` (whatever order they came in).
Parsing happens once, at the edge: inner components take the frozen result and never read
files or the environment. A bad file or value raises ``ConfigError``
naming the key and the file, never a traceback.

This module owns the worker's whole config and the sections read here; the generic reading
machinery (merge, key checks, typed ``Reader``, secret files) is ``config_reader`` and the
``[[tiers]]`` tables (``TierSpec``, ``host_tier``, ...) are ``config_tiers``, re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError, InvalidInput
from kvstrata.identity import secret_digest
from kvstrata.runtime.config_overrides import OVERRIDES, PATH_OVERRIDES, override_phase
from kvstrata.runtime.config_reader import Reader, check_keys, merge, read_secret, text
from kvstrata.runtime.config_schema import GIB, MIB, TIER_NAMES
from kvstrata.runtime.config_tiers import TierSpec, disk_tier, host_tier, parse_tier, remote_tier
from kvstrata.runtime.events import KVEventsConfig
from kvstrata.runtime.read_layouts import READ_LAYOUTS, ReadLayout, parse_read_layout
from kvstrata.runtime.scheduler import SchedulerConfig
from kvstrata.runtime.transfer_config import TransferConfig
from kvstrata.security.config import SecurityConfig


@dataclass(frozen=True)
class ServeLimits:
    """What a ``serve`` worker accepts from one client request (the ``[limits]`` table)."""

    max_tokens: int = 4096
    max_body_bytes: int = 4 * MIB
    body_timeout_s: float = 30.0


@dataclass(frozen=True)
class WorkerConfig:
    model: str = "smollm2"
    served_model_name: str | None = None
    pool_bytes: int = GIB
    block_size: int = 16
    read_layouts: tuple[ReadLayout, ...] = ()  # alternate layouts of stored objects it reads
    tiers: tuple[TierSpec, ...] = ()
    events: KVEventsConfig | None = None
    tenant_secret: bytes = field(default=b"", repr=False)
    admin_token: str | None = field(default=None, repr=False)
    debug_endpoints: bool = False
    limits: ServeLimits = ServeLimits()
    lookup_timeout_ms: int = 2000
    load_timeout_ms: int = 5000
    save_queue_blocks: int = 1024
    pd_wait_ms: int = 30000
    stats_path: Path | None = None
    lookup_curve_secret_file: Path | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def tier(self, name: str) -> TierSpec | None:
        return next((spec for spec in self.tiers if spec.name == name), None)

    @property
    def secret_digest(self) -> str:
        return secret_digest(self.tenant_secret)

    def with_events(self, events: KVEventsConfig | None) -> WorkerConfig:
        return dataclasses.replace(self, events=events)


TENANT_SECRET_ENV = "KVSTRATA_TENANT_SECRET"


# ---- loading ----------------------------------------------------------------------------------
def load_worker_config(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    raw: Mapping[str, Any] | None = None,
    source: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorkerConfig:
    """Read ``path`` (TOML) or ``raw`` (a parsed mapping), apply ``overrides``, validate.

    ``environ`` (default: the process environment; this is the edge): ``KVSTRATA_TENANT_SECRET``
    is the tenant secret when no ``tenant_secret_file`` is set (the file wins)."""
    where = source or (str(path) if path is not None else "defaults")
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read the file: {exc.strerror}", source=where) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError("the file is not UTF-8", source=where) from exc
        except (tomllib.TOMLDecodeError, RecursionError) as exc:  # RecursionError: too deep
            raise ConfigError(f"not valid TOML: {exc}", source=where) from exc
        base = Path(path).resolve().parent
    if raw is not None:
        data = merge(data, dict(raw))
    check_keys(data, where)
    for name, value in sorted(
        (overrides or {}).items(), key=lambda item: override_phase(*item)
    ):  # a stable sort: in the given order within a phase
        if value is None:
            continue
        handler = OVERRIDES.get(name)
        if handler is None:
            raise ConfigError("unknown setting", key=name, source=where)
        if name in PATH_OVERRIDES:  # relative to where the flag was given, not to the file
            value = str(Path(value).expanduser().resolve())
        handler.apply(data, value)
    env = os.environ if environ is None else environ
    return _build(data, where, base, env.get(TENANT_SECRET_ENV))


def _build(
    data: Mapping[str, Any], where: str, base: Path, env_secret: str | None = None
) -> WorkerConfig:
    top = Reader(data, "", where, base)
    pool = Reader(data.get("pool", {}), "pool.", where, base)
    pool_gib = pool.get("gib")
    if pool_gib <= 0:
        raise pool.fail("gib", "must be positive")
    block_size = pool.get("block_size")
    if block_size < 1:
        raise pool.fail("block_size", "must be at least 1")
    tiers = tuple(
        parse_tier(entry, i, where, base) for i, entry in enumerate(data.get("tiers", []))
    )
    read_layouts = tuple(
        parse_read_layout(Reader(entry, f"{READ_LAYOUTS}.", f"{where} ({READ_LAYOUTS}[{i}])", base))
        for i, entry in enumerate(data.get("pool", {}).get("read_layouts", []))
    )
    names = [spec.name for spec in tiers]
    if len(set(names)) != len(names):
        raise ConfigError("each tier may appear once", key="tiers.name", source=where)
    if names != sorted(names, key=TIER_NAMES.index):
        raise ConfigError(
            "tiers go fastest first: host, then disk, then remote", key="tiers", source=where
        )
    secret_file = top.get("tenant_secret_file")
    secret = read_secret(secret_file, "tenant_secret_file", where)
    if secret_file is None and env_secret:
        secret = env_secret.encode("utf-8")
    token_file = top.get("admin_token_file")
    token = read_secret(token_file, "admin_token_file", where) if token_file else None
    sched = Reader(data.get("scheduler", {}), "scheduler.", where, base)
    try:
        scheduler = SchedulerConfig(
            max_num_seqs=sched.get("max_num_seqs"),
            max_num_batched_tokens=sched.get("max_num_batched_tokens"),
            max_waiting=sched.get("max_waiting"),
        )
    except ConfigError as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1], key=exc.key, source=where) from None
    connector = Reader(data.get("connector", {}), "connector.", where, base)
    timeout = connector.get("lookup_timeout_ms")
    if timeout <= 0:
        raise connector.fail("lookup_timeout_ms", "must be positive")
    load_timeout = connector.get("load_timeout_ms")
    if load_timeout <= 0:
        raise connector.fail("load_timeout_ms", "must be positive")
    save_queue = connector.get("save_queue_blocks")
    if save_queue <= 0:
        raise connector.fail("save_queue_blocks", "must be positive")
    pd_wait = connector.get("pd_wait_ms")
    if pd_wait <= 0:
        raise connector.fail("pd_wait_ms", "must be positive")
    lookup_curve = connector.get("lookup_curve_secret_file")
    if lookup_curve is not None and not lookup_curve.is_file():
        raise connector.fail("lookup_curve_secret_file", f"no such file: {lookup_curve}")
    return WorkerConfig(
        model=top.get("model"),
        served_model_name=top.get("served_model_name"),
        pool_bytes=int(pool_gib * GIB),
        block_size=block_size,
        read_layouts=read_layouts,
        tiers=tiers,
        events=_events(data.get("events"), where, base),
        tenant_secret=secret,
        admin_token=text(token, "admin_token_file", where) if token else None,
        debug_endpoints=top.get("debug_endpoints"),
        limits=_limits(Reader(data.get("limits", {}), "limits.", where, base)),
        lookup_timeout_ms=timeout,
        load_timeout_ms=load_timeout,
        save_queue_blocks=save_queue,
        pd_wait_ms=pd_wait,
        stats_path=connector.get("stats_path"),
        lookup_curve_secret_file=lookup_curve,
        scheduler=scheduler,
        security=_security(Reader(data.get("security", {}), "security.", where, base)),
        transfer=_transfer(Reader(data.get("transfer", {}), "transfer.", where, base)),
    )


def _transfer(table: Reader) -> TransferConfig:
    port = table.get("port")
    if port is not None and not 0 <= port <= 65535:
        raise table.fail("port", "must lie in 0..65535")
    try:
        return TransferConfig(
            host=table.get("host"),
            port=port,
            transport=table.get("transport"),
            allowed_targets=tuple(table.get("allowed_targets")),
        )
    except InvalidInput as exc:
        key = "transport" if "transport" in str(exc) else "allowed_targets"
        raise table.fail(key, str(exc)) from None


def _security(table: Reader) -> SecurityConfig:
    ttl = table.get("tombstone_ttl_s")
    if not 0 < ttl < math.inf:
        raise table.fail("tombstone_ttl_s", "must be a positive, finite number")
    cert, key = table.get("tls_cert_file"), table.get("tls_key_file")
    if (cert is None) != (key is None):
        raise table.fail("tls_key_file", "tls_cert_file and tls_key_file go together")
    for name in ("keys_file", "fleet_key_file", "tls_cert_file", "tls_key_file", "tls_ca_file"):
        path = table.get(name)
        if path is not None and not path.is_file():
            raise table.fail(name, f"no such file: {path}")
    fleet_key_file = table.get("fleet_key_file")
    fleet_key = read_secret(fleet_key_file, "security.fleet_key_file", table.where)
    if fleet_key_file is not None and not fleet_key.strip():
        raise table.fail("fleet_key_file", "the fleet key file is empty")
    try:
        fleet_key_text = fleet_key.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise table.fail("fleet_key_file", "the fleet key file is not UTF-8") from None
    return SecurityConfig(
        keys_file=table.get("keys_file"),
        fleet_key=fleet_key_text or None,
        audit_path=table.get("audit_path"),
        tombstone_ttl_s=ttl,
        tls_cert_file=cert,
        tls_key_file=key,
        tls_ca_file=table.get("tls_ca_file"),
    )


def _limits(limits: Reader) -> ServeLimits:
    max_tokens, body_mib, timeout = (
        limits.get(name) for name in ("max_tokens", "max_body_mib", "body_timeout_s")
    )
    if max_tokens < 1:
        raise limits.fail("max_tokens", "must be at least 1")
    for name, value in (("max_body_mib", body_mib), ("body_timeout_s", timeout)):
        if not 0 < value < math.inf:
            raise limits.fail(name, "must be a positive, finite number")
    return ServeLimits(max_tokens, max(1, int(body_mib * MIB)), timeout)


def _events(table: Mapping[str, Any] | None, where: str, base: Path) -> KVEventsConfig | None:
    if not table:
        return None
    events = Reader(table, "events.", where, base)
    endpoint = events.get("endpoint")
    if endpoint is None:
        if events.get("replay_endpoint") is not None or events.get("worker_id") is not None:
            raise events.fail("endpoint", "replay_endpoint and worker_id need an endpoint")
        return None
    for name in ("endpoint", "replay_endpoint"):
        value = events.get(name)
        if value is not None and "://" not in value:
            raise events.fail(name, f"must be a ZMQ endpoint like tcp://127.0.0.1:*, got {value!r}")
    worker_id = events.get("worker_id")
    if worker_id is not None and not worker_id.strip():
        raise events.fail("worker_id", "must not be empty")
    buffer_steps = events.get("buffer_steps")
    if buffer_steps < 1:
        raise events.fail("buffer_steps", "must be at least 1")
    curve_secret, curve_clients = events.get("curve_secret_file"), events.get("curve_clients_dir")
    if (curve_secret is None) != (curve_clients is None):
        raise events.fail("curve_clients_dir", "goes together with curve_secret_file")
    if curve_secret is not None and not curve_secret.is_file():
        raise events.fail("curve_secret_file", f"no such file: {curve_secret}")
    if curve_clients is not None and not curve_clients.is_dir():
        raise events.fail("curve_clients_dir", f"no such directory: {curve_clients}")
    return KVEventsConfig(
        endpoint,
        events.get("replay_endpoint"),
        worker_id=worker_id,
        topic=events.get("topic"),
        buffer_steps=buffer_steps,
        curve_secret_file=curve_secret,
        curve_clients_dir=curve_clients,
    )


__all__ = [
    "TENANT_SECRET_ENV",
    "ServeLimits",
    "TierSpec",
    "WorkerConfig",
    "disk_tier",
    "host_tier",
    "load_worker_config",
    "remote_tier",
]
