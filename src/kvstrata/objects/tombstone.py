"""Tombstones and object references: what a deletion leaves behind and what it selects from.

A ``Tombstone`` says "``key`` was deleted at ``deleted_at``; until ``expires_at``, refuse any
object of that key created at or before ``deleted_at``". Objects created *after* the deletion
(a new request recomputed the prefix) are allowed: deletion removes data, it does not ban a
prompt. Every medium applies the same rule (``covers``): the store's in-memory set, the disk
tier's tombstone file (recovery removes covered objects), the remote tier's server keys.

``ObjectRef`` is what a medium reports about one of a tenant's objects when a deletion selects
what to remove: key, parent (chains are followed to descendants), tenant, and the creation time
when the medium knows it (a remote reservation not yet written does not).
Pure: no I/O, time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.identity import BlockKey


@dataclass(frozen=True)
class Tombstone:
    key: BlockKey
    deleted_at: float
    expires_at: float

    def live(self, now: float) -> bool:
        return now < self.expires_at

    def covers(self, created_at: float, now: float) -> bool:
        """Must an object of this key created at ``created_at`` be refused (or removed)?"""
        return self.live(now) and created_at <= self.deleted_at


@dataclass(frozen=True)
class ObjectRef:
    key: BlockKey
    parent: BlockKey | None
    tenant: str
    created_at: float | None = None
