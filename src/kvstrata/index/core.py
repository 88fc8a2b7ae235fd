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
16 workers is a handful of numpy operations on the probed values. Requests of at least
``_TABLE_MIN_BLOCKS`` blocks are probed in a numpy mirror of that dict instead
(``index.table.ProbeTable``, one uint64 word a value per 16 slots: the dict stays the source
of truth, every write marks its hash dirty and the mirror is synced before a lookup, or on the
event path once 256 are pending or a rebuild is due), so the probe runs in C rather than once
per block in the interpreter.
Per worker, engine hash → router hash; when two engine hashes of one worker name the same
router hash (vLLM's ``cache_salt`` changes engine hashes, not tokens) the worker's bit stays
set until the last of them is removed.

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

The index's state and its direct mutations live in ``entries`` (``IndexEntries``: worker
slots, packed entries, the shared slot), deletion in ``deletion`` (``IndexDeletions``); this
module adds hashing, event application, approximate mode and matching.
"""

from __future__ import annotations

import array
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import numpy as np

from kvstrata.errors import IdentityError
from kvstrata.events.schema import (
    AllBlocksCleared,
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
from kvstrata.index.deletion import IndexDeletions
from kvstrata.index.entries import WorkerSlot
from kvstrata.index.matching import BITS_PER_SLOT as _BITS_PER_SLOT
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
from kvstrata.security.config import DEFAULT_TOMBSTONE_TTL_S

_NO_TIERS: Final = (0, 0, 0, 0)
_TABLE_MIN_BLOCKS: Final = 512
"""Requests of at least this many blocks probe the numpy table (``index.table``)."""
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


MAX_HASHERS: Final = 4096
"""Namespaces whose router hasher the index keeps (least recently used go first)."""


class GlobalIndex(IndexDeletions):
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
        super().__init__(tombstone_ttl_s=tombstone_ttl_s, clock=clock)
        self.mode = mode
        self.approx_ttl_s = approx_ttl_s
        self._secret = tenant_secret
        self._hashers: dict[str, RouterHasher] = {}

    # ---------------------------------------------------------------- hashing
    def hasher(self, tenant: str | None) -> RouterHasher:
        """The router hasher of a tenant's namespace, kept (it caches its power tables) for
        the ``MAX_HASHERS`` namespaces used last: namespace names come from clients (a
        sub-namespace per conversation), so an unbounded cache would grow without end."""
        name = tenant or DEFAULT_TENANT
        hasher = self._hashers.pop(name, None)
        if hasher is None:
            hasher = RouterHasher.for_root(self.root(name), self.block_size)
            if len(self._hashers) >= MAX_HASHERS:
                del self._hashers[next(iter(self._hashers))]  # the least recently used
        self._hashers[name] = hasher  # (re)inserted last: dicts keep insertion order
        return hasher

    def root(self, tenant: str) -> NamespaceRoot:
        return namespace_root(self.fingerprint, TenantNamespace.for_tenant(tenant, self._secret))

    def request_hashes(
        self, tenant: str | None, tokens: Sequence[int] | np.ndarray
    ) -> RouterHashes:
        """Router hashes of a request's full blocks in its tenant's namespace."""
        return self.hasher(tenant).hashes(tokens)

    # ---------------------------------------------------------------- resync
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
        if epoch is not None:
            # The dump is the worker's word: its epoch is live, even if a stray batch of
            # another epoch had retired it (``EventPlane`` confirms every epoch change here).
            worker.retired_epochs.discard(epoch)
        worker.epoch = epoch
        worker.consistent = True
        self.stats.resyncs += 1
        seq = None if next_seq is None else next_seq - 1
        worker.applied_seq, worker.applied_epoch = seq, epoch
        self._sync_deferred = True  # one sync at the end, not one per 256 hashes
        try:
            for event in events:
                self._apply_event(worker, event, seq)
        finally:
            self._sync_deferred = False
        self._sync_backlog()
        if ts is not None and math.isfinite(ts):  # a NaN or infinite stamp: as in apply_batch
            self.stats.lag_samples.append(max(0.0, self._clock() - ts))

    # ---------------------------------------------------------------- events
    def apply_batch(
        self,
        worker_id: str,
        batch: KVEventBatch,
        *,
        seq: int | None = None,
        second_stream: bool = False,
    ) -> None:
        """Apply one in-order batch from ``worker_id``'s stream (exact mode); ``seq`` is its
        live sequence number (a deleted block's tombstone refuses batches older than the
        deletion; unknown: refused while a tombstone lives). ``second_stream``: a batch of the
        worker's other stream (a vLLM connector's), whose seqs are not the worker's position."""
        self.add_worker(worker_id)
        worker = self._workers[worker_id]
        if len(self._deleted_engine) or len(self._deleted_router):  # oldest first: O(expired)
            now = self._clock()
            self._deleted_engine.expire(now)
            self._deleted_router.expire(now)
        if batch.epoch is not None and batch.epoch in worker.retired_epochs:
            self.stats.stale_batches += 1  # a late batch of a dead incarnation
            return
        if batch.epoch is not None and worker.epoch != batch.epoch:
            if worker.epoch is not None:
                self._new_epoch(worker, batch.epoch)
            worker.epoch = batch.epoch
        for event in batch.events:
            self._apply_event(worker, event, seq)
        if second_stream:
            worker.second_stream = True
        elif seq is not None:
            worker.applied_seq, worker.applied_epoch = seq, worker.epoch
        self.stats.batches += 1
        if math.isfinite(batch.ts):  # a NaN or infinite stamp would poison the quantiles
            self.stats.lag_samples.append(max(0.0, self._clock() - batch.ts))

    def _apply_event(self, worker: WorkerSlot, event: KVEvent, seq: int | None) -> None:
        self.stats.events += 1
        if isinstance(event, BlockStored):
            self._stored(worker, event, seq)
        elif isinstance(event, BlockRemoved):
            self._removed(worker, event)
        elif isinstance(event, AllBlocksCleared):  # vLLM's GPU prefix-cache reset (kvstrata's
            self.stats.clears += 1  # workers never send it): offloaded copies stay
            device_bit = 1 << Medium.DEVICE
            on_device = [h for h, packed in worker.held.items() if packed & device_bit]
            self.remove_hashes(worker.worker_id, on_device, Medium.DEVICE)

    def _stored(self, worker: WorkerSlot, event: BlockStored, seq: int | None) -> None:
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
        namespace = event.namespace
        if namespace is None and parent is not None:  # vLLM salts only a chain's first block
            namespace = self._lineage.namespace_of(parent)
        try:
            router = self.hasher(namespace).extend(parent, event.token_ids).tolist()
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
        self._lineage.add(namespace or DEFAULT_TENANT, parent, router)
        self.store_hashes(worker.worker_id, router, medium, engine_hashes=engine)

    def _removed(self, worker: WorkerSlot, event: BlockRemoved) -> None:
        medium = parse_medium(event.medium)
        if medium is None:  # its store was skipped too: the copies the index knows remain
            self.stats.unknown_mediums += 1
            return
        self.remove_hashes(worker.worker_id, event.block_hashes, medium)

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

    # ---------------------------------------------------------------- lookup
    def _probe_values(
        self, router_hashes: RouterHashes | Sequence[int]
    ) -> list[int] | RouterHashes:
        """The packed values of the request's blocks up to the first block nobody holds: from
        the numpy table for long requests, from the dict for short ones (numpy's per-call
        overhead beats the dict's per-block cost only past ``_TABLE_MIN_BLOCKS``)."""
        if len(router_hashes) >= _TABLE_MIN_BLOCKS and self.sync_table():
            keys: RouterHashes | None
            if isinstance(router_hashes, np.ndarray):
                keys = router_hashes.astype(np.uint64, copy=False)
            else:
                try:
                    keys = np.frombuffer(array.array("Q", router_hashes), dtype=np.uint64)
                except (OverflowError, TypeError):  # not a 64-bit hash: the dict answers
                    keys = None
            if keys is not None:
                return self._table.prefix_values(keys)
        hashes = router_hashes.tolist() if isinstance(router_hashes, np.ndarray) else router_hashes
        return _probe(self._entries, hashes)

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
        values = self._probe_values(router_hashes)
        live = reach = 0
        for worker in self._workers.values():
            if worker.consistent:
                live |= 1 << (worker.slot * _BITS_PER_SLOT)
                if worker.worker_id not in self._blind:
                    reach |= 1 << (worker.slot * _BITS_PER_SLOT)
        shared = self._shared_slot if self._shared_refs else None
        counts = (
            _slot_prefixes(values, self._next_slot, live, shared=shared, reach=reach)
            if len(values) and live
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
