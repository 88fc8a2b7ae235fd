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
- Shared levels (a tier that ``evicts_itself``: every worker reaches the same objects) are the
  exception: a removal there that names its tenant (the shared ledger's victims, a delete of
  an object whose meta the tier knows) is announced even when another store announced the
  object, since the object is gone for every worker and any of them may be the one to notice.
  Their key → tenant map is bounded (``SHARED_TENANTS``): objects other writers evicted never
  leave it otherwise.
- Events are in the order the changes became visible under the store lock; an object is
  announced as stored before it can be announced as removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

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

SHARED_TENANTS: Final = 1 << 16
"""Announced objects of a shared level whose tenant the feed remembers (oldest forgotten)."""


class EventFeed:
    """The buffer behind ``take_events`` plus the per-level tenants of announced objects.

    Not thread-safe on its own: the store calls it under its lock. When ``enabled`` is false
    every method is a no-op, so a store without consumers pays nothing.
    """

    def __init__(self, enabled: bool, shared: Iterable[str] = ()) -> None:
        self.enabled = enabled
        self._shared = frozenset(shared)
        self._events: list[StoreEvent] = []
        self._tenants: dict[str, OrderedDict[BlockKey, str]] = {}

    def stored(self, tier: str, meta: KVObjectMeta) -> None:
        if self.enabled:
            tenants = self._tenants.setdefault(tier, OrderedDict())
            tenants[meta.key] = meta.tenant
            if tier in self._shared and len(tenants) > SHARED_TENANTS:
                tenants.popitem(last=False)
            self._events.append(ObjectStored(tier, meta))

    def removed(self, tier: str, key: BlockKey, tenant: str | None = None) -> None:
        """Announce a removal of an object announced as stored here — or, in a shared level,
        of any object whose ``tenant`` the caller knows (see the module docstring)."""
        if self.enabled:
            tenants = self._tenants.get(tier)
            known = None if tenants is None else tenants.pop(key, None)
            if tenant is None or tier not in self._shared:
                tenant = known
            if tenant is not None:
                self._events.append(ObjectRemoved(tier, key, tenant))

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def take(self) -> list[StoreEvent]:
        events, self._events = self._events, []
        return events
