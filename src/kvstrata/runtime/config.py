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
file before validation. Parsing happens once, at the edge: inner components take the frozen
result and never read files or the environment. A bad file or value raises ``ConfigError``
naming the key and the file, never a traceback.
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
from kvstrata.runtime.config_schema import (
    BY_PATH,
    EVICTION_POLICIES,
    GIB,
    MIB,
    OVERRIDES,
    PATH_OVERRIDES,
    TABLES,
    TIER_NAMES,
)
from kvstrata.runtime.events import KVEventsConfig
from kvstrata.runtime.read_layouts import READ_LAYOUTS, ReadLayout, parse_read_layout
from kvstrata.runtime.scheduler import SchedulerConfig
from kvstrata.runtime.transfer_config import TransferConfig
from kvstrata.security.config import SecurityConfig
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy
from kvstrata.tiers.remote_client import RemoteConfig


@dataclass(frozen=True)
class TierSpec:
    """One tier below the device pool: its medium and the store's ``TierConfig`` for it."""

    capacity_bytes: int
    config: TierConfig
    path: Path | None = None
    durable: bool = True
    eviction_policy: str = "kvstrata"
    remote: RemoteConfig | None = None

    @property
    def name(self) -> str:
        return self.config.name


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
        data = _merge(data, dict(raw))
    _check_keys(data, where)
    for name, value in (overrides or {}).items():
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


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = _merge(out[name], value)
        else:
            out[name] = value
    return out


def _check_keys(data: Mapping[str, Any], where: str) -> None:
    for name, value in data.items():
        if name in TABLES:
            entries = value if name == "tiers" else [value]
            if name == "tiers" and not isinstance(value, list):
                raise ConfigError("must be an array of tables ([[tiers]])", key=name, source=where)
            for entry in entries:
                if not isinstance(entry, Mapping):
                    raise ConfigError("must be a table", key=name, source=where)
                _check_table(name, entry, where)
        elif name not in BY_PATH:
            raise ConfigError("unknown key", key=name, source=where)


def _check_table(prefix: str, table: Mapping[str, Any], where: str) -> None:
    for name, value in table.items():
        path = f"{prefix}.{name}"
        if path == "tiers.rollout":
            if not isinstance(value, Mapping):
                raise ConfigError("must be a table", key=path, source=where)
            _check_table(path, value, where)
        elif path == READ_LAYOUTS:
            if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
                raise ConfigError("must be an array of tables", key=path, source=where)
            for entry in value:
                _check_table(path, entry, where)
        elif path not in BY_PATH:
            raise ConfigError("unknown key", key=path, source=where)


class _Reader:
    """Typed access to one table of the raw data, naming ``prefix.key`` in every error."""

    def __init__(self, table: Mapping[str, Any], prefix: str, where: str, base: Path) -> None:
        self.table, self.prefix, self.where, self.base = table, prefix, where, base

    def get(self, name: str) -> Any:
        path = f"{self.prefix}{name}"
        key = BY_PATH[path]
        value = self.table.get(name)
        if value is None:  # absent, or null in a parsed mapping: the default
            value = key.default
        if value is None:
            return None
        try:
            return _coerce(key.type, value, self.base)
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: float(10**400)
            raise ConfigError(f"{exc} (got {value!r})", key=path, source=self.where) from None

    def fail(self, name: str, message: str) -> ConfigError:
        return ConfigError(message, key=f"{self.prefix}{name}", source=self.where)


def _coerce(kind: str, value: Any, base: Path) -> Any:
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise TypeError("expected true or false")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError("expected an integer")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError("expected a number")
        number = float(value)
        if not math.isfinite(number):  # nan and inf pass every comparison check below
            raise ValueError("expected a finite number")
        return number
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError("expected a string")
        return value
    if kind == "path":
        if not isinstance(value, str | Path):
            raise TypeError("expected a path")
        if "\0" in str(value):
            raise ValueError("a path cannot hold a NUL character")
        try:
            path = Path(value).expanduser()
        except RuntimeError:  # "~user" of no such user
            raise ValueError("cannot expand '~' in this path") from None
        return path if path.is_absolute() else base / path
    if kind == "list[str]":
        if isinstance(value, str):
            value = [part for part in value.split(",") if part]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError("expected a list of strings")
        return list(value)
    if kind == "table[float]":
        if not isinstance(value, Mapping):
            raise TypeError("expected a table of numbers")
        return {str(k): _coerce("float", v, base) for k, v in value.items()}
    raise AssertionError(kind)


def _gib(reader: _Reader, name: str, value: float | None) -> int | None:
    if value is None:
        return None
    if value < 0:
        raise reader.fail(name, "must be >= 0")
    return int(value * GIB)


