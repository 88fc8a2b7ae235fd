"""One configuration for a worker: a TOML file, with command-line flags as overrides.

``kvstrata serve --config F``, ``kvstrata up --config F`` (which hands the same file to every
worker) and the vLLM connector (``kv_connector_extra_config = {"config": F, ...}``) all build
the same frozen ``WorkerConfig`` here, so their defaults cannot disagree. The schema is the
``KEYS`` table below: it validates files, names every key in errors, and generates the
reference page ``docs/configuration.md`` (a test checks the page is current).

A file looks like ``examples/worker.toml``: top-level keys, a ``[pool]`` table, one
``[[tiers]]`` table per tier below the device pool (fastest first: ``host`` then ``disk``),
each with an optional ``[tiers.rollout]`` table, an ``[events]`` table (KV events for a fleet
index) and a ``[connector]`` table (vLLM only).

Overrides (``OVERRIDES``) are flat names — the ``serve`` flags without dashes, and the flat keys
the connector has always taken (``host_gib``, ``disk_dir``, ...) — applied to the parsed
file before validation. Parsing happens once, at the edge: inner components take the frozen
result and never read files or the environment. A bad file or value raises ``ConfigError``
naming the key and the file, never a traceback.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvstrata.errors import ConfigError
from kvstrata.identity import secret_digest
from kvstrata.runtime.events import KVEventsConfig
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy

GIB: Final = 1 << 30
MIB: Final = 1 << 20
TIER_NAMES: Final = ("host", "disk")
EVICTION_POLICIES: Final = ("kvstrata", "lru")


@dataclass(frozen=True)
class Key:
    """One configuration key: its dotted path, type, default and meaning."""

    path: str
    type: str  # "float" | "int" | "str" | "bool" | "path" | "list[str]" | "table[float]"
    default: Any
    help: str


KEYS: Final[tuple[Key, ...]] = (
    Key("model", "str", "smollm2", "`serve`: smollm2 | tiny | a local HF model directory"),
    Key("served_model_name", "str", None, "`serve`: the name clients pass as `model`"),
    Key(
        "tenant_secret_file",
        "path",
        None,
        "file whose bytes are mixed into every tenant's salt; router and workers must agree "
        "(compared by digest at attach); unset: the empty secret",
    ),
    Key("admin_token_file", "path", None, "`serve`: bearer token required on `/admin`"),
    Key("debug_endpoints", "bool", False, "`serve`: `POST /kv/debug/drop-events` (tests)"),
    Key("pool.gib", "float", 1.0, "device KV pool size in GiB (reference engine)"),
    Key("pool.block_size", "int", 16, "tokens per KV block (reference engine)"),
    Key("tiers.name", "str", None, "`host` (DRAM slab) or `disk` (one file per object)"),
    Key("tiers.gib", "float", None, "capacity in GiB"),
    Key("tiers.path", "path", None, "disk: the tier's directory (required for disk)"),
    Key("tiers.durable", "bool", True, "disk: fsync every object (off: survives process death)"),
    Key(
        "tiers.write_policy",
        "str",
        "write-through",
        "how objects enter this tier from the one above: write-through | write-back | selective",
    ),
    Key("tiers.ttl_s", "float", None, "seconds an object lives in this tier (unset: no TTL)"),
    Key("tiers.eviction_policy", "str", "kvstrata", "kvstrata (by measured value) | lru"),
    Key("tiers.verify_reads", "bool", True, "check the payload digest on every read"),
    Key("tiers.selective_min_uses", "int", 2, "selective: uses before an object is admitted"),
    Key("tiers.write_back_max_mib", "float", 256.0, "write-back: queued MiB before backpressure"),
    Key("tiers.quota_gib", "table[float]", {}, "per-tenant byte quota in GiB (`{tenant = gib}`)"),
    Key("tiers.default_quota_gib", "float", None, "quota of tenants not in `quota_gib`"),
    Key("tiers.rollout.enabled", "bool", True, "the tier's switch at start (admin can flip it)"),
    Key("tiers.rollout.tenants", "list[str]", None, "only these tenants use the tier"),
    Key("tiers.rollout.models", "list[str]", None, "only these model names use the tier"),
    Key("tiers.rollout.canary", "float", 1.0, "share of requests that use the tier, in [0, 1]"),
    Key(
        "tiers.rollout.min_reusable_tokens",
        "int",
        0,
        "break-even: below this many reusable tokens from the tier, recompute",
    ),
    Key("events.endpoint", "str", None, "ZMQ endpoint KV events are published on"),
    Key("events.replay_endpoint", "str", None, "ZMQ ROUTER endpoint answering replay requests"),
    Key("events.worker_id", "str", None, "this worker's id in events (serve: HOSTNAME:PORT)"),
    Key("events.topic", "str", "", "ZMQ topic of the event stream"),
    Key("events.buffer_steps", "int", 10_000, "batches kept for replay"),
    Key("connector.lookup_timeout_ms", "int", 2000, "vLLM: scheduler → worker lookup timeout"),
    Key("connector.stats_path", "path", None, "vLLM: the worker writes its counters here"),
)
_BY_PATH: Final = {key.path: key for key in KEYS}
_TABLES: Final = ("pool", "tiers", "events", "connector")


@dataclass(frozen=True)
class TierSpec:
    """One tier below the device pool: its medium and the store's ``TierConfig`` for it."""

    capacity_bytes: int
    config: TierConfig
    path: Path | None = None
    durable: bool = True
    eviction_policy: str = "kvstrata"

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class WorkerConfig:
    model: str = "smollm2"
    served_model_name: str | None = None
    pool_bytes: int = GIB
    block_size: int = 16
    tiers: tuple[TierSpec, ...] = ()
    events: KVEventsConfig | None = None
    tenant_secret: bytes = field(default=b"", repr=False)
    admin_token: str | None = field(default=None, repr=False)
    debug_endpoints: bool = False
    lookup_timeout_ms: int = 2000
    stats_path: Path | None = None

    def tier(self, name: str) -> TierSpec | None:
        return next((spec for spec in self.tiers if spec.name == name), None)

    @property
    def secret_digest(self) -> str:
        return secret_digest(self.tenant_secret)

    def with_events(self, events: KVEventsConfig | None) -> WorkerConfig:
        return dataclasses.replace(self, events=events)


