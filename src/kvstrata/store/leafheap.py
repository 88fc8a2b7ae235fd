"""Shared bookkeeping of the eviction policies: leaves, tenants, TTL expiry, a priority heap.

Every policy of ``kvstrata.store.policies`` has the same obligations (see
``kvstrata.store.policy``): victims are present leaves that ``can_evict`` accepts, of the
requested tenant, expired objects first. Only the *order* among the remaining leaves differs,
so the order is the one thing a subclass supplies: a float priority per key (lowest leaves
first), recomputed only when the policy is told something (insert, access). Priorities are
therefore static between events, which is what lets a heap find the victim in O(log n).
A subclass whose order changes with time (``ValuePolicy``) ranks by sampling instead and
keeps the heap in LRU order as its fallback.

Data structures, all O(log n) amortised per event:

* ``_children[k]``: how many present objects name ``k`` as parent. ``k`` is a leaf iff it is
  present and the count is 0. Counting by parent key (present or not) keeps the count right
  when a child arrives before its parent (a lower tier can receive a demoted child first).
* one binary heap of ``(priority, seq, key)`` per tenant, with lazy invalidation: an entry is
  live iff the key is present, is a leaf, and ``(priority, seq)`` is the key's current entry.
  Every priority change pushes an entry with a fresh ``seq``; a key that becomes a leaf
  again re-pushes its current entry (an old copy may still sit in the heap: both are live
  and identical, so the duplicate is harmless and dies with the key); dead entries
  are dropped when they reach the top, and a heap is rebuilt from its live entries once it
  holds more than twice as many entries as the tenant has objects (plus a constant), so
  memory stays O(n) and the rebuild cost is amortised over the pushes that caused it.
  ``seq`` also breaks priority ties in event order, deterministically.
* TTL: a heap of deadlines. ``now`` is assumed non-decreasing (simulated or wall time),
  so an object found expired stays expired; expired leaves wait in a per-tenant ordered set
  and are offered before anything else. Removed objects' deadlines are dropped the same
  way as dead heap entries (a rebuild past twice the objects plus a constant).

Pinned objects (``can_evict`` false) met at the top of a heap are set aside and pushed back
after the call, so a victim search costs O((pinned on top + dead entries) · log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import ClassVar

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta

HeapEntry = tuple[float, int, BlockKey]

_REBUILD_SLACK = 1024
"""Dead heap entries tolerated beyond 2× the live ones before a rebuild (keeps tiny heaps
from being rebuilt on every push)."""


class LeafHeapPolicy:
    """Base class: leaf tracking, tenants, expiry and a priority heap; subclasses rank."""

    name: ClassVar[str] = "abstract"

    def __init__(self) -> None:
        self._meta: dict[BlockKey, KVObjectMeta] = {}
        self._children: dict[BlockKey, int] = {}
        self._entry: dict[BlockKey, tuple[float, int]] = {}
        self._heaps: dict[str, list[HeapEntry]] = {}
        self._tenant_count: dict[str, int] = {}
        self._seq = 0
        self._deadlines: list[tuple[float, int, BlockKey]] = []
        self._expired: set[BlockKey] = set()
        self._expired_leaves: dict[str, dict[BlockKey, None]] = {}

    # ---- what subclasses provide ---------------------------------------------------------
    def _priority_on_insert(self, meta: KVObjectMeta, now: float) -> float:
        raise NotImplementedError

    def _priority_on_access(self, key: BlockKey, now: float) -> float:
        raise NotImplementedError

    def _forget(self, key: BlockKey) -> None:
        """Drop subclass state of ``key`` (called from ``on_remove``, key still in _meta)."""

    def _leaf_changed(self, key: BlockKey, is_leaf: bool) -> None:
        """``key`` became a leaf, or stopped being one (removal included); for subclasses
        that keep their own view of the leaves (sampling)."""

    # ---- the EvictionPolicy protocol -----------------------------------------------------
    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def is_leaf(self, key: BlockKey) -> bool:
        return key in self._meta and not self._children.get(key)

    def on_insert(self, meta: KVObjectMeta, now: float) -> None:
        key = meta.key
        if key in self._meta:
            self.on_access(key, now)
            return
        self._meta[key] = meta
        self._tenant_count[meta.tenant] = self._tenant_count.get(meta.tenant, 0) + 1
        if not self._children.get(key):
            self._leaf_changed(key, True)
        parent = meta.parent
        if parent is not None:
            count = self._children.get(parent, 0)
            self._children[parent] = count + 1
            if count == 0 and parent in self._meta:
                self._lost_leaf(parent)
        deadline = meta.expires_at()
        if deadline is not None:
            self._seq += 1
            heapq.heappush(self._deadlines, (deadline, self._seq, key))
            if len(self._deadlines) > 2 * len(self._meta) + _REBUILD_SLACK:
                self._rebuild_deadlines()
        self._push(key, self._priority_on_insert(meta, now))

    def on_access(self, key: BlockKey, now: float) -> None:
        if key in self._meta:
            self._push(key, self._priority_on_access(key, now))

    def on_remove(self, key: BlockKey) -> None:
        meta = self._meta.get(key)
        if meta is None:
            return
        self._forget(key)
        if not self._children.get(key):
            self._leaf_changed(key, False)
        del self._meta[key]
        del self._entry[key]
        tenant_count = self._tenant_count[meta.tenant] - 1
        if tenant_count:
            self._tenant_count[meta.tenant] = tenant_count
        else:
            del self._tenant_count[meta.tenant]
            self._heaps.pop(meta.tenant, None)
        if key in self._expired:
            self._expired.discard(key)
            self._expired_leaves.get(meta.tenant, {}).pop(key, None)
        parent = meta.parent
        if parent is not None:
            count = self._children[parent] - 1
            if count:
                self._children[parent] = count
            else:
                del self._children[parent]
                if parent in self._meta:
                    self._became_leaf(parent)

    def victim(
        self,
        now: float,
        *,
        tenant: str | None = None,
        can_evict: Callable[[BlockKey], bool] | None = None,
    ) -> BlockKey | None:
        expired = self._expired_victim(now, tenant, can_evict)
        return expired if expired is not None else self._heap_victim(tenant, can_evict)

    def _expired_victim(
        self, now: float, tenant: str | None, can_evict: Callable[[BlockKey], bool] | None
    ) -> BlockKey | None:
        self._drain_deadlines(now)
        tenants = list(self._expired_leaves) if tenant is None else [tenant]
        for name in tenants:
            for key in self._expired_leaves.get(name, {}):
                if can_evict is None or can_evict(key):
                    return key
        return None

    def _heap_victim(
        self, tenant: str | None, can_evict: Callable[[BlockKey], bool] | None
    ) -> BlockKey | None:
        tenants = list(self._heaps) if tenant is None else [tenant]
        best: HeapEntry | None = None
        for name in tenants:
            entry = self._top(name, can_evict)
            if entry is not None and (best is None or entry < best):
                best = entry
        return None if best is None else best[2]

    # ---- internals -----------------------------------------------------------------------
    def _push(self, key: BlockKey, priority: float) -> None:
        self._seq += 1
        self._entry[key] = (priority, self._seq)
        if not self._children.get(key):
            self._heap_push(key, priority, self._seq)

    def _heap_push(self, key: BlockKey, priority: float, seq: int) -> None:
        tenant = self._meta[key].tenant
        heap = self._heaps.setdefault(tenant, [])
        heapq.heappush(heap, (priority, seq, key))
        if len(heap) > 2 * self._tenant_count[tenant] + _REBUILD_SLACK:
            live = [entry for entry in heap if self._live(entry)]
            heapq.heapify(live)
            self._heaps[tenant] = live

    def _became_leaf(self, key: BlockKey) -> None:
        priority, seq = self._entry[key]
        self._heap_push(key, priority, seq)
        self._leaf_changed(key, True)
        if key in self._expired:
            self._expired_leaves.setdefault(self._meta[key].tenant, {})[key] = None

    def _lost_leaf(self, key: BlockKey) -> None:
        self._leaf_changed(key, False)
        if key in self._expired:
            self._expired_leaves.get(self._meta[key].tenant, {}).pop(key, None)

    def _live(self, entry: HeapEntry) -> bool:
        key = entry[2]
        current = self._entry.get(key)
        return (
            current is not None and current[1] == entry[1] and not self._children.get(key)
        )  # seq values are unique per push, so equal seq means equal priority

    def _top(self, tenant: str, can_evict: Callable[[BlockKey], bool] | None) -> HeapEntry | None:
        heap = self._heaps.get(tenant)
        if not heap:
            return None
        pinned: list[HeapEntry] = []
        found: HeapEntry | None = None
        while heap:
            entry = heap[0]
            if not self._live(entry):
                heapq.heappop(heap)
            elif can_evict is not None and not can_evict(entry[2]):
                pinned.append(heapq.heappop(heap))
            else:
                found = entry
                break
        for entry in pinned:
            heapq.heappush(heap, entry)
        return found

    def _rebuild_deadlines(self) -> None:
        """Keep the deadlines of present objects only: removals leave theirs in the heap, so
        without this it grew with every insert until the deadlines passed (a day's TTL: a
        day of inserts)."""
        meta = self._meta
        live = [
            entry
            for entry in self._deadlines
            if (m := meta.get(entry[2])) is not None and m.expires_at() == entry[0]
        ]
        heapq.heapify(live)
        self._deadlines = live

    def _drain_deadlines(self, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, key = heapq.heappop(deadlines)
            meta = self._meta.get(key)
            if meta is None or not meta.expired(now):
                continue
            self._expired.add(key)
            if not self._children.get(key):
                self._expired_leaves.setdefault(meta.tenant, {})[key] = None
