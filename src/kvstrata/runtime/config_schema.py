"""The worker configuration's schema: every key of a worker configuration file.

One table (``KEYS``) names each key with its type, default and meaning;
``kvstrata.runtime.config`` validates files against it and ``config_reference`` renders
``docs/configuration.md`` from it, so the page cannot drift from the parser. The flat
overrides (``serve`` flags, the vLLM connector's keys) are ``config_overrides``.
"""

from __future__ import annotations

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
