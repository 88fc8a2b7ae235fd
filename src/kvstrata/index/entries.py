"""The global index's packed entries and its worker slots (``IndexEntries``).

``IndexEntries`` owns the index's mutable state: the dict router hash → packed int (4 bits per
worker slot, one per medium), each worker's slot with its engine hash → router hash map
(``WorkerSlot``), the shared (remote) tier's pseudo-slot with its own map and reference
counts, the approximate mode's predictions, and the lineage and tombstones a deletion uses. It
applies the direct mutations on them: worker registration, epochs and removal, ``store_hashes``
and ``remove_hashes`` (remote blocks go to the shared slot), and the clearing of entry bits
when the last engine hash placing a router hash in a medium goes. Event application and
matching (``core.GlobalIndex``) and deletion (``deletion.IndexDeletions``) build on it.

Not thread-safe: one owner calls every method (see ``GlobalIndex``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstrata.events.schema import BlockHash
from kvstrata.index.matching import BITS_PER_SLOT as _BITS_PER_SLOT
from kvstrata.index.matching import SLOT_MASK as _SLOT_MASK
from kvstrata.index.matching import words_for
from kvstrata.index.model import IndexStats, Medium
from kvstrata.index.table import SYNC_BACKLOG as _SYNC_BACKLOG
from kvstrata.index.table import ProbeTable
from kvstrata.index.tombstones import Lineage, Tombstones


@dataclass
class WorkerSlot:
    """One worker's slot in the packed entries, and what it holds there."""

    worker_id: str
    slot: int
    epoch: int | None = None
    consistent: bool = True
    held: dict[BlockHash, int] = field(default_factory=dict)
    """engine hash → (router hash << 4) | medium bits."""
    per_medium: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    retired_epochs: set[int] = field(default_factory=set)
    """Epochs this worker had before a restart: a late batch from one of them is ignored."""
    applied_seq: int | None = None
    """The last live seq applied from the worker's stream, in ``applied_epoch`` (a dump
    counts as its ``next_seq - 1``); None: unknown. A deletion whose position this has
    reached spares the slot (``IndexDeletions.delete``)."""
    applied_epoch: int | None = None
    second_stream: bool = False
    """Batches of another stream (a vLLM connector's ``lower``) fill this slot too: their
    seqs count elsewhere, so ``applied_seq`` does not tell what the slot reflects."""
    aliases: dict[int, int] = field(default_factory=dict)
    """(router hash << 2) | medium → engine hashes beyond the first that place it there.

    Two engine hashes can name the same router hash on one worker (vLLM's ``cache_salt`` or a
    LoRA changes engine hashes, not tokens); the entry bit must outlive the first removal.
    """


