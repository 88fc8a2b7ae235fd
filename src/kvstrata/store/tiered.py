"""The tiered store: host DRAM, local disk (and later remote) behind one lookup.

The engine's device pool sits above this store: blocks enter the store when the pool writes
them through or evicts them (demotion), and leave it into the pool when a request hits them
(promotion). Inside the store, levels are ordered fastest first. Each level has a tier (bytes),
a policy (which object to evict), and a ``TierConfig`` (write policy, TTL, quotas, rollout).

Invariants kept here:
- lookup is prefix-closed: a block counts only if every ancestor is available in some level;
- only COMMITTED, verified objects of the requesting tenant are ever handed out (tiers verify
  digests; the store re-checks the tenant recorded in the object);
- tenant quotas are hard limits at admission: a tenant over its quota evicts its own objects
  first, and an object that cannot fit is not admitted;
- eviction asks the level's policy for a leaf victim, and demotes it to the next level when
  that level's write policy wants it, before dropping it;
- an optional ``listener`` (``store.listener.StoreListener``) hears every commit into and
  every removal from a level, under the store lock; ``resident`` lists what every level holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.levels import Level, Located, RequestScope, UseCounter
from kvstrata.store.listener import StoreListener
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.writeback import WriteBackQueue
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.base import LoadLease, Tier, TierError

PayloadFill = Callable[[memoryview], None]
"""Fills a writable buffer of exactly ``meta.size`` bytes with an object's payload."""

_FETCH_EWMA = 0.2  # weight of the newest measurement in a level's fetch-cost estimate


