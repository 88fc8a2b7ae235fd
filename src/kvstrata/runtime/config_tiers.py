"""The ``[[tiers]]`` tables: one tier below the device pool, as a worker is configured with it.

``TierSpec`` is a tier's medium (capacity, disk path, durability, eviction policy, remote
servers) and the store's ``TierConfig`` for it. ``parse_tier`` parses one ``[[tiers]]`` table with
its ``[tiers.rollout]`` table and, for the remote tier, its servers and password file;
``host_tier``, ``disk_tier`` and ``remote_tier`` build specs in code (tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.errors import InvalidInput
from kvstrata.runtime.config_reader import Reader, read_secret, text
from kvstrata.runtime.config_schema import EVICTION_POLICIES, GIB, MIB, TIER_NAMES
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy
from kvstrata.store.deployed import peer_point
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


def parse_tier(entry: Mapping[str, Any], index: int, where: str, base: Path) -> TierSpec:
    tier = Reader(entry, "tiers.", f"{where} (tiers[{index}])", base)
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
        try:
            point = peer_point(eviction) if isinstance(eviction, str) else None
        except InvalidInput as exc:
            raise tier.fail("eviction_policy", str(exc)) from None
        if point is None:
            raise tier.fail(
                "eviction_policy",
                f"must be one of {', '.join(EVICTION_POLICIES)}, or NAME-tuned / NAME:VALUE "
                "for s3fifo, tinylfu, gdsf",
            )
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


def _remote(tier: Reader, name: str, where: str) -> RemoteConfig | None:
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
        raw = read_secret(password_file, "tiers.password_file", where)
        password = text(raw, "tiers.password_file", where)
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
    rollout = Reader(table, "tiers.rollout.", f"{where} (tiers[{index}])", base)
    canary = rollout.get("canary")
    if not 0.0 <= canary <= 1.0:
        raise rollout.fail("canary", "must lie in [0, 1]")
    min_tokens = rollout.get("min_reusable_tokens")
    if min_tokens < 0:
        raise rollout.fail("min_reusable_tokens", "must be >= 0")
    tenants, models = rollout.get("tenants"), rollout.get("models")
    for name, names in (("tenants", tenants), ("models", models)):
        if names is not None and not names:  # an allow-list of none: everyone, or no one?
            what = name.removesuffix("s")
            raise rollout.fail(
                name,
                f"an empty list names no {what}: leave the key out for every {what}, or set"
                " rollout.enabled = false for none",
            )
    return RolloutConfig(
        enabled=rollout.get("enabled"),
        tenants=frozenset(tenants) if tenants is not None else None,
        models=frozenset(models) if models is not None else None,
        canary_fraction=canary,
        min_reusable_tokens=min_tokens,
    )


def _gib(reader: Reader, name: str, value: float | None) -> int | None:
    if value is None:
        return None
    if value < 0:
        raise reader.fail(name, "must be >= 0")
    return int(value * GIB)


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
