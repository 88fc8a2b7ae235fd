"""The tier interface and the bookkeeping every tier shares.

Primitives and their contracts (checked by ``tests/test_tier_contract.py`` for every tier):

- ``prepare_store(meta) -> StoreSlot | None``: reserve room for one object, which is PENDING
  (invisible to ``contains``/``prepare_load``, not removable by eviction). ``None`` means "no
  room" — an expected outcome; the caller evicts (policy is not the tier's business) and
  retries. Storing a key that is already present returns ``None`` too (objects are immutable).
  Raises ``TierError`` only when the medium fails.
- The caller fills ``slot.buffer`` (``meta.size`` writable bytes) and calls
  ``complete_store(slot, success)``. With ``success=True`` the tier verifies the payload digest
  and makes the object COMMITTED (returns True); on a mismatch or ``success=False`` nothing is
  left behind (returns False). A writer that learns the digest only once the payload is
  whole (a layer-wise transfer) prepares with a provisional digest and, before completing,
  sets ``slot.meta`` to the final meta — same key, size and tenant (``final_meta_problem``, else
  ``TierError`` and the reservation released); the
  host and disk tiers verify against and keep the slot's meta (``adopt_meta``). A writer
  that hashed the payload where it lies, after its last write to ``slot.buffer`` (a
  layer-wise receiver feeds each slice to a running hash as it lands), may hand that digest
  over as ``slot.written_digest``: the tier compares it with the meta's digest instead of
  reading every byte again (``slot_digest``, the one rule every medium uses). Reads still
  verify (``verify_reads``): a writer whose digest lied gets an object that its first read
  finds INVALID and removes — never served.
- ``prepare_load(key) -> LoadLease | None``: a COMMITTED, unexpired, *verified* object, pinned
  until ``complete_load(lease)``; ``None`` on a miss. Every tier re-checks the payload digest
  on every read unless built with ``verify_reads=False`` (one policy for every medium). A
  digest mismatch found while loading marks the object INVALID, removes it (other readers'
  leases stay valid until they complete), reports it through ``take_dropped`` and counts it —
  the caller recomputes. ``prepare_load`` does the medium's I/O; callers (the store) call it
  without holding their own locks.
- ``remove(key) -> bool``: drop a committed object (eviction, demotion, deletion). Returns
  False while the object is being loaded (pinned) or is absent.
- ``contains``, ``meta``, ``keys``, ``used_bytes``, ``object_count``, ``tenant_bytes``,
  ``counters``, ``evictable``, ``reserved``: read-only views; ``take_dropped`` drains the
  keys the tier dropped by itself, each with its reason (``Dropped``: expired, corrupt,
  tombstoned), so that the owner can keep its policy in step and say per key why it went.
- Shared media (the remote tier) add three things, no-ops for the others: ``evicts_itself``
  (True: the tier picks its own victims — other writers share its capacity — so
  ``prepare_store`` returning ``None`` is final and the store's policy never names a victim
  there; ``take_evicted`` drains the keys it evicted, each with the tenant that owned it, so
  the owner can announce the removal of an object another writer stored), ``probe(keys)``
  (refresh the read-only views of ``keys`` from the medium: I/O, called without locks
  before a lookup) and ``read_ahead(keys)`` / ``discard_read_ahead()`` (fetch a planned
  promotion's objects in one batch; drop what no load took).
- Deletion (``kvstrata.objects.tombstone``): ``objects_of(tenant)`` lists a tenant's objects
  in any state (a shared medium asks its server: I/O, call without locks); ``bury(marks)``
  records tombstones on the medium before the store removes the marked objects — a durable
  medium persists them so that its recovery removes (never serves) an object they cover, a
  shared medium stores them on the server, where they refuse other writers' late writes, and
  removes the marked objects there at once (returned with their tenants); a volatile medium
  does nothing. ``recovered_tombstones`` are those a durable medium found at start-up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, ObjectState, payload_digest
from kvstrata.objects.model import ObjectRecord
from kvstrata.objects.tombstone import ObjectRef, Tombstone


class TierError(KvstrataError):
    """The medium failed (I/O error, disk full, corrupt state). Reads of other objects go on."""


EXPIRED: Final = "expired"
CORRUPT: Final = "corrupt"
TOMBSTONED: Final = "tombstoned"


class Dropped(NamedTuple):
    """A key a tier dropped on its own, and why: ``EXPIRED`` (its TTL passed), ``CORRUPT`` (a
    read found its bytes failing verification) or ``TOMBSTONED`` (a deletion covers it)."""

    key: BlockKey
    reason: str


@dataclass
class StoreSlot:
    """A reserved, PENDING object: fill ``buffer`` then ``complete_store``."""

    meta: KVObjectMeta
    buffer: memoryview
    token: object = None  # tier-private (slab slot index, temp file path …)
    written_digest: bytes | None = None
    """The writer's own digest of ``buffer`` after its last write (module docstring)."""


