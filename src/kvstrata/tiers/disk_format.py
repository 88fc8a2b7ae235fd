"""The on-disk format of one KV object file (version 1), kept apart from the tier's behaviour.

Little endian::

    magic b"KVSTRATA" | u16 version | u16 flags (0) | u32 meta_len | u64 payload_len
    | u64 xxh3-64(meta JSON) | meta JSON (KVObjectMeta.to_dict, payload digest inside) | payload

The payload starts at a multiple of ``PAYLOAD_ALIGN`` (the meta JSON is padded with spaces) and
the tier reads into buffers aligned the same way. Why: the kernel's page-cache → user copy is
much slower on some CPUs when source and destination addresses differ by a small non-multiple
of 64 modulo 4096 — exactly what an mmap'd ``malloc`` buffer and a page-aligned payload
produce; equal alignment avoids it (figures in ``docs/results-history.md``, disk tier).

The meta checksum lets recovery reject a flipped bit in the metadata (which the payload digest
does not cover); the exact file size rejects truncation and trailing garbage. Nothing here
touches tier bookkeeping, so ``kvstrata inspect``-style tools can parse files without a tier.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct
import threading
from pathlib import Path
from typing import Final

import numpy as np
import xxhash

from kvstrata.objects import MALFORMED_META, KVObjectMeta, payload_hasher

MAGIC = b"KVSTRATA"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHIQQ")
OBJECT_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
_MAX_META_BYTES = 1 << 20
PAYLOAD_ALIGN = 64


def aligned_buffer(size: int) -> np.ndarray:
    """A ``PAYLOAD_ALIGN``-aligned uint8 array of ``size`` bytes (a slice of a larger one)."""
    raw = np.empty(size + PAYLOAD_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % PAYLOAD_ALIGN
    return raw[start : start + size]


class BufferPool:
    """Reusable aligned arrays, so steady-state stores and loads allocate no payload memory."""

    def __init__(self, max_pooled: int) -> None:
        self._free: list[np.ndarray] = []
        self._max = max_pooled
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= size:
                    return self._free.pop(i)
        return aligned_buffer(size)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self._max:
                self._free.append(buf)


class MetaTooLarge(ValueError):
    """A meta whose JSON exceeds what ``parse_object`` accepts: never written, since the
    object would be served until the next restart and then discarded as corrupt."""


def encode_head(meta: KVObjectMeta) -> bytes:
    """Header plus meta JSON, space-padded so the payload starts ``PAYLOAD_ALIGN``-aligned;
    ``MetaTooLarge`` beyond ``_MAX_META_BYTES``."""
    meta_bytes = json.dumps(meta.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    if len(meta_bytes) > _MAX_META_BYTES - PAYLOAD_ALIGN:  # room for the padding
        raise MetaTooLarge(f"meta of {meta.key.hex()} is {len(meta_bytes)} bytes of JSON")
    meta_bytes += b" " * (-(HEADER.size + len(meta_bytes)) % PAYLOAD_ALIGN)
    header = HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, len(meta_bytes), meta.size, xxhash.xxh3_64_intdigest(meta_bytes)
    )
    return header + meta_bytes


def write_atomic(
    final: Path, temp: Path, head: bytes, payload: memoryview, *, durable: bool
) -> None:
    """Temp file → fsync → rename → fsync dir: ``final`` appears complete or not at all.

    On any ``OSError`` whatever was created (temp or, after the rename, final) is removed and
    the error re-raised, so a failed write leaves nothing behind.
    """
    renamed = False
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, head, payload)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, final)
        renamed = True
        if durable:
            fsync_dir(final.parent)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            (final if renamed else temp).unlink()
        raise


READ_CHUNK_BYTES: Final = 512 * 1024
"""Verified reads hash each chunk right after reading it, while it is still in the CPU's
cache (measured on 4 MiB objects, warm page cache: 0.74× a bare ``preadv`` against 0.66× for
one read then one hash over the whole; 64 KiB–1 MiB chunks all land within a few percent)."""


TRANSIENT_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR}
)
"""Errors of the moment (no descriptor, no memory), not of the file: the object may be intact."""


class TransientReadError(Exception):
    """A read failed for a reason of the moment (``TRANSIENT_ERRNOS``): a miss now, never a
    reason to delete the object."""


def _transient(exc: OSError) -> bool:
    return exc.errno in TRANSIENT_ERRNOS


def open_regular(path: str | Path) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file, else None (never blocks).

    An object name may hold anything another process put there: a FIFO (a plain ``open``
    would wait for a writer forever), a device, a directory, a symlink to elsewhere. Opened
    without following a final symlink and without blocking, then checked with ``fstat``;
    anything but a regular file is treated like a missing or corrupt object. An error of the
    moment raises ``TransientReadError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if _transient(exc):
            raise TransientReadError(f"opening {path}: {exc}") from exc
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_exact(
    path: str | Path, offset: int, view: memoryview, hasher: xxhash.xxh3_128 | None = None
) -> bool:
    """Fill ``view`` from ``path`` at ``offset`` with ``preadv``; False on short read or error
    (``TransientReadError`` for an error of the moment: the file may be intact).

    With a ``hasher`` (:func:`payload_hasher`), the bytes are read in ``READ_CHUNK_BYTES``
    chunks and each is hashed as soon as it is read; without, in one call."""
    chunk = READ_CHUNK_BYTES if hasher is not None else len(view)
    fd = open_regular(path)
    if fd is None:
        return False
    try:
        done, size = 0, len(view)
        while done < size:
            n = os.preadv(fd, [view[done : min(done + chunk, size)]], offset + done)
            if n <= 0:
                return False
            if hasher is not None:
                hasher.update(view[done : done + n])
            done += n
        return True
    except OSError as exc:
        if _transient(exc):
            raise TransientReadError(f"reading {path}: {exc}") from exc
        return False
    finally:
        os.close(fd)


def write_all(fd: int, head: bytes, payload: memoryview) -> None:
    """``writev`` until every byte is written (regular files may still write short)."""
    parts: list[memoryview] = [memoryview(head), payload]
    while parts:
        n = os.writev(fd, parts)
        if n == 0:
            raise OSError(errno.EIO, "write returned 0")
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_object(
    path: Path, scratch: bytearray, max_payload: int
) -> tuple[tuple[KVObjectMeta, int] | None, bytearray]:
    """Validate one object file fully; returns (meta, payload offset) or None if invalid.

    The header is checked before anything else is read or allocated: a file that is not a
    regular file (:func:`open_regular`), whose sizes disagree with its length, or whose
    payload exceeds ``max_payload`` (the tier's capacity: no such object could have been
    stored) is rejected without reading it. Then the meta (at most 1 MiB) is read and checked,
    and only then the payload, hashed in ``READ_CHUNK_BYTES`` chunks: ``scratch`` never grows
    past the larger of the two, whatever size a file claims. ``TransientReadError`` for an
    error of the moment (the file may be intact: keep it)."""
    fd = open_regular(path)
    if fd is None:
        return None, scratch
    try:
        size = os.fstat(fd).st_size
        if size < HEADER.size:
            return None, scratch
        head = os.pread(fd, HEADER.size, 0)
        if len(head) != HEADER.size:
            return None, scratch
        magic, version, _flags, meta_len, payload_len, meta_sum = HEADER.unpack(head)
        offset = HEADER.size + meta_len
        if (
            magic != MAGIC
            or version != FORMAT_VERSION
            or meta_len > _MAX_META_BYTES
            or payload_len > max_payload
            or size != offset + payload_len
        ):
            return None, scratch
        want = max(meta_len, min(READ_CHUNK_BYTES, payload_len))
        if len(scratch) < want:
            scratch = bytearray(want)
        view = memoryview(scratch)
        if not _pread_into(fd, view[:meta_len], HEADER.size):
            return None, scratch
        meta_bytes = bytes(view[:meta_len])
        if xxhash.xxh3_64_intdigest(meta_bytes) != meta_sum:
            return None, scratch
        try:
            meta = KVObjectMeta.from_dict(json.loads(meta_bytes))
        except MALFORMED_META:  # well-checksummed nonsense
            return None, scratch
        if (
            path.name != meta.key.hex() + OBJECT_SUFFIX
            or path.parent.name != meta.key.hex()[:2]
            or meta.size != payload_len
        ):
            return None, scratch
        hasher = payload_hasher()
        for start in range(offset, size, READ_CHUNK_BYTES):
            part = view[: min(READ_CHUNK_BYTES, size - start)]
            if not _pread_into(fd, part, start):
                return None, scratch
            hasher.update(part)
        if hasher.digest() != meta.digest:
            return None, scratch
    except OSError as exc:
        if _transient(exc):
            raise TransientReadError(f"reading {path}: {exc}") from exc
        return None, scratch
    finally:
        os.close(fd)
    return (meta, offset), scratch


def _pread_into(fd: int, view: memoryview, at: int) -> bool:
    """Fill ``view`` from offset ``at`` of ``fd``; False if the file ends first."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], at + done)
        if n <= 0:
            return False
        done += n
    return True
