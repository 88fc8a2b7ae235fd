"""Local disk tier: one crash-safe file per object, found again and verified after a restart.

Layout: ``root/objects/<first two hex digits>/<key hex>.kv`` (format: ``disk_format``),
``root/TOMBSTONES`` (deletions, ``disk_tombstones``: the recovery scan removes every object a
live tombstone covers, e.g. a file whose unlink a SIGKILL interrupted), plus ``root/LOCK``,
held with ``flock`` so that two live tiers never share a directory (a recovery scan deletes
temp files, which would destroy a live writer's work).

Crash safety: an object is written to a temp file in its final directory, flushed and
``fsync``'d, renamed over its final name and the directory is ``fsync``'d. ``rename`` is atomic,
so a SIGKILL or a power cut at any point leaves either no ``.kv`` file or a complete one —
never a torn object. Leftover ``*.tmp`` files are deleted by ``recover()``. With
``durable=False`` the fsyncs are skipped: still safe against process death (the page cache
survives it), not against power loss.

Verification: ``recover()`` (run by the constructor) checks header, meta checksum, file size,
that the file name matches the key, and the payload digest; anything else is deleted and
counted in ``counters.invalidated`` — it never raises (a store built over the tier exports that
count as ``kvstrata_tier_invalidated_total{reason="recovery_scan"}``). ``prepare_load``
re-verifies the payload digest on every read (``verify_reads=True``, the default, the same
policy as every tier below the device pool), because disk bytes can rot or be touched by
others: a mismatch marks the object INVALID, deletes the file, counts it and returns ``None``.
``verify_reads=False`` is for measuring what verification costs (``kvstrata bench tiers``), not
for production.

Foreign entries: whatever else lies in the tree is never followed, blocked on or read whole.
Objects are opened without following symlinks and without blocking (a FIFO would wait for a
writer forever) and must be regular files; a header that disagrees with the file's length or
names a payload larger than the tier is rejected before the rest is read. Recovery leaves
entries that are not regular files alone (``recovery.foreign``). A file the tier drops but
cannot delete (a read-only remount, a directory in its place) is logged and counted
(``counters.undeletable``, ``kvstrata_tier_undeletable_files``) and never raises out of a read:
the object is out of the index already. Only ``remove`` — a deletion, whose caller must know —
raises ``TierError`` then.

Failures: an ``OSError`` while writing (ENOSPC, EFBIG, EIO …) removes the temp file, releases the
reservation and raises ``TierError`` from ``complete_store`` — the medium failed, as the
``Tier`` contract says; the slot is finished either way and other objects stay readable. An
``OSError`` while reading an object is treated like corruption (invalidate, recompute), except
an error of the moment (out of file descriptors or memory: ``disk_format.TRANSIENT_ERRNOS``),
which is a miss that keeps the object. At start-up such an object is retried for about a
second, then fails recovery: an object left out of the index would be out of every deletion's
reach. The start-up scan reads a payload in chunks, so a file's claimed size costs no memory.

Capacity bounds the sum of payload sizes (``meta.size``), like every other tier; each file adds
a header and meta JSON (well under 1 KiB) on top. Buffers for stores and loads come from a
small pool of 64-byte aligned arrays and are reused, so steady-state I/O allocates no payload
memory (and the kernel's page-cache copies stay on their fast path, see ``disk_format``).
The default clock is wall time: objects outlive the process, so ``created_at``/TTL must be
wall-clock seconds.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, ObjectState, payload_hasher
from kvstrata.objects.model import ObjectRecord
from kvstrata.objects.tombstone import Tombstone
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
from kvstrata.tiers.disk_format import (
    OBJECT_SUFFIX,
    TEMP_SUFFIX,
    BufferPool,
    MetaTooLarge,
    TransientReadError,
    encode_head,
    fsync_dir,
    parse_object,
    read_exact,
    write_atomic,
)
from kvstrata.tiers.disk_tombstones import TombstoneFile

logger = logging.getLogger(__name__)


_RECOVERY_RETRY_S: Final = (0.05, 0.25, 1.0)
"""Pauses before recovery retries an object an error of the moment kept from reading."""


@dataclass
class RecoveryReport:
    """What ``recover()`` found: objects re-indexed, files deleted and why."""

    recovered: int = 0
    invalid: int = 0
    temp_removed: int = 0
    over_capacity: int = 0
    expired: int = 0
    tombstoned: int = 0  # objects a deletion's tombstone covers: removed, never served
    foreign: int = 0  # entries that are not regular files (directories, FIFOs, links): left
    unreadable_at_first: int = 0
    """Objects an error of the moment (``TRANSIENT_ERRNOS``) kept from reading at first, then
    read on a retry (one still unreadable after the retries fails recovery)."""


@dataclass
class _Handle:
    """Tier-private token of a slot or lease: its record and its pooled buffer."""

    record: ObjectRecord
    buffer: np.ndarray
    done: bool = False


class DiskTier(IndexedTierViews):
    """A bounded, crash-safe local-disk tier (see the module docstring for format and contract)."""

    name = "disk"

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        durable: bool = True,
        verify_reads: bool = True,
        clock: Callable[[], float] = time.time,
        pooled_buffers: int = 8,
    ) -> None:
        self.root = Path(root_dir)
        self.verify_reads = verify_reads
        self.capacity_bytes = capacity_bytes
        self.durable = durable
        self._objects = self.root / "objects"
        self._objects_prefix = str(self._objects) + os.sep
        self._clock = clock
        self._lock = threading.Lock()
        self._index = TierIndex(capacity_bytes=capacity_bytes)
        self._pool = BufferPool(pooled_buffers)
        self._dropped: list[Dropped] = []
        self._known_dirs: set[str] = set()
        self._temp_ids = itertools.count()
        self._tombstones = TombstoneFile(self.root, durable=durable)
        try:
            self._objects.mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise TierError(f"cannot open disk tier at {self.root}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise TierError(f"{self.root} is in use by another disk tier") from exc
        try:
            self.recovery = self.recover()
        except (OSError, TierError) as exc:
            self.close()
            raise TierError(f"recovery of {self.root} failed: {exc}") from exc
        except BaseException:  # MemoryError, KeyboardInterrupt …: never keep the lock
            self.close()
            raise

    # ---------------------------------------------------------------- read-only views

    def path_of(self, key: BlockKey) -> Path:
        return Path(self._path(key))

    def _path(self, key: BlockKey) -> str:
        """The object's file name as a plain string: pathlib costs microseconds per call."""
        hexkey = key.hex()
        return f"{self._objects_prefix}{hexkey[:2]}{os.sep}{hexkey}{OBJECT_SUFFIX}"

    # ---------------------------------------------------------------- store

    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None:
        with self._lock:
            self._check_open()
            record = self._index.reserve(meta)
        if record is None:
            return None
        buf = self._pool.take(meta.size)
        return StoreSlot(meta, buf.data[: meta.size], _Handle(record, buf))

    def complete_store(self, slot: StoreSlot, success: bool) -> bool:
        """Write the object durably; False for a cancelled or mismatching write.

        Raises ``TierError`` when the medium fails; the slot is finished and nothing of the
        object is left on disk or in the index.
        """
        handle = self._claim(slot.token)
        meta = slot.meta
        try:
            problem = final_meta_problem(handle.record.meta, meta) if success else None
            if problem is not None:
                self._abort(handle, corrupt=False)
                raise TierError(problem)
            if not success or slot_digest(slot) != meta.digest:
                self._abort(handle, corrupt=success)
                return False
            try:
                offset = self._write_file(meta, slot.buffer)
            except MetaTooLarge:
                logger.warning("disk tier: not storing %s, its meta is too large", meta.key.hex())
                self._abort(handle, corrupt=False)
                return False
            except OSError as exc:
                self._abort(handle, corrupt=False)
                raise TierError(f"writing {meta.key.hex()} failed: {exc}") from exc
            with self._lock:
                handle.record.extra["offset"] = offset
                adopt_meta(handle.record, meta)
                self._index.commit(meta.key, self._clock())
            return True
        finally:
            self._pool.give(handle.buffer)

    # ---------------------------------------------------------------- load

    def prepare_load(self, key: BlockKey) -> LoadLease | None:
        record = self._pin_visible(key)
        if record is None:
            return None
        meta = record.meta
        buf = self._pool.take(meta.size)
        view = buf.data[: meta.size]
        try:
            ok = self._read_verified(record, view)
        except TransientReadError as exc:  # out of descriptors or memory: a miss, kept
            logger.warning("disk tier: %s (kept, a miss for now)", exc)
            self._pool.give(buf)
            with self._lock:
                if self._index.records.get(key) is record:
                    self._index.unpin(record)
                self._index.counters.misses += 1
            return None
        if ok:
            return LoadLease(meta, view.toreadonly(), _Handle(record, buf))
        self._pool.give(buf)
        with self._lock:
            if self._index.records.get(key) is record:
                self._index.drop(key, invalid=True)
                self._dropped.append(Dropped(key, CORRUPT))
                self._discard(self._path(key))
        return None

    def complete_load(self, lease: LoadLease) -> None:
        handle = self._claim(lease.token)
        with self._lock:
            if self._index.records.get(lease.meta.key) is handle.record:
                self._index.unpin(handle.record)
        self._pool.give(handle.buffer)

    # ---------------------------------------------------------------- removal

    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            if self._index.removable(key) is None:
                return False
            # Under the lock: a re-store of the same key must not race with this unlink. The
            # file goes first: one that cannot (a read-only remount) raises with the object
            # still indexed, so the caller's retry finds it, and learns when it is gone.
            self._unlink(self._path(key))
            self._index.drop(key)
            self._index.counters.removed += 1
            return True

    def bury(self, marks: Sequence[Tombstone]) -> list[tuple[BlockKey, str]]:
        """Persist tombstones (fsync'd when durable) before the store unlinks the objects."""
        try:
            self._tombstones.append(marks, self._clock())
        except OSError as exc:
            raise TierError(f"writing tombstones in {self.root} failed: {exc}") from exc
        return []

    def recovered_tombstones(self) -> list[Tombstone]:
        return self._tombstones.live(self._clock())

    def close(self) -> None:
        """Release the directory lock; committed objects stay on disk for the next tier."""
        with self._lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- recovery

    def _parse_retrying(
        self, path: Path, scratch: bytearray, report: RecoveryReport
    ) -> tuple[tuple[KVObjectMeta, int] | None, bytearray]:
        """``parse_object``, retried over about a second while an error of the moment stops
        it. An object still unreadable then fails recovery (``TierError``): left unindexed, it
        would be out of every deletion's reach (``objects_of`` lists the index) and served by
        a later start after its tombstone expired."""
        attempt = 0
        while True:
            try:
                return parse_object(path, scratch, self.capacity_bytes)
            except TransientReadError as exc:
                report.unreadable_at_first += attempt == 0
                if attempt == len(_RECOVERY_RETRY_S):
                    raise TierError(
                        f"{exc}: still failing after {attempt} retries; the tier does not"
                        " start with objects it cannot index (no deletion would reach them)"
                    ) from exc
                pause = _RECOVERY_RETRY_S[attempt]
                logger.warning("disk tier recovery: %s (retrying in %.2f s)", exc, pause)
                time.sleep(pause)
                attempt += 1

    def recover(self) -> RecoveryReport:
        """Rebuild the index from disk: keep verified objects, delete temp and invalid files.

        Objects are admitted newest first; those that no longer fit the capacity (a smaller
        tier reopened on a bigger directory) are deleted and counted as ``over_capacity``.
        The constructor runs it; call it again only while no store is in flight, since it
        deletes temp files.
        """
        report = RecoveryReport()
        marks = self._tombstones.load(self._clock())
        found: list[tuple[KVObjectMeta, int]] = []
        scratch = bytearray()
        for subdir in sorted(self._entries(self._objects), key=lambda e: e.name):
            # A symlink is not followed: recovery deletes files, and only below the root (a
            # store that needs the name replaces the link with a directory).
            if not subdir.is_dir(follow_symlinks=False):
                report.foreign += subdir.is_symlink()
                continue
            self._known_dirs.add(subdir.name)
            for entry in sorted(self._entries(Path(subdir.path)), key=lambda e: e.name):
                path = Path(entry.path)
                if not entry.is_file(follow_symlinks=False):
                    report.foreign += 1  # not ours to delete (a directory, FIFO, symlink …)
                elif entry.name.endswith(TEMP_SUFFIX):
                    self._discard(path)
                    report.temp_removed += 1
                elif entry.name.endswith(OBJECT_SUFFIX):
                    parsed, scratch = self._parse_retrying(path, scratch, report)
                    if parsed is None:
                        self._discard(path)
                        report.invalid += 1
                    else:
                        found.append(parsed)
        now = self._clock()
        with self._lock:
            self._index.counters.invalidated += report.invalid
            for meta, offset in sorted(found, key=lambda item: -item[0].created_at):
                if meta.key in self._index.records:
                    continue  # recover() called twice: already indexed
                if meta.expired(now):
                    report.expired += 1
                    self._discard(self._path(meta.key))
                    continue
                mark = marks.get(meta.key)
                if mark is not None and mark.covers(meta.created_at, now):
                    report.tombstoned += 1
                    self._discard(self._path(meta.key))
                    continue
                record = self._index.reserve(meta)
                if record is None:
                    report.over_capacity += 1
                    self._discard(self._path(meta.key))
                    continue
                record.transition(ObjectState.COMMITTED)
                record.last_access = now
                record.extra["offset"] = offset
                report.recovered += 1
        return report

    @staticmethod
    def _entries(directory: Path) -> list[os.DirEntry[str]]:
        """The entries of one directory of the tier; none if it cannot be listed (counted
        nowhere: recovery keeps what it can read)."""
        try:
            with os.scandir(directory) as it:
                return list(it)
        except OSError as exc:
            logger.warning("disk tier: cannot list %s: %s", directory, exc)
            return []

    # ---------------------------------------------------------------- internals

    def _write_file(self, meta: KVObjectMeta, payload: memoryview) -> int:
        """Temp file → fsync → rename → fsync dir; returns the payload offset in the file."""
        final = self.path_of(meta.key)
        directory = final.parent
        if directory.name not in self._known_dirs:
            if directory.is_symlink():  # never write through a link to outside the root
                directory.unlink()
            directory.mkdir(exist_ok=True)
            if self.durable:
                fsync_dir(self._objects)
            self._known_dirs.add(directory.name)
        head = encode_head(meta)
        temp = directory / f".{final.stem}.{os.getpid()}.{next(self._temp_ids)}{TEMP_SUFFIX}"
        write_atomic(final, temp, head, payload, durable=self.durable)
        return len(head)

    def _read_verified(self, record: ObjectRecord, view: memoryview) -> bool:
        """Read the payload straight into ``view`` (no allocation) and check its digest, hashed
        chunk by chunk as it is read (``read_exact`` with a hasher)."""
        offset = int(record.extra["offset"])
        path = self._path(record.meta.key)
        if not self.verify_reads:
            return read_exact(path, offset, view)
        hasher = payload_hasher()
        return read_exact(path, offset, view, hasher) and hasher.digest() == record.meta.digest

    def _abort(self, handle: _Handle, *, corrupt: bool) -> None:
        with self._lock:
            key = handle.record.meta.key
            if self._index.records.get(key) is not handle.record:
                return
            self._index.counters.store_failures += 1
            if corrupt:
                self._index.drop(key, invalid=True)
            else:
                handle.record.transition(ObjectState.INVALID)
                self._index.drop(key)

    def _claim(self, token: object) -> _Handle:
        if not isinstance(token, _Handle):
            raise TierError("handle does not belong to a disk tier")
        if token.done:
            raise TierError("slot or lease completed twice")
        token.done = True
        return token

    def _release_expired(self, key: BlockKey, record: ObjectRecord) -> None:
        self._discard(self._path(key))

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise TierError("disk tier is closed")

    @staticmethod
    def _unlink(path: str | Path) -> None:
        """Delete ``path`` or raise ``TierError``: for ``remove``, whose caller (a deletion)
        must learn that the bytes are still there."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TierError(f"cannot delete {path}: {exc}") from exc

    def _discard(self, path: str | Path) -> None:
        """Delete a file the index no longer holds (expired, invalid, temp, over capacity);
        never raises. A file that cannot go (a read-only remount, a directory in its place)
        is logged and counted in ``counters.undeletable``; the object is already out of the
        index, so no reader sees it, and the next recovery meets it again."""
        try:
            self._unlink(path)
        except TierError as exc:
            logger.warning("disk tier: %s", exc)
            self._index.counters.undeletable += 1
