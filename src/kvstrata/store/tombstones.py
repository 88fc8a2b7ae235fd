"""The store's tombstones: deleted keys that refuse late writes of their old objects.

Pure bookkeeping (no I/O, time passed in), guarded by the store lock like the rest of
``StoreCore``. ``add(key, deleted_at)`` records a deletion that expires ``ttl_s`` later (the
``[security] tombstone_ttl_s`` setting, longer than any write-back delay or event lag);
``covers(key, created_at, now)`` is the check every admission (a put, a copy between levels, a
write-back flush, a prefetch) and every lookup applies: an object of a tombstoned key created at
or before the deletion is refused, one created after it is allowed. Expired tombstones are
forgotten on sight and in ``expire`` (every ``add`` runs it), so the set stays bounded by the
deletions of one TTL.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects.tombstone import Tombstone


class Tombstones:
    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise InvalidInput(f"tombstone TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._marks: dict[BlockKey, Tombstone] = {}
        self._expiry: list[tuple[float, BlockKey]] = []  # lazy heap: stale entries skipped

    def __len__(self) -> int:
        return len(self._marks)

    def add(self, key: BlockKey, deleted_at: float) -> Tombstone:
        """Record that ``key`` was deleted at ``deleted_at`` (a later deletion extends it)."""
        self.expire(deleted_at)
        old = self._marks.get(key)
        if old is not None and old.deleted_at >= deleted_at:
            return old
        mark = Tombstone(key, deleted_at, deleted_at + self.ttl_s)
        self._remember(mark)
        return mark

    def restore(self, marks: Iterable[Tombstone], now: float) -> None:
        """Adopt tombstones a durable medium recovered (the newest per key wins)."""
        for mark in marks:
            old = self._marks.get(mark.key)
            if mark.live(now) and (old is None or old.deleted_at < mark.deleted_at):
                self._remember(mark)

    def get(self, key: BlockKey, now: float) -> Tombstone | None:
        mark = self._marks.get(key)
        if mark is not None and not mark.live(now):
            del self._marks[key]
            return None
        return mark

    def covers(self, key: BlockKey, created_at: float, now: float) -> bool:
        if not self._marks:
            return False
        mark = self.get(key, now)
        return mark is not None and mark.covers(created_at, now)

    def expire(self, now: float) -> int:
        """Forget every tombstone expired at ``now``; how many went."""
        gone = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            mark = self._marks.get(key)
            if mark is not None and mark.expires_at == expires_at:
                del self._marks[key]
                gone += 1
        return gone

    def _remember(self, mark: Tombstone) -> None:
        self._marks[mark.key] = mark
        heapq.heappush(self._expiry, (mark.expires_at, mark.key))
