"""The disk tier among things it did not write: directories, FIFOs and huge files where its
objects should be, files it cannot delete, a torn tombstone line, a meta too large to read
back. Each gives a miss or a refusal and loses nothing else; nothing blocks or raises."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvstrata.objects.tombstone import Tombstone
from kvstrata.tiers import disk as disk_module
from kvstrata.tiers.base import CORRUPT, Dropped, TierError
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.disk_format import READ_CHUNK_BYTES, parse_object
from kvstrata.tiers.disk_tombstones import encode_line
from tier_helpers import CAPACITY, FakeClock, load_bytes, make_object, store

T = TypeVar("T")


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()``, failing the test (instead of hanging the suite) if it blocks."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} blocked for {seconds} s"
    return out[0]


def _three(root: Path) -> list[tuple[object, bytes]]:
    objects = [make_object(i) for i in (1, 2, 3)]
    with DiskTier(root, CAPACITY) as tier:
        for meta, payload in objects:
            assert store(tier, meta, payload)
    return objects  # type: ignore[return-value]


def test_directories_named_like_objects_or_temp_files_do_not_stop_recovery(
    tmp_path: Path,
) -> None:
    objects = [make_object(i) for i in (1, 2, 3)]
    with DiskTier(tmp_path, CAPACITY) as tier:
        for meta, payload in objects:
            assert store(tier, meta, payload)
        first = tier.path_of(objects[0][0].key)
    first.unlink()
    first.mkdir()
    (first.parent / "junk.tmp").mkdir()
    with DiskTier(tmp_path, CAPACITY) as again:
        assert again.recovery.recovered == 2
        assert again.recovery.foreign == 2
        assert load_bytes(again, objects[0][0].key) is None
        for meta, payload in objects[1:]:
            assert load_bytes(again, meta.key) == payload


def test_a_fifo_in_place_of_an_object_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    meta, payload = make_object(1)
    other, other_payload = make_object(2)
    tier = DiskTier(tmp_path, CAPACITY)
    assert store(tier, meta, payload) and store(tier, other, other_payload)
    path = tier.path_of(meta.key)
    path.unlink()
    os.mkfifo(path)
    assert within(10, lambda: tier.prepare_load(meta.key)) is None
    assert tier.meta(meta.key) is None and Dropped(meta.key, CORRUPT) in tier.take_dropped()
    assert load_bytes(tier, other.key) == other_payload
    tier.close()
    if not path.exists():  # the read dropped the FIFO; put one back for the recovery scan
        os.mkfifo(path)
    again = within(10, lambda: DiskTier(tmp_path, CAPACITY))
    assert again.recovery.recovered == 1 and again.recovery.foreign == 1
    again.close()


def test_a_symlink_in_place_of_an_object_is_not_followed(tmp_path: Path) -> None:
    meta, payload = make_object(1)
    root = tmp_path / "tier"
    with DiskTier(root, CAPACITY) as tier:
        assert store(tier, meta, payload)
        path = tier.path_of(meta.key)
    outside = tmp_path / "outside.kv"
    path.rename(outside)
    path.symlink_to(outside)
    with DiskTier(root, CAPACITY) as again:
        assert again.recovery.recovered == 0 and again.recovery.foreign == 1
    assert outside.read_bytes()  # recovery deletes only below its root


def test_a_huge_sparse_file_is_rejected_on_its_header_without_reading_it(
    tmp_path: Path,
) -> None:
    meta, payload = make_object(1)
    with DiskTier(tmp_path, CAPACITY) as tier:
        assert store(tier, meta, payload)
        path = tier.path_of(meta.key)
    with open(path, "r+b") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: reading it whole would exhaust memory
    with DiskTier(tmp_path, CAPACITY) as again:
        assert again.recovery.invalid == 1 and again.recovery.recovered == 0
    assert not path.exists()


def test_a_file_that_cannot_be_deleted_gives_misses_not_errors(tmp_path: Path) -> None:
    clock = FakeClock()
    expiring, payload = make_object(1, ttl=10.0)
    corrupt, corrupt_payload = make_object(2)
    tier = DiskTier(tmp_path, CAPACITY, clock=clock)
    assert store(tier, expiring, payload) and store(tier, corrupt, corrupt_payload)
    for meta in (expiring, corrupt):  # a non-empty directory: unlink fails (EISDIR)
        path = tier.path_of(meta.key)
        path.unlink()
        (path / "x").mkdir(parents=True)
    assert tier.prepare_load(corrupt.key) is None  # unreadable: dropped, counted
    assert Dropped(corrupt.key, CORRUPT) in tier.take_dropped()
    clock.now += 100  # the other expires; the views release it
    assert not tier.contains(expiring.key) and tier.meta(expiring.key) is None
    assert list(tier.keys()) == []
    assert tier.counters.undeletable == 2
    tier.close()


def test_a_torn_tombstone_line_does_not_swallow_the_next_deletion(tmp_path: Path) -> None:
    clock = FakeClock()
    a, _ = make_object(1)
    b, b_payload = make_object(2)
    c, _ = make_object(3)
    with DiskTier(tmp_path, CAPACITY, clock=clock) as tier:
        tier.bury([Tombstone(a.key, 1000.0, 5000.0)])
    with open(tmp_path / "TOMBSTONES", "ab") as f:  # a crash in the middle of an append
        f.write(encode_line(Tombstone(c.key, 1000.0, 5000.0))[:30])
    with DiskTier(tmp_path, CAPACITY, clock=clock) as tier:
        tier.bury([Tombstone(b.key, 1000.0, 5000.0)])  # durable deletion of b …
        assert store(tier, b, b_payload)  # … whose file an ill-timed SIGKILL kept
    with DiskTier(tmp_path, CAPACITY, clock=clock) as tier:
        assert {m.key for m in tier.recovered_tombstones()} == {a.key, b.key}
        assert tier.recovery.tombstoned == 1
        assert load_bytes(tier, b.key) is None


def test_a_meta_too_large_to_read_back_is_not_stored(tmp_path: Path) -> None:
    meta, payload = make_object(1)
    huge = dataclasses.replace(meta, model="m" * (1 << 20))
    with DiskTier(tmp_path, CAPACITY) as tier:
        assert not store(tier, huge, payload)
        assert load_bytes(tier, huge.key) is None and tier.used_bytes == 0
        assert store(tier, meta, payload)
    with DiskTier(tmp_path, CAPACITY) as again:
        assert again.recovery.recovered == 1 and again.recovery.invalid == 0


def _out_of_descriptors(real: Callable[..., int]) -> Callable[..., int]:
    def fake(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".kv"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *args, **kwargs)

    return fake


def test_running_out_of_descriptors_is_a_miss_that_keeps_the_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta, payload = make_object(1)
    tier = DiskTier(tmp_path, CAPACITY)
    assert store(tier, meta, payload)
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", _out_of_descriptors(os.open))
        assert tier.prepare_load(meta.key) is None
    assert tier.take_dropped() == [] and tier.counters.invalidated == 0
    assert load_bytes(tier, meta.key) == payload  # still there, still pinned right
    assert tier.remove(meta.key)  # no pin left behind
    assert store(tier, meta, payload)
    tier.close()
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", _out_of_descriptors(os.open))
        patch.setattr(disk_module, "_RECOVERY_RETRY_S", (0.0, 0.0))
        # Started with the object unindexed, a tenant-wide deletion would miss it and a later
        # start would serve it: the tier refuses to start instead, and releases its lock.
        with pytest.raises(TierError, match="cannot index"):
            DiskTier(tmp_path, CAPACITY)
    with DiskTier(tmp_path, CAPACITY) as again:  # the next start reads it
        assert load_bytes(again, meta.key) == payload


def test_an_object_unreadable_for_a_moment_at_start_is_retried_and_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta, payload = make_object(1)
    with DiskTier(tmp_path, CAPACITY) as tier:
        assert store(tier, meta, payload)
    failures = iter([True, True])
    real_open = os.open

    def flaky(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".kv") and next(failures, False):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_module, "_RECOVERY_RETRY_S", (0.0, 0.0, 0.0))
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", flaky)
        tier = DiskTier(tmp_path, CAPACITY)
    assert tier.recovery.unreadable_at_first == 1 and tier.recovery.recovered == 1
    assert [m.key for m in tier.objects_of("t0")] == [meta.key]  # a deletion reaches it
    assert load_bytes(tier, meta.key) == payload
    tier.close()


def test_recovery_reads_a_file_of_any_claimed_size_in_bounded_memory(tmp_path: Path) -> None:
    """The start-up scan hashes a payload in chunks: a file claiming gigabytes (a sparse file
    with a forged header) costs the chunk's memory, not the file's, and a corrupt one goes."""
    big = 8 * READ_CHUNK_BYTES
    meta, payload = make_object(1, size=big)
    with DiskTier(tmp_path, 4 * big) as tier:
        assert store(tier, meta, payload)
        path = tier.path_of(meta.key)
    parsed, scratch = parse_object(path, bytearray(), 4 * big)
    assert parsed is not None and parsed[0] == meta and len(scratch) <= READ_CHUNK_BYTES
    with open(path, "r+b") as f:  # one flipped byte in the last chunk
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    parsed, scratch = parse_object(path, bytearray(), 4 * big)
    assert parsed is None and len(scratch) <= READ_CHUNK_BYTES
    with DiskTier(tmp_path, 4 * big) as again:
        assert again.recovery.invalid == 1 and load_bytes(again, meta.key) is None


def test_a_symlinked_fan_out_directory_is_neither_followed_nor_written_through(
    tmp_path: Path,
) -> None:
    """Objects live in ``objects/<first two hex digits>/``. A link in place of such a
    directory would take the tier's writes outside its root, where recovery never looks and
    a deletion never reaches: the link is counted as foreign, then replaced by a directory."""
    meta, payload = make_object(1)
    root, outside = tmp_path / "tier", tmp_path / "outside"
    with DiskTier(root, CAPACITY) as tier:
        fan_out = tier.path_of(meta.key).parent
    outside.mkdir()
    fan_out.symlink_to(outside, target_is_directory=True)
    with DiskTier(root, CAPACITY) as tier:
        assert tier.recovery.foreign == 1
        assert store(tier, meta, payload)
        assert load_bytes(tier, meta.key) == payload
    assert not fan_out.is_symlink() and fan_out.is_dir()
    assert list(outside.iterdir()) == []
