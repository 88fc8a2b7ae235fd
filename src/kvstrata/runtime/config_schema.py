"""The worker configuration's schema: every key, every override, and the reference page.

One table (``KEYS``) names each key of a worker configuration file with its type, default
and meaning; ``kvstrata.runtime.config`` validates files against it and
``reference_markdown`` renders ``docs/configuration.md`` from it, so the page cannot drift
from the parser. ``OVERRIDES`` are the flat names (``serve`` flags, the vLLM connector's keys)
and where each lands in a file's data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

GIB: Final = 1 << 30
MIB: Final = 1 << 20
TIER_NAMES: Final = ("host", "disk", "remote")
EVICTION_POLICIES: Final = (
    "kvstrata",
    "kvstrata-value",
    "kvstrata-adaptive",
    "lru",
    "s3fifo",
    "arc",
    "gdsf",
    "tinylfu",
)


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
        "(compared by digest at attach); unset: `KVSTRATA_TENANT_SECRET` from the environment, "
        "else the empty secret",
    ),
    Key("admin_token_file", "path", None, "`serve`: bearer token required on `/admin`"),
    Key("debug_endpoints", "bool", False, "`serve`: `POST /kv/debug/drop-events` (tests)"),
    Key(
        "limits.max_tokens",
        "int",
        4096,
        "`serve`: most output tokens a request may ask for (more: a 400); a chat request "
        "that sets none gets this, or the room left in the context window if that is less",
    ),
    Key(
        "limits.max_body_mib",
        "float",
        4.0,
        "`serve`, and the front door of `up` / `router` given the same file: largest request "
        "body in MiB (more: a 413)",
    ),
    Key(
        "limits.body_timeout_s",
        "float",
        30.0,
        "`serve` and the front door: seconds a request body may take to arrive (longer: a 408, "
        "connection closed)",
    ),
    Key("pool.gib", "float", 1.0, "device KV pool size in GiB (reference engine)"),
    Key("pool.block_size", "int", 16, "tokens per KV block (reference engine)"),
    Key(
        "pool.read_layouts.block_size",
        "int",
        None,
        "one alternate layout whose stored objects this worker reads and converts (an array "
        "of tables, `read_layouts = [{block_size = 32}]`; unset fields: the pool's own): "
        "tokens per block of the writer (a restart with another block size reuses the disk "
        "and remote tiers); none by default",
    ),
    Key(
        "pool.read_layouts.order",
        "str",
        None,
        "the writer's block axis order, a permutation of `LKHTD` (layers, K/V, heads, tokens, "
        "head dim)",
    ),
    Key(
        "pool.read_layouts.tp_size",
        "int",
        None,
        "the writer's tensor-parallel size (its KV heads sharded; every rank's objects read)",
    ),
    Key(
        "pool.read_layouts.dtype",
        "str",
        None,
        "the writer's KV dtype; another dtype than the pool's is lossy: refused, counted",
    ),
    Key("scheduler.max_num_seqs", "int", 64, "`serve`: sequences in one engine step's batch"),
    Key(
        "scheduler.max_num_batched_tokens",
        "int",
        512,
        "`serve`: tokens one step computes (decodes first, then prefill chunks)",
    ),
    Key(
        "scheduler.max_waiting",
        "int",
        64,
        "`serve`: requests queued beyond the batch; more get 429 with Retry-After",
    ),
    Key(
        "tiers.name",
        "str",
        None,
        "`host` (DRAM slab), `disk` (one file per object) or `remote` (Redis/Valkey, shared)",
    ),
    Key("tiers.gib", "float", None, "capacity in GiB"),
    Key("tiers.path", "path", None, "disk: the tier's directory (required for disk)"),
    Key("tiers.durable", "bool", True, "disk: fsync every object (off: survives process death)"),
    Key("tiers.url", "str", None, "remote: one node, `redis://host:port/db` (`rediss://`: TLS)"),
    Key("tiers.cluster", "list[str]", None, "remote: Redis Cluster seed nodes, `host:port`"),
    Key("tiers.password_file", "path", None, "remote: file holding the server's password"),
    Key("tiers.tls", "bool", False, "remote: TLS to the server (cluster; a url says rediss://)"),
    Key(
        "tiers.namespace",
        "str",
        "kvstrata",
        "remote: key prefix; workers sharing a namespace share objects and one capacity",
    ),
    Key("tiers.timeout_ms", "int", 500, "remote: bound on every call (connect and reply)"),
    Key(
        "tiers.write_policy",
        "str",
        "write-through",
        "how objects enter this tier from the one above: write-through | write-back | selective",
    ),
    Key("tiers.ttl_s", "float", None, "seconds an object lives in this tier (unset: no TTL)"),
    Key(
        "tiers.eviction_policy",
        "str",
        "kvstrata",
        "kvstrata (measured value: hit density with a ghost, seconds and tokens saved)"
        " | kvstrata-value (hit density × seconds alone) | kvstrata-adaptive (the candidate"
        " its miniature simulations find saves most) | lru | s3fifo | arc | gdsf | tinylfu;"
        " a deployed policy at another point of its main parameter: s3fifo:F (small-queue"
        " share), tinylfu:K (sample size ÷ cache size), gdsf:B (GreedyDual* beta), or NAME-tuned"
        " (the point kvstrata bench eviction's sweep chose, kvstrata.store.deployed)",
    ),
    Key("tiers.verify_reads", "bool", True, "check the payload digest on every read"),
    Key("tiers.selective_min_uses", "int", 2, "selective: uses before an object is admitted"),
    Key("tiers.write_back_max_mib", "float", 256.0, "write-back: queued MiB before backpressure"),
    Key("tiers.quota_gib", "table[float]", {}, "per-tenant byte quota in GiB (`{tenant = gib}`)"),
    Key("tiers.default_quota_gib", "float", None, "quota of tenants not in `quota_gib`"),
    Key("tiers.rollout.enabled", "bool", True, "the tier's switch at start (admin can flip it)"),
    Key(
        "tiers.rollout.tenants",
        "list[str]",
        None,
        "only these tenants use the tier (left out: every tenant; an empty list is an error)",
    ),
    Key(
        "tiers.rollout.models",
        "list[str]",
        None,
        "only these models use the tier: `kvstrata serve` names a model by its fingerprint"
        " (`fingerprint` in `/kv/info`), the vLLM connector by its served model name (left"
        " out: every model; an empty list is an error)",
    ),
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
    Key(
        "events.curve_secret_file",
        "path",
        None,
        "CURVE secret certificate of this worker (`zmq.auth` format): encrypts and "
        "authenticates the event and replay sockets (`kvstrata up` generates one)",
    ),
    Key(
        "events.curve_clients_dir",
        "path",
        None,
        "CURVE: directory of the public certificates of subscribers allowed in "
        "(required with `curve_secret_file`)",
    ),
    Key(
        "security.keys_file",
        "path",
        None,
        "API keys file (hashes → tenant, roles; reloaded when it changes); unset: "
        "single-tenant, admin/debug/dump endpoints off (see docs/security.md)",
    ),
    Key(
        "security.fleet_key_file",
        "path",
        None,
        "file holding the router's fleet key: one more credential (role fleet, reads "
        "`/kv/info` and `/kv/dump`) beside the keys file, or alone while clients stay "
        "anonymous (`kvstrata up` generates it)",
    ),
    Key("security.audit_path", "path", None, "audit JSON lines go here (unset: the log)"),
    Key(
        "security.tombstone_ttl_s",
        "float",
        24 * 3600.0,
        "seconds a deleted key refuses late write-backs, events and recovered copies",
    ),
    Key("security.tls_cert_file", "path", None, "serve HTTPS with this certificate (PEM)"),
    Key("security.tls_key_file", "path", None, "the certificate's private key (PEM)"),
    Key("security.tls_ca_file", "path", None, "CA bundle a router trusts for workers' HTTPS"),
    Key("transfer.host", "str", "127.0.0.1", "`serve`: the KV transfer listener's address"),
    Key(
        "transfer.port",
        "int",
        None,
        "`serve`: receive KV transfers (decode role) on this TCP port (0: any free one, "
        "advertised in `/kv/info`; needs `tenant_secret_file`); unset: none",
    ),
    Key(
        "transfer.transport",
        "str",
        "tcp",
        "`serve`: what the transfer listener speaks: `tcp` (built in) or `nixl` (optional extra)",
    ),
    Key(
        "transfer.allowed_targets",
        "list[str]",
        ["127.0.0.0/8", "[::1]", "localhost"],
        "`serve`: where `POST /kv/prefill` may stream KV: IPs or CIDR networks (IPv6 in "
        "brackets), host names matched literally, each optionally `:PORT`; `*` admits any",
    ),
    Key("connector.lookup_timeout_ms", "int", 2000, "vLLM: scheduler → worker lookup timeout"),
    Key(
        "connector.load_timeout_ms",
        "int",
        5000,
        "vLLM: a load not read by then is given up: its blocks are recomputed",
    ),
    Key(
        "connector.save_queue_blocks",
        "int",
        1024,
        "vLLM: blocks queued for the background saver at most (beyond: a request's first "
        "blocks that fit are queued, the rest not saved, counted)",
    ),
    Key(
        "connector.pd_wait_ms",
        "int",
        30000,
        "vLLM kv_consumer: how long a request waits for a producer's offered blocks",
    ),
    Key("connector.stats_path", "path", None, "vLLM: the worker writes its counters here"),
    Key(
        "connector.lookup_curve_secret_file",
        "path",
        None,
        "vLLM: a CURVE certificate (`zmq.auth` secret file) both connector sides load: the "
        "scheduler → worker lookup socket is encrypted and admits only that key",
    ),
)
BY_PATH: Final = {key.path: key for key in KEYS}
TABLES: Final = (
    "pool", "scheduler", "tiers", "events", "transfer", "connector", "limits", "security"
)  # fmt: skip


# ---- overrides ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Override:
    """A flat setting (a CLI flag, a connector key) and where it lands in the file's data."""

    name: str
    help: str
    apply: Callable[[dict[str, Any], Any], None]
    every_tier: bool = False
    """Sets a key of every tier there is: applied once every override that adds a tier ran."""
    size: bool = False
    """A tier's size: 0 removes the tier, after every override that could re-create it."""


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


