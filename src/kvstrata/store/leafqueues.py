"""Named FIFO / LRU queues over the leaves of a ``LeafHeapPolicy`` (S3-FIFO's and ARC's lists).

A queue orders its members by the sequence number they got when they were put at its head
(``put``): the oldest member is the tail. Prefix closure: only *leaves* are candidates, so
each (queue, tenant) keeps a heap of ``(seq, key)`` over its leaf members, with lazy
invalidation as in ``LeafHeapPolicy``; a member that becomes a leaf again (its children
left) returns at its *old* position, so an ancestor waits behind nothing younger than itself
and leaves right after its last child. ``size(queue)`` counts every member, leaf or not (the
list sizes the algorithms compare). Pinned members met at a tail are set aside and pushed
back, as ``LeafHeapPolicy._top`` does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from kvstrata.identity import BlockKey

_REBUILD_SLACK = 1024


class LeafQueues:
    def __init__(self, queues: int, is_leaf: Callable[[BlockKey], bool]) -> None:
        self._is_leaf = is_leaf
        self._where: dict[BlockKey, tuple[int, int, str]] = {}  # queue, seq, tenant
        self._heaps: dict[tuple[int, str], list[tuple[int, BlockKey]]] = {}
        self._sizes = [0] * queues
        self._seq = itertools.count()

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def queue_of(self, key: BlockKey) -> int | None:
        where = self._where.get(key)
        return None if where is None else where[0]

    def size(self, queue: int) -> int:
        return self._sizes[queue]

    def put(self, key: BlockKey, queue: int, tenant: str) -> None:
        """Put ``key`` at the head of ``queue`` (moving it from wherever it was)."""
        old = self._where.get(key)
        if old is not None:
            self._sizes[old[0]] -= 1
        seq = next(self._seq)
        self._where[key] = (queue, seq, tenant)
        self._sizes[queue] += 1
        if self._is_leaf(key):
            self._heap_push(key)

    def drop(self, key: BlockKey) -> None:
        old = self._where.pop(key, None)
        if old is not None:
            self._sizes[old[0]] -= 1

    def became_leaf(self, key: BlockKey) -> None:
        if key in self._where:
            self._heap_push(key)

    def tail(
        self, queue: int, tenant: str | None, can_evict: Callable[[BlockKey], bool] | None
    ) -> BlockKey | None:
        """The oldest evictable leaf of ``queue`` (of ``tenant`` when given), or None."""
        best: tuple[int, BlockKey] | None = None
        for (number, owner), heap in self._heaps.items():
            if number != queue or (tenant is not None and owner != tenant):
                continue
            top = self._top(heap, can_evict)
            if top is not None and (best is None or top[0] < best[0]):
                best = top
        return None if best is None else best[1]

    def _live(self, entry: tuple[int, BlockKey]) -> bool:
        where = self._where.get(entry[1])
        return where is not None and where[1] == entry[0] and self._is_leaf(entry[1])

    def _heap_push(self, key: BlockKey) -> None:
        queue, seq, tenant = self._where[key]
        heap = self._heaps.setdefault((queue, tenant), [])
        heapq.heappush(heap, (seq, key))
        if len(heap) > 2 * len(self._where) + _REBUILD_SLACK:
            live = [entry for entry in heap if self._live(entry)]
            heapq.heapify(live)
            self._heaps[(queue, tenant)] = live

    def _top(
        self, heap: list[tuple[int, BlockKey]], can_evict: Callable[[BlockKey], bool] | None
    ) -> tuple[int, BlockKey] | None:
        pinned: list[tuple[int, BlockKey]] = []
        found: tuple[int, BlockKey] | None = None
        while heap:
            entry = heap[0]
            if not self._live(entry):
                heapq.heappop(heap)
            elif can_evict is not None and not can_evict(entry[1]):
                pinned.append(heapq.heappop(heap))
            else:
                found = entry
                break
        for entry in pinned:
            heapq.heappush(heap, entry)
        return found
