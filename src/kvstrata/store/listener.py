"""The store's change feed: a listener hears every object that becomes or stops being resident.

Why a protocol here: the engine publishes KV events for its store tiers, but the store must not
import engine code (import-linter). The engine hands the store an object with these two
methods; the store calls them under its own lock, on whichever thread made the change (the
engine's, or the write-back flusher's), so a listener must be thread-safe and must not call
back into the store. Neither method may raise.

Contract:
- ``object_stored(tier, meta)``: ``meta`` just became COMMITTED in level ``tier`` (a put,
  a demotion, a write-through/write-back/selective copy). A re-store of a key the level
  already holds is not reported.
- ``object_removed(tier, key, meta)``: the level no longer holds ``key`` (evicted, demoted,
  deleted, expired or invalidated). ``meta`` is None when the tier dropped the object on its
  own (expiry, digest mismatch) and its meta is gone; a listener that needs the tenant keeps
  its own record.
"""

from __future__ import annotations

from typing import Protocol

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta


class StoreListener(Protocol):
    def object_stored(self, tier: str, meta: KVObjectMeta) -> None: ...

    def object_removed(self, tier: str, key: BlockKey, meta: KVObjectMeta | None) -> None: ...
