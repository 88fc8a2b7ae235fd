"""The remote tier's state and the calls every path shares (``RemoteState``).

``RemoteState`` owns what this process knows of the shared tier — the metas it learned, its
pending reservations, pins, read-ahead payloads, queued hits, the usage figures of the
ledger's last reply — and the calls every path of ``RemoteTier`` (``remote``) uses: the
ledger's scripts, ledger replies applied in version order, victims' deletion, the usage
refresh, hit booking and error counting. The read path (``remote_read``), the write path
(``remote_write``) and deletion (``remote_deletion``) are mixins over it.

Local views (``contains``, ``meta``, ``keys``, ``used_bytes``, ``tenant_bytes``, ...) do no
I/O: the store calls them under its lock. They reflect what this process last learned —
metas from its own commits, its loads and ``probe(keys)`` (a pipelined, shard-parallel ``MGET``
of meta keys, which the store runs before a lookup, outside its lock), usage from the ledger's
last reply. Another writer's eviction may therefore make a probed object vanish before it is
loaded: the load misses and the request recomputes, which is the contract (only verified
committed objects are ever served).

Hits are booked in the ledger (uses, score) in batches by a background thread (``start``),
so a load costs one round trip. Failures are counted per operation (``_count_error``); one
counted while a node's breaker is open forgets every meta and read-ahead payload learned (the
server may have lost them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.tiers.base import EXPIRED, Dropped, TierCounters, TierError
from kvstrata.tiers.remote_client import (
    RemoteClient,
    RemoteConfig,
    RemoteReplyError,
    RemoteUnavailable,
)
from kvstrata.tiers.remote_format import data_key, gen_key, key_of_hex, meta_key
from kvstrata.tiers.remote_ledger import (
    COMMIT,
    ERASE,
    FORGET_LOST,
    RELEASE,
    REMOVE,
    REPAIR,
    TOUCH,
    USAGE,
    LedgerReply,
    Victim,
)
from kvstrata.tiers.remote_ledger_admit import RESERVE
from kvstrata.tiers.remote_tombstones import DROP_OBJECT, ERASE_OBJECT, WRITE

ValueOf = Callable[[KVObjectMeta], float]
"""Saved prefill seconds per byte of an object: the store's value formula, injected."""

QuotaOf = Callable[[str], "int | None"]

TOUCH_BATCH = 256
"""Queued hits that wake the background booker (or, without one, are booked inline)."""
_TOUCH_INTERVAL_S = 0.05


_log = logging.getLogger(__name__)


@dataclass
class RemoteCounters:
    """What only a remote medium has: outages, refusals, the breaker, server evictions."""

    errors: dict[str, int] = field(default_factory=dict)  # op → calls that failed
    refused: dict[str, int] = field(default_factory=dict)  # reason → stores refused
    # reason → objects this writer evicted ("corrupt": a ledger entry that was garbage, dropped;
    # "unaccounted": bytes a read found that no committed entry accounts for, deleted)
    evicted: dict[str, int] = field(default_factory=dict)
    foreign_keys: int = 0  # names in the namespace a survey or scan skipped: not the tier's
    read_ahead_bytes: int = 0
    read_ahead_unused_bytes: int = 0
    ledger_repairs: int = 0  # wrong-typed ledger indexes rebuilt (``remote_ledger.REPAIR``)

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


def wrongtype(exc: RemoteReplyError) -> bool:
    """Whether the server refused a call for a key of the wrong type (a ledger index)."""
    return "WRONGTYPE" in str(exc)


