"""AdaptivePolicy ("kvstrata-adaptive"): rank by whichever candidate policy saves the most
prefill seconds on this tier's own workload, measured by miniature simulation.

It was kvstrata's default until stop 29, when disjoint windows of the Mooncake trace showed it
meeting issue 15's eviction goals on none of 8 (``docs/results-history.md``): the default is
now ``value_policy.kvstrata_policy``. Kept as a choice and as a peer in ``bench eviction``.

No single ranking wins everywhere (``kvstrata bench eviction``): on the Mooncake trace a
value policy that remembers evicted keys (``ValuePolicy`` with a ghost) saves the most at
small tiers, GDSF's cost/size term is the best deployed policy at medium ones, and on
synthetic presets the plain value policy leads. So the tier keeps a few *candidates* and
lets the measurement choose, as Waldspurger, Saemundsson, Ahmad, Park, "Cache Modeling and
Optimization using Miniature Simulations" (USENIX ATC 2017) do for cache parameters, and
LeCaR / Cacheus (Vietri et al., HotStorage 2018; Rodriguez et al., FAST 2021) for policies:

* **Candidates** (``CANDIDATES``): ``ValuePolicy`` (LHD-style hit density × saved seconds
  per byte), the same with a ghost of evicted keys (uncensored reuse histograms), GDSF
  (frequency × cost / size with inflation) and S3-FIFO (quick demotion of one-hit blocks).
  Each candidate is an ordinary policy instance that sees every event of the live tier,
  so whichever is chosen has a consistent view of the resident leaves; only the chosen one
  is asked for victims (the others' bookkeeping is O(1) or O(log n) per event).
* **Miniature simulations**: per candidate, a shadow tier of the *spatially sampled* keys
  (SHARDS: key ``k`` is in the sample iff ``crc32(k) / 2³² < rate``), whose byte capacity
  is ``rate`` × the live tier's (the live tier's resident bytes when it first asks for a
  victim, i.e. when full; re-measured at every victim call, never shrinking). Each live
  event on ``k`` (insert = a miss being stored, access = a use) is one reference: a shadow
  that holds ``k`` credits ``k``'s ``recompute_s`` (the seconds a hit saves), one that
  does not stores it, evicting by its own candidate. ``rate = min(1, SHADOW_OBJECTS /
  resident objects)``, so a shadow holds at most ``SHADOW_OBJECTS`` objects (plus any
  ghost its candidate keeps): memory is O(candidates × (n + SHADOW_OBJECTS)) and the
  shadows' work per live event is O(candidates × rate × a victim search). Lowering the rate
  drops the shadow keys no longer sampled, as SHARDS does.
* **Choice**: the credited seconds decay by half every ``HALF_LIFE_REFERENCES`` sampled
  references (the workload may change); at each victim call the live tier follows the
  candidate with the most decayed credit (ties: the earlier candidate; before any credit,
  ``ValuePolicy``).

A shadow tier's objects need not be prefix-closed (a sampled block's parent is usually not
sampled), so a shadow hit on a block counts even when the live tier would have missed an
ancestor; the shadow ranks the candidates, it does not predict the live hit rate.

Constants (none fitted to a trace): ``SHADOW_OBJECTS = 512`` (SHARDS' fixed-size variant
keeps a bounded sample; 512 rather than a few thousand keeps the shadows' victim searches
under the live tier's own cost);
``HALF_LIFE_REFERENCES = 65536`` sampled references.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.gdsf import GDSFPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.s3fifo import S3FIFOPolicy
from kvstrata.store.value_policy import GHOST_FACTOR, ValuePolicy

SHADOW_OBJECTS = 512
HALF_LIFE_REFERENCES = 65536
_HASH_SPACE = float(1 << 32)

Factory = Callable[[float | None], EvictionPolicy]


def _value(fetch: float | None) -> EvictionPolicy:
    return ValuePolicy(demotion_fetch_s_per_byte=fetch)


def _value_ghost(fetch: float | None) -> EvictionPolicy:
    return ValuePolicy(
        demotion_fetch_s_per_byte=fetch,
        ghost_factor=GHOST_FACTOR,
        ghost_uses=True,
        ghost_censored=True,
    )


def _gdsf(fetch: float | None) -> EvictionPolicy:
    return GDSFPolicy(demotion_fetch_s_per_byte=fetch)


def _s3fifo(_fetch: float | None) -> EvictionPolicy:
    return S3FIFOPolicy()


CANDIDATES: tuple[tuple[str, Factory], ...] = (
    ("value", _value),
    ("value-ghost", _value_ghost),
    ("gdsf", _gdsf),
    ("s3fifo", _s3fifo),
)


def sample_point(key: BlockKey) -> float:
    """Where ``key`` falls in [0, 1): it is sampled at rate ``r`` iff this is below ``r``."""
    return zlib.crc32(key) / _HASH_SPACE


class _Shadow:
    """One candidate's miniature tier: sampled keys, scaled byte capacity, credited seconds."""

    def __init__(self, policy: EvictionPolicy, fetch: float | None) -> None:
        self.policy = policy
        self.fetch = fetch
        self.resident: dict[BlockKey, KVObjectMeta] = {}
        self.bytes = 0
        self.credit = 0.0

    def saved_s(self, meta: KVObjectMeta) -> float:
        saved = max(meta.recompute_s, 0.0)
        return saved if self.fetch is None else min(saved, self.fetch * meta.size)

    def reference(self, meta: KVObjectMeta, capacity: float, now: float) -> None:
        key = meta.key
        if key in self.resident:
            self.credit += self.saved_s(meta)
            self.policy.on_access(key, now)
            return
        while self.resident and self.bytes + meta.size > capacity:
            victim = self.policy.victim(now)
            if victim is None:
                break
            self.remove(victim)
        self.resident[key] = meta
        self.bytes += meta.size
        self.policy.on_insert(meta, now)

    def remove(self, key: BlockKey) -> None:
        meta = self.resident.pop(key, None)
        if meta is not None:
            self.bytes -= meta.size
            self.policy.on_remove(key)

    def prune(self, rate: float) -> None:
        dropped = [key for key in self.resident if sample_point(key) >= rate]
        # children first, so a leaf-tracking candidate never sees a parent leave before them
        for key in reversed(dropped):
            self.remove(key)