# ---- loading ----------------------------------------------------------------------------------
def load_worker_config(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    raw: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> WorkerConfig:
    """Read ``path`` (TOML) or ``raw`` (a parsed mapping), apply ``overrides``, validate."""
    where = source or (str(path) if path is not None else "defaults")
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read the file: {exc.strerror}", source=where) from exc
        except tomllib.TOMLDecodeError as exc:
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
        if name in _PATH_OVERRIDES:  # relative to where the flag was given, not to the file
            value = str(Path(value).expanduser().resolve())
        handler.apply(data, value)
    _check_keys(data, where)
    return _build(data, where, base)


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
        if name in _TABLES:
            entries = value if name == "tiers" else [value]
            if name == "tiers" and not isinstance(value, list):
                raise ConfigError("must be an array of tables ([[tiers]])", key=name, source=where)
            for entry in entries:
                if not isinstance(entry, Mapping):
                    raise ConfigError("must be a table", key=name, source=where)
                _check_table(name, entry, where)
        elif name not in _BY_PATH:
            raise ConfigError("unknown key", key=name, source=where)


def _check_table(prefix: str, table: Mapping[str, Any], where: str) -> None:
    for name, value in table.items():
        path = f"{prefix}.{name}"
        if path == "tiers.rollout":
            if not isinstance(value, Mapping):
                raise ConfigError("must be a table", key=path, source=where)
            _check_table(path, value, where)
        elif path not in _BY_PATH:
            raise ConfigError("unknown key", key=path, source=where)


class _Reader:
    """Typed access to one table of the raw data, naming ``prefix.key`` in every error."""

    def __init__(self, table: Mapping[str, Any], prefix: str, where: str, base: Path) -> None:
        self.table, self.prefix, self.where, self.base = table, prefix, where, base

    def get(self, name: str) -> Any:
        path = f"{self.prefix}{name}"
        key = _BY_PATH[path]
        value = self.table.get(name, key.default)
        if value is None:
            return None
        try:
            return _coerce(key.type, value, self.base)
        except (TypeError, ValueError) as exc:
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
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError("expected a string")
        return value
    if kind == "path":
        if not isinstance(value, str | Path):
            raise TypeError("expected a path")
        path = Path(value).expanduser()
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


def _build(data: Mapping[str, Any], where: str, base: Path) -> WorkerConfig:
    top = _Reader(data, "", where, base)
    pool = _Reader(data.get("pool", {}), "pool.", where, base)
    pool_gib = pool.get("gib")
    if pool_gib <= 0:
        raise pool.fail("gib", "must be positive")
    block_size = pool.get("block_size")
    if block_size < 1:
        raise pool.fail("block_size", "must be at least 1")
    tiers = tuple(_tier(entry, i, where, base) for i, entry in enumerate(data.get("tiers", [])))
    names = [spec.name for spec in tiers]
    if len(set(names)) != len(names):
        raise ConfigError("each tier may appear once", key="tiers.name", source=where)
    if names != sorted(names, key=TIER_NAMES.index):
        raise ConfigError("tiers go fastest first: host, then disk", key="tiers", source=where)
    secret_file = top.get("tenant_secret_file")
    secret = _read_secret(secret_file, "tenant_secret_file", where)
    token_file = top.get("admin_token_file")
    token = _read_secret(token_file, "admin_token_file", where) if token_file else None
    connector = _Reader(data.get("connector", {}), "connector.", where, base)
    timeout = connector.get("lookup_timeout_ms")
    if timeout <= 0:
        raise connector.fail("lookup_timeout_ms", "must be positive")
    return WorkerConfig(
        model=top.get("model"),
        served_model_name=top.get("served_model_name"),
        pool_bytes=int(pool_gib * GIB),
        block_size=block_size,
        tiers=tiers,
        events=_events(data.get("events"), where, base),
        tenant_secret=secret,
        admin_token=token.decode("utf-8").strip() if token else None,
        debug_endpoints=top.get("debug_endpoints"),
        lookup_timeout_ms=timeout,
        stats_path=connector.get("stats_path"),
    )


def _read_secret(path: Path | None, key: str, where: str) -> bytes:
    if path is None:
        return b""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", key=key, source=where) from exc


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
        raise tier.fail("path", "the disk tier needs a path; the host tier takes none")
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
    )


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
    return KVEventsConfig(
        endpoint,
        events.get("replay_endpoint"),
        worker_id=worker_id,
        topic=events.get("topic"),
        buffer_steps=buffer_steps,
    )


