"""The store's plain records: a level (tier + policy + config), a located object, a request
scope, and the use counter that selective levels consult."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.config import TierConfig
from kvstrata.store.policy import EvictionPolicy
from kvstrata.tiers.base import Tier


class RejectedObject(KvstrataError):
    """Raised by a consumer inside ``with store.load(...)``: the object verified, but it cannot
    be used here (another representation or size). The store books no hit, removes the object
    from its level (as it would a corrupt one) and lets the exception through."""


@dataclass
class Level:
    tier: Tier
    policy: EvictionPolicy
    config: TierConfig
    enabled: bool = True
    fetch_s_per_byte: float = 0.0  # measured (EWMA of loads); 0 until the first load

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class Located:
    key: BlockKey
    level: int
    meta: KVObjectMeta


@dataclass(frozen=True)
class RequestScope:
    """Who asks: tier rollout targets tenants, models and a canary share of request ids."""

    tenant: str
    model: str = ""
    request_id: str | None = None


class UseCounter:
    """Uses per key (every put and every load): the evidence a selective level asks for.

    Bounded: when it grows past its limit, counts of keys no level holds any more are
    forgotten (``held`` says which keys are still stored somewhere).
    """

    def __init__(self, held: Callable[[BlockKey], bool], limit: int = 1 << 16) -> None:
        self._counts: dict[BlockKey, int] = {}
        self._held = held
        self._limit = limit

    def get(self, key: BlockKey) -> int:
        return self._counts.get(key, 0)

    def add(self, key: BlockKey, uses: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + uses
        if len(self._counts) > self._limit:
            for stale in [k for k in self._counts if not self._held(k)]:
                del self._counts[stale]
            self._limit = max(self._limit, 2 * len(self._counts))

    def forget(self, key: BlockKey) -> None:
        self._counts.pop(key, None)