def slot_digest(slot: StoreSlot) -> bytes:
    """What ``complete_store`` compares with ``slot.meta.digest``: the writer's digest of the
    bytes it wrote in place, else one pass over the buffer."""
    written = slot.written_digest
    return written if written is not None else payload_digest(slot.buffer)


@dataclass
class LoadLease:
    """A pinned, verified COMMITTED object; ``buffer`` stays valid until ``complete_load``."""

    meta: KVObjectMeta
    buffer: memoryview
    token: object = None


class Tier(Protocol):
    name: str
    capacity_bytes: int
    evicts_itself: bool

    @property
    def used_bytes(self) -> int: ...

    @property
    def object_count(self) -> int: ...

    @property
    def counters(self) -> TierCounters: ...

    def tenant_bytes(self, tenant: str) -> int: ...

    def take_dropped(self) -> list[Dropped]:
        """Keys the tier dropped on its own since the last call, each with why (``Dropped``)."""
        ...

    def evictable(self, key: BlockKey) -> bool:
        """Committed, unexpired and not pinned: ``remove`` would succeed now."""
        ...

    def reserved(self, key: BlockKey) -> bool:
        """The key occupies room in any state (pending, committed, expired but still pinned)."""
        ...

    def take_evicted(self) -> list[tuple[BlockKey, str]]:
        """(key, tenant) of the objects a tier that ``evicts_itself`` evicted since the last
        call (whoever wrote them: the tier is shared)."""
        ...

    def probe(self, keys: Sequence[BlockKey]) -> None:
        """Make the views of ``keys`` current (I/O; call without holding locks)."""
        ...

    def read_ahead(self, keys: Sequence[BlockKey]) -> None:
        """Fetch these objects in one batch for the ``prepare_load`` calls to come."""
        ...

    def discard_read_ahead(self) -> None:
        """Drop what ``read_ahead`` fetched and no load took."""
        ...

    def objects_of(self, tenant: str) -> list[ObjectRef]:
        """Every object of ``tenant`` the medium holds, in any state (I/O for shared media)."""
        ...

    def bury(self, marks: Sequence[Tombstone]) -> list[tuple[BlockKey, str]]:
        """Record tombstones (see the module docstring); (key, tenant) of the objects a shared
        medium removed at once. Raises ``TierError`` when the medium fails."""
        ...

    def recovered_tombstones(self) -> list[Tombstone]:
        """The live tombstones a durable medium found when it opened."""
        ...

    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None: ...

    def complete_store(self, slot: StoreSlot, success: bool) -> bool: ...

    def prepare_load(self, key: BlockKey) -> LoadLease | None: ...

    def complete_load(self, lease: LoadLease) -> None: ...

    def contains(self, key: BlockKey) -> bool: ...

    def meta(self, key: BlockKey) -> KVObjectMeta | None: ...

    def remove(self, key: BlockKey) -> bool: ...

    def keys(self) -> Iterator[BlockKey]: ...

    def close(self) -> None: ...


def final_meta_problem(reserved: KVObjectMeta, final: KVObjectMeta) -> str | None:
    """Why ``final`` cannot replace the meta a slot was reserved with, or None. Every tier
    asks this first in ``complete_store(slot, True)`` and, on a problem, releases the
    reservation as a cancelled write before raising ``TierError`` (nothing reserved is left
    behind); an abort (``success=False``) releases the reservation whatever the meta says."""
    if final is reserved:
        return None
    if (final.key, final.size, final.tenant) != (reserved.key, reserved.size, reserved.tenant):
        return "a slot's final meta must keep its key, size and tenant"
    return None


def adopt_meta(record: ObjectRecord, final: KVObjectMeta) -> None:
    """Make ``final`` (checked by ``final_meta_problem``) the committed meta of a pending
    record (see ``complete_store``)."""
    record.meta = final


@dataclass
class TierCounters:
    stores: int = 0
    store_failures: int = 0
    loads: int = 0
    misses: int = 0
    invalidated: int = 0
    removed: int = 0
    tombstoned: int = 0  # objects refused or dropped because a deletion's tombstone covers them
    undeletable: int = 0  # files out of the index that the medium would not delete (disk)


