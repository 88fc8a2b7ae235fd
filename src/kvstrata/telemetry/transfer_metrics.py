"""Prometheus metrics of KV transfers between workers, bound to an injected registry.

Every transfer a receiver finishes is counted once with its ``path`` (the transport: ``tcp``,
``nixl``) and ``outcome`` (``committed``, ``digest_mismatch``, ``cancelled``, ``timeout``,
``peer_lost``, ``refused``); bytes are the payload bytes received, committed or not.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

OUTCOMES = ("committed", "digest_mismatch", "cancelled", "timeout", "peer_lost", "refused")


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        labels = ["path", "outcome"]
        self.transfers = Counter(
            "kvstrata_transfers", "KV transfers received, by outcome", labels, registry=r
        )
        self.bytes = Counter(
            "kvstrata_transfer_bytes", "Payload bytes received by KV transfers", labels, registry=r
        )
        self.seconds = Histogram(
            "kvstrata_transfer_seconds",
            "Wall time of a KV transfer, first frame to outcome",
            labels,
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )

    def observe(self, path: str, outcome: str, payload_bytes: int, seconds: float) -> None:
        self.transfers.labels(path, outcome).inc()
        self.bytes.labels(path, outcome).inc(payload_bytes)
        self.seconds.labels(path, outcome).observe(seconds)

    def count(self, path: str, outcome: str) -> float:
        """Transfers counted so far for one label pair (tests, reports)."""
        value = self.registry.get_sample_value(
            "kvstrata_transfers_total", {"path": path, "outcome": outcome}
        )
        return 0.0 if value is None else value
