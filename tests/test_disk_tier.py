"""Disk-tier specifics: recovery after restart, bit flips, damaged files, disk full, I/O errors.

The shared contract runs in ``test_tier_contract.py``; crash safety under SIGKILL in
``test_disk_crash.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.config import WorkerConfig, disk_tier
from kvstrata.runtime.store_factory import build_store
from kvstrata.tiers.base import CORRUPT, Dropped, TierError
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.disk_format import READ_CHUNK_BYTES
from tier_helpers import CAPACITY, OBJ, FakeClock, load_bytes, make_object, store


def test_disk_recovery_after_restart(tmp_path: Path) -> None:
    objects = [make_object(i, size=OBJ - i, tenant=f"t{i % 2}") for i in range(4)]
    with DiskTier(tmp_path, CAPACITY) as tier:
        for meta, payload in objects:
            assert store(tier, meta, payload)
    with DiskTier(tmp_path, CAPACITY) as again:
        assert again.recovery.recovered == 4
        for meta, payload in objects:
            assert again.meta(meta.key) == meta
            assert load_bytes(again, meta.key) == payload
        assert again.tenant_bytes("t0") == objects[0][0].size + objects[2][0].size


def test_disk_directory_is_exclusive(tmp_path: Path) -> None:
    with DiskTier(tmp_path, CAPACITY), pytest.raises(TierError):
        DiskTier(tmp_path, CAPACITY)


def test_disk_bit_flip_invalidates(tmp_path: Path) -> None:
    meta, payload = make_object(1)
    with DiskTier(tmp_path, CAPACITY) as tier:
        assert store(tier, meta, payload)
        path = tier.path_of(meta.key)
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0x04
        path.write_bytes(raw)
        assert tier.prepare_load(meta.key) is None
        assert tier.counters.invalidated == 1
        assert not path.exists()
        assert not tier.contains(meta.key)
        assert tier.take_dropped() == [Dropped(meta.key, CORRUPT)]
        assert store(tier, meta, payload)  # a fresh store works
        assert load_bytes(tier, meta.key) == payload


@pytest.mark.parametrize("flip_at", [0, READ_CHUNK_BYTES - 1, READ_CHUNK_BYTES, -1])
def test_disk_reads_hash_in_chunks_and_catch_a_flip_in_any_chunk(
    tmp_path: Path, flip_at: int
) -> None:
    """A payload of several read chunks (hashed chunk by chunk as read) loads intact, and one
    flipped bit in the first, a middle or the last chunk is caught."""
    size = 2 * READ_CHUNK_BYTES + 123
    meta, payload = make_object(3, size=size)
    with DiskTier(tmp_path, 4 * size) as tier:
        assert store(tier, meta, payload)
        assert load_bytes(tier, meta.key) == payload
        path = tier.path_of(meta.key)
        raw = bytearray(path.read_bytes())
        raw[len(raw) - size + flip_at if flip_at >= 0 else flip_at] ^= 0x10
        path.write_bytes(raw)
        assert tier.prepare_load(meta.key) is None
        assert tier.counters.invalidated == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "meta_flip", "renamed", "payload_flip"])
def test_disk_recovery_cleans_damaged_files(tmp_path: Path, damage: str) -> None:
    good, good_payload = make_object(1)
    bad, bad_payload = make_object(2)
    with DiskTier(tmp_path, CAPACITY) as tier:
        assert store(tier, good, good_payload)
        assert store(tier, bad, bad_payload)
        path = tier.path_of(bad.key)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(raw)))
    elif damage == "meta_flip":
        path.write_bytes(raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])
    elif damage == "payload_flip":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0x80]))
    else:
        path.rename(path.with_name("ab" * 32 + ".kv"))
        path = path.with_name("ab" * 32 + ".kv")
    temp = path.parent / ".leftover.123.0.tmp"
    temp.write_bytes(b"half an object")
    with DiskTier(tmp_path, CAPACITY) as again:
        assert again.recovery.invalid == 1
        assert again.recovery.temp_removed == 1
        assert again.counters.invalidated == 1
        assert not path.exists() and not temp.exists()
        assert list(again.keys()) == [good.key]
        assert load_bytes(again, good.key) == good_payload


def test_objects_invalidated_by_the_recovery_scan_are_counted(tmp_path: Path) -> None:
    objects = [make_object(i) for i in range(10)]
    with DiskTier(tmp_path, 16 * OBJ) as tier:
        for meta, payload in objects:
            assert store(tier, meta, payload)
        paths = [tier.path_of(meta.key) for meta, _ in objects]
    for path in paths[:8]:  # bit rot in eight payloads
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01
        path.write_bytes(raw)
    registry = CollectorRegistry()
    config = WorkerConfig(tiers=(disk_tier(tmp_path, 16 * OBJ),))
    restarted = build_store(OBJ, config, registry)  # what `kvstrata serve` builds at start
    assert restarted is not None
    try:
        labels = {"tier": "disk", "reason": "recovery_scan"}
        assert registry.get_sample_value("kvstrata_tier_invalidated_total", labels) == 8
        assert registry.get_sample_value("kvstrata_tier_objects", {"tier": "disk"}) == 2
        assert sorted(restarted.levels[0].tier.keys()) == sorted(m.key for m, _ in objects[8:])
    finally:
        restarted.close()
    clean = CollectorRegistry()
    again = build_store(OBJ, config, clean)  # nothing left to invalidate: no count
    assert again is not None
    again.close()
    assert clean.get_sample_value("kvstrata_tier_invalidated_total", labels) is None


def test_disk_recovery_respects_capacity_and_ttl(tmp_path: Path) -> None:
    objects = [make_object(i, created_at=1000.0 + i) for i in range(4)]
    with DiskTier(tmp_path, CAPACITY) as tier:
        for meta, payload in objects:
            assert store(tier, meta, payload)
    clock = FakeClock()
    expiring, exp_payload = make_object(9, created_at=clock.now, ttl=5.0)
    with DiskTier(tmp_path, 2 * CAPACITY, clock=clock) as tier:
        assert store(tier, expiring, exp_payload)
    clock.now += 5.0
    with DiskTier(tmp_path, 2 * OBJ, clock=clock) as smaller:
        assert smaller.recovery.expired == 1
        assert smaller.recovery.over_capacity == 2
        assert sorted(smaller.keys()) == sorted([objects[3][0].key, objects[2][0].key])


def _assert_failed_cleanly(tier: DiskTier, committed: list[tuple[KVObjectMeta, bytes]]) -> None:
    assert not list(tier.root.glob("objects/*/*.tmp"))
    assert tier.used_bytes == sum(m.size for m, _ in committed)
    for meta, payload in committed:
        assert load_bytes(tier, meta.key) == payload


def _fill_until_error(tier: DiskTier, size: int) -> list[tuple[KVObjectMeta, bytes]]:
    committed: list[tuple[KVObjectMeta, bytes]] = []
    for i in range(1000):
        meta, payload = make_object(i + 1, size=size)
        try:
            assert store(tier, meta, payload)
        except TierError:
            assert not tier.contains(meta.key)
            assert tier.counters.store_failures == 1
            return committed
        committed.append((meta, payload))
    raise AssertionError("the medium never filled up")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_on_real_tmpfs(small_tmpfs: Path) -> None:
    with DiskTier(small_tmpfs, 64 * OBJ * 16) as tier:
        committed = _fill_until_error(tier, 16 * OBJ)
        assert committed, "at least one object fits in 512 KiB"
        _assert_failed_cleanly(tier, committed)
        assert tier.remove(committed[0][0].key)  # space comes back and stores work again
        retry, retry_payload = make_object(5000, size=16 * OBJ)
        assert store(tier, retry, retry_payload)


def test_disk_io_error_during_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with DiskTier(tmp_path, CAPACITY) as tier:
        ok, ok_payload = make_object(1)
        assert store(tier, ok, ok_payload)

        def failing_fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fsync", failing_fsync)
        meta, payload = make_object(2)
        with pytest.raises(TierError):
            store(tier, meta, payload)
        monkeypatch.undo()
        assert not tier.contains(meta.key) and not tier.path_of(meta.key).exists()
        _assert_failed_cleanly(tier, [(ok, ok_payload)])


_RLIMIT_CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    from kvstrata.identity import BlockKey
    from kvstrata.objects import KVObjectMeta, Representation, payload_digest
    from kvstrata.tiers.base import TierError
    from kvstrata.tiers.disk import DiskTier

    def make_object(seed, size):
        payload = bytes([seed % 251]) * size
        meta = KVObjectMeta(
            key=BlockKey(seed.to_bytes(4, "little") * 8), parent=None, tenant="t",
            representation=Representation("uint8", "raw", 1, (size,)), size=size,
            digest=payload_digest(payload), created_at=0.0,
        )
        return meta, payload

    def store(tier, meta, payload):
        slot = tier.prepare_store(meta)
        slot.buffer[:] = payload
        return tier.complete_store(slot, True)

    def assert_readable(tier, committed):
        assert not list(tier.root.glob("objects/*/*.tmp"))
        for meta, payload in committed:
            lease = tier.prepare_load(meta.key)
            assert bytes(lease.buffer) == payload
            tier.complete_load(lease)

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    tier = DiskTier(sys.argv[1], 1 << 30)
    resource.setrlimit(resource.RLIMIT_FSIZE, (48 * 1024, 48 * 1024))
    committed = [make_object(i, size=8192) for i in range(3)]
    for meta, payload in committed:
        assert store(tier, meta, payload)
    big, big_payload = make_object(100, size=64 * 1024)
    try:
        store(tier, big, big_payload)
    except TierError as exc:
        assert "File too large" in str(exc), exc
    else:
        raise AssertionError("a write past RLIMIT_FSIZE succeeded")
    assert not tier.contains(big.key) and not tier.path_of(big.key).exists()
    assert_readable(tier, committed)
    late, late_payload = make_object(200, size=8192)
    assert store(tier, late, late_payload)  # the tier carries on
    print("ok")
    """
)


def test_disk_file_size_limit_in_child(tmp_path: Path) -> None:
    """Portable disk-full: RLIMIT_FSIZE makes writes fail with EFBIG in a child process."""
    proc = subprocess.run(
        [sys.executable, "-c", _RLIMIT_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")
