"""Assemble the reference engine with its tiers from a ``WorkerConfig`` (CLI, benchmarks).

The store is built by ``kvstrata.runtime.store_factory`` (the same code the vLLM connector
uses); this module only adds what is the reference engine's own: its pool and cost model.
"""

from __future__ import annotations

from kvstrata.costs import DEFAULT_PREFILL_MODEL, OnlinePrefillFit, PrefillModel
from kvstrata.engine.engine import EngineConfig, ReferenceEngine, pool_config_for
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.runtime.config import WorkerConfig
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.runtime.store_factory import build_store
from kvstrata.security.audit import NULL_AUDIT, AuditLog
from kvstrata.telemetry import KvMetrics


def build_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    worker: WorkerConfig | None = None,
    *,
    metrics: KvMetrics | None = None,
    cost_model: PrefillModel | None = None,
    events: KVEventEmitter | None = None,
    audit: AuditLog = NULL_AUDIT,
) -> ReferenceEngine:
    """``audit``: where the store records evictions, invalidations, quota rejections and tier
    switches (the caller owns the log: starts it before, closes it after the engine)."""
    metrics = metrics if metrics is not None else KvMetrics()
    block_bytes = pool_config_for(loaded, config.block_size, 1).bytes_per_block
    store = None
    if worker is not None:
        store = build_store(
            block_bytes, worker, metrics.registry, record_events=events is not None, audit=audit
        )
    costs = OnlinePrefillFit(cost_model or DEFAULT_PREFILL_MODEL)
    return ReferenceEngine(loaded, config, metrics=metrics, store=store, costs=costs, events=events)
