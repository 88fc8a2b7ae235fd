"""The global index: which worker holds which prefix block, in which tier.

Why it is keyed by *router* hashes and not by the engines' own block hashes: a router must
hash every request, and vLLM's sha256 or kvstrata's BLAKE3 keys are several times slower than
the vectorised router hash (:mod:`kvstrata.identity.router_hash`). As Dynamo's indexer does, the
index therefore recomputes its own chained hash from the ``token_ids`` each ``BlockStored``
event carries, continuing the parent's chain (``RouterHasher.extend``), and keeps, per worker,
the mapping engine hash → router hash so that ``BlockRemoved`` (which carries engine hashes
only) can be applied. Router hashes are seeded per namespace root (model fingerprint + tenant
salt), so a tenant's request can never match another tenant's blocks: they hash differently.

Two consistency modes, always visible in :class:`IndexStats` and in metrics:

- ``exact``: built from events. The owner (the fleet's event loop) feeds batches in sequence
  order; a gap the publisher could not replay makes the owner call :meth:`mark_inconsistent`
  (the worker's entries stop counting at once) and then :meth:`replace_worker` with the
  worker's dump. A batch with a new ``epoch`` (engine restart) drops the worker's entries.
- ``approximate``: no events; the router records its own decisions (:meth:`record_route`),
  which expire after a TTL (Dynamo's ``ApproxKvIndexer`` default, 120 s).

Storage: one dict router hash → packed int, 4 bits per worker slot (one bit per medium), so a
lookup is one dict probe per block for all workers at once, and a longest-prefix match over
16 workers is a handful of numpy operations on the probed values. Per worker, engine hash →
router hash; when two engine hashes of one worker name the same router hash (vLLM's
``cache_salt`` changes engine hashes, not tokens) the worker's bit stays set until the last
of them is removed.

The remote tier is shared: every worker of the model reaches the same objects (one Valkey
namespace), so a block announced with ``medium = remote`` is not the announcing worker's.
It goes into a *shared slot* (a pseudo-worker, allocated with the first remote block, never
matched itself) with its own engine hash → router hash map, and:

- every worker that reaches the shared tier (all, unless :meth:`set_shared_access` says
  otherwise — the fleet clears it for workers that report no remote tier) counts a shared
  block as held in its remote tier, so ``match`` splits it as a remote block for each of them;
- it is removed by a remote ``BlockRemoved`` from *any* worker (the store announces the shared
  ledger's victims whoever wrote them), not only from the one that announced it;
- a worker's restart (new epoch), resync, clear or removal leaves shared blocks alone: the
  objects outlive the worker that wrote them. A parent held only there places a child too.

Shared entries are hints like any other: a block the ledger dropped without anyone noticing
(the server lost its data), or one a worker's dump lists after another worker evicted it (a
dump names the remote objects the worker knows of — its writes, loads and probes — and it is
not told of others' evictions), costs a routing mistake, since the worker re-checks its
BLAKE3 keys: its lookup misses and it recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from kvstrata.errors import IdentityError
from kvstrata.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from kvstrata.identity.keys import (
    DEFAULT_TENANT,
    FingerprintDigest,
    NamespaceRoot,
    TenantNamespace,
    namespace_root,
)
from kvstrata.identity.router_hash import RouterHasher, RouterHashes
from kvstrata.index.matching import BITS_PER_SLOT as _BITS_PER_SLOT
from kvstrata.index.matching import SLOT_MASK as _SLOT_MASK
from kvstrata.index.matching import probe as _probe
from kvstrata.index.matching import slot_prefixes as _slot_prefixes
from kvstrata.index.model import (
    MEDIUM_ALIASES,
    ConsistencyMode,
    IndexDeletion,
    IndexStats,
    Medium,
    PrefixMatch,
    parse_medium,
)
from kvstrata.index.tombstones import Lineage, StreamPosition, Tombstones
from kvstrata.security.config import DEFAULT_TOMBSTONE_TTL_S

_NO_TIERS: Final = (0, 0, 0, 0)
__all__ = [
    "MEDIUM_ALIASES",
    "ConsistencyMode",
    "GlobalIndex",
    "IndexDeletion",
    "IndexStats",
    "Medium",
    "PrefixMatch",
    "parse_medium",
]


@dataclass
class _Worker:
    worker_id: str
    slot: int
    epoch: int | None = None
    consistent: bool = True
    held: dict[BlockHash, int] = field(default_factory=dict)
    """engine hash → (router hash << 4) | medium bits."""
    per_medium: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    retired_epochs: set[int] = field(default_factory=set)
    """Epochs this worker had before a restart: a late batch from one of them is ignored."""
    aliases: dict[int, int] = field(default_factory=dict)
    """(router hash << 2) | medium → engine hashes beyond the first that place it there.

    Two engine hashes can name the same router hash on one worker (vLLM's ``cache_salt`` or a
    LoRA changes engine hashes, not tokens); the entry bit must outlive the first removal.
    """


class GlobalIndex:
    """Block → (worker, medium) for one model, with per-worker longest-prefix matching.

    Not thread-safe: one owner (an event loop thread, or the simulator) calls every method.
    """

    def __init__(
        self,
        fingerprint: FingerprintDigest,
        block_size: int,
        *,
        mode: ConsistencyMode = ConsistencyMode.EXACT,
        tenant_secret: bytes = b"",
        approx_ttl_s: float = 120.0,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.mode = mode
        self.approx_ttl_s = approx_ttl_s
        self.stats = IndexStats()
        self._secret = tenant_secret
        self._clock = clock
        self._hashers: dict[str, RouterHasher] = {}
        self._entries: dict[int, int] = {}
        self._workers: dict[str, _Worker] = {}
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

    # ---------------------------------------------------------------- hashing
    def hasher(self, tenant: str | None) -> RouterHasher:
        """The router hasher of a tenant's namespace (kept: it caches its power tables)."""
        name = tenant or DEFAULT_TENANT
        hasher = self._hashers.get(name)
        if hasher is None:
            hasher = RouterHasher.for_root(self.root(name), self.block_size)
            self._hashers[name] = hasher
        return hasher

    def root(self, tenant: str) -> NamespaceRoot:
        return namespace_root(self.fingerprint, TenantNamespace.for_tenant(tenant, self._secret))

    def request_hashes(
        self, tenant: str | None, tokens: Sequence[int] | np.ndarray
    ) -> RouterHashes:
        """Router hashes of a request's full blocks in its tenant's namespace."""
        return self.hasher(tenant).hashes(tokens)

    # ---------------------------------------------------------------- workers
    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def add_worker(self, worker_id: str, epoch: int | None = None) -> None:
        """Register a worker (idempotent); a different epoch drops what it held."""
        worker = self._workers.get(worker_id)
        if worker is None:
            slot = self._free_slots.pop() if self._free_slots else self._take_slot()
            self._workers[worker_id] = _Worker(worker_id, slot, epoch)
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

    def replace_worker(
        self,
        worker_id: str,
        epoch: int | None,
        events: Iterable[KVEvent],
        *,
        ts: float | None = None,
        next_seq: int | None = None,
    ) -> None:
        """Resync: replace everything known about a worker with its dump (consistent with live
        seq ``next_seq``: its blocks are as old as batch ``next_seq - 1``, for tombstones)."""
        self.add_worker(worker_id)
        worker = self._workers[worker_id]
        self.stats.stale_entries_dropped += self._drop_entries(worker)
        if worker.epoch is not None and epoch != worker.epoch:
            worker.retired_epochs.add(worker.epoch)
        worker.epoch = epoch
        worker.consistent = True
        self.stats.resyncs += 1
        seq = None if next_seq is None else next_seq - 1
        for event in events:
            self._apply_event(worker, event, seq)
        if ts is not None:
            self.stats.lag_samples.append(max(0.0, self._clock() - ts))

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

    # ---------------------------------------------------------------- events
    def apply_batch(self, worker_id: str, batch: KVEventBatch, *, seq: int | None = None) -> None:
        """Apply one in-order batch from ``worker_id``'s stream (exact mode); ``seq`` is its
        live sequence number (a deleted block's tombstone refuses batches older than the
        deletion; unknown: refused while a tombstone lives)."""
        self.add_worker(worker_id)
        worker = self._workers[worker_id]
        if batch.epoch is not None and batch.epoch in worker.retired_epochs:
            self.stats.stale_batches += 1  # a late batch of a dead incarnation
            return
        if batch.epoch is not None and worker.epoch != batch.epoch:
            if worker.epoch is not None:
                self._new_epoch(worker, batch.epoch)
            worker.epoch = batch.epoch
        for event in batch.events:
            self._apply_event(worker, event, seq)
        self.stats.batches += 1
        self.stats.lag_samples.append(max(0.0, self._clock() - batch.ts))

    def _new_epoch(self, worker: _Worker, epoch: int) -> None:
        """An engine restart: everything the old incarnation reported is stale."""
        self.stats.epoch_changes += 1
        self.stats.stale_entries_dropped += self._drop_entries(worker)
        if worker.epoch is not None:
            worker.retired_epochs.add(worker.epoch)
        worker.epoch = epoch
        worker.consistent = True

    def _apply_event(self, worker: _Worker, event: KVEvent, seq: int | None) -> None:
        self.stats.events += 1
        if isinstance(event, BlockStored):
            self._stored(worker, event, seq)
        elif isinstance(event, BlockRemoved):
            self._removed(worker, event)
        elif isinstance(event, AllBlocksCleared):
            self.stats.clears += 1
            self._drop_entries(worker)

    def _stored(self, worker: _Worker, event: BlockStored, seq: int | None) -> None:
        medium = parse_medium(event.medium)
        n = len(event.block_hashes)
        if medium is None:
            self.stats.unknown_mediums += 1
            return
        if event.block_size != self.block_size or len(event.token_ids) != n * self.block_size:
            self.stats.bad_events += 1
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            packed = worker.held.get(event.parent_block_hash)
            if packed is not None:
                parent = packed >> _BITS_PER_SLOT
            else:
                parent = self._shared_held.get(event.parent_block_hash)
                if parent is None:
                    self.stats.orphan_blocks += n
                    return
        try:
            router = self.hasher(event.namespace).extend(parent, event.token_ids).tolist()
        except IdentityError:  # token ids no tokenizer produces (outside [0, 2**32))
            self.stats.bad_events += 1
            return
        engine = event.block_hashes
        if len(self._deleted_engine) or len(self._deleted_router):
            kept = self._undeleted(worker, engine, router, seq)
            if kept < n:  # the rest descend from a deleted block: refused with it
                self.stats.tombstone_refusals += n - kept
                engine, router = engine[:kept], router[:kept]
                if not kept:
                    return
        self._lineage.add(event.namespace or DEFAULT_TENANT, parent, router)
        self.store_hashes(worker.worker_id, router, medium, engine_hashes=engine)

    def _undeleted(
        self, worker: _Worker, engine: Sequence[BlockHash], router: Sequence[int], seq: int | None
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

    def _removed(self, worker: _Worker, event: BlockRemoved) -> None:
        medium = parse_medium(event.medium)
        if medium is None:
            self.stats.unknown_mediums += 1
            return
        self.remove_hashes(worker.worker_id, event.block_hashes, medium)

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
        worker.per_medium[medium] += placed
        self.stats.blocks_stored += placed

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

    # ---------------------------------------------------------------- deletion
    def delete(
        self,
        namespace: str,
        *,
        everything: bool = False,
        router_hashes: RouterHashes | Sequence[int] = (),
        engine_hashes: Iterable[BlockHash] = (),
        positions: Mapping[str, StreamPosition] | None = None,
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
        for worker in self._workers.values():
            for engine_hash, packed in list(worker.held.items()):
                if engine_hash in reported or packed >> _BITS_PER_SLOT in targets:
                    removed += (packed & _SLOT_MASK).bit_count()
                    self._forget(worker, engine_hash, packed)
                    deleted.add(engine_hash)
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
            for worker_id, position in (positions or {}).items()
        }
        self._deleted_engine.expire(now)
        self._deleted_router.expire(now)
        self._deleted_engine.add(deleted, bounds, now)
        self._deleted_router.add(targets, bounds, now)
        self.stats.deletions += 1
        self.stats.deleted_entries += removed
        self.stats.blocks_removed += removed
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
        self.stats.blocks_stored += placed

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

    def _unref_shared(self, router_hash: int, entry_bit: int) -> None:
        count = self._shared_refs[router_hash] - 1
        if count:
            self._shared_refs[router_hash] = count
            return
        del self._shared_refs[router_hash]
        value = self._entries.get(router_hash, 0) & ~entry_bit
        if value:
            self._entries[router_hash] = value
        else:
            self._entries.pop(router_hash, None)
            self._lineage.discard(router_hash)

    def _forget(self, worker: _Worker, engine_hash: BlockHash, packed: int) -> None:
        router_hash = packed >> _BITS_PER_SLOT
        shift = worker.slot * _BITS_PER_SLOT
        for medium in Medium:
            if packed & (1 << medium):
                worker.per_medium[medium] -= 1
                self._release(worker, router_hash, medium, (1 << medium) << shift)
        del worker.held[engine_hash]

    def _release(self, worker: _Worker, router_hash: int, medium: int, entry_bit: int) -> None:
        """An engine hash stopped placing ``router_hash`` in ``medium``: clear if the last."""
        alias = (router_hash << 2) | medium
        others = worker.aliases.get(alias)
        if others:
            if others == 1:
                del worker.aliases[alias]
            else:
                worker.aliases[alias] = others - 1
            return
        value = self._entries.get(router_hash, 0) & ~entry_bit
        if value:
            self._entries[router_hash] = value
        else:
            self._entries.pop(router_hash, None)
            self._lineage.discard(router_hash)

    def _drop_entries(self, worker: _Worker) -> int:
        shift = worker.slot * _BITS_PER_SLOT
        keep = ~(_SLOT_MASK << shift)
        entries = self._entries
        for packed in worker.held.values():
            router_hash = packed >> _BITS_PER_SLOT
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
        return dropped

    # ---------------------------------------------------------------- approximate mode
    def record_route(
        self, worker_id: str, router_hashes: Sequence[int], now: float | None = None
    ) -> None:
        """Approximate mode: assume ``worker_id`` will hold these blocks for ``approx_ttl_s``."""
        self.add_worker(worker_id)
        slot = self._workers[worker_id].slot
        expires = (self._clock() if now is None else now) + self.approx_ttl_s
        approx = self._approx
        for router_hash in router_hashes:
            holders = approx.get(router_hash)
            if holders is None:
                approx[router_hash] = {slot: expires}
            else:
                holders[slot] = expires
        self.stats.routes_recorded += 1
        self._approx_writes += len(router_hashes)
        if self._approx_writes > 2 * len(approx) + 4096:
            self.expire_predictions(now)

    def expire_predictions(self, now: float | None = None) -> int:
        """Drop expired predictions (lookups ignore them anyway); returns how many."""
        now = self._clock() if now is None else now
        expired = 0
        for router_hash in list(self._approx):
            holders = self._approx[router_hash]
            for slot in [s for s, t in holders.items() if t <= now]:
                del holders[slot]
                expired += 1
            if not holders:
                del self._approx[router_hash]
        self._approx_writes = 0
        self.stats.predictions_expired += expired
        return expired

    def _drop_predictions(self, slot: int) -> None:
        for router_hash in list(self._approx):
            holders = self._approx[router_hash]
            holders.pop(slot, None)
            if not holders:
                del self._approx[router_hash]

    # ---------------------------------------------------------------- lookup
    def match(
        self, router_hashes: RouterHashes | Sequence[int], *, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Every known worker's longest cached prefix of the request (0 blocks if none).

        Workers marked inconsistent (lost events, resync pending) match nothing: when unsure,
        the router must assume a recompute. Probing stops at the first block no worker holds
        (no prefix can reach past it); the rest is a few numpy passes over the packed values
        for all workers at once (:func:`_slot_prefixes`). Shared-tier blocks count as remote
        blocks of every worker that reaches the shared tier.
        """
        if self.mode is ConsistencyMode.APPROXIMATE:
            return self._match_approx(router_hashes, self._clock() if now is None else now)
        hashes = router_hashes.tolist() if isinstance(router_hashes, np.ndarray) else router_hashes
        values = _probe(self._entries, hashes)
        live = reach = 0
        for worker in self._workers.values():
            if worker.consistent:
                live |= 1 << (worker.slot * _BITS_PER_SLOT)
                if worker.worker_id not in self._blind:
                    reach |= 1 << (worker.slot * _BITS_PER_SLOT)
        shared = self._shared_slot if self._shared_refs else None
        counts = (
            _slot_prefixes(values, self._next_slot, live, shared=shared, reach=reach)
            if values and live
            else None
        )
        result: dict[str, PrefixMatch] = {}
        for worker in self._workers.values():
            if counts is None or not counts[0, worker.slot]:
                result[worker.worker_id] = PrefixMatch(worker.worker_id, 0, _NO_TIERS)
                continue
            depth, device, host, disk = (int(c) for c in counts[:, worker.slot])
            tiers = (device, host, disk, depth - device - host - disk)
            result[worker.worker_id] = PrefixMatch(worker.worker_id, depth, tiers)
        return result

    def _match_approx(
        self, router_hashes: RouterHashes | Sequence[int], now: float
    ) -> dict[str, PrefixMatch]:
        hashes = router_hashes.tolist() if isinstance(router_hashes, np.ndarray) else router_hashes
        depth: dict[int, int] = {}
        live: set[int] | None = None
        for i, router_hash in enumerate(hashes):
            holders = self._approx.get(router_hash)
            current = {s for s, t in holders.items() if t > now} if holders else set()
            live = current if live is None else live & current
            if not live:
                break
            for slot in live:
                depth[slot] = i + 1
        return {
            worker.worker_id: PrefixMatch(
                worker.worker_id,
                depth.get(worker.slot, 0),
                (depth.get(worker.slot, 0), 0, 0, 0),
                predicted=True,
            )
            for worker in self._workers.values()
        }