def _zero_size(value: Any) -> bool:
    """A tier size that removes its tier: a number (or numeric text) equal to 0. Anything
    else, a bool included, is set as the size and judged by the tier's check (a
    ``ConfigError`` naming the key, never a traceback)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return False
    try:
        return float(value) == 0.0
    except ValueError:
        return False


def _tier_size(name: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        if _zero_size(value):  # 0 GiB: no such tier
            data["tiers"] = [e for e in data.get("tiers", []) if e.get("name") != name]
        else:
            _tier_table(data, name)["gib"] = value

    return apply


def _size(name: str, tier: str) -> Override:
    """``name`` sets the size of ``tier`` in GiB; 0 removes it (``override_phase``)."""
    return Override(name, f"the {tier} tier's gib (0 removes it)", _tier_size(tier), size=True)


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


def _every(name: str, key: str) -> Override:
    """``name`` sets ``key`` of every tier."""
    return Override(name, f"{key} of every tier", _every_tier(key), every_tier=True)


_OVERRIDE_LIST: Final = (
    Override("model", "model", _set("model")),
    Override("served_model_name", "served_model_name", _set("served_model_name")),
    Override("pool_gib", "pool.gib", _set("pool.gib")),
    Override("block_size", "pool.block_size", _set("pool.block_size")),
    Override("max_num_seqs", "scheduler.max_num_seqs", _set("scheduler.max_num_seqs")),
    Override(
        "max_num_batched_tokens",
        "scheduler.max_num_batched_tokens",
        _set("scheduler.max_num_batched_tokens"),
    ),
    Override("max_waiting", "scheduler.max_waiting", _set("scheduler.max_waiting")),
    _size("host_gib", "host"),
    Override(
        "host_write_policy", "the host tier's write_policy", _tier_key("host", "write_policy")
    ),
    Override("disk_dir", "the disk tier's path", _tier_key("disk", "path")),
    _size("disk_gib", "disk"),
    Override(
        "disk_write_policy", "the disk tier's write_policy", _tier_key("disk", "write_policy")
    ),
    Override("disk_write", "the disk tier's write_policy", _tier_key("disk", "write_policy")),
    Override("durable", "the disk tier's durable", _tier_key("disk", "durable")),
    Override("remote_url", "the remote tier's url", _tier_key("remote", "url")),
    Override("remote_cluster", "the remote tier's cluster seeds", _tier_key("remote", "cluster")),
    _size("remote_gib", "remote"),
    Override(
        "remote_password_file",
        "the remote tier's password_file",
        _tier_key("remote", "password_file"),
    ),
    Override(
        "remote_write_policy", "the remote tier's write_policy", _tier_key("remote", "write_policy")
    ),
    Override("remote_namespace", "the remote tier's namespace", _tier_key("remote", "namespace")),
    _every("tier_ttl_s", "ttl_s"),
    _every("eviction_policy", "eviction_policy"),
    _every("policy", "eviction_policy"),
    _every("verify_reads", "verify_reads"),
    _every("tier_tenants", "rollout.tenants"),
    _every("tier_canary", "rollout.canary"),
    _every("min_reusable_tokens", "rollout.min_reusable_tokens"),
    Override("tenant_secret_file", "tenant_secret_file", _set("tenant_secret_file")),
    Override("debug_endpoints", "debug_endpoints", _set("debug_endpoints")),
    Override("max_tokens_limit", "limits.max_tokens", _set("limits.max_tokens")),
    Override("max_body_mib", "limits.max_body_mib", _set("limits.max_body_mib")),
    Override("body_timeout_s", "limits.body_timeout_s", _set("limits.body_timeout_s")),
    Override("events_endpoint", "events.endpoint", _set("events.endpoint")),
    Override("replay_endpoint", "events.replay_endpoint", _set("events.replay_endpoint")),
    Override("events_replay_endpoint", "events.replay_endpoint", _set("events.replay_endpoint")),
    Override("events_topic", "events.topic", _set("events.topic")),
    Override("worker_id", "events.worker_id", _set("events.worker_id")),
    Override(
        "lookup_timeout_ms", "connector.lookup_timeout_ms", _set("connector.lookup_timeout_ms")
    ),
    Override("load_timeout_ms", "connector.load_timeout_ms", _set("connector.load_timeout_ms")),
    Override(
        "save_queue_blocks", "connector.save_queue_blocks", _set("connector.save_queue_blocks")
    ),
    Override("pd_wait_ms", "connector.pd_wait_ms", _set("connector.pd_wait_ms")),
    Override("stats_path", "connector.stats_path", _set("connector.stats_path")),
    Override(
        "lookup_curve_secret_file",
        "connector.lookup_curve_secret_file",
        _set("connector.lookup_curve_secret_file"),
    ),
    Override("transfer_host", "transfer.host", _set("transfer.host")),
    Override("transfer_port", "transfer.port", _set("transfer.port")),
    Override("transfer_transport", "transfer.transport", _set("transfer.transport")),
    Override(
        "allowed_transfer_targets", "transfer.allowed_targets", _set("transfer.allowed_targets")
    ),
    Override("keys_file", "security.keys_file", _set("security.keys_file")),
    Override("fleet_key_file", "security.fleet_key_file", _set("security.fleet_key_file")),
    Override("audit_path", "security.audit_path", _set("security.audit_path")),
    Override("tombstone_ttl_s", "security.tombstone_ttl_s", _set("security.tombstone_ttl_s")),
    Override("tls_cert_file", "security.tls_cert_file", _set("security.tls_cert_file")),
    Override("tls_key_file", "security.tls_key_file", _set("security.tls_key_file")),
    Override("tls_ca_file", "security.tls_ca_file", _set("security.tls_ca_file")),
    Override("curve_secret_file", "events.curve_secret_file", _set("events.curve_secret_file")),
    Override("curve_clients_dir", "events.curve_clients_dir", _set("events.curve_clients_dir")),
)
OVERRIDES: Final[Mapping[str, Override]] = {o.name: o for o in _OVERRIDE_LIST}


def override_phase(name: str, value: Any) -> int:
    """When an override applies, whatever order the flags or keys came in: 0, one that adds
    or sets (a tier's size or key, a top-level key); 1, one that sets a key of every tier
    (``Override.every_tier``: after the tiers exist, or a tier named only by its size would
    miss it); 2, a size of 0 (it removes the tier: after any key that would re-create it)."""
    override = OVERRIDES.get(name)
    if override is None:
        return 0  # refused as unknown when applied
    if override.size and _zero_size(value):
        return 2
    return 1 if override.every_tier else 0


PATH_OVERRIDES: Final = frozenset(
    {
        "disk_dir",
        "tenant_secret_file",
        "stats_path",
        "keys_file",
        "fleet_key_file",
        "audit_path",
        "tls_cert_file",
        "tls_key_file",
        "tls_ca_file",
        "curve_secret_file",
        "curve_clients_dir",
        "lookup_curve_secret_file",
    }
)


# ---- the reference page -------------------------------------------------------------------------
def reference_markdown() -> str:
    """``docs/configuration.md``, generated from ``KEYS`` and ``OVERRIDES``."""
    lines = [
        "# Worker configuration reference",
        "",
        "Generated from `kvstrata.runtime.config_schema` (`tests/test_worker_config.py` checks",
        "that this page is current; regenerate with `kvstrata config --reference > "
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
        "them as flat keys of `kv_connector_extra_config` beside `config`. They apply whatever",
        "order they come in: an override of every tier reaches every tier, one that a size adds",
        "included, and a size of 0 removes its tier even when another override names it.",
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
