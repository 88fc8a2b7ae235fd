"""GDSFPolicy ("gdsf"): Greedy-Dual-Size-Frequency, Cherkasova, "Improving WWW Proxies
Performance with Greedy-Dual-Size-Frequency Caching Policy", HP Labs HPL-98-69R1, 1998.

Each object's priority is ``H = L + frequency × cost / size`` and the lowest goes first; the
inflation value ``L`` is raised to the priority of every evicted object, so objects not
touched for a while age relative to newly priced ones. ``frequency`` counts uses (insert =
1, each hit + 1). ``cost / size`` is kvstrata's own value, ``value_per_byte`` (prefill
seconds a hit saves, per byte), the same formula ``ValuePolicy`` prices with, so the two
differ only in how they estimate future use (GDSF: frequency and inflation; kvstrata:
measured hit density). With ``demotion_fetch_s_per_byte`` the cost is capped at the fetch
from the tier below, as for ``ValuePolicy``.

``beta`` (default 1: GDSF) is GreedyDual*'s (Jin, Bestavros, "GreedyDual* Web caching
algorithm: exploiting the two sources of temporal locality in Web request streams", Computer
Communications 24(2), 2001): ``H = L + (frequency × cost / size)^(1/β)``. Below 1 it weighs
frequency and cost more against the inflation's aging (toward a static cost-frequency order),
above 1 less (toward LRU). It is the peer's main parameter in ``kvstrata bench eviction``
(``gdsf:B``, ``gdsf-tuned``: :mod:`kvstrata.store.deployed`).

Priorities are static between events, so ``LeafHeapPolicy``'s heap serves them. Prefix
closure: only leaves are in the heap, so the victim is the lowest-priority *leaf*; an
interior object waits for its children. ``L`` is raised only when the victim this policy
named is removed (not on invalidations), and never lowered.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.leafheap import LeafHeapPolicy
from kvstrata.store.value_policy import value_per_byte


class GDSFPolicy(LeafHeapPolicy):
    name = "gdsf"

    def __init__(
        self, *, demotion_fetch_s_per_byte: float | None = None, beta: float = 1.0
    ) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        self._fetch_s_per_byte = demotion_fetch_s_per_byte
        self._exponent = 1.0 / beta
        self._frequency: dict[BlockKey, int] = {}
        self._value: dict[BlockKey, float] = {}
        self._named: BlockKey | None = None
        self.inflation = 0.0

    def _priority_on_insert(self, meta: KVObjectMeta, now: float) -> float:
        self._frequency[meta.key] = 1
        self._value[meta.key] = value_per_byte(meta, self._fetch_s_per_byte)
        return self.inflation + math.pow(self._value[meta.key], self._exponent)

    def _priority_on_access(self, key: BlockKey, now: float) -> float:
        frequency = self._frequency[key] + 1
        self._frequency[key] = frequency
        return self.inflation + math.pow(frequency * self._value[key], self._exponent)

    def _forget(self, key: BlockKey) -> None:
        if key == self._named:
            self.inflation = max(self.inflation, self._entry[key][0])
            self._named = None
        del self._frequency[key]
        del self._value[key]

    def victim(
        self,
        now: float,
        *,
        tenant: str | None = None,
        can_evict: Callable[[BlockKey], bool] | None = None,
    ) -> BlockKey | None:
        self._named = super().victim(now, tenant=tenant, can_evict=can_evict)
        return self._named
