"""Telemetry: per-request records and Prometheus metrics, always injected, never global."""

from kvstrata.telemetry.metrics import KvMetrics
from kvstrata.telemetry.records import RequestRecord

__all__ = ["KvMetrics", "RequestRecord"]
