"""The remote tier's write path: reservation in the shared ledger, then commit and write.

Two-phase store, as the ``Tier`` contract asks:

- ``prepare_store`` reserves room in the shared ledger (``remote_ledger``: capacity, tenant
  quotas and eviction by value, atomically on the server; it returns the victims, whose keys
  this writer then deletes). Nothing is written to the object keys yet, so a PENDING object
  is invisible to every reader, in this process or another.
- ``complete_store`` checks the digest, commits the ledger entry, then writes meta and payload
  in one ``MULTI``/``EXEC`` transaction: a reader's ``MGET meta payload`` (one command, one
  slot) sees both or neither, never a partial object. A crash between the two steps leaves a
  ledger entry without bytes (a miss for readers), never bytes the ledger does not account
  for; so does an outside ``DEL`` or a server that evicts keys itself. The next store of that
  key finds it ``exists``, checks the object, and drops the entry as ``lost`` once it was
  committed ``pending_timeout_s`` ago (``FORGET_LOST``), then stores it again. Keys get a
  server TTL of the object's remaining TTL plus ``expiry_grace_s`` as garbage collection;
  visibility follows ``meta.expires_at()`` and the tier's clock.

Every reservation has a random owner token: the commit, the release of a failed store and the
check after the write act only on this store's own entry, never on that of a writer that took
the key over after this one stalled past ``pending_timeout_s``. A call that fails may still
have run (a timeout): the reservation's token is kept for the key's next store, which the
ledger then answers as the same reservation; a failed write deletes this commit's bytes before
it releases the entry, and keeps the entry when it cannot (a committed entry without bytes is
reclaimed as ``lost``; bytes without an entry would not be, but for a read: ``remote_read``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.tiers.base import StoreSlot, TierError, final_meta_problem, slot_digest
from kvstrata.tiers.remote_client import RemoteUnavailable
from kvstrata.tiers.remote_format import encode_meta, gen_key
from kvstrata.tiers.remote_ledger import EntryView, LedgerReply, commit_generation
from kvstrata.tiers.remote_ledger_admit import new_owner, reserve_args
from kvstrata.tiers.remote_state import RemoteState
from kvstrata.tiers.remote_tombstones import metas_on_server, tomb_key


@dataclass
class _Slot:
    meta: KVObjectMeta
    owner: str  # the reservation's owner token (``remote_ledger``)
    done: bool = False


class RemoteWrites(RemoteState):
    """``prepare_store`` / ``complete_store`` of ``RemoteTier``."""

    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None:
        self._check_open()
        if meta.size < 0:
            raise InvalidInput(f"negative object size {meta.size}")
        with self._lock:
            if meta.key in self._pending:
                return None
            owner = self._unsure.pop(meta.key, None) or new_owner()
        args = self._reserve_args(meta, self._clock(), owner)
        if args is None:  # refused here, before any I/O (the script refuses it too)
            with self._lock:
                self.remote_counters.count(self.remote_counters.refused, "invalid")
            return None
        try:
            reply = self._reserve(args)
            if reply.status == "exists" and self._lost(meta.key):  # stored, but its bytes
                reply = self._reserve(args)  # are gone: the entry was dropped, store it again
        except RemoteUnavailable:
            self._unsure_of(meta.key, owner)  # it may have run: the next try is the same one
            raise
        status = reply.status
        with self._lock:
            self._apply(reply)
            if status == "ok":
                self._pending[meta.key] = meta
        if status != "ok":
            with self._lock:
                self.remote_counters.count(self.remote_counters.refused, status)
                if status == "tombstoned":
                    self._counters.tombstoned += 1
            return None
        return StoreSlot(meta, memoryview(bytearray(meta.size)), _Slot(meta, owner))

    def complete_store(self, slot: StoreSlot, success: bool) -> bool:
        self._claim_slot(slot.token)
        assert isinstance(slot.token, _Slot)
        reserved, owner = slot.token.meta, slot.token.owner
        problem = final_meta_problem(reserved, slot.meta) if success else None
        if problem is not None:
            self._release(reserved, owner, pending_only=True)
            raise TierError(problem)
        meta = slot.meta if success else reserved  # an abort releases what was reserved
        if not success or slot_digest(slot) != meta.digest:
            with self._lock:
                self._counters.store_failures += 1
                if success:
                    self._counters.invalidated += 1
            self._release(meta, owner, pending_only=True)
            return False
        args = [self._prefix, meta.key.hex(), repr(self._clock()), owner]
        try:
            reply = self._script("commit", args)
        except RemoteUnavailable as exc:
            self._count_error("commit")
            self._unsure_of(meta.key, owner)  # it may have run (no bytes were written)
            self._release(meta, owner, pending_only=False)
            raise TierError(f"committing {meta.key.hex()} failed: {exc}") from exc
        if reply.status != "ok":  # stale (swept, taken over by another writer) or deleted
            with self._lock:
                self._pending.pop(meta.key, None)
                self._counters.store_failures += 1
            return False
        generation = commit_generation(reply)
        try:
            written = self._write_object(meta, slot.buffer, generation)
        except RemoteUnavailable as exc:
            self._count_error("write")
            self._unwrite(meta, owner, generation)
            raise TierError(f"writing {meta.key.hex()} failed: {exc}") from exc
        if not written:  # deleted since its reservation: a tombstone covers it
            with self._lock:
                self._counters.tombstoned += 1
                self.remote_counters.count(self.remote_counters.refused, "tombstoned")
            self._release(meta, owner, pending_only=False)
            return False
        if not self._still_in_ledger(meta.key):  # evicted between its commit and its write
            deleted = self._delete_objects([meta.key], generation)  # ours, no later one
            with self._lock:
                self._pending.pop(meta.key, None)
                self._forget(meta.key)
                self._counters.store_failures += 1
                self.remote_counters.count(self.remote_counters.refused, "evicted_in_flight")
            if not deleted:
                self._count_error("write")  # no entry: a later read deletes them
            return False
        with self._lock:
            self._pending.pop(meta.key, None)
            self._apply(reply)
            if self._gone_at.pop(meta.key, -1) < reply.version:
                self._learn_commit(meta, reply.version)
            self._counters.stores += 1
        return True

    def _adopt(self) -> int:
        """Account again for every object on the server after ``REPAIR`` cleared a ledger
        whose entries were lost (``rebuilt``, ``RemoteState._repair``): each meta's object is
        reserved and committed as a store would be, parents first; one refused (no room,
        quota, a tombstone) or whose meta is garbage is deleted, as it would be unaccounted
        bytes. Another writer may adopt at the same time (then ``exists``). Returns the
        objects adopted. I/O; ``RemoteUnavailable`` stops it half-way (the rest stays
        unaccounted until stored again or its server TTL)."""
        found = metas_on_server(self._client, self._ns)
        with self._lock:
            self.remote_counters.foreign_keys += found.foreign
        if found.garbage:  # unreadable (a reader would invalidate them): nothing to account
            self._delete_objects(found.garbage, None)
        adopted = 0
        for meta in sorted(found.metas, key=lambda m: m.position):
            now = self._clock()
            if meta.expired(now):
                continue  # its server TTL collects it
            owner = new_owner()
            args = self._reserve_args(meta, now, owner)
            reply = None if args is None else self._script("reserve", args)
            if reply is not None and reply.status == "ok":
                reply = self._script("commit", [self._prefix, meta.key.hex(), repr(now), owner])
                adopted += reply.status == "ok"
            elif reply is None or reply.status != "exists":
                self._delete_objects([meta.key], None if reply is None else reply.version)
        return adopted

    def _reserve_args(self, meta: KVObjectMeta, now: float, owner: str) -> list[Any] | None:
        return reserve_args(
            self._prefix,
            meta,
            value=float(self._value_of(meta)),
            quota=self._quota_of(meta.tenant),
            capacity=self.capacity_bytes,
            now=now,
            pending_timeout_s=self.config.pending_timeout_s,
            owner=owner,
        )

    def _reserve(self, args: list[Any]) -> LedgerReply:
        try:
            return self._script("reserve", args)
        except RemoteUnavailable:
            self._count_error("reserve")
            raise

    def _lost(self, key: BlockKey) -> bool:
        """Whether the ledger's committed entry of ``key`` had lost its object (meta or
        payload missing on the server) and was dropped (``FORGET_LOST``). Without this an
        outside ``DEL`` — or a server evicting keys itself — left an entry that kept the key
        from ever being stored again until the ledger's own eviction reached it: a hot
        prefix block missed for good. One round trip to the object's slot, and one to the
        ledger only when something is missing; unknown (a node down) counts as not lost."""
        mkey, dkey = self.meta_key(key), self.data_key(key)
        try:
            present = self._client.call(
                self._client.node_of(mkey), lambda conn: conn.exists(mkey, dkey)
            )
            if int(present) == 2:
                return False
            grace = repr(self.config.pending_timeout_s)
            reply = self._script(
                "forget_lost", [self._prefix, key.hex(), repr(self._clock()), grace]
            )
        except RemoteUnavailable:
            self._count_error("lost_check")
            return False
        with self._lock:
            self._apply(reply)
        return reply.status == "ok" and reply.extra[:1] == [1]

    def _still_in_ledger(self, key: BlockKey) -> bool:
        """Whether a committed ledger entry of ``key`` accounts for the bytes just written.
        Another writer's admission may evict this store's entry between the commit and the
        write (the ledger and the object live on different slots, so no script can do both):
        its victim deletion then ran before the bytes existed. A third writer may have
        reserved the key since; a pending entry (never this store's: it committed) does not
        account for them — should its store fail, they would stay unaccounted. A committed
        one does, whoever's it is: it is later than this store's, and its own write, delete
        or eviction covers this store's older generation. One round trip to the ledger's
        node; unknown (node down) counts as held — if it was not, a later read finds no
        committed entry and deletes the bytes."""
        try:
            raw = self._client.call(
                self.ledger_node, lambda conn: conn.hget(self._ledger_key, key.hex())
            )
        except RemoteUnavailable:
            self._count_error("commit_check")
            return True
        entry = EntryView.parse(raw)
        return entry is not None and entry.state == "C"

    def _write_object(self, meta: KVObjectMeta, payload: memoryview, version: int) -> bool:
        """Meta, payload and generation (``version``: the commit's ledger version) in one
        script on the object's slot (readers see both or neither); False when the object's
        tombstone covers it (nothing written)."""
        mkey, dkey = self.meta_key(meta.key), self.data_key(meta.key)
        expires = meta.expires_at()
        ttl = ""
        if expires is not None:
            ttl = str(max(1, int((expires - self._clock() + self.config.expiry_grace_s) * 1000)))
        script = self._scripts["write"]
        keys = [mkey, dkey, tomb_key(self._ns, meta.key), gen_key(self._ns, meta.key)]
        args = [payload, encode_meta(meta), ttl, repr(float(meta.created_at)), str(version)]

        def write(conn: Any) -> object:
            return script(keys=keys, args=args, client=conn)

        return bool(int(self._client.call(self._client.node_of(mkey), write)))

    def _release(self, meta: KVObjectMeta, owner: str, *, pending_only: bool) -> None:
        """Drop the entry of a failed or cancelled store, if it is still this store's (its
        owner token; still pending unless the store got past its commit); best effort on the
        server — the ledger sweeps a stale reservation after ``pending_timeout_s``."""
        with self._lock:
            self._pending.pop(meta.key, None)
        args = [self._prefix, repr(self._clock()), meta.key.hex(), owner]
        try:
            reply = self._script("release", [*args, "P" if pending_only else ""])
        except RemoteUnavailable:
            self._count_error("release")
            return
        with self._lock:
            self._apply(reply)

    def _unwrite(self, meta: KVObjectMeta, owner: str, generation: int) -> None:
        """After a failed write, which may still land (a timeout is no refusal): delete the
        object's keys of this commit's generation, and release the entry only once they are
        gone. Otherwise the committed entry stays — one that may lack its bytes is dropped
        as ``lost`` (``FORGET_LOST``) or evicted, while bytes no entry accounts for would
        stay on the server; should the write land after the delete, a read deletes them."""
        with self._lock:
            self._pending.pop(meta.key, None)
        self._unsure_of(meta.key, owner)
        if self._delete_objects([meta.key], generation):
            self._release(meta, owner, pending_only=False)

    def _unsure_of(self, key: BlockKey, owner: str) -> None:
        """Keep the owner token of a store that failed in an unknown state for the key's
        next store (it may hold a reservation or a committed entry already)."""
        with self._lock:
            self._unsure[key] = owner
            self._unsure.move_to_end(key)
            if len(self._unsure) > 4096:
                self._unsure.popitem(last=False)

    @staticmethod
    def _claim_slot(token: object) -> None:
        if not isinstance(token, _Slot):
            raise TierError("slot does not belong to a remote tier")
        if token.done:
            raise TierError("slot completed twice")
        token.done = True
