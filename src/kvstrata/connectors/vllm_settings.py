"""``kv_connector_extra_config`` of the vLLM connector, parsed once (frozen dataclass).

Keys (all optional; at least one tier must be configured):

| key | meaning | default |
|---|---|---|
| ``host_gib`` | host DRAM tier size (GiB) | 0 (none) |
| ``disk_dir`` / ``disk_gib`` | local disk tier directory and size (GiB) | none |
| ``disk_write`` | host → disk: ``write-through`` / ``write-back`` / ``selective`` | write-through |
| ``durable`` | fsync every disk object (off: safe against process death, not power loss) | true |
| ``policy`` | eviction policy, ``kvstrata`` or ``lru`` | kvstrata |
| ``tenant_secret`` | deployment secret mixed into tenant salts | "" |
| ``events_endpoint`` | publish kvstrata KV events here (ZMQ, e.g. ``tcp://127.0.0.1:*``) | off |
| ``events_replay_endpoint`` / ``events_topic`` / ``worker_id`` | event plane details | — |
| ``stats_path`` | the worker writes its counters here (JSON) after each changing step | off |
| ``lookup_timeout_ms`` | scheduler → worker lookup timeout (multiprocess mode) | 2000 |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.engine.factory import TierOptions
from kvstrata.errors import InvalidInput
from kvstrata.store.config import TierConfig, WritePolicy

GIB = 1 << 30
_KNOWN = frozenset(
    {
        "host_gib",
        "disk_dir",
        "disk_gib",
        "disk_write",
        "durable",
        "policy",
        "tenant_secret",
        "events_endpoint",
        "events_replay_endpoint",
        "events_topic",
        "worker_id",
        "stats_path",
        "lookup_timeout_ms",
    }
)


@dataclass(frozen=True)
class ConnectorSettings:
    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0
    disk_write: WritePolicy = WritePolicy.WRITE_THROUGH
    durable: bool = True
    policy: str = "kvstrata"
    tenant_secret: bytes = b""
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str = ""
    worker_id: str | None = None
    stats_path: Path | None = None
    lookup_timeout_ms: int = 2000

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KNOWN)
        if unknown:
            raise InvalidInput(f"unknown kvstrata connector settings: {', '.join(unknown)}")
        disk_dir = extra.get("disk_dir")
        settings = cls(
            host_bytes=int(float(extra.get("host_gib", 0)) * GIB),
            disk_dir=Path(disk_dir) if disk_dir else None,
            disk_bytes=int(float(extra.get("disk_gib", 0)) * GIB),
            disk_write=WritePolicy(str(extra.get("disk_write", WritePolicy.WRITE_THROUGH))),
            durable=_bool(extra.get("durable", True)),
            policy=str(extra.get("policy", "kvstrata")),
            tenant_secret=str(extra.get("tenant_secret", "")).encode("utf-8"),
            events_endpoint=extra.get("events_endpoint") or None,
            events_replay_endpoint=extra.get("events_replay_endpoint") or None,
            events_topic=str(extra.get("events_topic", "")),
            worker_id=extra.get("worker_id") or None,
            stats_path=Path(extra["stats_path"]) if extra.get("stats_path") else None,
            lookup_timeout_ms=int(extra.get("lookup_timeout_ms", 2000)),
        )
        if not settings.tier_options().any:
            raise InvalidInput("the kvstrata connector needs host_gib and/or disk_dir + disk_gib")
        return settings

    def tier_options(self) -> TierOptions:
        return TierOptions(
            host_bytes=self.host_bytes,
            host=TierConfig("host", WritePolicy.WRITE_THROUGH),
            disk_dir=self.disk_dir,
            disk_bytes=self.disk_bytes,
            disk=TierConfig("disk", self.disk_write),
            policy=self.policy,
            durable_disk=self.durable,
        )


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
