"""The remote tier's removal, deletion (tombstones) and survey paths.

Deletion (``remote_tombstones``): ``bury`` sets a deleted key's tombstones on the server (one
the ledger's ``RESERVE`` checks, one beside the object that writes and reads check), drops its
ledger entry and deletes its keys, so no worker — this one or another — can bring an object
created before the deletion back; ``objects_of`` surveys a tenant's objects on the server.

``remove`` deletes one key everywhere in the shared tier (whoever wrote it); ``scan_keys``
lists every committed object (a ``SCAN`` of every primary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects.tombstone import ObjectRef, Tombstone
from kvstrata.tiers.base import TierError
from kvstrata.tiers.remote_client import RemoteReplyError, RemoteUnavailable
from kvstrata.tiers.remote_state import RemoteState, wrongtype
from kvstrata.tiers.remote_tombstones import erase_objects, meta_keys, survey, ttl_ms


class RemoteDeletion(RemoteState):
    """``remove``, ``bury``, ``objects_of`` and ``scan_keys`` of ``RemoteTier``."""

    def remove(self, key: BlockKey) -> bool:
        """Delete ``key`` everywhere in the shared tier (also if another worker wrote it)."""
        self._check_open()
        with self._lock:
            if self._pins.get(key) or key in self._pending:
                return False
            self._forget(key)
        try:
            reply = self._script("remove", [self._prefix, repr(self._clock()), "", key.hex()])
        except RemoteUnavailable as exc:
            self._count_error("remove")
            raise TierError(f"removing {key.hex()} failed: {exc}") from exc
        if not self._delete_objects([key], reply.version):
            self._count_error("remove")
            raise TierError(f"removing {key.hex()} failed: its shard did not answer")
        present = bool(int(reply.extra[0]))  # type: ignore[call-overload]
        with self._lock:
            # again: a read may have fetched it while it was being deleted
            self._forget(key, after=reply.version)
            self._apply(reply)
            if present:
                self._counters.removed += 1
        return present

    def bury(self, marks: Sequence[Tombstone]) -> list[tuple[BlockKey, str]]:
        """Tombstone ``marks`` on the server, drop their ledger entries and delete their
        objects, whoever wrote them; (key, tenant) of those whose bytes were there (tenant
        "" when the ledger did not know it). Raises ``TierError`` when the server fails."""
        self._check_open()
        if not marks:
            return []
        for mark in marks:
            if not (math.isfinite(mark.deleted_at) and math.isfinite(mark.expires_at)):
                raise InvalidInput(f"tombstone of {mark.key.hex()} has a non-finite time")
        now = self._clock()
        args: list[Any] = [self._prefix, repr(now)]
        for mark in marks:
            args += [mark.key.hex(), repr(float(mark.deleted_at)), ttl_ms(mark, now)]
        try:
            reply = self._script("erase", args)
        except RemoteUnavailable as exc:
            self._count_error("erase")
            raise TierError(f"erasing {len(marks)} objects failed: {exc}") from exc
        if reply.status != "ok":  # "invalid": refused before any write
            raise TierError(f"erasing {len(marks)} objects refused: {reply.status}")
        with self._lock:
            self._apply(reply)
            for mark in marks:
                self._forget(mark.key)
                ahead = self._ahead.pop(mark.key, None)
                if ahead is not None:
                    self._ahead_bytes -= len(ahead[1])
                self._gone_at[mark.key] = reply.version  # an older commit reply stays unseen
                if len(self._gone_at) > 4096:
                    self._gone_at.popitem(last=False)
        try:
            deleted = erase_objects(
                self._client, self._ns, marks, now, self._scripts["erase_object"]
            )
        except RemoteUnavailable as exc:
            self._count_error("erase")
            raise TierError(f"erasing {len(marks)} objects failed: {exc}") from exc
        tenants = [_text(t) for t in reply.extra]
        present = [
            (mark.key, tenant)
            for mark, tenant in zip(marks, tenants, strict=True)
            if deleted.get(mark.key, 0) > 0
        ]
        with self._lock:
            self._counters.removed += len(present)
        return present

    def objects_of(self, tenant: str) -> list[ObjectRef]:
        """The tenant's objects on the server, pending reservations included (a survey of
        the ledger and of every primary's meta keys: I/O, call without locks)."""
        self._check_open()
        try:
            try:
                found = survey(self._client, self._ns, self._ledger_key, tenant)
            except RemoteReplyError as exc:  # a ledger of the wrong type: repaired, asked again
                if not wrongtype(exc):
                    raise
                self._repair()
                found = survey(self._client, self._ns, self._ledger_key, tenant)
        except RemoteUnavailable:
            self._count_error("survey")
            raise
        with self._lock:
            self.remote_counters.foreign_keys += found.foreign
        return found.refs

    def recovered_tombstones(self) -> list[Tombstone]:
        return []  # they live on the server, where every worker's calls check them

    def scan_keys(self) -> list[BlockKey]:
        """Every committed object in the shared tier (a ``SCAN`` of every primary); keys the
        pattern matches that are no meta key of this tier are skipped (``foreign_keys``)."""
        named, foreign = meta_keys(self._client, self._ns)
        with self._lock:
            self.remote_counters.foreign_keys += foreign
        return list(named.values())


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