class RemoteState:
    """What this process knows of the shared tier, and the calls every path shares."""

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
        # Owner tokens of stores that failed in an unknown state (a reservation or commit that
        # timed out may have run): the next store of the key reuses it (``remote_write``).
        self._unsure: OrderedDict[BlockKey, str] = OrderedDict()
        self._pins: dict[BlockKey, int] = {}
        self._dropped: list[Dropped] = []
        self._evicted: list[tuple[BlockKey, str]] = []
        # Ledger version at which recent victims left: a commit reply older than that must
        # not make the object visible here again (replies of concurrent calls can cross).
        self._gone_at: OrderedDict[BlockKey, int] = OrderedDict()
        # Local sequence number of each key's last change by a writer of this process (a
        # removal or eviction ``_forget``, a commit ``_learn_commit``): a read that began
        # before it (``_read_mark``) saw the server before that change, so its result must
        # not undo it (``_learn_read``, ``_miss_read``).
        self._changes = 0
        self._changed_at: OrderedDict[BlockKey, int] = OrderedDict()
        self._committed_at: OrderedDict[BlockKey, int] = OrderedDict()  # ledger versions
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
                ("forget_lost", FORGET_LOST),
                ("remove", REMOVE),
                ("release", RELEASE),
                ("touch", TOUCH),
                ("usage", USAGE),
                ("erase", ERASE),
                ("write", WRITE),
                ("erase_object", ERASE_OBJECT),
                ("drop_object", DROP_OBJECT),
                ("repair", REPAIR),
            )
        }
        self._wake = threading.Event()
        self._toucher: threading.Thread | None = None

    def start(self) -> Self:
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

    def take_dropped(self) -> list[Dropped]:
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
            self._dropped.append(Dropped(key, EXPIRED))
            return None
        self._known.move_to_end(key)
        return meta

    def _learn(self, meta: KVObjectMeta) -> None:
        self._known[meta.key] = meta
        self._known.move_to_end(meta.key)
        while len(self._known) > self.config.meta_cache_entries:
            self._known.popitem(last=False)

    def _forget(self, key: BlockKey, *, after: int | None = None) -> None:
        """Drop ``key`` from the local view because it is leaving the server (a removal, a
        victim), and keep reads already in flight from learning it again. ``after``: the
        ledger version of the removal — a commit of the key at a later version (a new store
        that raced past the removal) stays visible. Caller holds ``_lock``."""
        if after is None or self._committed_at.get(key, -1) < after:
            self._known.pop(key, None)
            ahead = self._ahead.pop(key, None)  # fetched before the removal: stale now
            if ahead is not None:
                self._ahead_bytes -= len(ahead[1])
        self._changed(key)

    def _learn_commit(self, meta: KVObjectMeta, version: int) -> None:
        """Learn a meta this process committed at ledger ``version``. Caller holds ``_lock``."""
        self._learn(meta)
        self._changed(meta.key)
        self._committed_at[meta.key] = version
        self._committed_at.move_to_end(meta.key)
        if len(self._committed_at) > 4096:
            self._committed_at.popitem(last=False)

    def _changed(self, key: BlockKey) -> None:
        self._changes += 1
        self._changed_at[key] = self._changes
        self._changed_at.move_to_end(key)
        if len(self._changed_at) > 4096:
            self._changed_at.popitem(last=False)

    def _read_mark(self) -> int:
        """Taken under ``_lock`` before a read's I/O; passed to ``_learn_read``/``_miss_read``."""
        return self._changes

    def _learn_read(self, meta: KVObjectMeta, mark: int) -> None:
        """Learn a meta a read fetched, unless a writer here changed the key since the read
        began (removed: its bytes may be gone from the server by now). Caller holds ``_lock``."""
        if self._changed_at.get(meta.key, -1) <= mark:
            self._learn(meta)

    def _miss_read(self, key: BlockKey, mark: int) -> None:
        """A read found no object: forget the key, unless a writer here changed it since the
        read began (committed it after the read missed). Caller holds ``_lock``."""
        if self._changed_at.get(key, -1) <= mark:
            self._known.pop(key, None)

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

    # ---------------------------------------------------------------- ledger and victims
    def _delete_victims(self, victims: Sequence[Victim], version: int) -> None:
        """Delete the object keys of the ledger's victims (counted by reason). A corrupt
        entry whose field was no key hex names no object of the tier: counted, nothing to
        delete."""
        if not victims:
            return
        named = [(victim, key_of_hex(victim.key_hex)) for victim in victims]
        with self._lock:
            for victim, _ in named:
                self.remote_counters.count(self.remote_counters.evicted, victim.reason)
        found = [(victim, key) for victim, key in named if key is not None]
        if not found:
            return
        keys = [key for _, key in found]
        with self._lock:
            for victim, key in found:
                self._forget(key)
                self._gone_at[key] = version
                if len(self._gone_at) > 4096:
                    self._gone_at.popitem(last=False)
                self._evicted.append((key, victim.tenant))
        deleted = self._delete_objects(keys, version)
        with self._lock:  # a read may have fetched one between the eviction and the delete
            for key in keys:
                self._forget(key, after=version)
        if not deleted:
            self._count_error("evict")  # a later read deletes them (no entry: unaccounted)

    def _delete_objects(self, keys: Sequence[BlockKey], upto: int | None) -> bool:
        """Delete the object keys of ``keys`` whose generation is at most ``upto`` (the ledger
        version at which their entries left; None: any generation), one pipeline per shard.
        Bytes of a later commit of the same key — a store that raced past the removal — stay
        (``DROP_OBJECT``). False when a shard did not answer."""
        script = self._scripts["drop_object"]
        by_name = {self.meta_key(k): k for k in keys}
        bound = "" if upto is None else str(upto)

        def drop(pipe: Any, name: str) -> None:
            key = by_name[name]
            names = [name, self.data_key(key), gen_key(self._ns, key)]
            script(keys=names, args=[bound], client=pipe)

        replies = self._client.pipelined(list(by_name), drop)
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
        """Run a ledger script and delete the object keys of the victims it reports (any
        script may drop a corrupt entry, not only an admission), outside ``_lock``. A ledger
        index of the wrong type is repaired once and the call retried (``remote_ledger``:
        ``REPAIR``)."""
        reply = self._unless_wrongtype(name, args)
        if reply is None:
            self._repair()
            reply = self._unless_wrongtype(name, args)
            if reply is None:
                raise RemoteReplyError(f"ledger {self._prefix}: wrong-typed index after REPAIR")
        self._delete_victims(reply.victims, reply.version)
        return reply

    def _unless_wrongtype(self, name: str, args: Sequence[Any]) -> LedgerReply | None:
        """The script's reply; None when it met a ledger index of the wrong type (answered
        ``wrongtype`` before writing, or failed with ``WRONGTYPE`` half-way)."""
        try:
            reply = LedgerReply.parse(self._run_script(name, args))
        except RemoteReplyError as exc:
            if not wrongtype(exc):
                raise
            return None
        return None if reply.status == "wrongtype" else reply

    def _repair(self) -> None:
        reply = LedgerReply.parse(self._run_script("repair", [self._prefix, repr(self._clock())]))
        self._delete_victims(reply.victims, reply.version)
        if reply.status == "repaired":
            self.remote_counters.ledger_repairs += 1
            _log.warning(
                "remote ledger %s: indexes of the wrong type rebuilt (%d entries dropped)",
                self._prefix,
                len(reply.victims),
            )
        elif reply.status == "rebuilt":
            self.remote_counters.ledger_repairs += 1
            adopted = self._adopt()
            _log.warning(
                "remote ledger %s: its entries were of the wrong type; rebuilt from the %d "
                "objects' metas on the server",
                self._prefix,
                adopted,
            )

    def _adopt(self) -> int:
        """Account again for the objects on the server after a ``rebuilt`` repair (the write
        path's, ``RemoteWrites._adopt``). Returns the objects adopted."""
        raise NotImplementedError

    def _run_script(self, name: str, args: Sequence[Any]) -> Any:
        script = self._scripts[name]
        return self._client.call(
            self.ledger_node,
            lambda conn: script(keys=[self._ledger_key], args=list(args), client=conn),
        )

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