class TieredStore:
    def __init__(
        self,
        levels: Sequence[tuple[Tier, EvictionPolicy, TierConfig]],
        *,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.levels = [Level(tier, policy, config) for tier, policy, config in levels]
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.clock = clock
        self._lock = threading.RLock()
        self._writeback = WriteBackQueue(self, self.metrics)
        self._uses = UseCounter(self._held_anywhere)
        # Deleted while a reader had them pinned: invisible now, removed when the pin ends.
        self._pending_delete: set[BlockKey] = set()
        self.listener: StoreListener | None = None
        now = clock()
        for level in self.levels:
            for key in list(level.tier.keys()):  # objects recovered from a durable medium
                meta = level.tier.meta(key)
                if meta is not None:
                    level.policy.on_insert(meta, now)
            self.metrics.tier_enabled.labels(tier=level.name).set(1)
            self._publish(level)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background write-back flusher (only needed with write-back levels)."""
        self._writeback.start()

    def close(self) -> None:
        """Flush every write-back queue, stop the flusher, close the tiers."""
        self._writeback.close()
        for level in self.levels:
            level.tier.close()

    def bytes_at_risk(self, index: int) -> int:
        """Bytes queued for write-back into level ``index`` (lost there on a crash now)."""
        return self._writeback.bytes_at_risk(index)

    def flush(self) -> None:
        self._writeback.drain()

    def exclusive(self) -> AbstractContextManager[bool]:
        """Hold the store lock: no put, eviction, expiry or write-back runs meanwhile, so a
        snapshot of ``resident`` plus what a listener heard so far is consistent."""
        return self._lock

    def resident(self) -> list[tuple[str, list[KVObjectMeta]]]:
        """Every level's name and the metas of its committed, unexpired objects."""
        with self._lock:
            out = []
            for level in self.levels:
                metas = [level.tier.meta(key) for key in level.tier.keys()]
                out.append((level.name, [meta for meta in metas if meta is not None]))
                self._sync_dropped(level)  # report what expired on sight just now
            return out

    def level_index(self, name: str) -> int:
        for index, level in enumerate(self.levels):
            if level.name == name:
                return index
        raise KeyError(name)

    def set_enabled(self, name: str, enabled: bool) -> None:
        """The rollback switch: a disabled level is neither read nor written; data is kept."""
        with self._lock:
            level = self.levels[self.level_index(name)]
            level.enabled = enabled
            self.metrics.tier_enabled.labels(tier=name).set(1 if enabled else 0)

    def _active(self, level: Level, scope: RequestScope | None) -> bool:
        """Does this request use the level? (None: an owner-less operation, e.g. tests.)"""
        if not level.enabled or not level.config.rollout.enabled:
            return False
        if scope is None:
            return True
        return level.config.rollout.admits(
            tenant=scope.tenant, model=scope.model, request_id=scope.request_id
        )

    def _accepts(self, level: Level, meta: KVObjectMeta) -> bool:
        """May a background movement (demotion, write-back, selective) put ``meta`` here?"""
        rollout = level.config.rollout
        return (
            level.enabled
            and rollout.enabled
            and rollout.targets(tenant=meta.tenant, model=meta.model)
        )

    # ---- lookup and load --------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], scope: RequestScope) -> list[Located]:
        """Longest prefix of ``keys`` available in some active level (fastest level wins)."""
        found: list[Located] = []
        with self._lock:
            active = [i for i, lvl in enumerate(self.levels) if self._active(lvl, scope)]
            for key in keys:
                hit = self._locate(key, active, scope.tenant)
                if hit is None:
                    break
                found.append(hit)
        return found

    def _locate(self, key: BlockKey, active: list[int], tenant: str) -> Located | None:
        if key in self._pending_delete:
            return None
        for index in active:
            tier = self.levels[index].tier
            if tier.contains(key):
                meta = tier.meta(key)
                if meta is not None and meta.tenant == tenant:
                    return Located(key, index, meta)
        return None

    def estimated_fetch_s(self, located: Sequence[Located]) -> float:
        return sum(loc.meta.size * self.levels[loc.level].fetch_s_per_byte for loc in located)

    @contextmanager
    def load(self, located: Located, tenant: str) -> Iterator[LoadLease | None]:
        """Pin and yield a verified object (None if it vanished or failed verification)."""
        level = self.levels[located.level]
        started = time.perf_counter()
        with self._lock:
            invalid_before = level.tier.counters.invalidated
            lease = level.tier.prepare_load(located.key)
            if lease is None:
                self._forget_if_gone(level, located.key)
                if level.tier.counters.invalidated > invalid_before:
                    self.metrics.invalid.labels(tier=level.name, reason="digest_mismatch").inc()
            elif lease.meta.tenant != tenant or located.key in self._pending_delete:
                level.tier.complete_load(lease)
                lease = None
        if lease is None:
            yield None
            return
        try:
            yield lease
        finally:
            with self._lock:
                level.tier.complete_load(lease)
                if located.key in self._pending_delete:
                    self._finish_delete(located.key)
                else:
                    self._record_hit(located, lease.meta, time.perf_counter() - started)

    def _record_hit(self, located: Located, meta: KVObjectMeta, seconds: float) -> None:
        level = self.levels[located.level]
        self._uses.add(located.key)
        level.policy.on_access(located.key, self.clock())
        self.metrics.hits.labels(tier=level.name).inc()
        self.metrics.fetched_bytes.labels(tier=level.name).inc(meta.size)
        per_byte = seconds / max(meta.size, 1)
        level.fetch_s_per_byte = (
            per_byte
            if level.fetch_s_per_byte == 0.0
            else (1 - _FETCH_EWMA) * level.fetch_s_per_byte + _FETCH_EWMA * per_byte
        )
        self._after_use(located.level, meta)

    def _after_use(self, index: int, meta: KVObjectMeta) -> None:
        """Selective levels below admit an object once it has proven its value."""
        for target_index in range(index + 1, len(self.levels)):
            target = self.levels[target_index]
            if target.config.write_policy is not WritePolicy.SELECTIVE:
                continue
            if not self._accepts(target, meta) or target.tier.contains(meta.key):
                continue
            if self._proven_for(target, meta.key):
                self._copy_between(index, target_index, meta.key, cause="selective")

    # ---- writes -----------------------------------------------------------------------------
    def put(
        self,
        meta: KVObjectMeta,
        fill: PayloadFill,
        scope: RequestScope | None = None,
        *,
        uses: int = 1,
    ) -> bool:
        """An object enters the store (write-through from the device pool, or its demotion).

        ``uses`` is how often it was used before it got here (the device pool counts them).
        It lands in the fastest active level that wants it — a selective level only once the
        object has been used ``selective_min_uses`` times — and the lower levels follow their
        write policies. Returns whether any level admitted it.
        """
        with self._lock:
            self._uses.add(meta.key, uses)
            eligible = [
                i
                for i, lvl in enumerate(self.levels)
                if self._active(lvl, scope) and self._proven_for(lvl, meta.key)
            ]
            if not eligible:
                return False
            first = eligible[0]
            if not self._admit(first, meta, fill, cause="put"):
                # could not land in the fastest level: try the next ones directly
                return any(self._admit(i, meta, fill, cause="put") for i in eligible[1:])
            for index in eligible[1:]:
                if self.levels[index].config.write_policy is WritePolicy.WRITE_BACK:
                    self._writeback.enqueue(first, index, meta)
                else:  # write-through, or selective with the uses it asks for
                    self._copy_between(first, index, meta.key, cause="write-through")
            return True

    def _proven_for(self, level: Level, key: BlockKey) -> bool:
        if level.config.write_policy is not WritePolicy.SELECTIVE:
            return True
        return self._uses.get(key) >= level.config.selective_min_uses

    def _admit(self, index: int, meta: KVObjectMeta, fill: PayloadFill, *, cause: str) -> bool:
        level = self.levels[index]
        tier, name = level.tier, level.name
        if meta.key in self._pending_delete:
            self.metrics.rejections.labels(tier=name, reason="being_deleted").inc()
            return False
        if tier.contains(meta.key):
            level.policy.on_access(meta.key, self.clock())
            return True
        # The key may have just expired here (dropped on sight): let the policy forget the old
        # object before it learns of the new one.
        self._sync_dropped(level)
        if tier.reserved(meta.key):  # pending, or expired but still pinned by a reader
            self.metrics.rejections.labels(tier=name, reason="busy").inc()
            return False
        meta = meta.with_ttl(level.config.ttl_s)  # each level's own TTL, not the source's
        quota = level.config.quota_for(meta.tenant)
        if quota is not None:
            if meta.size > quota:
                self.metrics.rejections.labels(tier=name, reason="quota").inc()
                return False
            while tier.tenant_bytes(meta.tenant) + meta.size > quota:
                if not self._evict_one(index, tenant=meta.tenant):
                    self.metrics.rejections.labels(tier=name, reason="quota").inc()
                    return False
        try:
            slot = tier.prepare_store(meta)
            while slot is None:
                if tier.reserved(meta.key) or meta.size > tier.capacity_bytes:
                    self.metrics.rejections.labels(tier=name, reason="no_room").inc()
                    return False
                if not self._evict_one(index, tenant=None):
                    self.metrics.rejections.labels(tier=name, reason="no_room").inc()
                    return False
                slot = tier.prepare_store(meta)
        except TierError:
            self.metrics.write_failures.labels(tier=name).inc()
            return False
        try:
            fill(slot.buffer)
        except BaseException:
            tier.complete_store(slot, False)
            raise
        try:
            ok = tier.complete_store(slot, True)
        except TierError:
            ok = False
        if not ok:
            self.metrics.write_failures.labels(tier=name).inc()
            return False
        level.policy.on_insert(slot.meta, self.clock())
        if self.listener is not None:
            self.listener.object_stored(name, slot.meta)
        self.metrics.stores.labels(tier=name, cause=cause).inc()
        self._publish(level)
        return True

    def _copy_between(self, source: int, target: int, key: BlockKey, *, cause: str) -> bool:
        if key in self._pending_delete:
            return False  # never copy what is being deleted
        src = self.levels[source].tier
        lease = src.prepare_load(key)
        if lease is None:
            self._forget_if_gone(self.levels[source], key)
            return False
        try:
            payload = lease.buffer

            def fill(buffer: memoryview) -> None:
                buffer[:] = payload

            return self._admit(target, lease.meta, fill, cause=cause)
        finally:
            src.complete_load(lease)
            if key in self._pending_delete:
                self._finish_delete(key)

    # ---- eviction ---------------------------------------------------------------------------
    def _evict_one(self, index: int, *, tenant: str | None) -> bool:
        """Evict one victim of level ``index`` (demoting it if wanted). False: nothing to evict."""
        level = self.levels[index]
        self._sync_dropped(level)
        while True:
            victim = level.policy.victim(
                self.clock(), tenant=tenant, can_evict=level.tier.evictable
            )
            if victim is None:
                return False
            meta = level.tier.meta(victim)
            if meta is None:  # expired or invalidated behind the policy
                level.policy.on_remove(victim)
                continue
            self._writeback.flush_source(index, victim)
            outcome = self._demote(index, meta)
            try:
                removed = level.tier.remove(victim)
            except TierError:
                self.metrics.write_failures.labels(tier=level.name).inc()
                removed = False
            if removed:
                level.policy.on_remove(victim)
                if self.listener is not None:
                    self.listener.object_removed(level.name, victim, meta)
                self.metrics.evictions.labels(tier=level.name, outcome=outcome).inc()
                self._publish(level)
                return True
            return False  # pinned since the check, or the medium failed: give up this round

    def _demote(self, index: int, meta: KVObjectMeta) -> str:
        for target in range(index + 1, len(self.levels)):
            level = self.levels[target]
            if not self._accepts(level, meta):
                continue
            if level.tier.contains(meta.key):
                return "already_below"
            if not self._proven_for(level, meta.key):
                return "dropped_low_value"
            if self._copy_between(index, target, meta.key, cause="demotion"):
                return "demoted"
            return "dropped"
        return "dropped"

    def _held_anywhere(self, key: BlockKey) -> bool:
        return any(level.tier.meta(key) is not None for level in self.levels)

    # ---- deletion ---------------------------------------------------------------------------
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove every replica of ``keys`` from every level; returns replicas removed now.

        A replica pinned by a reader cannot go at once: its key becomes invisible to lookup
        and loads immediately, and the replica is removed when the last reader finishes.
        """
        removed = 0
        with self._lock:
            for key in keys:
                self._writeback.discard(key)
                self._uses.forget(key)
                removed += self._finish_delete(key)
        return removed

    def _finish_delete(self, key: BlockKey) -> int:
        removed = 0
        for level in self.levels:
            meta = level.tier.meta(key) if self.listener is not None else None
            if level.tier.remove(key):
                level.policy.on_remove(key)
                if self.listener is not None:
                    self.listener.object_removed(level.name, key, meta)
                removed += 1
                self._publish(level)
        if any(level.tier.reserved(key) for level in self.levels):
            self._pending_delete.add(key)
        else:
            self._pending_delete.discard(key)
        return removed

    # ---- internals --------------------------------------------------------------------------
    def _forget_if_gone(self, level: Level, key: BlockKey) -> None:
        if level.tier.meta(key) is None:
            level.policy.on_remove(key)
            self._publish(level)

    def _sync_dropped(self, level: Level) -> None:
        for key in level.tier.take_dropped():
            if level.tier.reserved(key):
                continue  # stored again since it was dropped: the policy's entry is live
            level.policy.on_remove(key)
            if self.listener is not None:
                self.listener.object_removed(level.name, key, None)
            self.metrics.invalid.labels(tier=level.name, reason="dropped_by_tier").inc()

    def _publish(self, level: Level) -> None:
        self._sync_dropped(level)
        self.metrics.bytes.labels(tier=level.name).set(level.tier.used_bytes)
        self.metrics.objects.labels(tier=level.name).set(level.tier.object_count)
