"""Shared pieces of the tier tests: deterministic objects, a settable clock, store/load steps."""

from __future__ import annotations

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.tiers.base import Tier

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


def store(tier: Tier, meta: KVObjectMeta, payload: bytes) -> bool:
    slot = tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    return tier.complete_store(slot, True)


def load_bytes(tier: Tier, key: BlockKey) -> bytes | None:
    lease = tier.prepare_load(key)
    if lease is None:
        return None
    try:
        return bytes(lease.buffer)
    finally:
        tier.complete_load(lease)
