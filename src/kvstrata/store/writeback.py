"""Write-back: a bounded queue of objects still to be copied to a lower level.

Entries are (target level, key) → source level. The flusher thread copies the oldest entry
through the store's public ``copy_down`` (the store does the byte copy outside its lock, so
lookups and loads go on while write-back runs). The bytes queued per target level are "at
risk": a crash now loses them from that level (they are still in the faster, volatile level
above), and are exported as ``kvstrata_writeback_bytes_at_risk{tier}``. A full queue flushes
its oldest entry synchronously — backpressure, never a silent drop. ``close()`` drains
everything.

Why a protocol and not the store: the queue is a client of the store, like any other; it knows
nothing of levels, locks or policies, only "copy this key from level a to level b" (a copy
whose source is gone meanwhile is simply skipped by the store). Invariants: the queue's own
lock is never held while calling ``copy_down`` (which takes the store lock), so the two locks
never nest the other way round; an entry is removed from the queue before its copy starts, so
a ``discard`` (the key is being deleted) either removes it first or finds it already in flight,
and then the store's delete wins over the late copy.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.telemetry.store_metrics import StoreMetrics

logger = logging.getLogger("kvstrata.store")


class CopyDown(Protocol):
    def copy_down(self, source: int, target: int, key: BlockKey, *, cause: str) -> bool:
        """Copy ``key`` from level ``source`` into level ``target`` if it still may go there;
        False when skipped (source gone, target refuses, being deleted)."""
        ...


class WriteBackQueue:
    def __init__(
        self,
        store: CopyDown,
        metrics: StoreMetrics,
        *,
        level_names: Sequence[str],
        max_bytes: Sequence[int],
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._names = list(level_names)
        self._max_bytes = list(max_bytes)
        self._entries: OrderedDict[tuple[int, BlockKey], tuple[int, int]] = OrderedDict()
        self._bytes: dict[int, int] = {}
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = 0  # copies popped from the queue and not finished yet
        self._thread: threading.Thread | None = None
        self._closing = False

    # ---- producer side (never called with the store lock held) ----------------------------
    def enqueue(self, source: int, target: int, meta: KVObjectMeta) -> None:
        with self._cond:
            entry = (target, meta.key)
            if entry in self._entries:
                return
            self._entries[entry] = (source, meta.size)
            self._bytes[target] = self._bytes.get(target, 0) + meta.size
            self._publish(target)
            over = self._bytes[target] > self._max_bytes[target]
            self._cond.notify()
        if over:
            self._flush_oldest(target)

    def flush_source(self, source: int, key: BlockKey) -> None:
        """The source is about to drop ``key``: write its pending copies now."""
        targets = []
        with self._cond:
            for (target, entry_key), (entry_source, _) in self._entries.items():
                if entry_key == key and entry_source == source:
                    targets.append(target)
        for target in targets:
            self._flush_entry(target, key)

    def pending_from(self, source: int, key: BlockKey) -> bool:
        """Does a queued copy of ``key`` still read from level ``source``?"""
        with self._cond:
            return any(
                entry_key == key and entry_source == source
                for (_, entry_key), (entry_source, _) in self._entries.items()
            )

    def discard(self, key: BlockKey) -> None:
        """``key`` is being deleted everywhere: forget its pending copies."""
        with self._cond:
            for entry in [e for e in self._entries if e[1] == key]:
                _, size = self._entries.pop(entry)
                self._bytes[entry[0]] -= size
                self._publish(entry[0])

    def bytes_at_risk(self, target: int) -> int:
        with self._cond:
            return self._bytes.get(target, 0)

    # ---- flushing ---------------------------------------------------------------------------
    def _flush_oldest(self, target: int) -> None:
        with self._cond:
            key = next((k for t, k in self._entries if t == target), None)
        if key is not None:
            self._flush_entry(target, key)

    def _flush_entry(self, target: int, key: BlockKey) -> bool:
        """Copy one queued object down. A tier switched off (rollback) or out of the object's
        target gets nothing: the entry is dropped, the object stays in the level above."""
        with self._cond:
            item = self._entries.pop((target, key), None)
            if item is None:
                return False
            source, size = item
            self._in_flight += 1
        try:
            return self._store.copy_down(source, target, key, cause="write-back")
        except KvstrataError:
            logger.exception("write-back of an object to %s failed", self._names[target])
            self._metrics.write_failures.labels(tier=self._names[target]).inc()
            return False
        finally:
            with self._cond:  # at risk until the copy has finished, one way or the other
                self._in_flight -= 1
                self._bytes[target] -= size
                self._publish(target)
                self._cond.notify_all()

    def drain(self) -> None:
        """Copy everything queued, and wait for copies another thread has in flight: when
        this returns, nothing queued before the call is still on its way."""
        while True:
            with self._cond:
                if not self._entries:
                    while self._in_flight:
                        self._cond.wait()
                    if not self._entries:
                        return
                    continue
                target, key = next(iter(self._entries))
            self._flush_entry(target, key)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvstrata-writeback", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.drain()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._entries and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                target, key = next(iter(self._entries))
            try:
                self._flush_entry(target, key)
            except Exception:  # keep flushing: one bad object must not stop write-back
                logger.exception("write-back flusher: unexpected error")

    def _publish(self, target: int) -> None:
        name = self._names[target]
        self._metrics.bytes_at_risk.labels(tier=name).set(self._bytes.get(target, 0))
