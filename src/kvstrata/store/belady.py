"""Belady's offline optimum, as a reference for what any online policy could reach.

``BeladyPolicy`` evicts the leaf whose next use lies farthest in the future (never-used-again
leaves first). It learns the future from an oracle, ``next_use(key)``, that the simulator
answers from the whole trace; it asks on every insert and access, which is exactly when a
key's next use changes, so the priority stays static in between (a heap suffices).

Restricting victims to leaves costs Belady nothing: a block is used whenever any of its
descendants is, so a parent's next use is never later than its children's and the farthest
block can always be found among the leaves. It is the classic optimum for unit-size,
unit-value objects; with prefix-closed hits and a partial last block per prompt it is a
near-optimal reference, not a proven bound.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.leafheap import LeafHeapPolicy

K = TypeVar("K", bound=Hashable)

NEVER = float("inf")


class FutureAccesses(Generic[K]):
    """The oracle: for each key, the ordered steps (e.g. request indices) that use it.

    The simulator calls ``advance(step)`` before it processes step ``step``; ``next_use(key)``
    is then the first later step that uses ``key`` (``NEVER`` if none).
    """

    def __init__(self, steps: Sequence[Sequence[K]]) -> None:
        uses: dict[K, list[int]] = {}
        for step, keys in enumerate(steps):
            for key in keys:
                positions = uses.setdefault(key, [])
                if not positions or positions[-1] != step:
                    positions.append(step)
        self._uses = uses
        self._step = -1

    def advance(self, step: int) -> None:
        self._step = step

    def next_use(self, key: K) -> float:
        positions = self._uses.get(key)
        if not positions:
            return NEVER
        index = bisect.bisect_right(positions, self._step)
        return float(positions[index]) if index < len(positions) else NEVER


class BeladyPolicy(LeafHeapPolicy):
    """Evict the leaf used farthest in the future, as told by ``next_use``."""

    name = "belady"

    def __init__(self, next_use: Callable[[BlockKey], float]) -> None:
        super().__init__()
        self._next_use = next_use

    def _priority_on_insert(self, meta: KVObjectMeta, now: float) -> float:
        return -self._next_use(meta.key)

    def _priority_on_access(self, key: BlockKey, now: float) -> float:
        return -self._next_use(key)