@dataclass
class TierIndex:
    """Pure bookkeeping of one tier: records by key, states, pins and byte accounting.

    Used bytes count PENDING reservations too, so admission can never overshoot capacity.
    """

    capacity_bytes: int
    records: dict[BlockKey, ObjectRecord] = field(default_factory=dict)
    used_bytes: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)
    counters: TierCounters = field(default_factory=TierCounters)

    def fits(self, size: int) -> bool:
        return self.used_bytes + size <= self.capacity_bytes

    def reserve(self, meta: KVObjectMeta) -> ObjectRecord | None:
        if meta.key in self.records or not self.fits(meta.size):
            return None
        record = ObjectRecord(meta=meta)
        self.records[meta.key] = record
        self.used_bytes += meta.size
        self.by_tenant[meta.tenant] = self.by_tenant.get(meta.tenant, 0) + meta.size
        return record

    def commit(self, key: BlockKey, now: float) -> None:
        record = self.records[key]
        record.transition(ObjectState.COMMITTED)
        record.last_access = now
        self.counters.stores += 1

    def drop(self, key: BlockKey, *, invalid: bool = False) -> ObjectRecord | None:
        """Forget an object (failed write, eviction, invalidation) and release its bytes."""
        record = self.records.pop(key, None)
        if record is None:
            return None
        if invalid and record.state is not ObjectState.INVALID:
            record.transition(ObjectState.INVALID)
            self.counters.invalidated += 1
        self.used_bytes -= record.meta.size
        remaining = self.by_tenant.get(record.meta.tenant, 0) - record.meta.size
        if remaining:
            self.by_tenant[record.meta.tenant] = remaining
        else:
            self.by_tenant.pop(record.meta.tenant, None)
        return record

    def visible(self, key: BlockKey, now: float) -> ObjectRecord | None:
        """The committed, unexpired record of ``key``; an expired one is dropped on sight."""
        record = self.records.get(key)
        if record is None or record.state is not ObjectState.COMMITTED:
            return None
        if record.meta.expired(now):
            if record.readers == 0:
                record.transition(ObjectState.EXPIRED)
                self.drop(key)
            return None
        return record

    def pin(self, record: ObjectRecord, now: float) -> None:
        record.readers += 1
        record.hits += 1
        record.last_access = now
        self.counters.loads += 1

    def unpin(self, record: ObjectRecord) -> None:
        if record.readers <= 0:
            raise TierError("complete_load without a matching prepare_load")
        record.readers -= 1

    def removable(self, key: BlockKey) -> ObjectRecord | None:
        record = self.records.get(key)
        if record is None or record.state is not ObjectState.COMMITTED or record.readers:
            return None
        return record


class IndexedTierViews:
    """The read-only half of a tier over a ``TierIndex``, shared by every tier.

    A subclass sets ``_index``, ``_lock`` (a lock guarding the index), ``_clock`` and
    ``_dropped`` (a list) and says in ``_release_expired`` how to free the medium of an
    object that expired on sight (a slab slot, a file).
    """

    _index: TierIndex
    _lock: threading.Lock
    _clock: Callable[[], float]
    _dropped: list[Dropped]
    evicts_itself = False  # the store's policy picks this tier's victims

    def take_evicted(self) -> list[tuple[BlockKey, str]]:
        return []

    def probe(self, keys: Sequence[BlockKey]) -> None:
        """Local media: the index is always current."""

    def read_ahead(self, keys: Sequence[BlockKey]) -> None:
        """Local media: a load is as cheap one by one."""

    def discard_read_ahead(self) -> None:
        pass

    def objects_of(self, tenant: str) -> list[ObjectRef]:
        with self._lock:
            return [
                ObjectRef(r.meta.key, r.meta.parent, tenant, r.meta.created_at)
                for r in self._index.records.values()
                if r.meta.tenant == tenant
            ]

    def bury(self, marks: Sequence[Tombstone]) -> list[tuple[BlockKey, str]]:
        """A volatile medium: the store removes the objects, nothing outlives the process."""
        return []

    def recovered_tombstones(self) -> list[Tombstone]:
        return []

    def _release_expired(self, key: BlockKey, record: ObjectRecord) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def _pin_visible(self, key: BlockKey) -> ObjectRecord | None:
        """First half of ``prepare_load``: pin the committed, unexpired record (or count a miss)."""
        with self._lock:
            self._check_open()
            now = self._clock()
            record = self._visible(key, now)
            if record is None:
                self._index.counters.misses += 1
                return None
            self._index.pin(record, now)
            return record

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def object_count(self) -> int:
        return len(self._index.records)

    @property
    def counters(self) -> TierCounters:
        return self._index.counters

    def tenant_bytes(self, tenant: str) -> int:
        return self._index.by_tenant.get(tenant, 0)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return self._visible(key, self._clock()) is not None

    def meta(self, key: BlockKey) -> KVObjectMeta | None:
        with self._lock:
            record = self._visible(key, self._clock())
            return None if record is None else record.meta

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            now = self._clock()
            snapshot = [k for k in list(self._index.records) if self._visible(k, now)]
        return iter(snapshot)

    def evictable(self, key: BlockKey) -> bool:
        with self._lock:
            record = self._visible(key, self._clock())
            return record is not None and record.readers == 0

    def reserved(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._index.records

    def take_dropped(self) -> list[Dropped]:
        """Keys this tier dropped on its own (expired, invalidated) since the last call.

        The store drains this to keep its eviction policy's bookkeeping in step.
        """
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _visible(self, key: BlockKey, now: float) -> ObjectRecord | None:
        """``TierIndex.visible``, releasing the medium of an object it expired on sight."""
        record = self._index.records.get(key)
        visible = self._index.visible(key, now)
        if visible is None and record is not None and key not in self._index.records:
            self._release_expired(key, record)
            self._dropped.append(Dropped(key, EXPIRED))
        return visible
