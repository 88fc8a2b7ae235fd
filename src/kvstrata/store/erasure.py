"""Deletion in the tiered store: tombstones first, then every replica on every level.

``delete_keys(keys, now)`` runs in three steps, so that no phase does I/O under the store lock
and no replica can come back:

1. locked: each key gets a tombstone (``store.tombstones``), its queued write-back copies are
   dropped and it turns invisible at once (pending delete: lookups, loads and copies skip it,
   a store or copy in flight is removed when it completes instead of becoming visible);
2. unlocked: every tier ``bury``s the tombstones — the disk tier persists them before any
   unlink (its recovery scan removes what they cover after a crash), the remote tier sets them
   on the server, where they refuse other workers' late writes, and erases the objects there;
3. locked: the local replicas are removed; those pinned by a reader (or still in flight) go
   when it finishes — they are reported as ``pending``.

A medium that fails in step 2 is reported in ``unreachable``; its replicas, and any that step 3
could not remove (a medium down, a file that cannot be unlinked), stay invisible here and
are retried when the key is next stored or deleted. ``objects_of(tenant)`` surveys what a deletion
selects from: every level's objects of that tenant (the remote tier asks its server), outside
the store lock. ``delete_selected(selector)`` is survey + ``store.deletion.select`` +
``delete_keys`` for a caller without a device pool of its own (the engine adds its pool's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstrata.identity import BlockKey
from kvstrata.objects.tombstone import ObjectRef, Tombstone
from kvstrata.store.deletion import DeleteReport, DeleteSelector, select
from kvstrata.store.state import StoreCore
from kvstrata.store.writeback import WriteBackQueue
from kvstrata.tiers.base import TierError


@dataclass
class StoreDeletion:
    """What ``delete_keys`` did: replicas removed per level (every level listed), replicas
    that go once their reader or movement finishes, levels whose medium failed."""

    removed: dict[str, int]
    pending: int = 0
    unreachable: list[str] = field(default_factory=list)


@dataclass
class Survey:
    """A tenant's objects on every level (one ref per key), and the levels that failed."""

    refs: list[ObjectRef]
    unreachable: list[str] = field(default_factory=list)


class ErasingCore(StoreCore):
    _writeback: WriteBackQueue  # the write-back queue (``TieredStore`` builds it)

    def objects_of(self, tenant: str) -> Survey:
        """Every object of ``tenant`` on every level, in any state (outside the lock: a
        shared level's survey is I/O)."""
        refs: dict[BlockKey, ObjectRef] = {}
        unreachable: list[str] = []
        for level in self.levels:
            try:
                found = level.tier.objects_of(tenant)
            except TierError:
                self.metrics.write_failures.labels(tier=level.name).inc()
                unreachable.append(level.name)
                continue
            for ref in found:
                old = refs.get(ref.key)
                if old is None or (old.created_at is None and ref.created_at is not None):
                    refs[ref.key] = ref
        return Survey(list(refs.values()), unreachable)

    def delete_keys(self, keys: Sequence[BlockKey], *, now: float | None = None) -> StoreDeletion:
        """Tombstone ``keys`` (deleted at ``now``, the store's clock by default) and remove
        every replica of them from every level (see the module docstring)."""
        deleted_at = self.clock() if now is None else now
        unique = list(dict.fromkeys(keys))
        known: dict[tuple[int, BlockKey], str] = {}
        with self._lock:
            marks: list[Tombstone] = [self.tombstones.add(key, deleted_at) for key in unique]
            for key in unique:
                self._writeback.discard(key)
                self._uses.forget(key)
                self._pending_delete.add(key)
                for index, level in enumerate(self.levels):
                    meta = level.tier.meta(key) if level.tier.evicts_itself else None
                    if meta is not None:
                        known[(index, key)] = meta.tenant
        result = StoreDeletion({level.name: 0 for level in self.levels})
        buried: dict[int, list[tuple[BlockKey, str]]] = {}
        for index, level in enumerate(self.levels):
            try:
                buried[index] = level.tier.bury(marks)
            except TierError:
                self.metrics.write_failures.labels(tier=level.name).inc()
                result.unreachable.append(level.name)
        with self._lock:
            erased = frozenset(i for i in buried if self.levels[i].tier.evicts_itself)
            for index in erased:
                level = self.levels[index]
                for key, tenant in buried[index]:
                    level.policy.on_remove(key)
                    self._gone(level, key, tenant or known.get((index, key)))
                    result.removed[level.name] += 1
                self._publish(level)
            for key in unique:
                for index in self._finish_delete(key, skip=erased):
                    result.removed[self.levels[index].name] += 1
            result.pending = sum(1 for key in unique if key in self._pending_delete)
        return result

    def delete_selected(
        self,
        selector: DeleteSelector,
        *,
        now: float | None = None,
        extra: Iterable[ObjectRef] = (),
    ) -> DeleteReport:
        """Delete what ``selector`` names on every level; ``extra``: refs of another holder
        (a device pool) whose chains the selection follows too."""
        deleted_at = self.clock() if now is None else now
        survey = self.objects_of(selector.tenant)
        keys = select(selector, [*extra, *survey.refs], deleted_at)
        if keys:
            done = self.delete_keys(keys, now=deleted_at)
        else:
            done = StoreDeletion({level.name: 0 for level in self.levels})
        unreachable = list(dict.fromkeys(survey.unreachable + done.unreachable))
        return DeleteReport(dict(done.removed), keys, done.pending, unreachable)
