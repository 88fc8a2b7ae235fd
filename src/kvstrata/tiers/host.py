"""Host DRAM tier: one preallocated slab of fixed-size slots.

Why a slab: the hot path (demotion from the engine pool, promotion back into it) must not pay a
Python/allocator round trip and page faults per object. The whole capacity is one torch uint8
tensor allocated up front — pinned when CUDA is present so device↔host copies can be DMA'd
asynchronously — and cut into ``slot_bytes`` slots. The store uses one slot size (the model's
block object size); an object must fit into one slot.

Zero copy: ``prepare_store`` hands out a writable memoryview of a free slot and
``prepare_load`` a read-only memoryview of the slot itself; ``tensor(handle)`` gives the same
bytes as a torch view of the slab, so the engine copies straight between its pool and the slab.

Digests are verified at ``complete_store`` and, by default (``verify_reads=True``), again on
every ``prepare_load``: one digest policy for every tier below the device pool. The slab is
process-private and written only through a slot that is invisible until its digest verified,
so a re-check guards against stray writes into the slab (a bug elsewhere in the process) and
DRAM bit rot rather than against other writers; ``verify_reads=False`` trusts committed slots
and saves a full pass over the bytes per load (``kvstrata bench tiers`` reports the cost). A
mismatch on a read invalidates the object: it leaves the index at once, is reported through
``take_dropped``, and its slot is recycled when the last reader that still pins it finishes.

Thread safety: one lock guards the bookkeeping (the store may flush or demote from a background
thread); digests and copies run outside it. A slot is recycled only after its object left the
index, and an object being loaded is pinned, so a slot's bytes never change under a reader —
as long as the reader stops using ``lease.buffer`` at ``complete_load``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, ObjectState, payload_digest
from kvstrata.objects.model import ObjectRecord
from kvstrata.tiers.base import (
    CORRUPT,
    Dropped,
    IndexedTierViews,
    LoadLease,
    StoreSlot,
    TierError,
    TierIndex,
    adopt_meta,
    final_meta_problem,
    slot_digest,
)


@dataclass
class _Handle:
    """Tier-private token of a slot or lease: which record and which slot it refers to."""

    record: ObjectRecord
    slot: int
    done: bool = False


class HostTier(IndexedTierViews):
    """A bounded DRAM tier over a preallocated (pinned when CUDA is present) slab.

    ``capacity_bytes`` is rounded down to a whole number of slots. Byte accounting counts each
    object's ``meta.size`` (not the slot size) so quotas match the other tiers; admission also
    needs a free slot. ``prefault`` touches every page of an unpinned slab up front, so first
    stores pay no page faults (a hidden allocation on the hot path).
    """

    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        pin_memory: bool | None = None,
        prefault: bool = True,
        verify_reads: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise InvalidInput("need slot_bytes > 0 and capacity_bytes >= slot_bytes")
        self.slot_bytes = slot_bytes
        self.verify_reads = verify_reads
        self.slots = capacity_bytes // slot_bytes
        self.capacity_bytes = self.slots * slot_bytes
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        try:
            self.slab: torch.Tensor = torch.empty(
                self.capacity_bytes, dtype=torch.uint8, pin_memory=self.pinned
            )
        except RuntimeError as exc:  # no CUDA driver, or the OS refused to lock the pages
            raise TierError(f"cannot allocate a {self.capacity_bytes}-byte slab: {exc}") from exc
        if prefault and not self.pinned:  # pinning already commits every page
            self.slab.zero_()
        self._view = self.slab.numpy().data
        self._slot_views = [
            self._view[i * slot_bytes : (i + 1) * slot_bytes] for i in range(self.slots)
        ]
        self._slot_tensors = [
            self.slab[i * slot_bytes : (i + 1) * slot_bytes] for i in range(self.slots)
        ]
        # Pop from the end: the lowest slots are reused first, which keeps the slab's hot
        # part small when the tier is mostly empty.
        self._free = list(range(self.slots - 1, -1, -1))
        self._clock = clock
        self._lock = threading.Lock()
        self._index = TierIndex(capacity_bytes=self.capacity_bytes)
        self._dropped: list[Dropped] = []
        self._closed = False

    # ---------------------------------------------------------------- read-only views

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def tensor(self, handle: StoreSlot | LoadLease) -> torch.Tensor:
        """A uint8 torch view of the slab bytes behind a slot or lease (``meta.size`` long).

        Valid as long as the handle is: write into it only through a ``StoreSlot``.
        """
        if not isinstance(handle.token, _Handle):
            raise TierError("handle does not belong to a host tier")
        full = self._slot_tensors[handle.token.slot]
        size = handle.meta.size
        return full if size == self.slot_bytes else full[:size]

    # ---------------------------------------------------------------- store

    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None:
        if meta.size > self.slot_bytes or meta.size < 0:
            raise InvalidInput(f"object of {meta.size} bytes does not fit a {self.slot_bytes} slot")
        with self._lock:
            self._check_open()
            if not self._free:
                return None
            record = self._index.reserve(meta)
            if record is None:
                return None
            slot = self._free.pop()
            record.extra["slot"] = slot
        view = self._slot_views[slot]
        buffer = view if meta.size == self.slot_bytes else view[: meta.size]
        return StoreSlot(meta=meta, buffer=buffer, token=_Handle(record, slot))

    def complete_store(self, slot: StoreSlot, success: bool) -> bool:
        handle = self._claim(slot.token)
        problem = final_meta_problem(handle.record.meta, slot.meta) if success else None
        success = success and problem is None
        verified = success and slot_digest(slot) == slot.meta.digest
        with self._lock:
            key = handle.record.meta.key
            if self._index.records.get(key) is not handle.record:
                raise TierError("slot no longer reserved in this tier")
            if verified:
                adopt_meta(handle.record, slot.meta)
                self._index.commit(key, self._clock())
                return True
            self._index.counters.store_failures += 1
            if success:  # the caller wrote bytes that do not match the digest it announced
                self._index.drop(key, invalid=True)
            else:
                handle.record.transition(ObjectState.INVALID)
                self._index.drop(key)
            self._free.append(handle.slot)
        if problem is not None:
            raise TierError(problem)
        return False

    # ---------------------------------------------------------------- load

    def prepare_load(self, key: BlockKey) -> LoadLease | None:
        record = self._pin_visible(key)
        if record is None:
            return None
        slot = int(record.extra["slot"])
        view = self._slot_views[slot]
        size = record.meta.size
        buffer = (view if size == self.slot_bytes else view[:size]).toreadonly()
        if self.verify_reads and payload_digest(buffer) != record.meta.digest:
            self._invalidate_pinned(key, record, slot)
            return None
        return LoadLease(meta=record.meta, buffer=buffer, token=_Handle(record, slot))

    def complete_load(self, lease: LoadLease) -> None:
        handle = self._claim(lease.token)
        with self._lock:
            self._index.unpin(handle.record)
            self._free_if_orphaned(handle.record)

    def _invalidate_pinned(self, key: BlockKey, record: ObjectRecord, slot: int) -> None:
        """A read found the slot's bytes changed: drop the object now, free the slot later."""
        with self._lock:
            self._index.unpin(record)
            if self._index.records.get(key) is record:
                self._index.drop(key, invalid=True)
                self._dropped.append(Dropped(key, CORRUPT))
                record.extra["free_on_unpin"] = slot
            self._free_if_orphaned(record)

    def _free_if_orphaned(self, record: ObjectRecord) -> None:
        """Recycle the slot of an object invalidated while pinned, once nobody reads it."""
        if record.readers == 0 and "free_on_unpin" in record.extra:
            self._free.append(int(record.extra.pop("free_on_unpin")))

    # ---------------------------------------------------------------- removal

    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            if self._index.removable(key) is None:
                return False
            record = self._index.drop(key)
            assert record is not None
            self._index.counters.removed += 1
            self._free.append(int(record.extra["slot"]))
            return True

    def close(self) -> None:
        """Refuse further stores and loads; the slab is freed with the tier object."""
        with self._lock:
            self._closed = True

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _claim(self, token: Any) -> _Handle:
        if not isinstance(token, _Handle):
            raise TierError("handle does not belong to a host tier")
        if token.done:
            raise TierError("slot or lease completed twice")
        token.done = True
        return token

    def _release_expired(self, key: BlockKey, record: ObjectRecord) -> None:
        self._free.append(int(record.extra["slot"]))

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("host tier is closed")