class AdaptivePolicy:
    """Eviction by the candidate whose miniature simulation saves the most seconds."""

    name = "kvstrata-adaptive"

    def __init__(
        self,
        *,
        demotion_fetch_s_per_byte: float | None = None,
        candidates: Sequence[tuple[str, Factory]] = CANDIDATES,
        shadow_objects: int = SHADOW_OBJECTS,
        half_life_references: int = HALF_LIFE_REFERENCES,
    ) -> None:
        fetch = demotion_fetch_s_per_byte
        self.candidate_names = [name for name, _ in candidates]
        self._live = [factory(fetch) for _, factory in candidates]
        self._shadows = [_Shadow(factory(fetch), fetch) for _, factory in candidates]
        self._shadow_objects = shadow_objects
        self._half_life = half_life_references
        self._meta: dict[BlockKey, KVObjectMeta] = {}
        self._bytes = 0
        self._rate = 1.0
        self._capacity_bytes = 0
        self._references = 0
        self.chosen = 0

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def credits(self) -> list[float]:
        return [shadow.credit for shadow in self._shadows]

    # ---- events --------------------------------------------------------------------------
    def on_insert(self, meta: KVObjectMeta, now: float) -> None:
        if meta.key in self._meta:
            self.on_access(meta.key, now)
            return
        self._meta[meta.key] = meta
        self._bytes += meta.size
        for policy in self._live:
            policy.on_insert(meta, now)
        self._reference(meta, now)

    def on_access(self, key: BlockKey, now: float) -> None:
        meta = self._meta.get(key)
        if meta is None:
            return
        for policy in self._live:
            policy.on_access(key, now)
        self._reference(meta, now)

    def on_remove(self, key: BlockKey) -> None:
        meta = self._meta.pop(key, None)
        if meta is None:
            return
        self._bytes -= meta.size
        for policy in self._live:
            policy.on_remove(key)

    def victim(
        self,
        now: float,
        *,
        tenant: str | None = None,
        can_evict: Callable[[BlockKey], bool] | None = None,
    ) -> BlockKey | None:
        if self._bytes > self._capacity_bytes:
            self._resize(len(self._meta), self._bytes)
        credits = self.credits
        best = max(range(len(credits)), key=lambda index: (credits[index], -index))
        if credits[best] > credits[self.chosen]:
            self.chosen = best
        return self._live[self.chosen].victim(now, tenant=tenant, can_evict=can_evict)

    # ---- miniature simulations -----------------------------------------------------------
    def _resize(self, objects: int, capacity_bytes: int) -> None:
        self._capacity_bytes = capacity_bytes
        rate = min(1.0, self._shadow_objects / max(objects, 1))
        if rate < self._rate:
            self._rate = rate
            for shadow in self._shadows:
                shadow.prune(rate)

    def _reference(self, meta: KVObjectMeta, now: float) -> None:
        if self._rate < 1.0 and sample_point(meta.key) >= self._rate:
            return
        capacity = self._capacity_bytes * self._rate if self._capacity_bytes else float("inf")
        for shadow in self._shadows:
            shadow.reference(meta, capacity, now)
        self._references += 1
        if self._references >= self._half_life:
            self._references = 0
            for shadow in self._shadows:
                shadow.credit /= 2.0
