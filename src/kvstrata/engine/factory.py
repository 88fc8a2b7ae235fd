"""Assemble an engine with its tiers from plain options (used by the CLI and benchmarks).

Defaults and where they come from:
- eviction policy ``kvstrata`` (``ValuePolicy``) on every level; ``lru`` for comparison;
- the host level's policy prices demotion with the disk tier's fetch cost,
  ``DISK_FETCH_S_PER_BYTE`` = 1 / 7e9 s/byte: ``kvstrata bench tiers`` measured disk
  ``get_gbps`` ≈ 6.4–7.9 (read + verify + copy into a tensor) on this machine;
- device → host: write-through (every committed pool block is copied to the host tier, so
  a pool eviction costs nothing); host → disk: write-back (flushed in the background).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvstrata.costs import DEFAULT_PREFILL_MODEL, OnlinePrefillFit, PrefillModel
from kvstrata.engine.engine import EngineConfig, ReferenceEngine, pool_config_for
from kvstrata.engine.kv_events import KVEventEmitter
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.errors import InvalidInput
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.store.value_policy import ValuePolicy
from kvstrata.telemetry import KvMetrics
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier

DISK_FETCH_S_PER_BYTE = 1 / 7e9
POLICIES = ("kvstrata", "lru")


@dataclass(frozen=True)
class TierOptions:
    host_bytes: int = 0
    host: TierConfig = field(default_factory=lambda: TierConfig("host", WritePolicy.WRITE_THROUGH))
    disk_dir: Path | None = None
    disk_bytes: int = 0
    disk: TierConfig = field(default_factory=lambda: TierConfig("disk", WritePolicy.WRITE_BACK))
    policy: str = "kvstrata"
    durable_disk: bool = True

    @property
    def any(self) -> bool:
        return self.host_bytes > 0 or (self.disk_dir is not None and self.disk_bytes > 0)


def _policy(name: str, demotion_fetch_s_per_byte: float | None) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "kvstrata":
        return ValuePolicy(demotion_fetch_s_per_byte=demotion_fetch_s_per_byte)
    raise InvalidInput(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")


def build_store(
    block_bytes: int, options: TierOptions, registry: CollectorRegistry
) -> TieredStore | None:
    levels: list[tuple[Tier, EvictionPolicy, TierConfig]] = []
    has_disk = options.disk_dir is not None and options.disk_bytes > 0
    if options.host_bytes > 0:
        if options.host_bytes < block_bytes:
            raise InvalidInput(
                f"host tier of {options.host_bytes} B holds no {block_bytes} B block"
            )
        fetch = DISK_FETCH_S_PER_BYTE if has_disk else None
        tier = HostTier(options.host_bytes, block_bytes, clock=time.time)
        levels.append((tier, _policy(options.policy, fetch), options.host))
    if has_disk:
        assert options.disk_dir is not None
        disk = DiskTier(options.disk_dir, options.disk_bytes, durable=options.durable_disk)
        levels.append((disk, _policy(options.policy, None), options.disk))
    if not levels:
        return None
    store = TieredStore(levels, metrics=StoreMetrics(registry), clock=time.time)
    store.start()
    return store


def build_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    tiers: TierOptions | None = None,
    *,
    metrics: KvMetrics | None = None,
    cost_model: PrefillModel | None = None,
    events: KVEventEmitter | None = None,
) -> ReferenceEngine:
    metrics = metrics if metrics is not None else KvMetrics()
    block_bytes = pool_config_for(loaded, config.block_size, 1).bytes_per_block
    store = build_store(block_bytes, tiers, metrics.registry) if tiers is not None else None
    costs = OnlinePrefillFit(cost_model or DEFAULT_PREFILL_MODEL)
    return ReferenceEngine(loaded, config, metrics=metrics, store=store, costs=costs, events=events)
