"""The store's change feed: typed, frozen events the owner drains with ``take_events()``.

Why a feed and not callbacks: a callback runs under the store lock on whichever thread made the
change (an engine thread, a loader, the write-back flusher), so every consumer had to be
thread-safe, fast and never call back into the store. A feed inverts that: the store appends
under its lock (cheap), and the owner drains on its own thread, at its own pace (e.g. the KV
event emitter once per engine step). The store must not import engine code (import-linter), so
the events are plain data defined here.

Contract (``TieredStore(record_events=True)``; with it off nothing is recorded):
- ``ObjectStored(tier, meta)``: ``meta`` just became COMMITTED and visible in level ``tier``
  (a put, a demotion, a write-through/write-back/selective copy). A re-store of a key the
  level already holds is not reported. Objects recovered from a durable medium at
  construction are reported first, before any other event.
- ``ObjectRemoved(tier, key, tenant)``: the level no longer holds ``key`` (evicted, demoted,
  deleted, expired, invalidated or dropped by the tier itself). ``tenant`` is the owner of the
  removed object as recorded when it was announced (the feed keeps a key → tenant map per
  level, so a consumer needs none of its own, even when the tier dropped the object and its
  meta is gone). Only announced objects are announced as removed: a store that a delete
  overtook while its bytes were in flight was never visible, and is never reported.
- Events are in the order the changes became visible under the store lock; an object is
  announced as stored before it can be announced as removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta


@dataclass(frozen=True)
class ObjectStored:
    tier: str
    meta: KVObjectMeta


@dataclass(frozen=True)
class ObjectRemoved:
    tier: str
    key: BlockKey
    tenant: str


StoreEvent = ObjectStored | ObjectRemoved


class EventFeed:
    """The buffer behind ``take_events`` plus the per-level tenants of announced objects.

    Not thread-safe on its own: the store calls it under its lock. When ``enabled`` is false
    every method is a no-op, so a store without consumers pays nothing.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[StoreEvent] = []
        self._tenants: dict[str, dict[BlockKey, str]] = {}

    def stored(self, tier: str, meta: KVObjectMeta) -> None:
        if self.enabled:
            self._tenants.setdefault(tier, {})[meta.key] = meta.tenant
            self._events.append(ObjectStored(tier, meta))

    def removed(self, tier: str, key: BlockKey) -> None:
        """Announce a removal, only of an object that was announced as stored here."""
        if self.enabled:
            tenant = self._tenants.get(tier, {}).pop(key, None)
            if tenant is not None:
                self._events.append(ObjectRemoved(tier, key, tenant))

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def take(self) -> list[StoreEvent]:
        events, self._events = self._events, []
        return events
