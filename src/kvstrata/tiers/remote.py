"""Remote tier on Redis/Valkey (one node or a Redis Cluster), shared by every worker.

Object layout: ``remote_format`` (meta and payload under one cluster hash tag).

Two-phase store, as the ``Tier`` contract asks:

- ``prepare_store`` reserves room in the shared ledger (``remote_ledger``: capacity, tenant
  quotas and eviction by value, atomically on the server; it returns the victims, whose keys
  this writer then deletes). Nothing is written to the object keys yet, so a PENDING object
  is invisible to every reader, in this process or another.
- ``complete_store`` checks the digest, commits the ledger entry, then writes meta and payload
  in one ``MULTI``/``EXEC`` transaction: a reader's ``MGET meta payload`` (one command, one
  slot) sees both or neither, never a partial object. A crash between the two steps leaves a
  ledger entry without bytes (a miss for readers, evicted like any other entry), never bytes
  the ledger does not account for. Keys get a server TTL of the object's remaining TTL plus
  ``expiry_grace_s`` as garbage collection; visibility follows ``meta.expires_at()`` and the
  tier's clock.
- ``prepare_load`` is one ``MGET``; the meta checksum, the key, the exact payload length and
  the payload digest are verified on every read (``verify_reads=False`` skips only the
  digest). Garbage, a wrong length or a flipped bit is an INVALID object: its keys and ledger
  entry are deleted, it is counted and reported through ``take_dropped``, and the caller
  recomputes. Hits are booked in the ledger (uses, score) in batches by a background thread,
  so a load costs one round trip.

Local views (``contains``, ``meta``, ``keys``, ``used_bytes``, ``tenant_bytes``, ...) do no
I/O: the store calls them under its lock. They reflect what this process last learned —
metas from its own commits, its loads and ``probe(keys)`` (a pipelined, shard-parallel ``MGET``
of meta keys, which the store runs before a lookup, outside its lock), usage from the ledger's
last reply. Another writer's eviction may therefore make a probed object vanish before it is
loaded: the load misses and the request recomputes, which is the contract (only verified
committed objects are ever served). ``read_ahead(keys)`` fetches the payloads of a planned
promotion the same pipelined way, so a long prefix costs one round trip per shard.

Deletion (``remote_tombstones``): ``bury`` sets a deleted key's tombstones on the server (one
the ledger's ``RESERVE`` checks, one beside the object that writes and reads check), drops its
ledger entry and deletes its keys, so no worker — this one or another — can bring an object
created before the deletion back; ``objects_of`` surveys a tenant's objects on the server.

Eviction is the ledger's (``evicts_itself``): the store never picks victims here. Failures
(timeouts, refused connections, a dead shard) are ``RemoteUnavailable`` inside; the public
calls turn them into misses (loads, probes) or a refused store, count them in ``counters`` and
in ``remote_counters``, and a per-node circuit breaker stops a dead node from costing more
than one timeout per backoff period.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, payload_digest
from kvstrata.objects.tombstone import ObjectRef, Tombstone
from kvstrata.tiers.base import LoadLease, StoreSlot, TierCounters, TierError
from kvstrata.tiers.remote_client import RemoteClient, RemoteConfig, RemoteUnavailable
from kvstrata.tiers.remote_format import (
    data_key,
    decode_meta,
    encode_meta,
    key_of_meta,
    meta_key,
    meta_pattern,
)
from kvstrata.tiers.remote_ledger import (
    COMMIT,
    ERASE,
    REMOVE,
    RESERVE,
    TOUCH,
    USAGE,
    LedgerReply,
    Victim,
)
from kvstrata.tiers.remote_tombstones import (
    ERASE_OBJECT,
    WRITE,
    buried,
    erase_objects,
    survey,
    tomb_key,
    ttl_ms,
)

ValueOf = Callable[[KVObjectMeta], float]
"""Saved prefill seconds per byte of an object: the store's value formula, injected."""

QuotaOf = Callable[[str], "int | None"]

_TOUCH_BATCH = 256
_TOUCH_INTERVAL_S = 0.05


@dataclass
class RemoteCounters:
    """What only a remote medium has: outages, refusals, the breaker, server evictions."""

    errors: dict[str, int] = field(default_factory=dict)  # op → calls that failed
    refused: dict[str, int] = field(default_factory=dict)  # reason → stores refused
    evicted: dict[str, int] = field(default_factory=dict)  # reason → objects this writer evicted
    read_ahead_bytes: int = 0
    read_ahead_unused_bytes: int = 0

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