def _build(
    data: Mapping[str, Any], where: str, base: Path, env_secret: str | None = None
) -> WorkerConfig:
    top = _Reader(data, "", where, base)
    pool = _Reader(data.get("pool", {}), "pool.", where, base)
    pool_gib = pool.get("gib")
    if pool_gib <= 0:
        raise pool.fail("gib", "must be positive")
    block_size = pool.get("block_size")
    if block_size < 1:
        raise pool.fail("block_size", "must be at least 1")
    tiers = tuple(_tier(entry, i, where, base) for i, entry in enumerate(data.get("tiers", [])))
    read_layouts = tuple(
        parse_read_layout(
            _Reader(entry, f"{READ_LAYOUTS}.", f"{where} ({READ_LAYOUTS}[{i}])", base)
        )
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
    secret = _read_secret(secret_file, "tenant_secret_file", where)
    if secret_file is None and env_secret:
        secret = env_secret.encode("utf-8")
    token_file = top.get("admin_token_file")
    token = _read_secret(token_file, "admin_token_file", where) if token_file else None
    sched = _Reader(data.get("scheduler", {}), "scheduler.", where, base)
    try:
        scheduler = SchedulerConfig(
            max_num_seqs=sched.get("max_num_seqs"),
            max_num_batched_tokens=sched.get("max_num_batched_tokens"),
            max_waiting=sched.get("max_waiting"),
        )
    except ConfigError as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1], key=exc.key, source=where) from None
    connector = _Reader(data.get("connector", {}), "connector.", where, base)
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
        admin_token=_text(token, "admin_token_file", where) if token else None,
        debug_endpoints=top.get("debug_endpoints"),
        limits=_limits(_Reader(data.get("limits", {}), "limits.", where, base)),
        lookup_timeout_ms=timeout,
        load_timeout_ms=load_timeout,
        save_queue_blocks=save_queue,
        pd_wait_ms=pd_wait,
        stats_path=connector.get("stats_path"),
        lookup_curve_secret_file=lookup_curve,
        scheduler=scheduler,
        security=_security(_Reader(data.get("security", {}), "security.", where, base)),
        transfer=_transfer(_Reader(data.get("transfer", {}), "transfer.", where, base)),
    )


def _transfer(table: _Reader) -> TransferConfig:
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


def _security(table: _Reader) -> SecurityConfig:
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
    fleet_key = _read_secret(fleet_key_file, "security.fleet_key_file", table.where)
    if fleet_key_file is not None and not fleet_key.strip():
        raise table.fail("fleet_key_file", "the fleet key file is empty")
    return SecurityConfig(
        keys_file=table.get("keys_file"),
        fleet_key=fleet_key.decode("utf-8").strip() or None,
        audit_path=table.get("audit_path"),
        tombstone_ttl_s=ttl,
        tls_cert_file=cert,
        tls_key_file=key,
        tls_ca_file=table.get("tls_ca_file"),
    )


def _limits(limits: _Reader) -> ServeLimits:
    max_tokens, body_mib, timeout = (
        limits.get(name) for name in ("max_tokens", "max_body_mib", "body_timeout_s")
    )
    if max_tokens < 1:
        raise limits.fail("max_tokens", "must be at least 1")
    for name, value in (("max_body_mib", body_mib), ("body_timeout_s", timeout)):
        if not 0 < value < math.inf:
            raise limits.fail(name, "must be a positive, finite number")
    return ServeLimits(max_tokens, max(1, int(body_mib * MIB)), timeout)


def _read_secret(path: Path | None, key: str, where: str) -> bytes:
    if path is None:
        return b""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", key=key, source=where) from exc


def _text(secret: bytes, key: str, where: str) -> str:
    """A token or password file's text (stripped); not UTF-8 is a ConfigError."""
    try:
        return secret.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError("the file is not UTF-8 text", key=key, source=where) from None