# ---- overrides ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Override:
    """A flat setting (a CLI flag, a connector key) and where it lands in the file's data."""

    name: str
    help: str
    apply: Callable[[dict[str, Any], Any], None]


def _set(path: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        *tables, leaf = path.split(".")
        target = data
        for table in tables:
            target = target.setdefault(table, {})
        target[leaf] = value

    return apply


def _tier_table(data: dict[str, Any], name: str) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = data.setdefault("tiers", [])
    for entry in tiers:
        if entry.get("name") == name:
            return entry
    entry = {"name": name}
    tiers.append(entry)
    tiers.sort(key=lambda e: TIER_NAMES.index(e["name"]) if e.get("name") in TIER_NAMES else 9)
    return entry


def _tier_size(name: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        if float(value) == 0.0:  # 0 GiB: no such tier
            data["tiers"] = [e for e in data.get("tiers", []) if e.get("name") != name]
        else:
            _tier_table(data, name)["gib"] = value

    return apply


def _tier_key(name: str, key: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        _tier_table(data, name)[key] = str(value) if key == "path" else value

    return apply


def _every_tier(key: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        for entry in data.get("tiers", []):
            if key.startswith("rollout."):
                entry.setdefault("rollout", {})[key.removeprefix("rollout.")] = value
            else:
                entry[key] = value

    return apply


_OVERRIDE_LIST: Final = (
    Override("model", "model", _set("model")),
    Override("served_model_name", "served_model_name", _set("served_model_name")),
    Override("pool_gib", "pool.gib", _set("pool.gib")),
    Override("block_size", "pool.block_size", _set("pool.block_size")),
    Override("host_gib", "the host tier's gib (0 removes it)", _tier_size("host")),
    Override(
        "host_write_policy", "the host tier's write_policy", _tier_key("host", "write_policy")
    ),
    Override("disk_dir", "the disk tier's path", _tier_key("disk", "path")),
    Override("disk_gib", "the disk tier's gib (0 removes it)", _tier_size("disk")),
    Override(
        "disk_write_policy", "the disk tier's write_policy", _tier_key("disk", "write_policy")
    ),
    Override("disk_write", "the disk tier's write_policy", _tier_key("disk", "write_policy")),
    Override("durable", "the disk tier's durable", _tier_key("disk", "durable")),
    Override("tier_ttl_s", "ttl_s of every tier", _every_tier("ttl_s")),
    Override("eviction_policy", "eviction_policy of every tier", _every_tier("eviction_policy")),
    Override("policy", "eviction_policy of every tier", _every_tier("eviction_policy")),
    Override("verify_reads", "verify_reads of every tier", _every_tier("verify_reads")),
    Override("tier_tenants", "rollout.tenants of every tier", _every_tier("rollout.tenants")),
    Override("tier_canary", "rollout.canary of every tier", _every_tier("rollout.canary")),
    Override(
        "min_reusable_tokens",
        "rollout.min_reusable_tokens of every tier",
        _every_tier("rollout.min_reusable_tokens"),
    ),
    Override("tenant_secret_file", "tenant_secret_file", _set("tenant_secret_file")),
    Override("debug_endpoints", "debug_endpoints", _set("debug_endpoints")),
    Override("events_endpoint", "events.endpoint", _set("events.endpoint")),
    Override("replay_endpoint", "events.replay_endpoint", _set("events.replay_endpoint")),
    Override("events_replay_endpoint", "events.replay_endpoint", _set("events.replay_endpoint")),
    Override("events_topic", "events.topic", _set("events.topic")),
    Override("worker_id", "events.worker_id", _set("events.worker_id")),
    Override(
        "lookup_timeout_ms", "connector.lookup_timeout_ms", _set("connector.lookup_timeout_ms")
    ),
    Override("stats_path", "connector.stats_path", _set("connector.stats_path")),
)
OVERRIDES: Final[Mapping[str, Override]] = {o.name: o for o in _OVERRIDE_LIST}
_PATH_OVERRIDES: Final = frozenset({"disk_dir", "tenant_secret_file", "stats_path"})


# ---- the reference page -------------------------------------------------------------------------
def reference_markdown() -> str:
    """``docs/configuration.md``, generated from ``KEYS`` and ``OVERRIDES``."""
    lines = [
        "# Worker configuration reference",
        "",
        "Generated from `kvstrata.runtime.config` (`tests/test_worker_config.py` checks that",
        "this page is current; regenerate with `kvstrata config --reference > "
        "docs/configuration.md`).",
        "",
        "One TOML file configures `kvstrata serve --config F`, `kvstrata up --config F` (every",
        "worker gets the same file) and the vLLM connector",
        '(`kv_connector_extra_config = {"config": F}`). Command-line flags and flat connector',
        "keys override it (table at the end).",
        "See `examples/worker.toml`.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key in KEYS:
        default = "—" if key.default is None else f"`{_toml_value(key.default)}`"
        path = key.path.replace("tiers.", "[[tiers]] ", 1)
        meaning = key.help.replace("|", "\\|")
        lines.append(f"| `{path}` | {key.type} | {default} | {meaning} |")
    lines += [
        "",
        "## Overrides",
        "",
        "`kvstrata serve` flags are these names with dashes (`--host-gib`); the connector takes",
        "them as flat keys of `kv_connector_extra_config` beside `config`.",
        "",
        "| override | sets |",
        "|---|---|",
    ]
    lines += [f"| `{o.name}` | {o.help} |" for o in _OVERRIDE_LIST]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{}"
    return str(value)


# ---- programmatic construction (tests, benchmarks) ----------------------------------------------
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
