"""Admission into a level of the tiered store: reservation, quotas, eviction, demotion.

``AdmittingCore._admit`` stores one object into one level in three steps — reserve (locked:
admission checks, evictions that need no I/O, the tier's reservation), fill and complete
(unlocked: the caller's ``fill`` and the tier's digest and write), register (locked) — and
``_copy`` admits a replica read from another level the same way (every copy between levels:
write-through, selective, demotion, prefetch, write-back). A victim that must be demoted first
is copied down outside the lock and then removed (``_demote_and_remove``); a tier that evicts
itself (the shared remote tier) reserves outside the lock, its quotas and victims its own.

Invariants kept here:
- tenant quotas are hard limits at admission (the check and the reservation happen in one
  locked section): a tenant over its quota evicts its own objects first, and an object that
  cannot fit is not admitted;
- eviction asks the level's policy for a leaf victim among unpinned, committed objects that
  no other thread is demoting and nothing holds (``TieredStore.hold``: a planned promotion,
  an engine's lookup, a received transfer), and demotes it to the next level when that
  level's write policy wants it (the copy outside the lock), before removing it; a victim
  that vanished or got pinned meanwhile is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.erasure import ErasingCore
from kvstrata.store.policy import AdmissionFilter
from kvstrata.store.state import PREFETCH
from kvstrata.tiers.base import StoreSlot, TierError

PayloadFill = Callable[[memoryview], None]
"""Fills a writable buffer of exactly ``meta.size`` bytes with an object's payload."""

_MAX_DEMOTIONS = 64  # victims one admission may demote (copy down) before it gives up


@dataclass(frozen=True)
class _Demote:
    """A victim that must be copied down (outside the lock) before it can be removed."""

    key: BlockKey


@dataclass
class _Gate:
    """A level's admission filter (``policy.AdmissionFilter``), asked at most once per store:
    ``newcomer`` is None once asked (the newcomer won against the first victim, so further
    victims for it go without asking: asking each would count the request again and could
    refuse it after a victim already went), or when the store is not filtered (a transfer
    or a prefetch: KV a request needs now)."""

    newcomer: KVObjectMeta | None


@dataclass(frozen=True)
class _Refused:
    """The level's admission filter (``policy.AdmissionFilter``) kept its victim over the
    newcomer: nothing was evicted, the newcomer is not stored."""


@dataclass(frozen=True)
class _SelfEvicting:
    """Admission checks passed for a tier that evicts itself: reserve there, unlocked."""

    meta: KVObjectMeta


