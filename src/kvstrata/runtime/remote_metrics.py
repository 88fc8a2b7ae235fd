"""Prometheus view of a remote tier: outages, breakers, refusals, shared evictions, read-ahead.

A custom collector reads the tier's counters at scrape time, so the tier's hot path only bumps
plain integers (no Prometheus call under its lock).

- ``kvstrata_remote_errors_total{op}``: calls that failed (timeout, refused, breaker open);
  every one ended in a miss or a refused store, i.e. recompute, never wrong KV.
- ``kvstrata_remote_breaker_open{node}``: 1 while a node's circuit breaker is open;
  ``kvstrata_remote_breaker_trips_total{node}``: how often it opened.
- ``kvstrata_remote_refused_total{reason}``: stores the shared ledger refused (``exists``:
  another writer holds the key, ``quota``, ``no_room``, ``tombstoned``, ``invalid``: a value or
  time that is no finite number).
- ``kvstrata_remote_evictions_total{reason}``: objects this writer's admissions evicted from
  the shared tier (``value``, ``quota``, ``expired``; ``corrupt``: a garbage ledger entry any
  of its calls met and dropped; ``lost``: an entry whose object was gone from the server).
- ``kvstrata_remote_read_ahead_bytes_total`` / ``…_unused_bytes_total``: bytes fetched ahead of
  a promotion, and those no load took.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.tiers.base import Tier
from kvstrata.tiers.remote import RemoteTier


class RemoteTierCollector(Collector):
    def __init__(self, tier: RemoteTier) -> None:
        self.tier = tier

    @classmethod
    def register(cls, registry: CollectorRegistry, tier: Tier) -> None:
        if isinstance(tier, RemoteTier):
            registry.register(cls(tier))

    def collect(self) -> Iterator[Metric]:
        counters = self.tier.remote_counters
        for name, help_text, table in (
            ("kvstrata_remote_errors", "Remote calls that failed (recomputed)", counters.errors),
            ("kvstrata_remote_refused", "Stores the shared ledger refused", counters.refused),
            ("kvstrata_remote_evictions", "Objects this writer evicted", counters.evicted),
        ):
            label = "op" if name.endswith("errors") else "reason"
            family = CounterMetricFamily(name, help_text, labels=[label])
            for key, value in sorted(dict(table).items()):
                family.add_metric([key], value)
            yield family
        breakers = self.tier.client.breakers()
        open_family = GaugeMetricFamily(
            "kvstrata_remote_breaker_open", "1 while the node's circuit is open", labels=["node"]
        )
        trips = CounterMetricFamily(
            "kvstrata_remote_breaker_trips", "Times the node's circuit opened", labels=["node"]
        )
        for node, breaker in sorted(breakers.items()):
            open_family.add_metric([node], 1.0 if breaker.is_open else 0.0)
            trips.add_metric([node], breaker.trips)
        yield open_family
        yield trips
        yield CounterMetricFamily(
            "kvstrata_remote_ledger_repairs",
            "Ledger indexes of the wrong type found and rebuilt",
            value=counters.ledger_repairs,
        )
        yield CounterMetricFamily(
            "kvstrata_remote_read_ahead_bytes",
            "Bytes fetched ahead of a promotion",
            value=counters.read_ahead_bytes,
        )
        yield CounterMetricFamily(
            "kvstrata_remote_read_ahead_unused_bytes",
            "Bytes fetched ahead that no load took",
            value=counters.read_ahead_unused_bytes,
        )
