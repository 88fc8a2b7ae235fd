"""Build the tiered store a ``WorkerConfig`` describes (every engine adapter uses this).

Defaults and where they come from:
- eviction policy ``kvstrata`` (``ValuePolicy``) on every level; ``lru`` and the deployed peers
  (``s3fifo``, ``arc``, ``gdsf``, ``tinylfu``: ``kvstrata.store.deployed``) for comparison;
- the host level's policy prices demotion with the disk tier's fetch cost
  (``DISK_FETCH_S_PER_BYTE``, from ``kvstrata bench tiers`` on this project's machines; see
  ``docs/results-history.md``): evicting a block that is also on disk loses less than one
  that is not.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry

from kvstrata.errors import ConfigError
from kvstrata.runtime.config import TierSpec, WorkerConfig
from kvstrata.runtime.config_schema import EVICTION_POLICIES
from kvstrata.runtime.remote_metrics import RemoteTierCollector
from kvstrata.security.audit import NULL_AUDIT, AuditLog
from kvstrata.store.adaptive import AdaptivePolicy
from kvstrata.store.config import TierConfig
from kvstrata.store.deployed import DEPLOYED_POLICIES, is_peer_spec, peer_policy
from kvstrata.store.policies import LRUPolicy, SharedLedgerPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.store.value_policy import ValuePolicy, kvstrata_policy, value_per_byte
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteUnavailable

logger = logging.getLogger(__name__)

DISK_FETCH_S_PER_BYTE = 1 / 7e9


def eviction_policy(name: str, demotion_fetch_s_per_byte: float | None = None) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "kvstrata":
        return kvstrata_policy(demotion_fetch_s_per_byte)
    if name == "kvstrata-value":
        return ValuePolicy(demotion_fetch_s_per_byte=demotion_fetch_s_per_byte)
    if name == "kvstrata-adaptive":
        return AdaptivePolicy(demotion_fetch_s_per_byte=demotion_fetch_s_per_byte)
    if name in DEPLOYED_POLICIES:
        return DEPLOYED_POLICIES[name](demotion_fetch_s_per_byte)
    if is_peer_spec(name):  # a deployed policy at another point: gdsf-tuned, gdsf:0.25, …
        return peer_policy(name, demotion_fetch_s_per_byte)
    known = ", ".join(EVICTION_POLICIES)
    raise ConfigError(f"unknown eviction policy {name!r}; known: {known}")


def remote_tier_of(spec: TierSpec) -> RemoteTier:
    """The remote tier of ``spec``; raises ``RemoteUnavailable`` when it cannot be reached.

    Its shared ledger prices objects with ``value_per_byte`` (saved prefill seconds per byte,
    the formula of every kvstrata policy) and enforces the level's tenant quotas."""
    assert spec.remote is not None  # validated by the config
    tier = RemoteTier(
        spec.remote,
        spec.capacity_bytes,
        value_of=value_per_byte,
        quota_of=spec.config.quota_for,
        verify_reads=spec.config.verify_reads,
    )
    try:
        tier.ping()
    except RemoteUnavailable:
        tier.close()
        raise
    return tier.start()


def _tier(spec: TierSpec, block_bytes: int) -> Tier:
    if spec.name == "remote":
        return remote_tier_of(spec)
    if spec.name == "host":
        if spec.capacity_bytes < block_bytes:
            raise ConfigError(
                f"a host tier of {spec.capacity_bytes} B holds no {block_bytes} B block",
                key="tiers.gib",
            )
        return HostTier(
            spec.capacity_bytes,
            block_bytes,
            verify_reads=spec.config.verify_reads,
            clock=time.time,
        )
    assert spec.path is not None  # validated by the config
    return DiskTier(
        spec.path,
        spec.capacity_bytes,
        durable=spec.durable,
        verify_reads=spec.config.verify_reads,
    )


def build_store(
    block_bytes: int,
    config: WorkerConfig,
    registry: CollectorRegistry,
    *,
    record_events: bool = False,
    audit: AuditLog = NULL_AUDIT,
) -> TieredStore | None:
    """The store of ``config.tiers`` (None when there are none), started; it records its
    evictions, invalidations, quota rejections and tier switches in ``audit`` (the owner
    starts and closes that log)."""
    levels: list[tuple[Tier, EvictionPolicy, TierConfig]] = []
    has_disk = config.tier("disk") is not None
    for spec in config.tiers:
        fetch = DISK_FETCH_S_PER_BYTE if spec.name == "host" and has_disk else None
        try:
            tier = _tier(spec, block_bytes)
        except RemoteUnavailable as exc:
            logger.warning(
                "the remote tier at %s is unreachable at start-up (%s): starting without it",
                spec.remote.where if spec.remote else "?",
                exc,
            )
            continue
        if tier.evicts_itself:
            policy: EvictionPolicy = SharedLedgerPolicy()
            RemoteTierCollector.register(registry, tier)
        else:
            policy = eviction_policy(spec.eviction_policy, fetch)
        levels.append((tier, policy, spec.config))
    if not levels:
        return None
    store = TieredStore(
        levels,
        metrics=StoreMetrics(registry),
        clock=time.time,
        record_events=record_events,
        audit=audit,
        tombstone_ttl_s=config.security.tombstone_ttl_s,
    )
    store.start()
    return store