class IndexEntries:
    """The packed entries, worker slots and shared slot of a ``GlobalIndex``."""

    def __init__(self, *, tombstone_ttl_s: float, clock: Callable[[], float]) -> None:
        self.stats = IndexStats()
        self._clock = clock
        self._entries: dict[int, int] = {}
        self._table = ProbeTable()  # the lookup's numpy mirror: every write here marks it
        self._sync_deferred = False
        """Set while a dump is applied: it syncs once at its end (nobody looks up meanwhile:
        the caller holds the lock throughout)."""
        self._workers: dict[str, WorkerSlot] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._approx: dict[int, dict[int, float]] = {}
        self._approx_writes = 0
        self._shared_slot: int | None = None  # the shared (remote) tier's pseudo-slot
        self._shared_held: dict[BlockHash, int] = {}  # engine hash → router hash
        self._shared_refs: dict[int, int] = {}  # router hash → engine hashes placing it
        self._blind: set[str] = set()  # workers that cannot reach the shared tier
        # Deletions (``delete``, ``index.tombstones``): what events placed, what was deleted.
        self._lineage = Lineage()
        self._deleted_engine: Tombstones[BlockHash] = Tombstones(tombstone_ttl_s)
        self._deleted_router: Tombstones[int] = Tombstones(tombstone_ttl_s)

    # ---------------------------------------------------------------- workers
    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def add_worker(self, worker_id: str, epoch: int | None = None) -> None:
        """Register a worker (idempotent); a different epoch drops what it held."""
        worker = self._workers.get(worker_id)
        if worker is None:
            slot = self._free_slots.pop() if self._free_slots else self._take_slot()
            self._workers[worker_id] = WorkerSlot(worker_id, slot, epoch)
        elif epoch is not None and worker.epoch is not None and epoch != worker.epoch:
            self._new_epoch(worker, epoch)
        elif worker.epoch is None:
            worker.epoch = epoch

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def set_shared_access(self, worker_id: str, reaches: bool) -> None:
        """Does ``worker_id`` reach the shared (remote) tier? (Default: yes.)"""
        if reaches:
            self._blind.discard(worker_id)
        else:
            self._blind.add(worker_id)

    def remove_worker(self, worker_id: str) -> int:
        """Forget a worker (dead or drained): drop its entries (not the shared tier's, which
        outlive it); returns how many."""
        worker = self._workers.pop(worker_id, None)
        self._blind.discard(worker_id)
        if worker is None:
            return 0
        dropped = self._drop_entries(worker)
        self._drop_predictions(worker.slot)
        self._free_slots.append(worker.slot)
        return dropped

    def epoch(self, worker_id: str) -> int | None:
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.epoch

    def is_consistent(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.consistent

    def mark_inconsistent(self, worker_id: str) -> None:
        """The worker's stream lost events: stop trusting its entries until a resync."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.consistent:
            worker.consistent = False
            self.stats.inconsistent_marks += 1

    def blocks_held(self, worker_id: str) -> tuple[int, int, int, int]:
        worker = self._workers.get(worker_id)
        if worker is None:
            return (0, 0, 0, 0)
        a, b, c, d = worker.per_medium
        return (a, b, c, d)

    def shared_blocks(self) -> int:
        """Blocks in the shared (remote) tier, as announced by any worker."""
        return len(self._shared_held)

    def __len__(self) -> int:
        """Distinct router hashes held by any worker or the shared tier (exact entries)."""
        return len(self._entries)

    def _new_epoch(self, worker: WorkerSlot, epoch: int) -> None:
        """An engine restart: everything the old incarnation reported is stale."""
        self.stats.epoch_changes += 1
        self.stats.stale_entries_dropped += self._drop_entries(worker)
        if worker.epoch is not None:
            worker.retired_epochs.add(worker.epoch)
        worker.epoch = epoch
        worker.consistent = True
        worker.applied_seq = None

    # ---------------------------------------------------------------- direct API
    def store_hashes(
        self,
        worker_id: str,
        router_hashes: Sequence[int],
        medium: Medium,
        *,
        engine_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """Record blocks by router hash; the simulator calls this directly (engine = router).
        Remote blocks go to the shared tier (see the module docstring)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            self.add_worker(worker_id)
            worker = self._workers[worker_id]
        keys: Sequence[BlockHash] = router_hashes if engine_hashes is None else engine_hashes
        if medium is Medium.REMOTE:
            self._store_shared(keys, router_hashes)
            return
        medium_bit = 1 << medium
        entry_bit = medium_bit << (worker.slot * _BITS_PER_SLOT)
        entries = self._entries
        entries_get = entries.get
        held = worker.held
        held_get = held.get
        placed = 0
        for engine_hash, router_hash in zip(keys, router_hashes, strict=True):
            packed = held_get(engine_hash)
            if packed is None:
                held[engine_hash] = (router_hash << _BITS_PER_SLOT) | medium_bit
            elif packed >> _BITS_PER_SLOT != router_hash:
                # The engine reused a hash for other content: forget the old placement.
                self._forget(worker, engine_hash, packed)
                held[engine_hash] = (router_hash << _BITS_PER_SLOT) | medium_bit
            elif packed & medium_bit:
                self.stats.duplicate_stores += 1
                continue
            else:
                held[engine_hash] = packed | medium_bit
            value = entries_get(router_hash, 0)
            if value & entry_bit:
                alias = (router_hash << 2) | medium
                worker.aliases[alias] = worker.aliases.get(alias, 0) + 1
            else:
                entries[router_hash] = value | entry_bit
            placed += 1
        if placed:
            self._table.mark_many(router_hashes)
        worker.per_medium[medium] += placed
        self.stats.blocks_stored += placed
        self._sync_backlog()

    def remove_hashes(
        self, worker_id: str, engine_hashes: Sequence[BlockHash], medium: Medium
    ) -> None:
        if medium is Medium.REMOTE:  # whoever announced it: the object is gone for everyone
            self._remove_shared(engine_hashes)
            return
        worker = self._workers.get(worker_id)
        if worker is None:
            self.stats.unknown_removals += len(engine_hashes)
            return
        medium_bit = 1 << medium
        entry_bit = medium_bit << (worker.slot * _BITS_PER_SLOT)
        for engine_hash in engine_hashes:
            packed = worker.held.get(engine_hash)
            if packed is None or not packed & medium_bit:
                self.stats.unknown_removals += 1
                continue
            router_hash = packed >> _BITS_PER_SLOT
            remaining = packed & ~medium_bit
            if remaining & _SLOT_MASK:
                worker.held[engine_hash] = remaining
            else:
                del worker.held[engine_hash]
            self._release(worker, router_hash, medium, entry_bit)
            worker.per_medium[medium] -= 1
            self.stats.blocks_removed += 1
        self._sync_backlog()

    @property
    def table_backlog(self) -> int:
        """Hashes changed since the lookup table's last sync (what the next long lookup syncs)."""
        return self._table.pending

    def sync_table(self) -> bool:
        """Bring the lookup table (``index.table``) up to date with the entries; False when
        the index cannot use it (keys wider than 64 bits)."""
        table = self._table
        table.set_words(words_for(self._next_slot))  # a wider fleet: one word more a value
        table.sync(self._entries)
        return table.usable

    def _sync_backlog(self) -> None:
        """On the event path: sync once many hashes are pending (bounds a lookup's share), and
        whenever the sync could rebuild the table (a growth, a fleet past a multiple of 16
        slots), so a lookup never pays a rebuild."""
        table = self._table
        if self._sync_deferred:
            return
        if (
            table.pending >= _SYNC_BACKLOG
            or table.would_rebuild
            or table.words != words_for(self._next_slot)
        ):
            self.sync_table()

    # ---------------------------------------------------------------- entry bits
    def _store_shared(
        self, engine_hashes: Sequence[BlockHash], router_hashes: Sequence[int]
    ) -> None:
        if self._shared_slot is None:
            self._shared_slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        entry_bit = (1 << Medium.REMOTE) << (self._shared_slot * _BITS_PER_SLOT)
        held, refs, entries = self._shared_held, self._shared_refs, self._entries
        placed = 0
        for engine_hash, router_hash in zip(engine_hashes, router_hashes, strict=True):
            current = held.get(engine_hash)
            if current == router_hash:
                self.stats.duplicate_stores += 1
                continue
            if current is not None:  # the engine hash named other content: forget that one
                self._unref_shared(current, entry_bit)
            held[engine_hash] = router_hash
            count = refs.get(router_hash, 0)
            refs[router_hash] = count + 1
            if not count:
                entries[router_hash] = entries.get(router_hash, 0) | entry_bit
            placed += 1
        if placed:
            self._table.mark_many(router_hashes)
        self.stats.blocks_stored += placed
        self._sync_backlog()

    def _remove_shared(self, engine_hashes: Sequence[BlockHash]) -> None:
        if self._shared_slot is None:
            self.stats.unknown_removals += len(engine_hashes)
            return
        entry_bit = (1 << Medium.REMOTE) << (self._shared_slot * _BITS_PER_SLOT)
        for engine_hash in engine_hashes:
            router_hash = self._shared_held.pop(engine_hash, None)
            if router_hash is None:
                self.stats.unknown_removals += 1
                continue
            self._unref_shared(router_hash, entry_bit)
            self.stats.blocks_removed += 1
        self._sync_backlog()

    def _unref_shared(self, router_hash: int, entry_bit: int) -> None:
        count = self._shared_refs[router_hash] - 1
        if count:
            self._shared_refs[router_hash] = count
            return
        del self._shared_refs[router_hash]
        self._table.mark(router_hash)
        value = self._entries.get(router_hash, 0) & ~entry_bit
        if value:
            self._entries[router_hash] = value
        else:
            self._entries.pop(router_hash, None)
            self._lineage.discard(router_hash)

    def _forget(self, worker: WorkerSlot, engine_hash: BlockHash, packed: int) -> None:
        router_hash = packed >> _BITS_PER_SLOT
        shift = worker.slot * _BITS_PER_SLOT
        for medium in Medium:
            if packed & (1 << medium):
                worker.per_medium[medium] -= 1
                self._release(worker, router_hash, medium, (1 << medium) << shift)
        del worker.held[engine_hash]

    def _release(self, worker: WorkerSlot, router_hash: int, medium: int, entry_bit: int) -> None:
        """An engine hash stopped placing ``router_hash`` in ``medium``: clear if the last."""
        alias = (router_hash << 2) | medium
        others = worker.aliases.get(alias)
        if others:
            if others == 1:
                del worker.aliases[alias]
            else:
                worker.aliases[alias] = others - 1
            return
        self._table.mark(router_hash)
        value = self._entries.get(router_hash, 0) & ~entry_bit
        if value:
            self._entries[router_hash] = value
        else:
            self._entries.pop(router_hash, None)
            self._lineage.discard(router_hash)

    def _drop_entries(self, worker: WorkerSlot) -> int:
        shift = worker.slot * _BITS_PER_SLOT
        keep = ~(_SLOT_MASK << shift)
        entries = self._entries
        mark = self._table.mark
        for packed in worker.held.values():
            router_hash = packed >> _BITS_PER_SLOT
            mark(router_hash)
            value = entries.get(router_hash, 0) & keep
            if value:
                entries[router_hash] = value
            else:
                entries.pop(router_hash, None)
                self._lineage.discard(router_hash)
        dropped = len(worker.held)
        worker.held.clear()
        worker.aliases.clear()
        worker.per_medium = [0, 0, 0, 0]
        self._sync_backlog()
        return dropped

    def _drop_predictions(self, slot: int) -> None:
        for router_hash in list(self._approx):
            holders = self._approx[router_hash]
            holders.pop(slot, None)
            if not holders:
                del self._approx[router_hash]
