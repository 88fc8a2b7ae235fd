"""Receiving a transfer into a ``TieredStore``'s level through the store's own two-phase path.

``TransferReceiver`` writes into a ``PendingSink`` (``stream.py``): ``prepare_store`` → fill
the slot's buffer → ``complete_store(ok)``. ``StoreIngress`` is that
sink over one level of a ``TieredStore`` (the first: the host tier), so the store stays the
single owner of its bookkeeping: a reservation is the store's admission (quotas, eviction,
demotion, tombstones, a delete in flight wins), the commit is the store's registration (the
change feed, KV events, the policy), and a received block is afterwards an ordinary object of
the store that the next request finds through the normal lookup and promotion path.

A key the level already holds is not written again: ``prepare_store`` hands out a scratch
slot whose completion reports success without touching the store (the block is there).
"""

from __future__ import annotations

from kvstrata.objects import KVObjectMeta
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.base import StoreSlot

_PRESENT = object()  # token of a scratch slot: the level holds the key already


class StoreIngress:
    """A ``PendingSink`` over level ``level`` of ``store`` (see the module docstring)."""

    def __init__(self, store: TieredStore, level: int = 0) -> None:
        self.store = store
        self.level = level
        self.name = store.levels[level].name

    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None:
        slot = self.store.reserve_external(self.level, meta)
        if slot is True:
            return StoreSlot(meta, memoryview(bytearray(meta.size)), _PRESENT)
        if slot is False:
            return None
        assert isinstance(slot, StoreSlot)
        return slot

    def complete_store(self, slot: StoreSlot, success: bool) -> bool:
        if slot.token is _PRESENT:
            return success
        return self.store.complete_external(self.level, slot, success)