def _tier(entry: Mapping[str, Any], index: int, where: str, base: Path) -> TierSpec:
    tier = _Reader(entry, "tiers.", f"{where} (tiers[{index}])", base)
    name = tier.get("name")
    if name not in TIER_NAMES:
        raise tier.fail("name", f"must be one of {', '.join(TIER_NAMES)}, got {name!r}")
    gib = tier.get("gib")
    if gib is None or gib <= 0:
        raise tier.fail("gib", "must be a positive number of GiB")
    path = tier.get("path")
    if (name == "disk") != (path is not None):
        raise tier.fail("path", "the disk tier needs a path; the other tiers take none")
    remote = _remote(tier, name, where)
    policy_name = tier.get("write_policy")
    try:
        write_policy = WritePolicy(policy_name)
    except ValueError:
        known = ", ".join(p.value for p in WritePolicy)
        raise tier.fail("write_policy", f"must be one of {known}") from None
    eviction = tier.get("eviction_policy")
    if eviction not in EVICTION_POLICIES:
        raise tier.fail("eviction_policy", f"must be one of {', '.join(EVICTION_POLICIES)}")
    ttl = tier.get("ttl_s")
    if ttl is not None and ttl <= 0:
        raise tier.fail("ttl_s", "must be positive")
    quotas = {t: _gib(tier, "quota_gib", q) or 0 for t, q in tier.get("quota_gib").items()}
    min_uses = tier.get("selective_min_uses")
    if min_uses < 1:
        raise tier.fail("selective_min_uses", "must be at least 1")
    write_back = tier.get("write_back_max_mib")
    if write_back <= 0:
        raise tier.fail("write_back_max_mib", "must be positive")
    config = TierConfig(
        name,
        write_policy,
        ttl,
        tenant_quota_bytes=quotas,
        default_tenant_quota_bytes=_gib(tier, "default_quota_gib", tier.get("default_quota_gib")),
        selective_min_uses=min_uses,
        write_back_max_bytes=int(write_back * MIB),
        rollout=_rollout(entry.get("rollout", {}), where, index, base),
        verify_reads=tier.get("verify_reads"),
    )
    return TierSpec(
        capacity_bytes=int(gib * GIB),
        config=config,
        path=path,
        durable=tier.get("durable"),
        eviction_policy=eviction,
        remote=remote,
    )


def _remote(tier: _Reader, name: str, where: str) -> RemoteConfig | None:
    url, cluster = tier.get("url"), tier.get("cluster")
    if name != "remote":
        for key in ("url", "cluster", "password_file"):
            if tier.get(key):
                raise tier.fail(key, "only the remote tier takes this")
        return None
    if (url is None) == (not cluster):
        raise tier.fail("url", "the remote tier needs exactly one of url or cluster")
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise tier.fail("url", f"must be redis://host:port[/db] or rediss://..., got {url!r}")
    password_file = tier.get("password_file")
    password = None
    if password_file is not None:
        raw = _read_secret(password_file, "tiers.password_file", where)
        password = _text(raw, "tiers.password_file", where)
    timeout = tier.get("timeout_ms")
    if timeout <= 0:
        raise tier.fail("timeout_ms", "must be positive")
    try:
        return RemoteConfig(
            url=url,
            cluster=tuple(cluster or ()),
            password=password,
            tls=tier.get("tls") or (url or "").startswith("rediss://"),
            namespace=tier.get("namespace"),
            timeout_s=timeout / 1000,
            connect_timeout_s=timeout / 1000,
        )
    except InvalidInput as exc:
        raise tier.fail("namespace", str(exc)) from None


def _rollout(table: Mapping[str, Any], where: str, index: int, base: Path) -> RolloutConfig:
    rollout = _Reader(table, "tiers.rollout.", f"{where} (tiers[{index}])", base)
    canary = rollout.get("canary")
    if not 0.0 <= canary <= 1.0:
        raise rollout.fail("canary", "must lie in [0, 1]")
    min_tokens = rollout.get("min_reusable_tokens")
    if min_tokens < 0:
        raise rollout.fail("min_reusable_tokens", "must be >= 0")
    tenants, models = rollout.get("tenants"), rollout.get("models")
    return RolloutConfig(
        enabled=rollout.get("enabled"),
        tenants=frozenset(tenants) if tenants else None,
        models=frozenset(models) if models else None,
        canary_fraction=canary,
        min_reusable_tokens=min_tokens,
    )


def _events(table: Mapping[str, Any] | None, where: str, base: Path) -> KVEventsConfig | None:
    if not table:
        return None
    events = _Reader(table, "events.", where, base)
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


# ---- programmatic construction (tests, benchmarks) ----------------------------------------------
def remote_tier(
    remote: RemoteConfig,
    capacity_bytes: int,
    config: TierConfig | None = None,
) -> TierSpec:
    """A remote tier spec (``config`` defaults to write-through, no TTL, no quotas)."""
    return TierSpec(capacity_bytes, config or TierConfig("remote"), remote=remote)


def host_tier(
    capacity_bytes: int, config: TierConfig | None = None, *, eviction_policy: str = "kvstrata"
) -> TierSpec:
    """A host DRAM tier spec (``config`` defaults to write-through, no TTL, no quotas)."""
    return TierSpec(capacity_bytes, config or TierConfig("host"), eviction_policy=eviction_policy)


def disk_tier(
    path: Path,
    capacity_bytes: int,
    config: TierConfig | None = None,
    *,
    durable: bool = True,
    eviction_policy: str = "kvstrata",
) -> TierSpec:
    """A local disk tier spec (``config`` defaults to write-through, no TTL, no quotas)."""
    return TierSpec(
        capacity_bytes,
        config or TierConfig("disk"),
        path=path,
        durable=durable,
        eviction_policy=eviction_policy,
    )
