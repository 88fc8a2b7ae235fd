"""The tiered store's bookkeeping: the state under the store lock and the helpers over it.

``StoreCore`` owns everything the store lock guards — the levels (tier, policy, config, the
enable switch), use counts, pending deletes, which keys are being stored (reserved, bytes in
flight: invisible), demoted (not picked as a victim again) or held (``TieredStore.hold``),
the change feed and the prefetched objects not used yet — plus the short, I/O-free
operations on it: views (``resident``, ``take_events``), rollout checks, the registration of
a finished store, the removal of a victim, the completion of a delete. ``TieredStore``
(``tiered``) adds the movement of bytes, which happens outside the lock.

Prefetch accounting (``TieredStore.prefetch`` copies a queued request's blocks from a shared
level into a faster one): an object a prefetch made visible in a level is *unused* until the
first hit on it there (its bytes count as used) or until it leaves that level without one —
evicted, demoted, deleted, expired, dropped, or still there when the store closes (its bytes
count as wasted: the seed's "prefetch waste"). Every removal goes through ``_gone``, so no
path can forget the accounting.

Audit (``audit``, an ``AuditLog``; ``record`` only queues, so it is called under the lock):
one line per eviction (reason: the eviction outcome), invalidation (``digest_mismatch``,
``expired``, ``recovery_scan``, or ``dropped_by_tier`` when a tier dropped a key for a reason
the store cannot tell apart), quota rejection and tier switch, with the tier and the block key,
never tokens. A digest failure is recorded where the load found it and marked, so the tier's
report of the same drop adds no second line; a drop while no invalidation happened is an
expiry.

Tombstones (``store.tombstones``): a deleted key refuses, until its tombstone expires, every
admission of an object created at or before the deletion (``_buried``); refusals are counted
(``kvstrata_tier_admission_rejections_total{reason="tombstoned"}``) and audited
(``tombstone_refused``).

Every method here whose name starts with ``_`` expects the caller to hold ``self._lock``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Final

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.security.audit import NULL_AUDIT, Action, AuditLog
from kvstrata.security.config import DEFAULT_TOMBSTONE_TTL_S
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.events import EventFeed, StoreEvent
from kvstrata.store.levels import Level, RequestScope, UseCounter
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.tombstones import Tombstones
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.base import CORRUPT, EXPIRED, TOMBSTONED, Tier, TierError

RECOVERY_SCAN = "recovery_scan"
"""``kvstrata_tier_invalidated_total`` reason of objects a tier's start-up scan found corrupt."""
PREFETCH = "prefetch"
"""The ``cause`` of a store that a prefetch made (``kvstrata_tier_stores_total{cause}``)."""


_MAX_FOUND_CORRUPT: Final = 4096
DIGEST_MISMATCH: Final = "digest_mismatch"
"""The invalidation reason of an object whose bytes failed verification on a read."""
HOLD_SHARE: Final = 0.5
"""The share of a level's capacity past which a reservation (``TieredStore.hold`` with
``reserve=True``: a received transfer, a vLLM scheduler's promise) is refused. Half: the
level keeps at least as much evictable room as its reservations take, and they get what
they most often need (a handful of prompts) long before the cap."""


@dataclass(slots=True)
class _Hold:
    count: int
    size: int  # bytes counted against the level's cap while held


