"""Configuration of the tiered store, parsed once at the edge (frozen dataclasses).

Every tier has a write policy, optional TTL, tenant quotas and rollout controls:

- ``WritePolicy.WRITE_THROUGH``: an object entering the tier above is written here at once.
  Durable and predictable, more write traffic.
- ``WritePolicy.WRITE_BACK``: it is queued (bounded by ``write_back_max_bytes``) and flushed by
  a background thread and on ``close()``; the bytes at risk are exported as a metric. When the
  queue is full, the oldest entry is flushed synchronously (backpressure, never a silent drop).
- ``WritePolicy.SELECTIVE``: written only once the object has proven its value — it has been
  used ``selective_min_uses`` times (default 2: "a second use"), or it is being demoted from
  the tier above after that many uses.

Integrity: ``verify_reads`` (default on, for every tier) makes the tier re-check the payload
digest on every read, not only when the object was written; the store's builder passes it to
the tier it constructs. Turning it off trusts committed bytes (``kvstrata bench tiers`` reports
what the check costs).

Rollout (the seed: every tier ships with a narrow target, a canary, a rollback switch and a
break-even threshold):
- ``tenants`` / ``models``: when set, only those tenants / model names use the tier;
- ``canary_fraction``: the share of requests (by a hash of the request id) that use it;
- ``enabled``: flipped at run time (``TieredStore.set_enabled``, admin HTTP endpoint) — a
  disabled tier is neither read nor written, and keeps its committed data for re-enabling;
- ``min_reusable_tokens`` and the fetch-vs-recompute test are applied by the engine: below
  that many reusable tokens, or when fetching would take longer than recomputing, it recomputes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from blake3 import blake3


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class RolloutConfig:
    enabled: bool = True
    tenants: frozenset[str] | None = None
    models: frozenset[str] | None = None
    canary_fraction: float = 1.0
    min_reusable_tokens: int = 0

    def targets(self, *, tenant: str, model: str) -> bool:
        """Is this tenant's / model's data in the tier's narrow target at all?"""
        if self.tenants is not None and tenant not in self.tenants:
            return False
        return self.models is None or model in self.models

    def admits(self, *, tenant: str, model: str, request_id: str | None) -> bool:
        """Does this request use the tier? (``enabled`` is checked by the store at run time.)

        Background movements (demotion, write-back, selective admission) and an object put
        without a request id have no request: they check ``targets`` only, so the canary
        share applies to requests, not objects.
        """
        if not self.targets(tenant=tenant, model=model):
            return False
        if self.canary_fraction >= 1.0:
            return True
        if self.canary_fraction <= 0.0 or request_id is None:
            return False
        return canary_bucket(request_id) < self.canary_fraction


def canary_bucket(request_id: str) -> float:
    """A stable number in [0, 1) per request id (BLAKE3, not Python's salted ``hash``)."""
    digest = blake3(request_id.encode("utf-8")).digest(8)
    return int.from_bytes(digest, "little") / 2**64


@dataclass(frozen=True)
class TierConfig:
    name: str
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    ttl_s: float | None = None
    tenant_quota_bytes: Mapping[str, int] = field(default_factory=dict)
    default_tenant_quota_bytes: int | None = None
    selective_min_uses: int = 2
    write_back_max_bytes: int = 256 << 20
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    verify_reads: bool = True

    def quota_for(self, tenant: str) -> int | None:
        return self.tenant_quota_bytes.get(tenant, self.default_tenant_quota_bytes)