class AdmittingCore(ErasingCore):
    """Admission into a level and eviction from it (see the module docstring)."""

    def _admit(self, index: int, meta: KVObjectMeta, fill: PayloadFill, *, cause: str) -> bool:
        """Reserve (locked), fill and complete (unlocked), register (locked)."""
        slot = self._reserve(index, meta, filtered=cause != PREFETCH)
        if isinstance(slot, bool):
            return slot
        try:
            fill(slot.buffer)
        except BaseException:
            self._finish_store(index, slot, False, cause=cause)
            raise
        return self._finish_store(index, slot, True, cause=cause)

    # ---- an external writer's two-phase store (a KV transfer receiving into a level) -------
    def reserve_external(self, index: int, meta: KVObjectMeta) -> StoreSlot | bool:
        """Phase one of a store whose bytes another component writes (a transfer receiver):
        the same admission as ``put``'s (quotas, eviction, demotion, tombstones) → a PENDING
        slot, invisible and unevictable, or True (the level holds the key already) or False
        (refused). The caller fills ``slot.buffer`` outside any lock of ours, may replace
        ``slot.meta``'s digest, and must end it with ``complete_external``."""
        if not 0 <= index < len(self.levels):
            raise InvalidInput(f"no level {index}")
        return self._reserve(index, meta, filtered=False)

    def complete_external(self, index: int, slot: StoreSlot, success: bool) -> bool:
        """Phase two: commit (the tier verifies the digest) and register the object — visible
        to lookups from here on, unless a delete came meanwhile — or abort it (``success``
        False). Returns whether the object is now visible."""
        return self._finish_store(index, slot, success, cause="transfer")

    def _finish_store(self, index: int, slot: StoreSlot, success: bool, *, cause: str) -> bool:
        tier = self.levels[index].tier
        if not success:
            tier.complete_store(slot, False)
            with self._lock:
                self._storing.discard((index, slot.meta.key))
                if slot.meta.key in self._pending_delete:
                    self._finish_delete(slot.meta.key)
            return False
        buried_before = tier.counters.tombstoned
        try:
            ok = tier.complete_store(slot, True)
        except TierError:
            ok = False
        with self._lock:
            if not ok and tier.counters.tombstoned > buried_before:  # the medium's tombstone
                self._storing.discard((index, slot.meta.key))
                self._refused_buried(self.levels[index], slot.meta)
                if slot.meta.key in self._pending_delete:
                    self._finish_delete(slot.meta.key)
                return False
            return self._register(index, slot.meta, ok, cause=cause)

    def _reserve(self, index: int, meta: KVObjectMeta, *, filtered: bool) -> StoreSlot | bool:
        """A PENDING slot, or True (already held here), or False (refused). ``filtered``: the
        level's admission filter, if any, may refuse the newcomer (see ``_Gate``)."""
        gate = _Gate(meta if filtered else None)
        for _ in range(_MAX_DEMOTIONS):
            with self._lock:
                outcome = self._try_reserve(index, meta, gate)
            if isinstance(outcome, _SelfEvicting):
                return self._reserve_self_evicting(index, outcome.meta)
            if not isinstance(outcome, _Demote):
                return outcome
            self._demote_and_remove(index, outcome.key)
        self.metrics.rejections.labels(tier=self.levels[index].name, reason="no_room").inc()
        return False

    def _try_reserve(
        self, index: int, meta: KVObjectMeta, gate: _Gate
    ) -> StoreSlot | bool | _Demote | _SelfEvicting:
        """Under the lock: admission checks, evictions that need no I/O, the reservation."""
        level = self.levels[index]
        tier, name, key = level.tier, level.name, meta.key
        if key in self._pending_delete:
            self._finish_delete(key)  # touched again: retry what could not go before
        if key in self._pending_delete:
            self.metrics.rejections.labels(tier=name, reason="being_deleted").inc()
            return False
        if self._buried(level, meta):
            return False
        if (index, key) in self._storing:
            self.metrics.rejections.labels(tier=name, reason="busy").inc()
            return False
        if tier.contains(key):
            level.policy.on_access(key, self.clock())
            return True
        # The key may have just expired here (dropped on sight): let the policy forget the old
        # object before it learns of the new one.
        self._sync_dropped(level)
        if tier.reserved(key):  # pending, or expired but still pinned by a reader
            self.metrics.rejections.labels(tier=name, reason="busy").inc()
            return False
        meta = meta.with_ttl(level.config.ttl_s)  # each level's own TTL, not the source's
        if meta.expired(self.clock()):  # older than this level keeps: evict nothing for it
            self.metrics.rejections.labels(tier=name, reason="expired").inc()
            return False
        if tier.evicts_itself:  # quotas and victims are the tier's (shared with other writers)
            self._storing.add((index, key))  # claimed: the reservation's I/O runs unlocked
            return _SelfEvicting(meta)
        quota = level.config.quota_for(meta.tenant)
        if quota is not None:
            if meta.size > quota:
                self._quota_reject(level, meta, "larger_than_quota")
                return False
            while tier.tenant_bytes(meta.tenant) + meta.size > quota:
                evicted = self._evict_now(index, tenant=meta.tenant, gate=gate)
                if isinstance(evicted, _Refused):
                    self.metrics.rejections.labels(tier=name, reason="admission").inc()
                    return False
                if evicted is False:
                    self._quota_reject(level, meta, "quota_full")
                    return False
                if isinstance(evicted, _Demote):
                    return evicted
        try:
            slot = tier.prepare_store(meta)
            while slot is None:
                if tier.reserved(key) or meta.size > tier.capacity_bytes:
                    self.metrics.rejections.labels(tier=name, reason="no_room").inc()
                    return False
                evicted = self._evict_now(index, tenant=None, gate=gate)
                if isinstance(evicted, _Refused):
                    self.metrics.rejections.labels(tier=name, reason="admission").inc()
                    return False
                if evicted is False:
                    self.metrics.rejections.labels(tier=name, reason="no_room").inc()
                    return False
                if isinstance(evicted, _Demote):
                    return evicted
                slot = tier.prepare_store(meta)
        except TierError:
            self.metrics.write_failures.labels(tier=name).inc()
            return False
        self._storing.add((index, key))
        return slot

    def _reserve_self_evicting(self, index: int, meta: KVObjectMeta) -> StoreSlot | bool:
        """One reservation in a tier that evicts itself; its I/O (a round trip to a shared
        ledger) runs outside the lock, the key already claimed in ``_storing``."""
        level = self.levels[index]
        buried_before = level.tier.counters.tombstoned
        try:
            slot = level.tier.prepare_store(meta)
        except TierError:
            slot = None
            failed = True
        else:
            failed = False
        with self._lock:
            self._sync_dropped(level)
            if slot is not None:
                return slot
            self._storing.discard((index, meta.key))
            if failed:
                self.metrics.write_failures.labels(tier=level.name).inc()
            elif level.tier.counters.tombstoned > buried_before:  # another worker deleted it
                self._refused_buried(level, meta)
            else:
                self.metrics.rejections.labels(tier=level.name, reason="refused_by_tier").inc()
            if meta.key in self._pending_delete:
                self._finish_delete(meta.key)
        return False

    def _copy(self, source: int, target: int, key: BlockKey, *, cause: str) -> bool:
        """Read ``key`` from ``source`` and admit it into ``target``; all I/O outside the lock."""
        src, dst = self.levels[source], self.levels[target]
        with self._lock:
            if key in self._pending_delete or (source, key) in self._storing:
                return False  # never copy what is being deleted or is not visible yet
            if (target, key) in self._storing:
                return False  # another thread is storing it there right now
            if dst.tier.contains(key):
                dst.policy.on_access(key, self.clock())
                return True
        lease = src.tier.prepare_load(key)
        if lease is None:  # evicted or deleted meanwhile, or failed verification: skip it
            with self._lock:
                self._claim_corrupt(src, key)  # a corrupt read is counted there, once
                self._forget_if_gone(src, key)
            return False
        try:
            payload = lease.buffer

            def fill(buffer: memoryview) -> None:
                buffer[:] = payload

            return self._admit(target, lease.meta, fill, cause=cause)
        finally:
            with self._lock:
                src.tier.complete_load(lease)
                if key in self._pending_delete:
                    self._finish_delete(key)

    # ---- eviction ---------------------------------------------------------------------------
    def _evict_now(
        self, index: int, *, tenant: str | None, gate: _Gate
    ) -> bool | _Demote | _Refused:
        """Under the lock: remove one victim of level ``index`` if that needs no copy (True);
        a victim that must be demoted first is marked moving and returned; False: none.
        True too when no victim was left but the search itself freed room: the tier drops
        an expired object on sight (``evictable``), which the policy then skips. A policy
        with an admission filter is asked first, once per store (``_Gate``), whether the
        newcomer is worth the victim."""
        level = self.levels[index]
        admission = level.policy if isinstance(level.policy, AdmissionFilter) else None
        self._sync_dropped(level)
        used = level.tier.used_bytes

        def can_evict(key: BlockKey) -> bool:
            at = (index, key)
            return at not in self._moving and at not in self._held and level.tier.evictable(key)

        while True:
            victim = level.policy.victim(self.clock(), tenant=tenant, can_evict=can_evict)
            if victim is None:
                self._sync_dropped(level)
                return level.tier.used_bytes < used
            meta = level.tier.meta(victim)
            if meta is None:  # expired or invalidated behind the policy
                level.policy.on_remove(victim)
                continue
            if admission is not None and gate.newcomer is not None:
                newcomer, gate.newcomer = gate.newcomer, None
                if not admission.admit(newcomer, victim, self.clock()):
                    return _Refused()
            outcome, target = self._demotion(index, meta)
            if target is not None or self._writeback.pending_from(index, victim):
                self._moving.add((index, victim))
                return _Demote(victim)
            return self._remove_victim(index, victim, outcome)

    def _demote_and_remove(self, index: int, key: BlockKey) -> None:
        """Outside the lock: write the victim's queued copies, demote it, then remove it."""
        try:
            self._writeback.flush_source(index, key)
            with self._lock:
                meta = self.levels[index].tier.meta(key)
                if meta is None:
                    return  # deleted, expired or invalidated meanwhile
                outcome, target = self._demotion(index, meta)
            if target is not None:
                copied = self._copy(index, target, key, cause="demotion")
                outcome = "demoted" if copied else "dropped"
            with self._lock:
                if key not in self._pending_delete:  # else the delete removes it
                    self._remove_victim(index, key, outcome)
        finally:
            with self._lock:
                self._moving.discard((index, key))
