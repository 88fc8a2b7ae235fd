"""Shared pieces of the tier tests: deterministic objects, a settable clock, store/load steps."""

from __future__ import annotations

from pathlib import Path

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.runtime.config import WorkerConfig, disk_tier, host_tier
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.tiers.base import Tier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig

OBJ = 4096
CAPACITY = 4 * OBJ


class FakeClock:
    """A settable clock: tests move time by assignment, never by sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_object(
    seed: int,
    *,
    size: int = OBJ,
    tenant: str = "t0",
    created_at: float = 1000.0,
    ttl: float | None = None,
) -> tuple[KVObjectMeta, bytes]:
    payload = (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]
    meta = KVObjectMeta(
        key=BlockKey(seed.to_bytes(4, "little") * 8),
        parent=None,
        tenant=tenant,
        representation=Representation("uint8", "raw", 1, (size,)),
        size=size,
        digest=payload_digest(payload),
        created_at=created_at,
        ttl_s=ttl,
    )
    return meta, payload


def remote_tier_on(url: str, namespace: str, capacity: int = 64 * OBJ, **kw: object) -> RemoteTier:
    """A remote tier on the server at ``url`` in ``namespace`` (tests keep apart by it)."""
    return RemoteTier(RemoteConfig(url=url, namespace=namespace), capacity, **kw)  # type: ignore[arg-type]


def store(
    tier: Tier, meta: KVObjectMeta, payload: bytes, *, written_digest: bytes | None = None
) -> bool:
    slot = tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    slot.written_digest = written_digest
    return tier.complete_store(slot, True)


def load_bytes(tier: Tier, key: BlockKey) -> bytes | None:
    lease = tier.prepare_load(key)
    if lease is None:
        return None
    try:
        return bytes(lease.buffer)
    finally:
        tier.complete_load(lease)


def worker_tiers(
    *,
    host_bytes: int = 0,
    host: TierConfig | None = None,
    disk_dir: Path | None = None,
    disk_bytes: int = 0,
    disk: TierConfig | None = None,
    durable_disk: bool = True,
    policy: str = "kvstrata",
) -> WorkerConfig:
    """A ``WorkerConfig`` with a host and/or a disk tier: host write-through and disk
    write-back unless ``host``/``disk`` say otherwise (what these engine tests were written
    for; the configuration's own default for every tier is write-through)."""
    specs = []
    if host_bytes > 0:
        specs.append(host_tier(host_bytes, host, eviction_policy=policy))
    if disk_dir is not None and disk_bytes > 0:
        config = disk or TierConfig("disk", WritePolicy.WRITE_BACK)
        specs.append(
            disk_tier(disk_dir, disk_bytes, config, durable=durable_disk, eviction_policy=policy)
        )
    return WorkerConfig(tiers=tuple(specs))
