"""Prometheus metrics of the tiered store, bound to an injected registry.

Prefetch (a queued request's blocks copied from a shared tier into a faster one before its
prefill is scheduled) has three byte counters per target tier: prefetched, later used (a hit
there) and wasted (left the tier unused, or still unused at shutdown) — the seed's "prefetch
waste" is ``wasted / prefetched``. ``kvstrata_prefetch_requests_total{outcome}`` says what
became of each prefetch the engine asked for.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.objects = Gauge(
            "kvstrata_tier_objects", "Objects held (incl. pending)", ["tier"], registry=r
        )
        self.bytes = Gauge(
            "kvstrata_tier_bytes", "Bytes held (incl. pending)", ["tier"], registry=r
        )
        self.hits = Counter(
            "kvstrata_tier_hits", "Objects loaded from a tier", ["tier"], registry=r
        )
        self.fetched_bytes = Counter(
            "kvstrata_tier_fetched_bytes", "Bytes loaded from a tier", ["tier"], registry=r
        )
        self.stores = Counter(
            "kvstrata_tier_stores", "Objects committed to a tier", ["tier", "cause"], registry=r
        )
        self.evictions = Counter(
            "kvstrata_tier_evictions", "Objects evicted", ["tier", "outcome"], registry=r
        )
        self.invalid = Counter(
            "kvstrata_tier_invalidated",
            "Objects found corrupt or incompatible and invalidated (then recomputed)",
            ["tier", "reason"],
            registry=r,
        )
        self.write_failures = Counter(
            "kvstrata_tier_write_failures", "Writes that failed cleanly", ["tier"], registry=r
        )
        self.rejections = Counter(
            "kvstrata_tier_admission_rejections",
            "Objects not admitted (quota, no evictable room, disabled)",
            ["tier", "reason"],
            registry=r,
        )
        self.undeletable = Gauge(
            "kvstrata_tier_undeletable_files",
            "Files a tier dropped from its index but could not delete (read-only medium, "
            "foreign entry in its place), since it opened; never served, met again at recovery",
            ["tier"],
            registry=r,
        )
        self.bytes_at_risk = Gauge(
            "kvstrata_writeback_bytes_at_risk",
            "Bytes queued for write-back to a tier: lost if the process dies now",
            ["tier"],
            registry=r,
        )
        self.tier_enabled = Gauge(
            "kvstrata_tier_enabled",
            "1 when the tier is enabled (rollback switch)",
            ["tier"],
            registry=r,
        )
        self.recompute_decisions = Counter(
            "kvstrata_breakeven_recompute",
            "Requests that recomputed instead of fetching from a lower tier",
            ["reason"],
            registry=r,
        )
        self.holds_refused = Counter(
            "kvstrata_store_holds_refused",
            "Reservations against eviction (a received transfer, a vLLM scheduler's promise)"
            " refused at the level's cap on held objects (half its capacity): the reserved"
            " blocks past it are not protected and may be evicted before their request",
            ["tier"],
            registry=r,
        )
        self.promotion_unloaded = Counter(
            "kvstrata_promotion_unloaded_blocks",
            "Blocks a planned promotion did not load (recomputed instead), by why: the pool"
            " had no room, or the load's outcome (missing, digest_mismatch, incompatible,"
            " tier_error)",
            ["reason"],
            registry=r,
        )

        self.prefetch_bytes = Counter(
            "kvstrata_prefetch_bytes",
            "Bytes a prefetch copied into a tier ahead of the request that asked for them",
            ["tier"],
            registry=r,
        )
        self.prefetch_used_bytes = Counter(
            "kvstrata_prefetch_used_bytes",
            "Prefetched bytes later hit in the tier they were prefetched into",
            ["tier"],
            registry=r,
        )
        self.prefetch_wasted_bytes = Counter(
            "kvstrata_prefetch_wasted_bytes",
            "Prefetched bytes that left the tier without a hit (removed) or were never used "
            "before shutdown (unused_at_close): prefetch waste",
            ["tier", "reason"],
            registry=r,
        )
        self.prefetch_requests = Counter(
            "kvstrata_prefetch_requests",
            "Prefetches asked for, by outcome (copied, nothing_to_fetch, cancelled, failed, "
            "dropped_queue_full)",
            ["outcome"],
            registry=r,
        )

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        found = self.registry.get_sample_value(name, labels or {})
        return float(found) if found is not None else 0.0
