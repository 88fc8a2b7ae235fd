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


def _key(name: str, path: str) -> Override:
    """``name`` sets the key ``path`` (its help is the path)."""
    return Override(name, path, _set(path))


def _every(name: str, key: str) -> Override:
    """``name`` sets ``key`` of every tier."""
    return Override(name, f"{key} of every tier", _every_tier(key), every_tier=True)


OVERRIDE_LIST: Final = (
    _key("model", "model"),
    _key("served_model_name", "served_model_name"),
    _key("pool_gib", "pool.gib"),
    _key("block_size", "pool.block_size"),
    _key("max_num_seqs", "scheduler.max_num_seqs"),
    _key("max_num_batched_tokens", "scheduler.max_num_batched_tokens"),
    _key("max_waiting", "scheduler.max_waiting"),
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
    _key("tenant_secret_file", "tenant_secret_file"),
    _key("debug_endpoints", "debug_endpoints"),
    _key("max_tokens_limit", "limits.max_tokens"),
    _key("max_body_mib", "limits.max_body_mib"),
    _key("body_timeout_s", "limits.body_timeout_s"),
    _key("events_endpoint", "events.endpoint"),
    _key("replay_endpoint", "events.replay_endpoint"),
    _key("events_replay_endpoint", "events.replay_endpoint"),
    _key("events_topic", "events.topic"),
    _key("worker_id", "events.worker_id"),
    _key("lookup_timeout_ms", "connector.lookup_timeout_ms"),
    _key("load_timeout_ms", "connector.load_timeout_ms"),
    _key("save_queue_blocks", "connector.save_queue_blocks"),
    _key("pd_wait_ms", "connector.pd_wait_ms"),
    _key("stats_path", "connector.stats_path"),
    _key("lookup_curve_secret_file", "connector.lookup_curve_secret_file"),
    _key("transfer_host", "transfer.host"),
    _key("transfer_port", "transfer.port"),
    _key("transfer_transport", "transfer.transport"),
    _key("allowed_transfer_targets", "transfer.allowed_targets"),
    _key("keys_file", "security.keys_file"),
    _key("fleet_key_file", "security.fleet_key_file"),
    _key("audit_path", "security.audit_path"),
    _key("tombstone_ttl_s", "security.tombstone_ttl_s"),
    _key("tls_cert_file", "security.tls_cert_file"),
    _key("tls_key_file", "security.tls_key_file"),
    _key("tls_ca_file", "security.tls_ca_file"),
    _key("curve_secret_file", "events.curve_secret_file"),
    _key("curve_clients_dir", "events.curve_clients_dir"),
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
