"""ARCPolicy ("arc"): Megiddo, Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST 2003.

Two LRU lists of resident objects — T1 (seen once since admission) and T2 (seen at least
twice) — and two ghost lists of keys — B1 (evicted from T1) and B2 (evicted from T2). The
target size ``p`` of T1 adapts: a miss found in B1 grows it by ``max(|B2|/|B1|, 1)``, one
found in B2 shrinks it by ``max(|B1|/|B2|, 1)``; both go to T2's MRU end, any other miss to
T1's. A hit moves the object to T2's MRU end. REPLACE evicts T1's LRU leaf when
``|T1| > p`` (else T2's), recording the key in the matching ghost list. The directory is
kept within the paper's bounds: ``|T1| + |B1| ≤ c`` and ``|T1| + |T2| + |B1| + |B2| ≤ 2c``.

Adaptation to this protocol: ``c`` is the number of resident objects (the policy is not told
the capacity; when eviction runs the tier is full, so they coincide); the victim is chosen
before the missing key is known, so REPLACE's tie rule (``x ∈ B2 and |T1| = p``) is dropped.

Prefix closure: each list's candidates are its *leaves* (``LeafQueues``): a non-leaf at the
LRU end is skipped, keeps its position, and is a candidate once its children left. When the
preferred list holds no evictable leaf, the other one is used. Expired objects go first;
tenants restrict both lists.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.leafheap import LeafHeapPolicy
from kvstrata.store.leafqueues import LeafQueues

_T1, _T2 = 0, 1


class ARCPolicy(LeafHeapPolicy):
    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        self._lists = LeafQueues(2, self.is_leaf)
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self.p = 0.0

    def _priority_on_insert(self, meta: KVObjectMeta, now: float) -> float:
        key = meta.key
        c = len(self)
        if key in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._lists.put(key, _T2, meta.tenant)
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._lists.put(key, _T2, meta.tenant)
        else:
            self._lists.put(key, _T1, meta.tenant)
        return now

    def _priority_on_access(self, key: BlockKey, now: float) -> float:
        self._lists.put(key, _T2, self._meta[key].tenant)
        return now

    def _forget(self, key: BlockKey) -> None:
        ghost = self._b1 if self._lists.queue_of(key) == _T1 else self._b2
        self._lists.drop(key)
        ghost[key] = None
        c = max(len(self) - 1, 0)  # resident objects once ``key`` has left
        while self._b1 and self._lists.size(_T1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and c + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def _leaf_changed(self, key: BlockKey, is_leaf: bool) -> None:
        if is_leaf:
            self._lists.became_leaf(key)

    def victim(
        self,
        now: float,
        *,
        tenant: str | None = None,
        can_evict: Callable[[BlockKey], bool] | None = None,
    ) -> BlockKey | None:
        expired = self._expired_victim(now, tenant, can_evict)
        if expired is not None:
            return expired
        t1 = self._lists.size(_T1)
        order = (_T1, _T2) if t1 >= 1 and t1 > self.p else (_T2, _T1)
        for queue in order:
            key = self._lists.tail(queue, tenant, can_evict)
            if key is not None:
                return key
        return None
