"""Build the tiered store a ``WorkerConfig`` describes (every engine adapter uses this).

Defaults and where they come from:
- eviction policy ``kvstrata`` (``ValuePolicy``) on every level; ``lru`` for comparison;
- the host level's policy prices demotion with the disk tier's fetch cost
  (``DISK_FETCH_S_PER_BYTE``, from ``kvstrata bench tiers`` on this project's machines; see
  ``docs/results.md``): evicting a block that is also on disk loses less than one that is not.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from kvstrata.errors import ConfigError
from kvstrata.runtime.config import TierSpec, WorkerConfig
from kvstrata.store.config import TierConfig
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.store.value_policy import ValuePolicy
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier

DISK_FETCH_S_PER_BYTE = 1 / 7e9


def eviction_policy(name: str, demotion_fetch_s_per_byte: float | None = None) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "kvstrata":
        return ValuePolicy(demotion_fetch_s_per_byte=demotion_fetch_s_per_byte)
    raise ConfigError(f"unknown eviction policy {name!r}; known: kvstrata, lru")


def _tier(spec: TierSpec, block_bytes: int) -> Tier:
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
) -> TieredStore | None:
    """The store of ``config.tiers`` (None when there are none), started."""
    levels: list[tuple[Tier, EvictionPolicy, TierConfig]] = []
    has_disk = config.tier("disk") is not None
    for spec in config.tiers:
        fetch = DISK_FETCH_S_PER_BYTE if spec.name == "host" and has_disk else None
        policy = eviction_policy(spec.eviction_policy, fetch)
        levels.append((_tier(spec, block_bytes), policy, spec.config))
    if not levels:
        return None
    store = TieredStore(
        levels, metrics=StoreMetrics(registry), clock=time.time, record_events=record_events
    )
    store.start()
    return store
