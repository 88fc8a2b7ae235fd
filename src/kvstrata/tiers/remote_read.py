"""The remote tier's read path: probes, read-ahead and verified loads.

``prepare_load`` is one ``MGET`` and, in the same pipeline (on the ledger's node, in parallel, in
a cluster), an ``HGET`` of the key's ledger entry: bytes that no committed entry accounts for
(a victim whose deletion failed, a write that landed after its store gave up) are a miss, and
are deleted, as nothing else would reclaim them. (While the ledger's node does not answer,
verified bytes are served unchecked: the other shards keep serving.) The meta checksum, the
key, the exact payload length and the payload digest are verified on every read
(``verify_reads=False`` skips only the digest).
Garbage, a wrong length or a flipped bit is an INVALID object: its keys and ledger entry are
deleted, it is counted and reported through ``take_dropped``, and the caller recomputes. Hits
are booked in the ledger (uses, score) in batches by a background thread, so a load costs one
round trip.

``probe(keys)`` refreshes the local metas of a lookup's keys (one pipelined, shard-parallel
``MGET`` per shard, outside the store's lock); ``read_ahead(keys)`` fetches the payloads of a
planned promotion the same pipelined way, with one ``HMGET`` of their ledger entries (keeping
only accounted ones), so a long prefix costs one round trip per shard. A
tombstone beside an object (``remote_tombstones``) that covers it makes it a miss, and a load
that finds one deletes the object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, payload_digest
from kvstrata.tiers.base import CORRUPT, TOMBSTONED, Dropped, LoadLease, TierError
from kvstrata.tiers.remote_client import RemoteUnavailable
from kvstrata.tiers.remote_format import decode_meta, gen_key
from kvstrata.tiers.remote_ledger import EntryView
from kvstrata.tiers.remote_state import TOUCH_BATCH, RemoteState
from kvstrata.tiers.remote_tombstones import buried, tomb_key


@dataclass
class _Lease:
    meta: KVObjectMeta
    done: bool = False


class RemoteReads(RemoteState):
    """``probe``, ``read_ahead`` and ``prepare_load`` / ``complete_load`` of ``RemoteTier``."""

    def probe(self, keys: Sequence[BlockKey]) -> None:
        """Refresh the local metas of ``keys`` with one pipelined ``GET`` per shard."""
        if self._closed or not keys:
            return
        by_name = {self.meta_key(k): k for k in keys}
        with self._lock:
            mark = self._read_mark()
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
                if meta is None:
                    self._miss_read(key, mark)
                elif buried(meta, raw_tomb):
                    self._known.pop(key, None)
                elif not meta.expired(self._clock()):
                    self._learn_read(meta, mark)
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
        hexes = [k.hex() for k in by_name.values()]

        def build(pipe: Any, name: str) -> None:
            if name == self._ledger_key:  # last: after the objects' batches on one node
                pipe.hmget(self._ledger_key, hexes)
            else:
                key = by_name[name]
                pipe.mget(name, self.data_key(key), tomb_key(self._ns, key))

        replies = self._client.pipelined([*by_name, self._ledger_key], build, sizes=sizes)
        ledger = replies.pop(self._ledger_key)
        entries = None
        if not isinstance(ledger, RemoteUnavailable):
            entries = dict(zip(hexes, ledger, strict=True))
        failed = False
        with self._lock:
            if entries is None:  # served unchecked, as ``_read`` does
                self.remote_counters.count(self.remote_counters.errors, "ledger_check")
            for name, reply in replies.items():
                if isinstance(reply, RemoteUnavailable):
                    failed = True
                    continue
                raw_meta, raw_data, raw_tomb = reply
                if raw_meta is None or raw_data is None or raw_tomb is not None:
                    continue  # a tombstoned key: the load reads it again and decides
                if entries is not None and not _accounted(entries[by_name[name].hex()]):
                    continue  # bytes no committed entry accounts for: the load decides
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
            mark = self._read_mark()
        if expired:
            self.refresh_usage()
            with self._lock:
                self._counters.misses += 1
            return None
        if ahead is None:
            read = self._read(key)
            if read is None:
                with self._lock:
                    self._counters.misses += 1
                return None
            raw_meta, raw_data, raw_tomb, generation, accounted = read
        else:  # checked by the read-ahead
            (raw_meta, raw_data), raw_tomb, generation, accounted = ahead, None, None, True
        if raw_meta is None and raw_data is None:
            with self._lock:
                self._miss_read(key, mark)
                self._counters.misses += 1
            return None
        if not accounted:  # bytes the ledger does not account for: never served
            self._unaccounted(key, generation, mark)
            return None
        meta = decode_meta(raw_meta, key) if isinstance(raw_meta, bytes) else None
        if (
            meta is None
            or not isinstance(raw_data, bytes)
            or len(raw_data) != meta.size
            or (self.verify_reads and payload_digest(raw_data) != meta.digest)
        ):
            self._invalidate(key, generation)
            return None
        if buried(meta, raw_tomb):  # written before a deletion that it survived: never served
            self._invalidate(key, generation, tombstoned=True)
            return None
        if meta.expired(self._clock()):  # the ledger's sweep frees it (and its keys)
            with self._lock:
                self._known.pop(key, None)
                self._counters.misses += 1
            self.refresh_usage()
            return None
        with self._lock:
            self._learn_read(meta, mark)
            self._pins[key] = self._pins.get(key, 0) + 1
            self._counters.loads += 1
            self._touches.append(key.hex())
            full = len(self._touches) >= TOUCH_BATCH
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

    def _read(self, key: BlockKey) -> tuple[Any, Any, Any, int | None, bool] | None:
        """Meta, payload, tombstone and generation of ``key`` (one ``MGET``, one slot), and
        whether its ledger entry accounts for them (``_accounted``; an ``HGET`` in the same
        pipeline on one node, in parallel in a cluster: one round trip); None when the
        object's node failed. A ledger that does not answer counts as accounting for them:
        the bytes are verified anyway, and the other shards' objects stay served while the
        ledger's node is down (errors: ``ledger_check``)."""
        mkey = self.meta_key(key)

        def build(pipe: Any, name: str) -> None:
            if name == mkey:
                pipe.mget(mkey, self.data_key(key), tomb_key(self._ns, key), gen_key(self._ns, key))
            else:
                pipe.hget(self._ledger_key, key.hex())

        replies = self._client.pipelined([mkey, self._ledger_key], build)
        found, entry = replies[mkey], replies[self._ledger_key]
        if isinstance(found, RemoteUnavailable):
            self._count_error("load")
            return None
        if isinstance(entry, RemoteUnavailable):  # not ``_count_error``: keep what is learned
            with self._lock:
                self.remote_counters.count(self.remote_counters.errors, "ledger_check")
        accounted = isinstance(entry, RemoteUnavailable) or _accounted(entry)
        raw_meta, raw_data, raw_tomb, raw_gen = found
        return raw_meta, raw_data, raw_tomb, _generation(raw_gen), accounted

    def _unaccounted(self, key: BlockKey, generation: int | None, mark: int) -> None:
        """A miss: bytes of ``key`` that no committed ledger entry accounts for (a failed
        deletion of a victim, a write that landed after its store gave up). The ledger is
        read again, after the bytes were: when it still holds no entry, or one still pending
        (whose commit will come with a later generation), the bytes of this generation and
        older are deleted — never those of a store committed since."""
        with self._lock:
            self._miss_read(key, mark)
            self._counters.misses += 1
        try:
            raw = self._client.call(
                self.ledger_node, lambda conn: conn.hget(self._ledger_key, key.hex())
            )
        except RemoteUnavailable:
            self._count_error("unaccounted")
            return
        entry = EntryView.parse(raw)
        if entry is not None and entry.state != "P":
            return  # committed since (served by the next read), or garbage the ledger drops
        if self._delete_objects([key], generation):
            with self._lock:
                self.remote_counters.count(self.remote_counters.evicted, "unaccounted")
        else:
            self._count_error("unaccounted")

    def _invalidate(
        self, key: BlockKey, generation: int | None, *, tombstoned: bool = False
    ) -> None:
        """A corrupt (or tombstoned) object of ``generation`` (None: unknown): delete its keys
        and its committed ledger entry (best effort), report it. A later store's bytes and
        entry (a later generation, or a reservation not committed yet) stay."""
        with self._lock:
            self._known.pop(key, None)
            if tombstoned:
                self._counters.tombstoned += 1
            else:
                self._counters.invalidated += 1
            self._dropped.append(Dropped(key, TOMBSTONED if tombstoned else CORRUPT))
        if not self._delete_objects([key], generation):
            self._count_error("invalidate")
        upto = "C" if generation is None else str(generation)
        try:
            reply = self._script("remove", [self._prefix, repr(self._clock()), upto, key.hex()])
        except RemoteUnavailable:
            self._count_error("invalidate")
            return
        with self._lock:
            self._apply(reply)


def _accounted(raw: object) -> bool:
    """Whether the ledger entry read as ``raw`` accounts for an object's bytes: a committed
    one, or garbage (the next script that meets it drops it and deletes the bytes as a
    ``corrupt`` victim; until then they are verified bytes, served as a victim's are). No
    entry, or a pending one, does not."""
    entry = EntryView.parse(raw)
    return entry is not None and entry.state != "P"


def _generation(raw: object) -> int | None:
    """An object's generation as read (None: absent or garbage — no guard)."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else ""
    return int(text) if text.isdigit() else None
