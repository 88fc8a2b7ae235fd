"""The router's Prometheus metrics: decisions, predicted vs actual TTFT, index consistency.

Counters that the index and the event plane already keep (``IndexStats``,
``EventPlaneStats``) are exported by a custom collector at scrape time rather than mirrored
by hand, so the two can never disagree. The index belongs to the fleet lock: the collector
builds every family under it, and yields them after releasing it (a scrape never holds it
while the client formats or writes).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstrata.events.subscriber import EventPlaneStats
from kvstrata.index.core import GlobalIndex, Medium

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvstrata_router_decisions",
            "Routing decisions by chosen worker, policy and reason",
            ["worker", "policy", "reason"],
            registry=r,
        )
        self.disagg_decisions = Counter(
            "kvstrata_disagg_decisions",
            "Prefill path per request of a disaggregated fleet (local or disagg) and why",
            ["path", "reason"],
            registry=r,
        )
        self.requests = Counter(
            "kvstrata_router_requests",
            "Front-door requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.retries = Counter(
            "kvstrata_router_retries",
            "Requests re-sent to another worker after the chosen one failed",
            ["worker"],
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "kvstrata_router_predicted_ttft_seconds",
            "TTFT the router predicted for the chosen worker",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.actual_ttft = Histogram(
            "kvstrata_router_actual_ttft_seconds",
            "Measured TTFT of routed streaming requests (first byte through the front door)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_ratio = Histogram(
            "kvstrata_router_ttft_actual_over_predicted",
            "Actual / predicted TTFT per routed streaming request",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.predicted_matched = Counter(
            "kvstrata_router_predicted_matched_tokens",
            "Prompt tokens the index said the chosen worker holds",
            ["worker"],
            registry=r,
        )
        self.matched = Counter(
            "kvstrata_router_matched_tokens",
            "Prompt tokens the worker reported as served from cache (usage.cached_tokens)",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvstrata_router_prompt_tokens",
            "Prompt tokens routed, by worker",
            ["worker"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "kvstrata_worker_healthy", "1 if the router sends to the worker", ["worker"], registry=r
        )
        self.worker_inflight = Gauge(
            "kvstrata_worker_inflight_requests",
            "Requests in flight per worker",
            ["worker"],
            registry=r,
        )
        self.worker_events = Counter(
            "kvstrata_worker_lifecycle_events",
            "Worker lifecycle: attached, detached (dead), epoch_changed",
            ["worker", "event"],
            registry=r,
        )

    def export_index(
        self,
        index: GlobalIndex,
        events: EventPlaneStats,
        lock: threading.Lock,
        resyncs: Mapping[str, int] | None = None,
    ) -> None:
        """Register a collector that reads the index's and event plane's own counters
        (``resyncs``: the event plane's resyncs by reason)."""
        self.registry.register(_IndexCollector(index, events, lock, resyncs or {}))


class _IndexCollector(Collector):
    def __init__(
        self,
        index: GlobalIndex,
        events: EventPlaneStats,
        lock: threading.Lock,
        resyncs: Mapping[str, int],
    ) -> None:
        self._index = index
        self._events = events
        self._lock = lock
        self._resyncs = resyncs

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            families = list(self._families())
        yield from families

    def _families(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Every family, read under the fleet lock (the caller holds it)."""
        index, stats, events = self._index, self._index.stats, self._events
        mode = GaugeMetricFamily(
            "kvstrata_index_consistency_mode",
            "1 for the index's consistency mode",
            labels=["mode"],
        )
        mode.add_metric([index.mode.value], 1.0)
        yield mode
        blocks = GaugeMetricFamily(
            "kvstrata_index_blocks",
            "Blocks the index holds per worker and medium",
            labels=["worker", "medium"],
        )
        inconsistent = GaugeMetricFamily(
            "kvstrata_index_worker_inconsistent",
            "1 while a worker's entries are distrusted (lost events, resync pending)",
            labels=["worker"],
        )
        for worker in index.workers:
            for medium, count in zip(Medium, index.blocks_held(worker), strict=True):
                blocks.add_metric([worker, medium.name.lower()], float(count))
            inconsistent.add_metric([worker], 0.0 if index.is_consistent(worker) else 1.0)
        yield blocks
        yield inconsistent
        shared = GaugeMetricFamily(
            "kvstrata_index_shared_blocks",
            "Blocks the index holds in the shared (remote) tier, which every worker reaches",
        )
        shared.add_metric([], float(index.shared_blocks()))
        yield shared
        lag = GaugeMetricFamily(
            "kvstrata_index_event_lag_seconds",
            "Event time → applied to the index, over recent batches",
            labels=["quantile"],
        )
        for q in (0.5, 0.99):
            value = stats.lag_quantile(q)
            if value is not None:
                lag.add_metric([str(q)], value)
        yield lag
        for name, value, doc in (
            ("index_events_applied", stats.events, "Events applied to the index"),
            ("index_blocks_stored", stats.blocks_stored, "Block placements applied"),
            ("index_blocks_removed", stats.blocks_removed, "Block removals applied"),
            (
                "index_duplicate_entries",
                stats.duplicate_stores,
                "Stores of blocks already held",
            ),
            ("index_stale_removals", stats.unknown_removals, "Removals of blocks not held"),
            ("index_orphan_blocks", stats.orphan_blocks, "Stored blocks with unknown parent"),
            ("index_bad_events", stats.bad_events, "Events with inconsistent sizes"),
            (
                "index_stale_entries_dropped",
                stats.stale_entries_dropped,
                "Entries dropped by a new epoch or a resync",
            ),
            ("index_epoch_changes", stats.epoch_changes, "Worker restarts seen"),
            ("index_resyncs", stats.resyncs, "Full dumps applied (attach or gap repair)"),
            ("index_unknown_mediums", stats.unknown_mediums, "Stores in a medium not known"),
            ("index_clears", stats.clears, "AllBlocksCleared events applied"),
            (
                "index_stale_batches",
                stats.stale_batches,
                "Batches of an epoch the worker left behind (ignored)",
            ),
            (
                "index_inconsistent_marks",
                stats.inconsistent_marks,
                "Times a worker's entries were distrusted (resync pending)",
            ),
            (
                "index_tombstone_refusals",
                stats.tombstone_refusals,
                "Stored blocks refused because a deletion's tombstone covers them",
            ),
            ("events_missed_batches", events.missed_batches, "Batches a gap skipped over"),
            ("events_batches", events.batches, "Event batches received"),
            ("events_malformed_messages", events.malformed_messages, "Undecodable messages"),
            ("events_malformed_events", events.malformed_events, "Undecodable events"),
            ("events_unknown_events", events.unknown_events, "Events of unknown type"),
            ("events_duplicate_batches", events.duplicates, "Batches seen twice"),
            ("events_gaps", events.gaps, "Sequence gaps detected"),
            ("events_replay_requests", events.replay_requests, "Replay requests sent"),
            ("events_replayed_batches", events.replayed_batches, "Batches recovered by replay"),
            ("events_resyncs_needed", events.resyncs_needed, "Gaps replay could not cover"),
            (
                "events_history_truncated",
                events.history_truncated,
                "Rebuilds from a replay history whose oldest batches were already evicted",
            ),
            (
                "events_untrusted_batches",
                events.untrusted_batches,
                "Live batches numbered past everything their publisher's replay holds (dropped)",
            ),
        ):
            counter = CounterMetricFamily(f"kvstrata_{name}", doc)
            counter.add_metric([], float(value))
            yield counter
        resyncs = CounterMetricFamily(
            "kvstrata_events_resyncs",
            "Event-plane resyncs from a worker's dump, by reason (gap, epoch, error; "
            "dump_failed: a resync's dump failed and is retried; "
            "lower_lost: a lower stream's lost events, not resynced)",
            labels=["reason"],
        )
        for reason, count in sorted(dict(self._resyncs).items()):  # dict(): one atomic copy
            resyncs.add_metric([reason], float(count))
        yield resyncs
