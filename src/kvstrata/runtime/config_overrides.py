"""Overrides of a worker configuration: the flat names (``serve`` flags without dashes, the
vLLM connector's keys) and where each lands in a configuration file's data.

``OVERRIDES`` maps each name to its ``Override``; ``kvstrata.runtime.config`` applies them to
the parsed file before validation, in the phases of ``override_phase``, so the result does
not depend on the order the flags or keys came in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvstrata.runtime.config_schema import TIER_NAMES


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


OVERRIDE_LIST: Final = (
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
OVERRIDES: Final[Mapping[str, Override]] = {o.name: o for o in OVERRIDE_LIST}


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
