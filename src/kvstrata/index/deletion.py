"""Deletion in the global index: entries leave every slot, tombstones refuse late events.

``IndexDeletions.delete`` removes a namespace's entries (or a prefix's and its descendants',
found through the lineage ``index.tombstones.Lineage``), plus the engine hashes the workers
reported deleting, from every worker slot, the shared slot and the predictions, and
tombstones every removed or reported hash with the workers' stream positions.
``_undeleted`` is the check event application runs on a ``BlockStored`` while a tombstone
lives: a block from before a worker's position (or from a worker with no position) is
refused, and so are its descendants in the event (see ``index.tombstones`` for the rules).

The index side runs once every worker has answered, so a fast worker's stream may already
have brought what followed its deletion: its ``BlockRemoved`` (before its position), then a
fresh ``BlockStored`` of the same prompt (at or after it: a new request recomputed it). A
worker slot whose applied position (``WorkerSlot.applied_seq``, same epoch, consistent, fed
by that one stream) has reached the worker's position already reflects the deletion and
what came after: its entries stay (removing them would lose that fresh store for good: no
later event brings it back); the tombstones are recorded all the same.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from kvstrata.events.schema import BlockHash
from kvstrata.identity.router_hash import RouterHashes
from kvstrata.index.entries import IndexEntries, WorkerSlot
from kvstrata.index.matching import BITS_PER_SLOT as _BITS_PER_SLOT
from kvstrata.index.matching import SLOT_MASK as _SLOT_MASK
from kvstrata.index.model import IndexDeletion, Medium
from kvstrata.index.tombstones import StreamPosition


class IndexDeletions(IndexEntries):
    """``delete`` and the tombstone check of a ``GlobalIndex``."""

    def delete(
        self,
        namespace: str,
        *,
        everything: bool = False,
        router_hashes: RouterHashes | Sequence[int] = (),
        engine_hashes: Iterable[BlockHash] = (),
        positions: Mapping[str, StreamPosition] | None = None,
        unsettled: Collection[str] = (),
        now: float | None = None,
    ) -> IndexDeletion:
        """Remove deleted blocks from every worker slot and the shared tier; tombstone them.

        What goes: every entry of ``namespace`` (``everything``), or the entries of
        ``router_hashes`` (a prompt's) and of their descendants, plus whatever the workers
        reported deleting (``engine_hashes``: their keys' event hashes, which is how an
        ``older_than`` deletion, chosen by age on the workers, reaches the index). Every
        removed or reported hash is tombstoned with the workers' ``positions`` (from their
        delete answers): a later ``BlockStored`` of it from before a worker's position — or
        from a worker with no position — is refused until the tombstone expires.

        A worker whose slot has already applied its stream at or past its position keeps
        its entries (module docstring), unless it is ``unsettled``: its deletion left
        replicas that go later (``pending``) or on a tier it could not reach, so its stream
        at that position does not show the whole deletion yet.

        Cost: one pass over the namespace's lineage and every worker's entries (a deletion
        is rare; matching and events pay nothing while no tombstone lives).
        """
        now = self._clock() if now is None else now
        if isinstance(router_hashes, np.ndarray):
            router_hashes = router_hashes.tolist()
        if everything:
            targets = self._lineage.namespace(namespace)
        else:
            targets = self._lineage.descendants(namespace, router_hashes)
        reported = set(engine_hashes)
        deleted: set[BlockHash] = set(reported)
        removed = 0
        positions = positions or {}
        for worker in self._workers.values():
            caught_up = worker.worker_id not in unsettled and _caught_up(
                worker, positions.get(worker.worker_id)
            )
            for engine_hash, packed in list(worker.held.items()):
                if engine_hash in reported or packed >> _BITS_PER_SLOT in targets:
                    deleted.add(engine_hash)
                    if not caught_up:
                        removed += (packed & _SLOT_MASK).bit_count()
                        self._forget(worker, engine_hash, packed)
        if self._shared_slot is not None:
            entry_bit = (1 << Medium.REMOTE) << (self._shared_slot * _BITS_PER_SLOT)
            for engine_hash, router_hash in list(self._shared_held.items()):
                if engine_hash in reported or router_hash in targets:
                    del self._shared_held[engine_hash]
                    self._unref_shared(router_hash, entry_bit)
                    deleted.add(engine_hash)
                    removed += 1
        for router_hash in targets:
            self._approx.pop(router_hash, None)
        bounds = {
            worker_id: self._with_known_epoch(worker_id, position)
            for worker_id, position in positions.items()
        }
        self._deleted_engine.expire(now)
        self._deleted_router.expire(now)
        self._deleted_engine.add(deleted, bounds, now)
        self._deleted_router.add(targets, bounds, now)
        self.stats.deletions += 1
        self.stats.deleted_entries += removed
        self.stats.blocks_removed += removed
        self._sync_backlog()
        return IndexDeletion(removed, len(deleted) + len(targets))

    def _with_known_epoch(self, worker_id: str, position: StreamPosition) -> StreamPosition:
        """The epoch the index still knows a worker by, if older than the answer's, is
        refused whole: its late batches all predate the deletion."""
        worker = self._workers.get(worker_id)
        known = None if worker is None else worker.epoch
        if known is None or position.epoch is None or known == position.epoch:
            return position
        return StreamPosition(position.epoch, position.next_seq, position.refused_epochs | {known})

    def tombstones(self) -> int:
        """Live tombstones (engine and router hashes), expired ones included until pruned."""
        return len(self._deleted_engine) + len(self._deleted_router)

    def _undeleted(
        self,
        worker: WorkerSlot,
        engine: Sequence[BlockHash],
        router: Sequence[int],
        seq: int | None,
    ) -> int:
        """How many leading blocks of a stored event no tombstone refuses."""
        now = self._clock()
        for i, (engine_hash, router_hash) in enumerate(zip(engine, router, strict=True)):
            for tombstone in (
                self._deleted_engine.get(engine_hash, now),
                self._deleted_router.get(router_hash, now),
            ):
                if tombstone is not None and tombstone.refuses(worker.worker_id, worker.epoch, seq):
                    return i
        return len(engine)


def _caught_up(worker: WorkerSlot, position: StreamPosition | None) -> bool:
    """Has the index applied ``worker``'s stream at or past its deletion's ``position`` (same
    epoch, nothing lost since, no second stream)? Then the slot reflects the deletion and
    what followed it. When unsure, no: its entries go, as they always did."""
    return (
        position is not None
        and position.epoch is not None
        and worker.consistent
        and not worker.second_stream
        and worker.applied_seq is not None
        and worker.applied_epoch == worker.epoch == position.epoch
        and worker.applied_seq >= position.next_seq
    )
