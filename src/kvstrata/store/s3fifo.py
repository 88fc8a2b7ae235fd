"""S3FIFOPolicy ("s3fifo"): Yang, Zhang, Qiu, Yue, Vinayak, "FIFO queues are all you need for
cache eviction", SOSP 2023.

Three FIFO queues: a small queue S (10% of the objects), a main queue M and a ghost queue G
of keys only (as many as M may hold, 90% of the objects). Each object has a 2-bit frequency
(capped at 3), incremented on every hit; queues are never reordered on a hit.

* insert: a key found in G goes to M's head; any other to S's head; frequency 0.
* evict: from S when S holds ≥ 10% of the objects, else from M.
  S's tail: accessed at least once while in S (frequency ≥ 1) → moved to M's head with
  frequency 0 (quick demotion: one-hit objects leave fast); else evicted, its key
  into G. M's tail: frequency > 0 → reinserted at M's head with frequency − 1 (CLOCK-like);
  else evicted.

Move-to-main threshold: 1 (one hit in S), as the authors' blog and figures describe it; the
paper's Algorithm 1 and its libCacheSim code default to 2 (``freq > 1``). 1 favours the
peer here: on the Mooncake trace 2 saved fewer tokens and seconds (15.8 M / 58.0k s against
16.8 M / 67.3k s over 4 windows × 3 capacities, measured by a review, 2026-12-06).

The tier size the paper splits is the number of resident objects here (the policy is not
told the capacity; when eviction runs the tier is full, so the two coincide).

Prefix closure: a queue's candidates are its *leaves* (``LeafQueues``): a non-leaf at a
tail is skipped, keeps its position, and is a candidate once its children left. When S (or
M) holds no evictable leaf the other queue is used. Expired objects go first; tenants
restrict every queue; a bounded number of moves per call, then the least recently used leaf
(``LeafHeapPolicy``'s heap), so a victim that exists is always found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.leafheap import LeafHeapPolicy
from kvstrata.store.leafqueues import LeafQueues

SMALL_FRACTION = 0.1
MAX_FREQUENCY = 3
_SMALL, _MAIN = 0, 1


class S3FIFOPolicy(LeafHeapPolicy):
    name = "s3fifo"

    def __init__(self, *, small_fraction: float = SMALL_FRACTION) -> None:
        super().__init__()
        self._small_fraction = small_fraction
        self._queues = LeafQueues(2, self.is_leaf)
        self._freq: dict[BlockKey, int] = {}
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()

    def _priority_on_insert(self, meta: KVObjectMeta, now: float) -> float:
        key = meta.key
        if key in self._ghost:
            del self._ghost[key]
            self._queues.put(key, _MAIN, meta.tenant)
        else:
            self._queues.put(key, _SMALL, meta.tenant)
        self._freq[key] = 0
        return now

    def _priority_on_access(self, key: BlockKey, now: float) -> float:
        self._freq[key] = min(self._freq[key] + 1, MAX_FREQUENCY)
        return now

    def _forget(self, key: BlockKey) -> None:
        if self._queues.queue_of(key) == _SMALL:
            self._ghost[key] = None
            limit = int((1.0 - self._small_fraction) * len(self))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        self._queues.drop(key)
        del self._freq[key]

    def _leaf_changed(self, key: BlockKey, is_leaf: bool) -> None:
        if is_leaf:
            self._queues.became_leaf(key)

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
        queues = self._queues
        for _ in range(4 * MAX_FREQUENCY * (len(self) + 1)):
            small_first = queues.size(_SMALL) >= self._small_fraction * len(self)
            order = (_SMALL, _MAIN) if small_first else (_MAIN, _SMALL)
            key = None
            for queue in order:
                key = queues.tail(queue, tenant, can_evict)
                if key is not None:
                    break
            if key is None:
                return None
            freq = self._freq[key]
            if queue == _SMALL:
                if freq < 1:
                    return key
                self._freq[key] = 0
                queues.put(key, _MAIN, self._meta[key].tenant)
            else:
                if freq < 1:
                    return key
                self._freq[key] = freq - 1
                queues.put(key, _MAIN, self._meta[key].tenant)
        return self._heap_victim(tenant, can_evict)
