"""One contract suite for every tier (host slab, local disk), plus host-specific checks.

The contract is the one in ``kvstrata.tiers.base``: two-phase stores, only verified COMMITTED
objects visible, no room → None, pinned objects not removable, TTL hides objects, bytes
(pending included) never exceed capacity and are accounted per tenant. Disk-only behaviour
(recovery, corruption, disk full) is in ``test_disk_tier.py``, SIGKILL in ``test_disk_crash.py``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.tiers.base import CORRUPT, EXPIRED, Dropped, Tier, TierError
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from tier_helpers import CAPACITY, OBJ, FakeClock, load_bytes, make_object, store


@dataclass
class Case:
    # The concrete union, not ``Tier``: both also offer ``counters`` and ``take_dropped``,
    # which the protocol does not (yet) name. ``_satisfy_protocol`` checks the protocol.
    tier: HostTier | DiskTier | RemoteTier
    clock: FakeClock


def _satisfy_protocol(host: HostTier, disk: DiskTier, remote: RemoteTier) -> tuple[Tier, ...]:
    """Never called: type checkers verify here that every tier satisfies ``Tier``."""
    return host, disk, remote


@pytest.fixture(params=["host", "disk", "remote", "remote-cluster"])
def case(request: pytest.FixtureRequest, tmp_path: Path, remote_namespace: str) -> Iterator[Case]:
    clock = FakeClock()
    tier: HostTier | DiskTier | RemoteTier
    if request.param == "host":
        tier = HostTier(CAPACITY, OBJ, clock=clock)
    elif request.param == "disk":
        tier = DiskTier(tmp_path / "disk", CAPACITY, clock=clock)
    elif request.param == "remote":
        server = request.getfixturevalue("remote_server")
        tier = RemoteTier(
            RemoteConfig(url=server.url, namespace=remote_namespace), CAPACITY, clock=clock
        )
    else:
        cluster = request.getfixturevalue("remote_cluster")
        config = RemoteConfig(cluster=cluster.seeds, namespace=remote_namespace)
        tier = RemoteTier(config, CAPACITY, clock=clock)
    yield Case(tier, clock)
    tier.close()


# ------------------------------------------------------------------ contract (every tier)


def test_round_trip(case: Case) -> None:
    meta, payload = make_object(1)
    assert store(case.tier, meta, payload)
    assert case.tier.contains(meta.key)
    assert case.tier.meta(meta.key) == meta
    assert load_bytes(case.tier, meta.key) == payload
    assert list(case.tier.keys()) == [meta.key]


def test_pending_is_invisible(case: Case) -> None:
    meta, payload = make_object(1)
    slot = case.tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    assert not case.tier.contains(meta.key)
    assert case.tier.prepare_load(meta.key) is None
    assert case.tier.meta(meta.key) is None
    assert list(case.tier.keys()) == []
    assert not case.tier.remove(meta.key)  # not evictable while pending
    assert case.tier.complete_store(slot, True)
    assert case.tier.contains(meta.key)


def test_cancelled_write_leaves_nothing(case: Case) -> None:
    meta, payload = make_object(1)
    slot = case.tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    assert not case.tier.complete_store(slot, False)
    assert not case.tier.contains(meta.key)
    assert case.tier.used_bytes == 0
    assert store(case.tier, meta, payload)  # the key is free again


def test_digest_mismatch_leaves_nothing(case: Case) -> None:
    meta, payload = make_object(1)
    slot = case.tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    slot.buffer[0] ^= 0xFF
    assert not case.tier.complete_store(slot, True)
    assert not case.tier.contains(meta.key)
    assert case.tier.used_bytes == 0
    assert case.tier.counters.invalidated == 1


def test_a_written_digest_replaces_the_commit_pass_and_reads_still_verify(case: Case) -> None:
    meta, payload = make_object(1)
    slot = case.tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    slot.written_digest = bytes(16)  # not the meta's digest: refused, nothing left
    assert not case.tier.complete_store(slot, True)
    assert not case.tier.contains(meta.key) and case.tier.used_bytes == 0
    assert store(case.tier, meta, payload, written_digest=meta.digest)
    assert load_bytes(case.tier, meta.key) == payload
    # A writer whose digest lied commits (the tier trusts it at commit) but is never served:
    # the first read checks the bytes, finds them wrong and drops the object.
    other, other_payload = make_object(2)
    slot = case.tier.prepare_store(other)
    assert slot is not None
    slot.buffer[:] = other_payload
    slot.buffer[0] ^= 0xFF
    slot.written_digest = other.digest
    assert case.tier.complete_store(slot, True)
    assert case.tier.prepare_load(other.key) is None
    assert not case.tier.contains(other.key)
    assert case.tier.counters.invalidated == 2  # the refused write, the read that caught one


def test_slot_completes_once(case: Case) -> None:
    meta, payload = make_object(1)
    slot = case.tier.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    assert case.tier.complete_store(slot, True)
    with pytest.raises(TierError):
        case.tier.complete_store(slot, True)


def test_a_final_meta_of_another_key_or_size_is_refused_and_frees_its_reservation(
    case: Case,
) -> None:
    """``complete_store`` with a final meta that changes the key or size (a caller's bug)
    raises, and leaves no reservation behind: the room and the key are free again."""
    meta, payload = make_object(1)
    other, _ = make_object(2)
    for final in (replace(meta, key=other.key), replace(meta, size=meta.size - 1)):
        slot = case.tier.prepare_store(meta)
        assert slot is not None
        slot.buffer[:] = payload
        slot.meta = final
        with pytest.raises(TierError, match="key, size and tenant"):
            case.tier.complete_store(slot, True)
        assert case.tier.used_bytes == 0
        assert not case.tier.contains(meta.key) and not case.tier.contains(other.key)
        slot = case.tier.prepare_store(meta)  # an abort never raises: it releases
        assert slot is not None
        slot.meta = final
        assert not case.tier.complete_store(slot, False)
        assert case.tier.used_bytes == 0
    assert store(case.tier, meta, payload)  # the key is free again


def test_duplicate_key_returns_none(case: Case) -> None:
    meta, payload = make_object(1)
    slot = case.tier.prepare_store(meta)
    assert slot is not None
    assert case.tier.prepare_store(meta) is None  # pending
    slot.buffer[:] = payload
    assert case.tier.complete_store(slot, True)
    assert case.tier.prepare_store(meta) is None  # committed


def test_capacity_counts_pending(case: Case) -> None:
    slots = [case.tier.prepare_store(make_object(i)[0]) for i in range(4)]
    assert all(s is not None for s in slots)
    assert case.tier.used_bytes == CAPACITY
    assert case.tier.prepare_store(make_object(99)[0]) is None
    small, _ = make_object(100, size=16)
    assert case.tier.prepare_store(small) is None
    for s in slots:
        assert s is not None
        assert not case.tier.complete_store(s, False)
    assert case.tier.used_bytes == 0


def test_capacity_never_exceeded_while_filling(case: Case) -> None:
    stored = 0
    for i in range(10):
        meta, payload = make_object(i, size=OBJ if i % 2 else OBJ // 2)
        slot = case.tier.prepare_store(meta)
        if slot is not None:
            slot.buffer[:] = payload
            assert case.tier.complete_store(slot, True)
            stored += 1
        assert case.tier.used_bytes <= case.tier.capacity_bytes
    assert stored >= 4


def test_remove_refuses_pinned(case: Case) -> None:
    meta, payload = make_object(1)
    assert store(case.tier, meta, payload)
    lease = case.tier.prepare_load(meta.key)
    assert lease is not None
    assert not case.tier.remove(meta.key)
    case.tier.complete_load(lease)
    with pytest.raises(TierError):
        case.tier.complete_load(lease)
    assert case.tier.remove(meta.key)
    assert not case.tier.remove(meta.key)
    assert not case.tier.contains(meta.key)
    assert case.tier.used_bytes == 0


def test_ttl_expiry_hides_and_frees(case: Case) -> None:
    meta, payload = make_object(1, created_at=case.clock.now, ttl=10.0)
    keep, keep_payload = make_object(2, created_at=case.clock.now)
    assert store(case.tier, meta, payload)
    assert store(case.tier, keep, keep_payload)
    case.clock.now += 9.0
    assert load_bytes(case.tier, meta.key) == payload
    case.clock.now += 1.0
    assert not case.tier.contains(meta.key)
    assert case.tier.prepare_load(meta.key) is None
    assert list(case.tier.keys()) == [keep.key]
    assert case.tier.used_bytes == OBJ
    assert case.tier.take_dropped() == [Dropped(meta.key, EXPIRED)]
    assert store(case.tier, meta.with_ttl(None), payload)  # room and key are free again


def test_tenant_accounting(case: Case) -> None:
    a1, pa1 = make_object(1, tenant="a")
    a2, pa2 = make_object(2, tenant="a", size=100)
    b1, pb1 = make_object(3, tenant="b")
    assert store(case.tier, a1, pa1)
    assert store(case.tier, b1, pb1)
    pending = case.tier.prepare_store(a2)
    assert pending is not None
    assert case.tier.tenant_bytes("a") == OBJ + 100  # pending counts
    assert case.tier.tenant_bytes("b") == OBJ
    assert case.tier.tenant_bytes("nobody") == 0
    pending.buffer[:] = pa2
    assert case.tier.complete_store(pending, True)
    assert case.tier.remove(a1.key)
    assert case.tier.tenant_bytes("a") == 100
    assert case.tier.used_bytes == OBJ + 100
    assert sorted(case.tier.keys()) == sorted([a2.key, b1.key])
    meta_b = case.tier.meta(b1.key)
    assert meta_b is not None and meta_b.tenant == "b"


def test_concurrent_use_keeps_invariants(case: Case) -> None:
    """Threads store, load and remove a shared key set: bytes stay right, accounting exact."""
    objects = [make_object(i, size=OBJ // (1 + i % 3)) for i in range(12)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                meta, payload = objects[rng.randrange(len(objects))]
                op = rng.random()
                if op < 0.4:
                    slot = case.tier.prepare_store(meta)
                    if slot is not None:
                        slot.buffer[:] = payload
                        case.tier.complete_store(slot, rng.random() < 0.9)
                elif op < 0.8:
                    got = load_bytes(case.tier, meta.key)
                    assert got is None or got == payload
                else:
                    case.tier.remove(meta.key)
                assert case.tier.used_bytes <= case.tier.capacity_bytes
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    visible = list(case.tier.keys())
    sizes = {meta.key: meta.size for meta, _ in objects}
    assert case.tier.used_bytes == sum(sizes[key] for key in visible)
    assert case.tier.tenant_bytes("t0") == case.tier.used_bytes
    for key in visible:
        assert case.tier.remove(key)
    assert case.tier.used_bytes == 0


def test_closed_tier_refuses_work(case: Case) -> None:
    case.tier.close()
    with pytest.raises(TierError):
        case.tier.prepare_store(make_object(1)[0])


# ------------------------------------------------------------------ host specifics


def test_host_zero_copy_views() -> None:
    tier = HostTier(CAPACITY, OBJ, pin_memory=False)
    meta, payload = make_object(7, size=100)
    slot = tier.prepare_store(meta)
    assert slot is not None
    tier.tensor(slot)[:] = tier.slab.new_tensor(list(payload))
    assert tier.complete_store(slot, True)
    lease = tier.prepare_load(meta.key)
    assert lease is not None
    view = tier.tensor(lease)
    assert view.numel() == 100 and view.data_ptr() >= tier.slab.data_ptr()
    assert bytes(view.numpy()) == payload
    with pytest.raises(TypeError):
        lease.buffer[0] = 0  # read-only
    tier.complete_load(lease)


def test_host_rejects_oversized_object() -> None:
    tier = HostTier(CAPACITY, OBJ, pin_memory=False)
    with pytest.raises(InvalidInput):
        tier.prepare_store(make_object(1, size=OBJ + 1)[0])


def test_host_pinned_slab_when_cuda_present() -> None:
    if torch.cuda.is_available():
        tier = HostTier(CAPACITY, OBJ)
        assert tier.pinned and tier.slab.is_pinned()
    else:
        assert not HostTier(CAPACITY, OBJ).pinned
        with pytest.raises(TierError):
            HostTier(CAPACITY, OBJ, pin_memory=True)


# ------------------------------------------------------------------ read verification (every tier)


def _corrupt(tier: HostTier | DiskTier, key: BlockKey) -> None:
    """Flip one payload byte of a committed object behind the tier's back."""
    if isinstance(tier, HostTier):
        lease = tier.prepare_load(key)
        assert lease is not None
        view = tier.tensor(lease)
        tier.complete_load(lease)
        view[0] ^= 0xFF
    else:
        path = tier.path_of(key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_reads_are_verified_by_default(kind: str, tmp_path: Path) -> None:
    tier: HostTier | DiskTier = (
        HostTier(CAPACITY, OBJ, pin_memory=False)
        if kind == "host"
        else DiskTier(tmp_path / "disk", CAPACITY, durable=False)
    )
    assert tier.verify_reads
    meta, payload = make_object(1)
    assert store(tier, meta, payload)
    _corrupt(tier, meta.key)
    assert tier.prepare_load(meta.key) is None  # a mismatch found on a read: INVALID, gone
    assert tier.counters.invalidated == 1
    assert tier.take_dropped() == [Dropped(meta.key, CORRUPT)]
    assert not tier.contains(meta.key) and tier.used_bytes == 0
    assert store(tier, meta, payload)  # room and key are free again
    assert load_bytes(tier, meta.key) == payload
    tier.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_unverified_reads_trust_committed_bytes(kind: str, tmp_path: Path) -> None:
    tier: HostTier | DiskTier = (
        HostTier(CAPACITY, OBJ, pin_memory=False, verify_reads=False)
        if kind == "host"
        else DiskTier(tmp_path / "disk", CAPACITY, durable=False, verify_reads=False)
    )
    meta, payload = make_object(1)
    assert store(tier, meta, payload)
    _corrupt(tier, meta.key)
    got = load_bytes(tier, meta.key)
    assert got is not None and got != payload and tier.counters.invalidated == 0
    tier.close()


def test_host_slot_of_an_invalidated_object_waits_for_its_readers() -> None:
    tier = HostTier(OBJ, OBJ, pin_memory=False)  # one slot
    meta, payload = make_object(1)
    assert store(tier, meta, payload)
    reader = tier.prepare_load(meta.key)
    assert reader is not None
    tier.tensor(reader)[0] ^= 0xFF  # (a stray write, as a bug elsewhere might do)
    assert tier.prepare_load(meta.key) is None  # invalidated, but the first reader still pins it
    other, other_payload = make_object(2)
    assert tier.prepare_store(other) is None  # its slot is not recycled under the reader
    tier.complete_load(reader)
    assert store(tier, other, other_payload)
    assert load_bytes(tier, other.key) == other_payload