class StoreCore:
    def __init__(
        self,
        levels: Sequence[tuple[Tier, EvictionPolicy, TierConfig]],
        *,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.time,
        record_events: bool = False,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        audit: AuditLog = NULL_AUDIT,
    ) -> None:
        self.levels = [Level(tier, policy, config) for tier, policy, config in levels]
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.audit = audit
        self.clock = clock
        self.tombstones = Tombstones(tombstone_ttl_s)
        self._lock = threading.RLock()
        self._feed = EventFeed(
            record_events, shared=[lvl.name for lvl in self.levels if lvl.tier.evicts_itself]
        )
        self._uses = UseCounter(self._held_anywhere)
        # Deleted while a reader or a movement held them: invisible now, removed when it ends.
        self._pending_delete: set[BlockKey] = set()
        self._storing: set[tuple[int, BlockKey]] = set()  # reserved, bytes in flight: invisible
        self._found_corrupt: set[tuple[str, BlockKey]] = set()  # drained, not yet claimed
        self._moving: set[tuple[int, BlockKey]] = set()  # victims being demoted: not re-picked
        # (level, key) → holds on it (loads under way, reservations): never a victim
        self._held: dict[tuple[int, BlockKey], _Hold] = {}
        self._held_bytes = [0] * len(self.levels)  # per level: bytes of the held objects
        self._prefetched: dict[tuple[str, BlockKey], int] = {}  # (level, key) → bytes, unused
        # (level, key) → seconds of a shared level's batched read-ahead its next load adds
        self._ahead_s: dict[tuple[int, BlockKey], float] = {}
        # (level name, key) of digest failures already audited where a load found them
        now = clock()
        for level in self.levels:
            self.tombstones.restore(level.tier.recovered_tombstones(), now)
            for key in list(level.tier.keys()):  # objects recovered from a durable medium
                meta = level.tier.meta(key)
                if meta is not None:
                    level.policy.on_insert(meta, now)
                    self._feed.stored(level.name, meta)
            # What the tier invalidated before this store took it over: the corrupt or torn
            # objects a durable medium's start-up recovery scan deleted.
            if found := level.tier.counters.invalidated:
                self.metrics.invalid.labels(tier=level.name, reason=RECOVERY_SCAN).inc(found)
                audit.record(
                    Action.INVALIDATE, RECOVERY_SCAN, tier=level.name, counts={"objects": found}
                )
            self.metrics.tier_enabled.labels(tier=level.name).set(1)
            self._publish(level)

    # ---- change feed, snapshots and switches ------------------------------------------------
    @property
    def records_events(self) -> bool:
        return self._feed.enabled

    def has_events(self) -> bool:
        """Would ``take_events`` return anything now? (Does not drain: one owner drains.)"""
        with self._lock:
            for level in self.levels:
                self._sync_dropped(level)
            return self._feed.pending

    def take_events(self) -> list[StoreEvent]:
        """Return and clear the change feed (empty unless built with ``record_events``)."""
        with self._lock:
            for level in self.levels:
                self._sync_dropped(level)  # report what the tiers dropped by themselves
            return self._feed.take()

    def exclusive(self) -> AbstractContextManager[bool]:
        """Hold the store lock: no commit or removal becomes visible meanwhile, so
        ``take_events()`` plus ``resident()`` inside it form a consistent snapshot."""
        return self._lock

    def resident(self) -> list[tuple[str, list[KVObjectMeta]]]:
        """Every level's name and the metas of its committed, unexpired, registered objects
        that no deletion is still removing (a replica a reader pins stays until released:
        announced in a snapshot, the router would route to deleted KV)."""
        with self._lock:
            out = []
            for index, level in enumerate(self.levels):
                metas = [
                    level.tier.meta(key)
                    for key in level.tier.keys()
                    if (index, key) not in self._storing and key not in self._pending_delete
                ]
                out.append((level.name, [meta for meta in metas if meta is not None]))
                self._sync_dropped(level)  # report what expired on sight just now
            return out

    def level_index(self, name: str) -> int:
        for index, level in enumerate(self.levels):
            if level.name == name:
                return index
        raise KeyError(name)

    def set_enabled(
        self,
        name: str,
        enabled: bool,
        *,
        key_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """The rollback switch: a disabled level is neither read nor written; data is kept.
        Audited (``key_id``/``request_id``: who asked, when the caller knows)."""
        with self._lock:
            level = self.levels[self.level_index(name)]
            level.enabled = enabled
            self.metrics.tier_enabled.labels(tier=name).set(1 if enabled else 0)
            self.audit.record(
                Action.TIER_SWITCH,
                "enabled" if enabled else "disabled",
                tier=name,
                key_id=key_id,
                request_id=request_id,
            )

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

    def _proven_for(self, level: Level, key: BlockKey) -> bool:
        if level.config.write_policy is not WritePolicy.SELECTIVE:
            return True
        return self._uses.get(key) >= level.config.selective_min_uses

    def _register(self, index: int, meta: KVObjectMeta, ok: bool, *, cause: str) -> bool:
        """Under the lock: a store's I/O finished; make it visible unless a delete came first."""
        level = self.levels[index]
        key = meta.key
        self._storing.discard((index, key))
        if not ok:
            self.metrics.write_failures.labels(tier=level.name).inc()
            if key in self._pending_delete:
                self._finish_delete(key)
            return False
        if key in self._pending_delete:  # deleted while its bytes were in flight: the delete wins
            self.metrics.rejections.labels(tier=level.name, reason="being_deleted").inc()
            self._finish_delete(key)
            return False
        if level.tier.meta(key) is None:  # expired on sight in between
            self._publish(level)
            return False
        level.policy.on_insert(meta, self.clock())
        self._found_corrupt.discard((level.name, key))  # stored again: an old mark is stale
        self._feed.stored(level.name, meta)
        self.metrics.stores.labels(tier=level.name, cause=cause).inc()
        if cause == PREFETCH:
            self._prefetched[(level.name, key)] = meta.size
            self.metrics.prefetch_bytes.labels(tier=level.name).inc(meta.size)
        self._publish(level)
        return True

    def _remove_victim(self, index: int, key: BlockKey, outcome: str | None) -> bool:
        """Remove ``key`` from a level (False: pinned since the check, or gone); ``outcome``
        names the eviction counted and audited, None for an object a consumer rejected
        (``RejectedObject``: its caller counts it as invalid; one still pinned by another
        reader stays, and its last rejection removes it)."""
        level = self.levels[index]
        meta = level.tier.meta(key)
        try:
            removed = level.tier.remove(key)
        except TierError:
            self.metrics.write_failures.labels(tier=level.name).inc()
            return False
        if removed:  # else pinned since the check, or gone: give up this round
            level.policy.on_remove(key)
            self._gone(level, key)
            if outcome is not None:
                self.metrics.evictions.labels(tier=level.name, outcome=outcome).inc()
                tenant = None if meta is None else meta.tenant
                audit = self.audit
                audit.record(Action.EVICT, outcome, tier=level.name, keys=[key], tenant=tenant)
            self._publish(level)
        return removed

    def _demotion(self, index: int, meta: KVObjectMeta) -> tuple[str, int | None]:
        """The eviction outcome for ``meta`` and the level to copy it to first (if any)."""
        for target in range(index + 1, len(self.levels)):
            level = self.levels[target]
            if not self._accepts(level, meta):
                continue
            if level.tier.contains(meta.key) or (target, meta.key) in self._storing:
                return "already_below", None
            if not self._proven_for(level, meta.key):
                return "dropped_low_value", None
            return "demoted", target
        return "dropped", None

    def _take_hold(self, at: tuple[int, BlockKey], size: int, cap: float | None) -> bool:
        """One more hold on ``at`` (level, key) of ``size`` bytes; False when a first hold
        would take the level's held bytes past ``cap`` (None: no cap; ``TieredStore.hold``)."""
        hold = self._held.get(at)
        if hold is not None:  # held already: no new bytes
            hold.count += 1
            return True
        level = at[0]
        if cap is not None and self._held_bytes[level] + size > cap:
            return False
        self._held[at] = _Hold(1, size)
        self._held_bytes[level] += size
        return True

    def _drop_hold(self, at: tuple[int, BlockKey]) -> None:
        hold = self._held.get(at)
        if hold is None:
            return
        hold.count -= 1
        if hold.count <= 0:
            del self._held[at]
            self._held_bytes[at[0]] -= hold.size

    def _held_anywhere(self, key: BlockKey) -> bool:
        return any(level.tier.meta(key) is not None for level in self.levels)

    def _buried(self, level: Level, meta: KVObjectMeta) -> bool:
        """Does a deletion's tombstone refuse ``meta`` here? (Counted and audited if so.)"""
        if not self.tombstones.covers(meta.key, meta.created_at, self.clock()):
            return False
        self._refused_buried(level, meta)
        return True

    def _refused_buried(self, level: Level, meta: KVObjectMeta) -> None:
        self.metrics.rejections.labels(tier=level.name, reason="tombstoned").inc()
        self.audit.record(
            Action.TOMBSTONE_REFUSED,
            "late_write",
            tenant=meta.tenant,
            tier=level.name,
            keys=[meta.key],
        )

    def _finish_delete(self, key: BlockKey, skip: frozenset[int] = frozenset()) -> list[int]:
        """Remove ``key``'s replicas from every level but ``skip``; the levels it left now.
        What cannot go yet (pinned, in flight, a medium down) keeps the key pending."""
        removed: list[int] = []
        failed = False
        for index, level in enumerate(self.levels):
            if (index, key) in self._storing or index in skip:
                continue  # its completion sees the pending delete and removes it
            known = level.tier.meta(key) if level.tier.evicts_itself else None
            try:
                gone = level.tier.remove(key)
            except TierError:  # a remote medium that is down: the key stays invisible here
                self.metrics.write_failures.labels(tier=level.name).inc()
                failed = True
                continue
            if gone:
                level.policy.on_remove(key)
                self._gone(level, key, None if known is None else known.tenant)
                removed.append(index)
                self._publish(level)
        if failed or any(level.tier.reserved(key) for level in self.levels):
            self._pending_delete.add(key)
        else:
            self._pending_delete.discard(key)
        return removed

    def _forget_if_gone(self, level: Level, key: BlockKey) -> None:
        """A load found no ``key``: forget it unless the tier still holds its record (an
        object that expired while another reader pins it keeps its room until the policy
        evicts it: forgotten now, nothing could ever free that room)."""
        if level.tier.meta(key) is None and not level.tier.reserved(key):
            level.policy.on_remove(key)
            self._publish(level)

    def _sync_dropped(self, level: Level) -> None:
        """Drain what ``level``'s tier dropped on its own.

        Each drop is counted and audited once, under the reason the tier gave for that key: a
        corrupt object as ``kvstrata_tier_invalidated{reason="digest_mismatch"}``, one a
        deletion's tombstone covers as ``{reason="tombstoned"}``, an expiry as an eviction
        (``kvstrata_tier_evictions{outcome="expired"}``: nothing was wrong with it). A corrupt
        key is also kept in ``_found_corrupt`` until its load claims it (``claim_corrupt``):
        any thread holding the lock may drain the tier between a load's read and its check."""
        name = level.name
        for key, tenant in level.tier.take_evicted():  # a shared tier's victims, any writer's
            level.policy.on_remove(key)
            self._gone(level, key, tenant)
            self.metrics.evictions.labels(tier=name, outcome="shared_ledger").inc()
            self.audit.record(Action.EVICT, "shared_ledger", tier=name, keys=[key], tenant=tenant)
        for key, why in level.tier.take_dropped():
            if why == CORRUPT:
                if len(self._found_corrupt) >= _MAX_FOUND_CORRUPT:  # unclaimed: reads by copies
                    self._found_corrupt.clear()
                self._found_corrupt.add((name, key))
                self.metrics.invalid.labels(tier=name, reason=DIGEST_MISMATCH).inc()
                self.audit.record(Action.INVALIDATE, DIGEST_MISMATCH, tier=name, keys=[key])
            elif why == TOMBSTONED:
                self.metrics.invalid.labels(tier=name, reason=TOMBSTONED).inc()
                self.audit.record(Action.INVALIDATE, TOMBSTONED, tier=name, keys=[key])
            else:
                self.metrics.evictions.labels(tier=name, outcome=EXPIRED).inc()
                self.audit.record(Action.EVICT, EXPIRED, tier=name, keys=[key])
            if level.tier.reserved(key):
                continue  # stored again since it was dropped: the policy's entry is live
            level.policy.on_remove(key)
            self._gone(level, key)

    def _claim_corrupt(self, level: Level, key: BlockKey) -> bool:
        """Under the lock, after a read of ``key`` missed: did that read find it corrupt?"""
        self._sync_dropped(level)
        found = (level.name, key) in self._found_corrupt
        self._found_corrupt.discard((level.name, key))
        return found

    def _quota_reject(self, level: Level, meta: KVObjectMeta, reason: str) -> None:
        self.metrics.rejections.labels(tier=level.name, reason="quota").inc()
        self.audit.record(
            Action.QUOTA_REJECT, reason, tier=level.name, keys=[meta.key], tenant=meta.tenant
        )

    def _gone(self, level: Level, key: BlockKey, tenant: str | None = None) -> None:
        """``key`` left ``level``: announce it, and waste a prefetch nobody used."""
        self._feed.removed(level.name, key, tenant)
        wasted = self._prefetched.pop((level.name, key), None)
        if wasted is not None:
            self.metrics.prefetch_wasted_bytes.labels(tier=level.name, reason="removed").inc(wasted)

    def _prefetch_used(self, level: Level, key: BlockKey) -> None:
        """A hit on ``key`` in ``level``: a prefetch of it there (if any) paid off."""
        used = self._prefetched.pop((level.name, key), None)
        if used is not None:
            self.metrics.prefetch_used_bytes.labels(tier=level.name).inc(used)

    def waste_unused_prefetches(self) -> None:
        """Closing: what was prefetched and never used is wasted (takes the lock)."""
        with self._lock:
            for (name, _), size in self._prefetched.items():
                self.metrics.prefetch_wasted_bytes.labels(tier=name, reason="unused_at_close").inc(
                    size
                )
            self._prefetched.clear()

    def _publish(self, level: Level) -> None:
        self._sync_dropped(level)
        self.metrics.bytes.labels(tier=level.name).set(level.tier.used_bytes)
        self.metrics.objects.labels(tier=level.name).set(level.tier.object_count)
        self.metrics.undeletable.labels(tier=level.name).set(level.tier.counters.undeletable)
