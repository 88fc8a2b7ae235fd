"""The disk tier's tombstone file: deletions that outlive the process.

Why: a deletion unlinks object files, but a SIGKILL between the deletion and an unlink (or a
pinned file whose reader had not finished, or a write-back that renamed its file just before
it was deleted) leaves a file the next process would recover and serve. So the tombstones go
to disk first, and ``DiskTier.recover`` removes every object a live tombstone covers.

Format: ``root/TOMBSTONES``, append-only, one line per tombstone::

    t1 <key hex> <deleted_at> <expires_at> <xxh3-64 hex of everything before it>\\n

(times as Python float reprs, which round-trip exactly). A line that does not parse or whose
checksum does not match (a torn last line after a crash) is skipped and counted. Bounded: when
the file holds more than ``max(compact_min, 2 × live)`` lines, it is rewritten atomically (temp
file, fsync, rename, fsync dir) with the live tombstones only; expired ones are dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvstrata.identity import BlockKey
from kvstrata.objects.tombstone import Tombstone
from kvstrata.tiers.disk_format import fsync_dir, write_atomic

FILE_NAME = "TOMBSTONES"
_VERSION = "t1"


def encode_line(mark: Tombstone) -> bytes:
    body = f"{_VERSION} {mark.key.hex()} {mark.deleted_at!r} {mark.expires_at!r}"
    return f"{body} {xxhash.xxh3_64_hexdigest(body.encode('ascii'))}\n".encode("ascii")


def decode_line(line: bytes) -> Tombstone | None:
    try:
        text = line.decode("ascii").rstrip("\n")
        body, _, checksum = text.rpartition(" ")
        if xxhash.xxh3_64_hexdigest(body.encode("ascii")) != checksum:
            return None
        version, key_hex, deleted_at, expires_at = body.split(" ")
        if version != _VERSION:
            return None
        key = BlockKey(bytes.fromhex(key_hex))
        return Tombstone(key, float(deleted_at), float(expires_at))
    except ValueError:
        return None


class TombstoneFile:
    """The tombstones of one disk tier directory (its own lock serialises appends)."""

    def __init__(self, root: Path, *, durable: bool, compact_min: int = 1024) -> None:
        self.path = root / FILE_NAME
        self.durable = durable
        self.compact_min = compact_min
        self.bad_lines = 0
        self._lock = threading.Lock()
        self._marks: dict[BlockKey, Tombstone] = {}
        self._lines = 0

    def load(self, now: float) -> dict[BlockKey, Tombstone]:
        """Read the file: the live tombstones, newest per key (the recovery scan's input)."""
        with self._lock:
            self._marks.clear()
            self._lines = 0
            for stale in self.path.parent.glob(f".{FILE_NAME}.*.tmp"):  # a compaction died
                stale.unlink(missing_ok=True)
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                return {}
            for line in raw.splitlines(keepends=True):
                self._lines += 1
                mark = decode_line(line)
                if mark is None:
                    self.bad_lines += 1
                    continue
                old = self._marks.get(mark.key)
                if mark.live(now) and (old is None or old.deleted_at < mark.deleted_at):
                    self._marks[mark.key] = mark
            return dict(self._marks)

    def live(self, now: float) -> list[Tombstone]:
        with self._lock:
            return [mark for mark in self._marks.values() if mark.live(now)]

    def get(self, key: BlockKey, now: float) -> Tombstone | None:
        with self._lock:
            mark = self._marks.get(key)
        return mark if mark is not None and mark.live(now) else None

    def append(self, marks: Sequence[Tombstone], now: float) -> None:
        """Persist ``marks`` (fsync'd when durable) before the caller unlinks anything.
        Raises ``OSError`` when the medium fails."""
        if not marks:
            return
        with self._lock:
            for mark in marks:
                old = self._marks.get(mark.key)
                if old is None or old.deleted_at < mark.deleted_at:
                    self._marks[mark.key] = mark
            for key in [k for k, m in self._marks.items() if not m.live(now)]:
                del self._marks[key]
            if self._lines + len(marks) > max(self.compact_min, 2 * len(self._marks)):
                self._rewrite()
                return
            created = not self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                data = b"".join(encode_line(mark) for mark in marks)
                if _ends_torn(fd):  # a crash or ENOSPC cut the last line: end it first, or
                    data = b"\n" + data  # the first new mark would be glued to it and lost
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if created and self.durable:  # the new file's name must survive a crash too
                fsync_dir(self.path.parent)
            self._lines += len(marks)

    def _rewrite(self) -> None:
        """Compaction (under ``_lock``): the live tombstones only, replaced atomically."""
        data = b"".join(encode_line(mark) for mark in self._marks.values())
        temp = self.path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        write_atomic(self.path, temp, data, memoryview(b""), durable=self.durable)
        self._lines = len(self._marks)


def _ends_torn(fd: int) -> bool:
    """Does the file end with an unterminated line (anything but empty or ``\n``-ended)?"""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
