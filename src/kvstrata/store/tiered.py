"""The tiered store: host DRAM, local disk (and later remote) behind one lookup.

The engine's device pool sits above this store: blocks enter the store when the pool writes
them through or evicts them (demotion), and leave it into the pool when a request hits them
(promotion). Inside the store, levels are ordered fastest first. Each level has a tier (bytes),
a policy (which object to evict), and a ``TierConfig`` (write policy, TTL, quotas, rollout).

Metadata is split from movement. The store lock guards bookkeeping only — lookup, policies,
quotas, rollout, use counts, pending deletes, which keys are being stored or demoted, and the
change feed — and is held for short, I/O-free sections. Byte movement (the caller's ``fill``,
``complete_store`` with its digest, write and fsync, ``prepare_load`` with its read and digest,
copies between levels) runs outside it through the tiers' two-phase seam, so a slow medium or
the write-back flusher never stalls lookups, and loads and stores from many threads overlap.
The locked bookkeeping lives in ``store.state.StoreCore``, admission into a level and
eviction in ``store.admission``, deletion in ``store.erasure``; this module adds the public
lookup, load, write and copy paths and the lifecycle.

Invariants kept here:
- lookup is prefix-closed: a block counts only if every ancestor is available in some level;
- only COMMITTED, verified objects of the requesting tenant are ever handed out (tiers verify
  digests; the store re-checks the tenant recorded in the object);
- an object being stored is invisible (to lookup, loads, ``resident`` and eviction) from its
  reservation until the store has registered its commit under the lock, even though the tier
  commits it a moment earlier, outside the lock;
- a delete wins over every movement in flight: its keys turn invisible at once, a store or
  copy that completes later is removed again instead of becoming visible, and replicas pinned
  by readers go when the last reader finishes; its tombstones (``store.erasure``) then refuse
  any object of those keys created before the delete — a late write-back flush, demotion copy
  or prefetch — on every level, and lookups never hand one out;
- admission into a level keeps ``store.admission``'s invariants (tenant quotas are hard limits
  at admission; eviction takes the level policy's leaf victims and demotes them first);
- with ``record_events=True`` every commit into and every removal from a level is appended to
  the change feed (``store.events``) under the lock, in order; ``take_events`` drains it, and
  ``exclusive`` + ``take_events`` + ``resident`` form a consistent snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.security.audit import NULL_AUDIT, AuditLog
from kvstrata.security.config import DEFAULT_TOMBSTONE_TTL_S
from kvstrata.store.admission import AdmittingCore, PayloadFill
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.levels import Located, RejectedObject, RequestScope
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.state import HOLD_SHARE, PREFETCH
from kvstrata.store.writeback import WriteBackQueue
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.base import CORRUPT, LoadLease, Tier

__all__ = ["PayloadFill", "RejectedObject", "RequestScope", "TieredStore"]


_FETCH_EWMA = 0.2  # weight of the newest measurement in a level's fetch-cost estimate


class TieredStore(AdmittingCore):
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
        """``tombstone_ttl_s``: how long a deleted key refuses late writes (``[security]``);
        ``audit``: where refused late writes are recorded."""
        super().__init__(
            levels,
            metrics=metrics,
            clock=clock,
            record_events=record_events,
            tombstone_ttl_s=tombstone_ttl_s,
            audit=audit,
        )
        self._writeback = WriteBackQueue(
            self,
            self.metrics,
            level_names=[level.name for level in self.levels],
            max_bytes=[level.config.write_back_max_bytes for level in self.levels],
        )

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background write-back flusher (only needed with write-back levels)."""
        self._writeback.start()

    def close(self) -> None:
        """Flush every write-back queue, stop the flusher, close the tiers (prefetched objects
        still unused count as wasted)."""
        self._writeback.close()
        self.waste_unused_prefetches()
        for level in self.levels:
            level.tier.close()

    def bytes_at_risk(self, index: int) -> int:
        """Bytes queued for write-back into level ``index`` (lost there on a crash now)."""
        return self._writeback.bytes_at_risk(index)

    def flush(self) -> None:
        self._writeback.drain()

    # ---- lookup and load --------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], scope: RequestScope) -> list[Located]:
        """Longest prefix of ``keys`` available in some active level (fastest level wins).

        When the local levels end short of ``keys`` and a shared level (``evicts_itself``) is
        active, the rest is probed there first, outside the lock (one pipelined round trip):
        other writers add and evict objects there, so its local views are only as fresh as
        the last probe."""
        found, shared = self._lookup_locked(keys, scope, local_only=True)
        if not shared:
            return found
        if len(found) < len(keys):  # what other writers hold (or dropped) is on the server
            for index in shared:
                self.levels[index].tier.probe(keys[len(found) :])
        found, _ = self._lookup_locked(keys, scope, local_only=False)
        return found

    def _lookup_locked(
        self, keys: Sequence[BlockKey], scope: RequestScope, *, local_only: bool
    ) -> tuple[list[Located], list[int]]:
        found: list[Located] = []
        with self._lock:
            active = [i for i, lvl in enumerate(self.levels) if self._active(lvl, scope)]
            shared = [i for i in active if self.levels[i].tier.evicts_itself]
            search = [i for i in active if i not in shared] if local_only else active
            for key in keys:
                hit = self._locate(key, search, scope.tenant)
                if hit is None:
                    break
                found.append(hit)
        return found, shared

    def hold(self, located: Sequence[Located], *, reserve: bool = False) -> list[Located]:
        """Keep objects from being evicted until ``release``; returns the prefix of
        ``located`` held: it ends at the first object gone since the lookup or already picked
        as a victim and being demoted, and, for a ``reserve``, at the level's cap.

        **A load in progress** (``reserve=False``). A promotion loads its plan one object at a
        time, and each load can make room for the next: the engine's pool evicts a block to
        take the loaded one, that block is demoted into this store, and the level, full,
        evicts a leaf — at that moment the plan's own tail. Without a hold a long plan lost
        its tail that way under load and recomputed it (``bench disagg``: 1,488 of 2,047
        transferred tokens found). The engine's admission holds what the store has of its
        prompt for its whole lookup the same way. These holds end with the load, so they are
        not capped: a plan is never cut short by them.

        **A reservation for a request yet to come** (``reserve=True``): a received transfer
        until its request reads it (``serve.transfer_receiver``), what the vLLM scheduler was
        promised until the load (``connectors.vllm_holds``). They can last seconds and pile
        up, so one is refused (counted in ``kvstrata_store_holds_refused``) where it would take
        the level's held bytes, every kind counted, past ``HOLD_SHARE`` of its capacity: its
        later objects are then only unprotected, not lost. Reservations delay eviction; they
        never hold more than that share of a level.

        A hold only keeps the policy from picking the object: a delete, an expiry or a failed
        check still removes it (its hold still counts until released). Holds nest (a count
        per level and key); objects of a level that evicts itself (a shared remote tier)
        cannot be held and are passed through."""
        held: list[Located] = []
        with self._lock:
            for loc in located:
                level = self.levels[loc.level]
                tier = level.tier
                if not tier.evicts_itself:
                    at = (loc.level, loc.key)
                    meta = tier.meta(loc.key)
                    gone = loc.key in self._pending_delete or at in self._moving
                    if gone or meta is None:  # moving: a victim already
                        break
                    cap = HOLD_SHARE * tier.capacity_bytes if reserve else None
                    if not self._take_hold(at, meta.size, cap):
                        self.metrics.holds_refused.labels(tier=level.name).inc()
                        break
                held.append(loc)
        return held

    def hold_prefix(
        self, keys: Sequence[BlockKey], scope: RequestScope, *, reserve: bool = False
    ) -> list[Located]:
        """``hold`` the longest prefix of ``keys`` that the local levels hold, found and held
        in one locked section (no shared level is probed: its objects cannot be held)."""
        with self._lock:
            found, _ = self._lookup_locked(keys, scope, local_only=True)
            return self.hold(found, reserve=reserve)

    def release(self, located: Sequence[Located]) -> None:
        """End the holds ``hold`` returned (each object of its result, once)."""
        with self._lock:
            for loc in located:
                self._drop_hold((loc.level, loc.key))

    def read_ahead(self, located: Sequence[Located]) -> None:
        """Fetch the objects of a planned promotion level by level in one batch each (a
        shared tier pipelines them; local tiers ignore it). Outside the lock.

        The batch's time is shared out over its objects by size and added to each one's load
        time when it is loaded, so a level's measured fetch cost still includes the network."""
        by_level: dict[int, list[Located]] = {}
        for loc in located:
            by_level.setdefault(loc.level, []).append(loc)
        for index, locs in by_level.items():
            tier = self.levels[index].tier
            if not tier.evicts_itself:
                continue  # local media: a load is as cheap one by one
            started = time.perf_counter()
            tier.read_ahead([loc.key for loc in locs])
            per_byte = (time.perf_counter() - started) / max(1, sum(x.meta.size for x in locs))
            with self._lock:
                for loc in locs:
                    self._ahead_s[(index, loc.key)] = per_byte * loc.meta.size

    def discard_read_ahead(self) -> None:
        with self._lock:
            self._ahead_s.clear()
        for level in self.levels:
            level.tier.discard_read_ahead()

    def prefetch(
        self,
        keys: Sequence[BlockKey],
        scope: RequestScope,
        *,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> int:
        """Copy what only a shared level holds of the prefix ``keys`` into the fastest local
        level the request uses, before the request is admitted; the blocks placed there.

        Admission's lookup takes the fastest level, so it then loads them from there. The
        lookup probes the shared level outside the lock, the shared level reads the blocks in
        one pipelined batch, and each is copied through the same two-phase ``_copy`` as a
        write-through (cause ``prefetch``: ``StoreCore`` books its later use or waste). Stops
        at the first block that cannot be placed (admission's prefix ends there too) or once
        ``cancelled()`` (the request was admitted meanwhile). Blocks a local level already
        holds are left alone. What the batch read and no copy took stays in the shared tier's
        read-ahead buffer until the next promotion discards it (counted there as unused);
        this method never discards it, since a promotion may be using it concurrently.
        """
        located = self.lookup(keys, scope)
        with self._lock:
            target = next(
                (
                    i
                    for i, level in enumerate(self.levels)
                    if not level.tier.evicts_itself and self._active(level, scope)
                ),
                None,
            )
        if target is None:
            return 0
        todo = [
            loc
            for loc in located
            if loc.level > target and self.levels[loc.level].tier.evicts_itself
        ]
        by_level: dict[int, list[BlockKey]] = {}
        for loc in todo:
            by_level.setdefault(loc.level, []).append(loc.key)
        for index, level_keys in by_level.items():
            self.levels[index].tier.read_ahead(level_keys)
        placed = 0
        for loc in todo:
            if cancelled() or not self._copy(loc.level, target, loc.key, cause=PREFETCH):
                break
            placed += 1
        return placed

    def _locate(self, key: BlockKey, active: list[int], tenant: str) -> Located | None:
        if key in self._pending_delete:
            return None
        for index in active:
            if (index, key) in self._storing:
                continue
            meta = self.levels[index].tier.meta(key)
            if meta is not None and meta.tenant == tenant:
                if self.tombstones.covers(key, meta.created_at, self.clock()):
                    return None  # outlived its deletion somewhere: never handed out
                return Located(key, index, meta)
        return None

    def estimated_fetch_s(self, located: Sequence[Located]) -> float:
        return sum(loc.meta.size * self.levels[loc.level].fetch_s_per_byte for loc in located)

    @contextmanager
    def load(
        self, located: Located, tenant: str, *, miss: list[str] | None = None
    ) -> Iterator[LoadLease | None]:
        """Pin and yield a verified object (None if it vanished or failed verification).

        The tier's read and digest check run outside the store lock. A hit is booked (policy,
        use counts, fetch cost, selective copies) only when the consumer's body finishes; a
        consumer that raises ``RejectedObject`` has the object removed from its level. On a
        miss, ``miss`` (if given) gets ``"corrupt"`` when this read found the bytes failing
        verification (the tier says so per key), else ``"missing"``."""
        index, key = located.level, located.key
        level = self.levels[index]
        started = time.perf_counter()
        with self._lock:
            hidden = key in self._pending_delete or (index, key) in self._storing
        lease = None if hidden else level.tier.prepare_load(key)
        with self._lock:
            if lease is None:
                corrupt = not hidden and self._claim_corrupt(level, key)
                if miss is not None:
                    miss.append(CORRUPT if corrupt else "missing")
                if not hidden:
                    self._forget_if_gone(level, key)
            elif (
                lease.meta.tenant != tenant
                or key in self._pending_delete
                or (index, key) in self._storing
            ):
                level.tier.complete_load(lease)
                lease = None
                if key in self._pending_delete:
                    self._finish_delete(key)
        if lease is None:
            yield None
            return
        copies: list[int] = []
        outcome = "failed"  # the consumer raised: no hit (nothing was used)
        try:
            yield lease
            outcome = "used"
        except RejectedObject:
            outcome = "rejected"
            raise
        finally:
            with self._lock:
                level.tier.complete_load(lease)
                if key in self._pending_delete:
                    self._finish_delete(key)
                elif outcome == "used":
                    copies = self._record_hit(located, lease.meta, time.perf_counter() - started)
                elif outcome == "rejected":
                    self._remove_victim(index, key, None)  # the consumer counts it
            for target in copies:
                self._copy(index, target, key, cause="selective")

    def _record_hit(self, located: Located, meta: KVObjectMeta, seconds: float) -> list[int]:
        """Book a hit; returns the selective levels below that the object has now earned."""
        level = self.levels[located.level]
        self._uses.add(located.key)
        self._prefetch_used(level, located.key)
        seconds += self._ahead_s.pop((located.level, located.key), 0.0)  # its read-ahead share
        level.policy.on_access(located.key, self.clock())
        self.metrics.hits.labels(tier=level.name).inc()
        self.metrics.fetched_bytes.labels(tier=level.name).inc(meta.size)
        per_byte = seconds / max(meta.size, 1)
        level.fetch_s_per_byte = (
            per_byte
            if level.fetch_s_per_byte == 0.0
            else (1 - _FETCH_EWMA) * level.fetch_s_per_byte + _FETCH_EWMA * per_byte
        )
        targets = []
        for target_index in range(located.level + 1, len(self.levels)):
            target = self.levels[target_index]
            if target.config.write_policy is not WritePolicy.SELECTIVE:
                continue
            if not self._accepts(target, meta) or target.tier.contains(meta.key):
                continue
            if self._proven_for(target, meta.key):
                targets.append(target_index)
        return targets

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
        write policies. Returns whether any level admitted it. ``fill`` runs outside the lock.
        A canary level takes the objects of the requests in its share; an object without a
        request id (a demotion) goes where the rollout targets it, like any background move.
        """
        with self._lock:
            self._uses.add(meta.key, uses)
            eligible = [
                i
                for i, lvl in enumerate(self.levels)
                if (
                    self._active(lvl, scope)
                    if scope is None or scope.request_id is not None
                    else self._accepts(lvl, meta)
                )
                and self._proven_for(lvl, meta.key)
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
                self._copy(first, index, meta.key, cause="write-through")
        return True

    def copy_down(self, source: int, target: int, key: BlockKey, *, cause: str = "copy") -> bool:
        """Copy ``key`` from level ``source`` into the slower level ``target`` (write-back's
        entry point). False, and nothing done, when the source no longer holds it, the target
        refuses it (disabled, out of its rollout target, no room) or it is being deleted."""
        if not 0 <= source < target < len(self.levels):
            raise InvalidInput(f"cannot copy from level {source} down to level {target}")
        with self._lock:
            meta = self.levels[source].tier.meta(key)
            if meta is None or not self._accepts(self.levels[target], meta):
                return False
        return self._copy(source, target, key, cause=cause)

    # ---- deletion ---------------------------------------------------------------------------
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove every replica of ``keys`` from every level, leaving tombstones; returns
        replicas removed now (``delete_keys`` says more, ``store.erasure``).

        A replica pinned by a reader, or a store or copy still in flight, cannot go at once:
        its key becomes invisible to lookup and loads immediately, and the replica is removed
        when the reader finishes or the movement completes (which then never shows it).
        """
        return sum(self.delete_keys(keys).removed.values())