@dataclass
class _Slot:
    meta: KVObjectMeta
    done: bool = False


@dataclass
class _Lease:
    meta: KVObjectMeta
    done: bool = False


class RemoteTier:
    """A shared Redis/Valkey tier (see the module docstring for layout and contract)."""

    name = "remote"
    evicts_itself = True

    def __init__(
        self,
        config: RemoteConfig,
        capacity_bytes: int,
        *,
        value_of: ValueOf = lambda meta: 0.0,
        quota_of: QuotaOf = lambda tenant: None,
        verify_reads: bool = True,
        clock: Callable[[], float] = time.time,
        client: RemoteClient | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidInput("remote capacity must be positive")
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.verify_reads = verify_reads
        self._value_of = value_of
        self._quota_of = quota_of
        self._clock = clock
        self._client = client if client is not None else RemoteClient(config)
        ns = config.namespace
        self._prefix = f"{{{ns}}}:L:"
        self._ledger_key = self._prefix + "info"
        self._ns = ns
        self._lock = threading.Lock()
        self._known: OrderedDict[BlockKey, KVObjectMeta] = OrderedDict()
        self._pending: dict[BlockKey, KVObjectMeta] = {}
        self._pins: dict[BlockKey, int] = {}
        self._dropped: list[BlockKey] = []
        self._evicted: list[tuple[BlockKey, str]] = []
        # Ledger version at which recent victims left: a commit reply older than that must
        # not make the object visible here again (replies of concurrent calls can cross).
        self._gone_at: OrderedDict[BlockKey, int] = OrderedDict()
        self._ahead: dict[BlockKey, tuple[bytes, bytes]] = {}
        self._ahead_bytes = 0
        self._touches: list[str] = []
        self._used = 0
        self._count = 0
        self._version = -1  # the ledger version the usage figures below come from
        self._by_tenant: dict[str, int] = {}
        self._tenant_version: dict[str, int] = {}
        self._counters = TierCounters()
        self.remote_counters = RemoteCounters()
        self._closed = False
        self._scripts = {
            name: self._client_script(lua)
            for name, lua in (
                ("reserve", RESERVE),
                ("commit", COMMIT),
                ("remove", REMOVE),
                ("touch", TOUCH),
                ("usage", USAGE),
                ("erase", ERASE),
                ("write", WRITE),
                ("erase_object", ERASE_OBJECT),
            )
        }
        self._wake = threading.Event()
        self._toucher: threading.Thread | None = None

    def start(self) -> RemoteTier:
        """Book hits in the ledger from a background thread every 50 ms. Without it they
        are booked inline, one round trip per 256 loads, and at ``close``."""
        if self._toucher is None:
            self._toucher = threading.Thread(
                target=self._touch_loop, name="kvstrata-remote-touch", daemon=True
            )
            self._toucher.start()
        return self

    # ---------------------------------------------------------------- keys
    def meta_key(self, key: BlockKey) -> str:
        return meta_key(self._ns, key)

    def data_key(self, key: BlockKey) -> str:
        return data_key(self._ns, key)

    @property
    def client(self) -> RemoteClient:
        return self._client

    @property
    def ledger_node(self) -> str:
        return self._client.node_of(self._ledger_key)

    # ---------------------------------------------------------------- local views (no I/O)
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def object_count(self) -> int:
        return self._count

    @property
    def counters(self) -> TierCounters:
        return self._counters

    def tenant_bytes(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def contains(self, key: BlockKey) -> bool:
        return self.meta(key) is not None

    def meta(self, key: BlockKey) -> KVObjectMeta | None:
        with self._lock:
            return self._visible(key)

    def keys(self) -> Iterator[BlockKey]:
        """Committed objects this process knows of (its writes, loads and probes)."""
        with self._lock:
            return iter([k for k in list(self._known) if self._visible(k) is not None])

    def evictable(self, key: BlockKey) -> bool:
        with self._lock:
            return self._visible(key) is not None and not self._pins.get(key)

    def reserved(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._pending or bool(self._pins.get(key))

    def take_dropped(self) -> list[BlockKey]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def take_evicted(self) -> list[tuple[BlockKey, str]]:
        """(key, tenant) of the objects the shared ledger evicted to admit this writer's
        objects (by value, quota) or swept as expired, whoever wrote them."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def ping(self) -> None:
        """One round trip to the ledger's node; ``RemoteUnavailable`` when it does not answer."""
        self._client.call(self.ledger_node, lambda conn: conn.ping())

    def breaker_open(self) -> bool:
        return any(b.is_open for b in self._client.breakers().values())

    def _visible(self, key: BlockKey) -> KVObjectMeta | None:
        meta = self._known.get(key)
        if meta is None:
            return None
        if meta.expired(self._clock()):
            del self._known[key]
            self._dropped.append(key)
            return None
        self._known.move_to_end(key)
        return meta

    def _learn(self, meta: KVObjectMeta) -> None:
        self._known[meta.key] = meta
        self._known.move_to_end(meta.key)
        while len(self._known) > self.config.meta_cache_entries:
            self._known.popitem(last=False)

    def _apply(self, reply: LedgerReply) -> None:
        """Take the usage figures of a ledger reply unless a newer one was applied already
        (replies of concurrent calls can arrive out of order). Caller holds ``_lock``."""
        if reply.version >= self._version:
            self._version = reply.version
            self._used, self._count = reply.used, reply.count
        for tenant, used in reply.tenants.items():
            if reply.version >= self._tenant_version.get(tenant, -1):
                self._tenant_version[tenant] = reply.version
                if used > 0:
                    self._by_tenant[tenant] = used
                else:
                    self._by_tenant.pop(tenant, None)

    # ---------------------------------------------------------------- store
    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None:
        self._check_open()
        if meta.size < 0:
            raise InvalidInput(f"negative object size {meta.size}")
        with self._lock:
            if meta.key in self._pending:
                return None
        now = self._clock()
        expires = meta.expires_at()
        quota = self._quota_of(meta.tenant)
        args = [
            self._prefix,
            meta.key.hex(),
            meta.size,
            meta.tenant,
            repr(float(self._value_of(meta))),
            -1 if quota is None else quota,
            self.capacity_bytes,
            repr(now),
            repr(now + self.config.pending_timeout_s),
            -1 if expires is None else repr(expires),
            meta.parent.hex() if meta.parent is not None else "",
            repr(float(meta.created_at)),
        ]
        try:
            reply = self._script("reserve", args)
        except RemoteUnavailable:
            self._count_error("reserve")
            raise
        status = reply.status
        with self._lock:
            self._apply(reply)
            if status == "ok":
                self._pending[meta.key] = meta
        self._delete_victims(reply.victims, reply.version)
        if status != "ok":
            with self._lock:
                self.remote_counters.count(self.remote_counters.refused, status)
                if status == "tombstoned":
                    self._counters.tombstoned += 1
            return None
        return StoreSlot(meta, memoryview(bytearray(meta.size)), _Slot(meta))

    def complete_store(self, slot: StoreSlot, success: bool) -> bool:
        self._claim_slot(slot.token)
        meta = slot.meta
        if not success or payload_digest(slot.buffer) != meta.digest:
            with self._lock:
                self._counters.store_failures += 1
                if success:
                    self._counters.invalidated += 1
            self._release(meta, "cancelled")
            return False
        try:
            reply = self._script("commit", [self._prefix, meta.key.hex(), repr(self._clock())])
        except RemoteUnavailable as exc:
            self._count_error("commit")
            self._release(meta, "commit")
            raise TierError(f"committing {meta.key.hex()} failed: {exc}") from exc
        if reply.status != "ok":  # the reservation went stale (or was deleted) meanwhile
            with self._lock:
                self._pending.pop(meta.key, None)
                self._counters.store_failures += 1
            return False
        try:
            written = self._write_object(meta, slot.buffer)
        except RemoteUnavailable as exc:
            self._count_error("write")
            self._release(meta, "write")
            raise TierError(f"writing {meta.key.hex()} failed: {exc}") from exc
        if not written:  # deleted since its reservation: a tombstone covers it
            with self._lock:
                self._counters.tombstoned += 1
                self.remote_counters.count(self.remote_counters.refused, "tombstoned")
            self._release(meta, "tombstoned")
            return False
        with self._lock:
            self._pending.pop(meta.key, None)
            self._apply(reply)
            if self._gone_at.pop(meta.key, -1) < reply.version:
                self._learn(meta)
            self._counters.stores += 1
        return True

    def _write_object(self, meta: KVObjectMeta, payload: memoryview) -> bool:
        """Meta and payload in one script on the object's slot (readers see both or
        neither); False when the object's tombstone covers it (nothing written)."""
        mkey, dkey = self.meta_key(meta.key), self.data_key(meta.key)
        expires = meta.expires_at()
        ttl = ""
        if expires is not None:
            ttl = str(max(1, int((expires - self._clock() + self.config.expiry_grace_s) * 1000)))
        script = self._scripts["write"]
        keys = [mkey, dkey, tomb_key(self._ns, meta.key)]
        args = [payload, encode_meta(meta), ttl, repr(float(meta.created_at))]

        def write(conn: Any) -> object:
            return script(keys=keys, args=args, client=conn)

        return bool(int(self._client.call(self._client.node_of(mkey), write)))

    def _release(self, meta: KVObjectMeta, why: str) -> None:
        """Forget a reservation (failed or cancelled store); best effort on the server."""
        with self._lock:
            self._pending.pop(meta.key, None)
        try:
            reply = self._script("remove", [self._prefix, repr(self._clock()), meta.key.hex()])
        except RemoteUnavailable:
            self._count_error("release")
            return  # the ledger drops the stale reservation after pending_timeout_s
        with self._lock:
            self._apply(reply)

    # ---------------------------------------------------------------- load
    def probe(self, keys: Sequence[BlockKey]) -> None:
        """Refresh the local metas of ``keys`` with one pipelined ``GET`` per shard."""
        if self._closed or not keys:
            return
        by_name = {self.meta_key(k): k for k in keys}
        replies = self._client.pipelined(
            list(by_name), lambda pipe, name: pipe.mget(name, tomb_key(self._ns, by_name[name]))
        )
        failed = False
        with self._lock:
            for name, reply in replies.items():
                key = by_name[name]
                if isinstance(reply, RemoteUnavailable):
                    failed = True
                    continue
                raw_meta, raw_tomb = reply
                meta = decode_meta(raw_meta, key) if isinstance(raw_meta, bytes) else None
                if meta is None or buried(meta, raw_tomb):
                    self._known.pop(key, None)
                elif not meta.expired(self._clock()):
                    self._learn(meta)
        if failed:
            self._count_error("probe")

    def read_ahead(self, keys: Sequence[BlockKey]) -> None:
        """Fetch the objects of ``keys`` (pipelined, shard-parallel) for the loads to come."""
        if self._closed or not keys:
            return
        budget = self.config.read_ahead_bytes
        by_name = {self.meta_key(k): k for k in keys}
        with self._lock:
            sizes = {n: m.size for n, k in by_name.items() if (m := self._known.get(k))}
        replies = self._client.pipelined(
            list(by_name),
            lambda pipe, name: pipe.mget(
                name, self.data_key(by_name[name]), tomb_key(self._ns, by_name[name])
            ),
            sizes=sizes,
        )
        failed = False
        with self._lock:
            for name, reply in replies.items():
                if isinstance(reply, RemoteUnavailable):
                    failed = True
                    continue
                raw_meta, raw_data, raw_tomb = reply
                if raw_meta is None or raw_data is None or raw_tomb is not None:
                    continue  # a tombstoned key: the load reads it again and decides
                if self._ahead_bytes + len(raw_data) > budget:
                    break
                key = by_name[name]
                if key not in self._ahead:
                    self._ahead[key] = (raw_meta, raw_data)
                    self._ahead_bytes += len(raw_data)
                    self.remote_counters.read_ahead_bytes += len(raw_data)
        if failed:
            self._count_error("read_ahead")

    def discard_read_ahead(self) -> None:
        """Drop what ``read_ahead`` fetched and no load took (counted as unused)."""
        with self._lock:
            self.remote_counters.read_ahead_unused_bytes += self._ahead_bytes
            self._ahead.clear()
            self._ahead_bytes = 0

    def prepare_load(self, key: BlockKey) -> LoadLease | None:
        self._check_open()
        with self._lock:
            known = self._known.get(key)
            if known is not None and known.expired(self._clock()):
                self._visible(key)  # drops it and reports it
                expired = True
            else:
                expired = False
            ahead = self._ahead.pop(key, None)
            if ahead is not None:
                self._ahead_bytes -= len(ahead[1])
        if expired:
            self.refresh_usage()
            with self._lock:
                self._counters.misses += 1
            return None
        if ahead is None:
            try:
                raw_meta, raw_data, raw_tomb = self._client.call(
                    self._client.node_of(self.meta_key(key)),
                    lambda conn: conn.mget(
                        self.meta_key(key), self.data_key(key), tomb_key(self._ns, key)
                    ),
                )
            except RemoteUnavailable:
                self._count_error("load")
                with self._lock:
                    self._counters.misses += 1
                return None
        else:
            (raw_meta, raw_data), raw_tomb = ahead, None
        if raw_meta is None and raw_data is None:
            with self._lock:
                self._known.pop(key, None)
                self._counters.misses += 1
            return None
        meta = decode_meta(raw_meta, key) if isinstance(raw_meta, bytes) else None
        if (
            meta is None
            or not isinstance(raw_data, bytes)
            or len(raw_data) != meta.size
            or (self.verify_reads and payload_digest(raw_data) != meta.digest)
        ):
            self._invalidate(key)
            return None
        if buried(meta, raw_tomb):  # written before a deletion that it survived: never served
            self._invalidate(key, tombstoned=True)
            return None
        if meta.expired(self._clock()):  # the ledger's sweep frees it (and its keys)
            with self._lock:
                self._known.pop(key, None)
                self._counters.misses += 1
            self.refresh_usage()
            return None
        with self._lock:
            self._learn(meta)
            self._pins[key] = self._pins.get(key, 0) + 1
            self._counters.loads += 1
            self._touches.append(key.hex())
            full = len(self._touches) >= _TOUCH_BATCH
        if full:
            if self._toucher is not None:
                self._wake.set()
            else:
                self._flush_touches()
        return LoadLease(meta, memoryview(raw_data), _Lease(meta))

    def complete_load(self, lease: LoadLease) -> None:
        token = lease.token
        if not isinstance(token, _Lease):
            raise TierError("lease does not belong to a remote tier")
        with self._lock:
            if token.done:
                raise TierError("complete_load without a matching prepare_load")
            token.done = True
            key = lease.meta.key
            # The reply's bytes are the lease's alone: free them now, not whenever the
            # caller drops the lease (a MiB-sized buffer kept alive one more load makes the
            # allocator map fresh pages for the next reply; measured ~20% per load).
            with contextlib.suppress(BufferError):  # a caller still exports it: its problem
                lease.buffer.release()
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def _invalidate(self, key: BlockKey, *, tombstoned: bool = False) -> None:
        """A corrupt (or tombstoned) object: delete its keys and ledger entry (best effort),
        report it."""
        with self._lock:
            self._known.pop(key, None)
            if tombstoned:
                self._counters.tombstoned += 1
            else:
                self._counters.invalidated += 1
            self._dropped.append(key)
        if not self._delete_objects([key]):
            self._count_error("invalidate")
        try:
            reply = self._script("remove", [self._prefix, repr(self._clock()), key.hex()])
        except RemoteUnavailable:
            self._count_error("invalidate")
            return
        with self._lock:
            self._apply(reply)

    # ---------------------------------------------------------------- removal
    def remove(self, key: BlockKey) -> bool:
        """Delete ``key`` everywhere in the shared tier (also if another worker wrote it)."""
        self._check_open()
        with self._lock:
            if self._pins.get(key) or key in self._pending:
                return False
            self._known.pop(key, None)
        try:
            reply = self._script("remove", [self._prefix, repr(self._clock()), key.hex()])
        except RemoteUnavailable as exc:
            self._count_error("remove")
            raise TierError(f"removing {key.hex()} failed: {exc}") from exc
        if not self._delete_objects([key]):
            self._count_error("remove")
            raise TierError(f"removing {key.hex()} failed: its shard did not answer")
        present = bool(int(reply.extra[0]))  # type: ignore[call-overload]
        with self._lock:
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
        now = self._clock()
        args: list[Any] = [self._prefix, repr(now)]
        for mark in marks:
            args += [mark.key.hex(), repr(float(mark.deleted_at)), ttl_ms(mark, now)]
        try:
            reply = self._script("erase", args)
        except RemoteUnavailable as exc:
            self._count_error("erase")
            raise TierError(f"erasing {len(marks)} objects failed: {exc}") from exc
        with self._lock:
            self._apply(reply)
            for mark in marks:
                self._known.pop(mark.key, None)
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
            return survey(self._client, self._ns, self._ledger_key, tenant)
        except RemoteUnavailable:
            self._count_error("survey")
            raise

    def recovered_tombstones(self) -> list[Tombstone]:
        return []  # they live on the server, where every worker's calls check them

    def _delete_victims(self, victims: Sequence[Victim], version: int) -> None:
        if not victims:
            return
        keys = [BlockKey(bytes.fromhex(victim.key_hex)) for victim in victims]
        with self._lock:
            for victim, key in zip(victims, keys, strict=True):
                self._known.pop(key, None)
                self._gone_at[key] = version
                if len(self._gone_at) > 4096:
                    self._gone_at.popitem(last=False)
                self._evicted.append((key, victim.tenant))
                self.remote_counters.count(self.remote_counters.evicted, victim.reason)
        if not self._delete_objects(keys):
            self._count_error("evict")  # their server TTL or a later read catches them

    def _delete_objects(self, keys: Sequence[BlockKey]) -> bool:
        """Delete the meta and payload keys of ``keys`` (one pipeline per shard); False when
        a shard did not answer."""
        by_name = {self.meta_key(k): k for k in keys}
        replies = self._client.pipelined(
            list(by_name), lambda pipe, name: pipe.delete(name, self.data_key(by_name[name]))
        )
        return not any(isinstance(r, RemoteUnavailable) for r in replies.values())

    def refresh_usage(self, tenants: Sequence[str] = ()) -> None:
        """Sweep expired objects in the ledger and refresh the usage figures, these
        tenants' bytes included (one call)."""
        try:
            reply = self._script("usage", [self._prefix, repr(self._clock()), *tenants])
        except RemoteUnavailable:
            self._count_error("usage")
            return
        with self._lock:
            self._apply(reply)
        self._delete_victims(reply.victims, reply.version)

    def scan_keys(self) -> list[BlockKey]:
        """Every committed object in the shared tier (a ``SCAN`` of every primary)."""
        out: list[BlockKey] = []
        pattern = meta_pattern(self._ns)
        for node in self._client.nodes():
            names = self._client.call(
                node, lambda conn: list(conn.scan_iter(match=pattern, count=1000))
            )
            out += [key_of_meta(self._ns, _text(name)) for name in names]
        return out

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._toucher is not None:
            self._toucher.join(timeout=2.0)
        else:
            self._flush_touches()
        self._client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("remote tier is closed")

    # ---------------------------------------------------------------- internals
    def _client_script(self, lua: str) -> Any:
        if self._client.single is not None:
            return self._client.single.register_script(lua)
        assert self._client.cluster is not None
        return self._client.cluster.register_script(lua)

    def _script(self, name: str, args: Sequence[Any]) -> LedgerReply:
        script = self._scripts[name]
        node = self.ledger_node
        raw = self._client.call(
            node, lambda conn: script(keys=[self._ledger_key], args=list(args), client=conn)
        )
        return LedgerReply.parse(raw)

    def _touch_loop(self) -> None:
        while not self._closed:
            self._wake.wait(_TOUCH_INTERVAL_S)
            self._wake.clear()
            self._flush_touches()
        self._flush_touches()

    def _flush_touches(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, []
        if not touches:
            return
        try:
            self._script("touch", [self._prefix, repr(self._clock()), *touches])
        except RemoteUnavailable:
            self._count_error("touch")  # hits go unbooked: the objects only age faster

    def flush_touches(self) -> None:
        """Book queued hits in the ledger now (tests, benchmarks)."""
        self._flush_touches()

    def _count_error(self, op: str) -> None:
        with self._lock:
            self.remote_counters.count(self.remote_counters.errors, op)
            if self.breaker_open():  # an outage: the server may have lost anything it held
                self._known.clear()
                self._ahead.clear()
                self._ahead_bytes = 0

    @staticmethod
    def _claim_slot(token: object) -> None:
        if not isinstance(token, _Slot):
            raise TierError("slot does not belong to a remote tier")
        if token.done:
            raise TierError("slot completed twice")
        token.done = True


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
