"""The connector's counters in vLLM's own telemetry: ``KVConnectorStats`` and Prometheus.

Each step the worker side returns the counters' *increase* since its last report
(``KvstrataConnectorStats``: a flat ``{name: number}`` dict, so it pickles across vLLM's
processes); vLLM sums the intervals (``aggregate``), logs them (``KV Transfer metrics: …``,
``reduce``) and hands them to ``KvstrataPromMetrics.observe``, which adds them to counters
``vllm:kvstrata_<name>_total`` on vLLM's ``/metrics`` (labelled per engine like vLLM's own).
Gauges (``GAUGES``: the saver's queued blocks) keep the latest value. The JSON stats file
(``connector.stats_path``) stays, for tests and benchmarks that read totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found]
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvstrata.connectors.vllm_worker import ConnectorStats

GAUGES = frozenset({"save_queued_blocks"})
_HELP = {
    "blocks_loaded": "KV blocks loaded from kvstrata into vLLM",
    "load_errors": "KV blocks reported to vLLM for recomputation (failed or late loads)",
    "load_timeouts": "step loads given up at connector.load_timeout_ms",
    "blocks_saved": "KV blocks saved by the background saver",
    "save_dropped": "KV blocks not saved: the saver's queue was full",
    "save_flushes": "finished requests whose saves a step finished before its forward"
    " (vLLM handed out a block they still read)",
    "save_rejected": "KV blocks the store refused (quota, space) or failed to store",
    "save_skipped_present": "KV blocks not saved again: kvstrata already held them",
    "save_skipped_failed_load": "KV blocks not saved: computed on a block whose load failed",
    "lookups": "scheduler lookups answered by the worker's store",
    "lookup_holds_expired": "lookups whose promised blocks were held until the hold expired,"
    " never loaded (request aborted or scheduled without a load)",
    "pd_offers_sent": "kv_producer: kvstrata offers returned in kv_transfer_params",
    "pd_offers_accepted": "kv_consumer: producer offers the handshake accepted",
    "pd_refused": "kv_consumer: producer offers refused (the request prefilled locally)",
    "pd_wait_timeouts": "kv_consumer: accepted offers whose blocks did not all arrive in time",
}
PD_REASON_PREFIX = "pd_refused:"


@dataclass
class KvstrataConnectorStats(KVConnectorStats):  # type: ignore[misc]
    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in GAUGES:
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in self.data.items() if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """What changed since the last report (the worker's counters are cumulative)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, current: ConnectorStats, gauges: Mapping[str, float]) -> dict[str, float]:
        now = {k: float(v) for k, v in asdict(current).items() if k != "steps"}
        delta = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        changed = {k: v for k, v in delta.items() if v}
        changed.update(gauges)
        return changed


class KvstrataPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        self._gauges: dict[str, Any] = {}
        for name in ConnectorStats.__dataclass_fields__:
            if name == "steps":
                continue
            self._counters[name] = self._counter_cls(
                name=f"vllm:kvstrata_{name}_total",
                documentation=_HELP.get(name, f"kvstrata connector: {name.replace('_', ' ')}"),
                labelnames=labelnames,
            )
        for name in GAUGES:
            self._gauges[name] = self._gauge_cls(
                name=f"vllm:kvstrata_{name}",
                documentation="KV blocks waiting for the background saver",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        self._refusals = self._counter_cls(
            name="vllm:kvstrata_pd_refusals_total",
            documentation="kv_consumer: producer offers refused, by reason",
            labelnames=[*labelnames, "reason"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name.startswith(PD_REASON_PREFIX) and value > 0:
                reason = name.removeprefix(PD_REASON_PREFIX)
                self._refusals.labels(*labels, reason).inc(value)
            elif name in self._gauges:
                self._gauges[name].labels(*labels).set(value)
            elif name in self._counters and value > 0:
                self._counters[name].labels(*labels).inc(value)
