"""The tiered store over real host and disk tiers: lookup, write policies, demotion, quotas,
rollout, TTL, corruption and restart. Time is a settable clock; nothing sleeps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy
from kvstrata.store.events import ObjectRemoved, ObjectStored
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.tiered import RequestScope, TieredStore
from kvstrata.telemetry.store_metrics import StoreMetrics
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from tier_helpers import FakeClock as Clock

OBJ = 4096


def chain(
    tag: str, n: int, tenant: str = "t0", created_at: float = 1000.0
) -> list[tuple[KVObjectMeta, bytes]]:
    """n objects forming one prefix chain (each the child of the previous)."""
    out: list[tuple[KVObjectMeta, bytes]] = []
    parent: BlockKey | None = None
    for i in range(n):
        key = BlockKey(f"{tenant}/{tag}/{i}".encode().ljust(32, b"."))
        payload = (f"{tag}{i}".encode() * OBJ)[:OBJ]
        meta = KVObjectMeta(
            key=key,
            parent=parent,
            tenant=tenant,
            representation=Representation("uint8", "raw", 1, (OBJ,)),
            size=OBJ,
            digest=payload_digest(payload),
            created_at=created_at,
            position=i,
            recompute_s=0.01 * (i + 1),
        )
        out.append((meta, payload))
        parent = key
    return out


def filler(payload: bytes):  # type: ignore[no-untyped-def]
    def fill(buffer: memoryview) -> None:
        buffer[:] = payload

    return fill


def make_store(
    tmp_path: Path,
    clock: Clock,
    *,
    host_objects: int = 8,
    disk_objects: int = 64,
    host: TierConfig | None = None,
    disk: TierConfig | None = None,
    metrics: StoreMetrics | None = None,
) -> TieredStore:
    levels = [
        (HostTier(host_objects * OBJ, OBJ, clock=clock), LRUPolicy(), host or TierConfig("host")),
        (
            DiskTier(tmp_path / "disk", disk_objects * OBJ, durable=False, clock=clock),
            LRUPolicy(),
            disk or TierConfig("disk"),
        ),
    ]
    return TieredStore(levels, metrics=metrics, clock=clock)


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def store(tmp_path: Path, clock: Clock) -> Iterator[TieredStore]:
    s = make_store(tmp_path, clock)
    yield s
    s.close()


def put_all(store: TieredStore, objs: list[tuple[KVObjectMeta, bytes]]) -> None:
    for meta, payload in objs:
        assert store.put(meta, filler(payload))


def keys_of(objs: list[tuple[KVObjectMeta, bytes]]) -> list[BlockKey]:
    return [m.key for m, _ in objs]


def read(store: TieredStore, key: BlockKey, tenant: str = "t0") -> bytes | None:
    found = store.lookup([key], RequestScope(tenant))
    if not found:
        return None
    with store.load(found[0], tenant) as lease:
        return None if lease is None else bytes(lease.buffer)


def test_write_through_lands_in_both_levels_and_lookup_is_prefix_closed(store: TieredStore) -> None:
    objs = chain("a", 4)
    put_all(store, objs[:2])
    put_all(store, objs[3:])  # block 2 never stored: block 3 is an orphan
    found = store.lookup(keys_of(objs), RequestScope("t0"))
    assert [f.key for f in found] == keys_of(objs)[:2]
    assert all(f.level == 0 for f in found)
    assert store.levels[1].tier.contains(objs[0][0].key)
    assert read(store, objs[1][0].key) == objs[1][1]


def test_host_eviction_demotes_and_disk_serves(tmp_path: Path, clock: Clock) -> None:
    disk = TierConfig("disk", write_policy=WritePolicy.WRITE_BACK)
    store = make_store(tmp_path, clock, host_objects=3, disk=disk)
    objs = chain("b", 6)
    for meta, payload in objs:
        clock.now += 1
        store.put(meta, filler(payload))
    found = store.lookup(keys_of(objs), RequestScope("t0"))
    assert [f.key for f in found] == keys_of(objs)
    assert {f.level for f in found} == {0, 1}
    for meta, payload in objs:
        assert read(store, meta.key) == payload
    store.close()


def test_write_back_queue_is_at_risk_until_flushed(tmp_path: Path, clock: Clock) -> None:
    metrics = StoreMetrics()
    disk = TierConfig("disk", write_policy=WritePolicy.WRITE_BACK)
    store = make_store(tmp_path, clock, disk=disk, metrics=metrics)
    objs = chain("c", 3)
    put_all(store, objs)
    at_risk = metrics.value("kvstrata_writeback_bytes_at_risk", {"tier": "disk"})
    assert at_risk == 3 * OBJ == store.bytes_at_risk(1)
    assert not store.levels[1].tier.contains(objs[0][0].key)
    store.flush()
    assert metrics.value("kvstrata_writeback_bytes_at_risk", {"tier": "disk"}) == 0
    assert all(store.levels[1].tier.contains(m.key) for m, _ in objs)
    store.close()


def test_write_back_flusher_thread_and_close_drain(tmp_path: Path, clock: Clock) -> None:
    disk = TierConfig("disk", write_policy=WritePolicy.WRITE_BACK)
    store = make_store(tmp_path, clock, disk=disk)
    store.start()
    objs = chain("d", 4)
    put_all(store, objs)
    store.close()  # drains whatever the flusher had not written yet
    reopened = DiskTier(tmp_path / "disk", 64 * OBJ, durable=False, clock=clock)
    assert {m.key for m, _ in objs} <= set(reopened.keys())
    reopened.close()


def test_selective_level_admits_on_second_use(tmp_path: Path, clock: Clock) -> None:
    disk = TierConfig("disk", write_policy=WritePolicy.SELECTIVE, selective_min_uses=2)
    store = make_store(tmp_path, clock, disk=disk)
    (meta, payload), (meta2, payload2) = chain("e", 2)
    store.put(meta, filler(payload))
    store.put(meta2, filler(payload2))
    assert not store.levels[1].tier.contains(meta.key)
    assert read(store, meta.key) == payload  # second use
    assert store.levels[1].tier.contains(meta.key)
    assert not store.levels[1].tier.contains(meta2.key)
    store.close()


def test_selective_level_drops_one_hit_objects_on_eviction(tmp_path: Path, clock: Clock) -> None:
    disk = TierConfig("disk", write_policy=WritePolicy.SELECTIVE)
    store = make_store(tmp_path, clock, host_objects=2, disk=disk)
    objs = [chain(f"f{i}", 1)[0] for i in range(4)]
    put_all(store, objs)
    assert (
        store.metrics.value(
            "kvstrata_tier_evictions_total", {"tier": "host", "outcome": "dropped_low_value"}
        )
        == 2
    )
    assert store.levels[1].tier.object_count == 0
    store.close()


def test_tenant_quota_is_hard_and_evicts_own_objects_first(tmp_path: Path, clock: Clock) -> None:
    host = TierConfig("host", tenant_quota_bytes={"greedy": 2 * OBJ})
    store = make_store(tmp_path, clock, host_objects=8, host=host)
    polite = chain("p", 2, tenant="polite")
    put_all(store, polite)
    for meta, payload in chain("g", 5, tenant="greedy"):
        clock.now += 1
        store.put(meta, filler(payload))
        assert store.levels[0].tier.tenant_bytes("greedy") <= 2 * OBJ
    assert all(store.levels[0].tier.contains(m.key) for m, _ in polite)
    # the greedy tenant's evicted blocks were demoted, not lost
    assert len(store.lookup(keys_of(chain("g", 5, tenant="greedy")), RequestScope("greedy"))) == 5
    store.close()


def test_object_over_quota_is_rejected(tmp_path: Path, clock: Clock) -> None:
    host = TierConfig("host", default_tenant_quota_bytes=OBJ // 2)
    disk = TierConfig("disk", default_tenant_quota_bytes=OBJ // 2)
    store = make_store(tmp_path, clock, host=host, disk=disk)
    meta, payload = chain("q", 1)[0]
    assert not store.put(meta, filler(payload))
    assert store.lookup([meta.key], RequestScope("t0")) == []
    store.close()


def test_other_tenant_never_sees_an_object(store: TieredStore) -> None:
    objs = chain("h", 2, tenant="alice")
    put_all(store, objs)
    assert store.lookup(keys_of(objs), RequestScope("bob")) == []
    found = store.lookup(keys_of(objs), RequestScope("alice"))
    assert len(found) == 2
    with store.load(found[0], "bob") as lease:
        assert lease is None


def test_rollback_switch_keeps_data(store: TieredStore) -> None:
    objs = chain("i", 2)
    put_all(store, objs)
    store.set_enabled("host", False)
    found = store.lookup(keys_of(objs), RequestScope("t0"))
    assert [f.level for f in found] == [1, 1]  # host skipped, disk still serves
    extra = chain("j", 1)[0]
    store.put(extra[0], filler(extra[1]))
    assert not store.levels[0].tier.contains(extra[0].key)
    store.set_enabled("host", True)
    assert [f.level for f in store.lookup(keys_of(objs), RequestScope("t0"))] == [0, 0]
    assert store.metrics.value("kvstrata_tier_enabled", {"tier": "host"}) == 1


def test_rollout_targets_tenants_and_canary(tmp_path: Path, clock: Clock) -> None:
    host = TierConfig("host", rollout=RolloutConfig(tenants=frozenset({"beta"})))
    disk = TierConfig("disk", rollout=RolloutConfig(canary_fraction=0.5))
    store = make_store(tmp_path, clock, host=host, disk=disk)
    beta = chain("k", 1, tenant="beta")[0]
    other = chain("k", 1, tenant="other")[0]
    store.put(beta[0], filler(beta[1]), RequestScope("beta", request_id="r1"))
    assert store.levels[0].tier.contains(beta[0].key)
    store.put(other[0], filler(other[1]), RequestScope("other"))
    assert not store.levels[0].tier.contains(other[0].key)
    ids = [f"req-{i}" for i in range(400)]
    share = sum(
        RolloutConfig(canary_fraction=0.5).admits(tenant="x", model="", request_id=r) for r in ids
    ) / len(ids)
    assert 0.4 < share < 0.6
    store.close()


def test_ttl_hides_expired_objects(tmp_path: Path, clock: Clock) -> None:
    host = TierConfig("host", ttl_s=60.0)
    disk = TierConfig("disk", ttl_s=60.0)
    store = make_store(tmp_path, clock, host=host, disk=disk)
    objs = chain("l", 2)
    put_all(store, objs)
    assert len(store.lookup(keys_of(objs), RequestScope("t0"))) == 2
    clock.now += 61
    assert store.lookup(keys_of(objs), RequestScope("t0")) == []
    fresh = chain("m", 3, created_at=clock.now)
    put_all(store, fresh)  # the store keeps working and reclaims the expired room
    assert len(store.lookup(keys_of(fresh), RequestScope("t0"))) == 3
    store.close()


def test_a_tinylfu_level_keeps_a_frequent_victim_over_a_one_off_newcomer(clock: Clock) -> None:
    """TinyLFU's admission in the store: with the level full, a newcomer seen less often than
    the victim is refused (counted as ``admission``) and the victim stays; before, the
    victim was evicted first and the newcomer stored at LRU's cold end anyway."""
    from kvstrata.store.tinylfu import TinyLFUPolicy

    host = HostTier(2 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, TinyLFUPolicy(), TierConfig("host"))], clock=clock)
    hot = chain("hot", 2, created_at=clock.now)
    for _ in range(3):
        put_all(store, hot)  # re-stores count as requests
    ((once, payload),) = chain("once", 1, created_at=clock.now)
    assert not store.put(once, filler(payload))
    assert len(store.lookup(keys_of(hot), RequestScope("t0"))) == 2
    refused = {"tier": "host", "reason": "admission"}
    assert store.metrics.value("kvstrata_tier_admission_rejections_total", refused) == 1
    store.close()


def _sized(tag: str, size: int, clock: Clock) -> tuple[KVObjectMeta, bytes]:
    payload = (tag.encode() * size)[:size]
    meta = KVObjectMeta(
        key=BlockKey(f"t0/{tag}".encode().ljust(32, b".")),
        parent=None,
        tenant="t0",
        representation=Representation("uint8", "raw", 1, (size,)),
        size=size,
        digest=payload_digest(payload),
        created_at=clock.now,
        position=0,
        recompute_s=0.01,
    )
    return meta, payload


def test_tinylfu_is_asked_once_per_store_even_when_it_takes_two_victims(clock: Clock) -> None:
    """A newcomer that needs two victims (here under a tenant quota) is compared once, with
    the first: asked again per victim, it could win the first (evicted) and lose the second
    (refused), room freed for nothing, and each ask counted the request again."""
    from kvstrata.store.tinylfu import TinyLFUPolicy

    policy = TinyLFUPolicy()
    quota = TierConfig("host", tenant_quota_bytes={"t0": 2 * OBJ})
    store = TieredStore([(HostTier(8 * OBJ, OBJ, clock=clock), policy, quota)], clock=clock)
    small_a, small_b, big, new = (
        _sized("A", OBJ // 2, clock),
        _sized("B", OBJ // 2, clock),
        _sized("C", OBJ, clock),
        _sized("N", OBJ, clock),
    )
    for obj, times in ((small_a, 1), (small_b, 5), (big, 5)):
        for _ in range(times):
            clock.now += 1
            store.put(obj[0], filler(obj[1]))
    tier = store.levels[0].tier
    assert not store.put(new[0], filler(new[1]))  # seen once, as often as A: refused
    assert tier.contains(small_a[0].key) and tier.contains(small_b[0].key)
    assert policy.sketch.estimate(new[0].key) == 1  # one request, counted once
    assert store.put(new[0], filler(new[1]))  # seen twice: beats A, so A and B make room
    assert policy.sketch.estimate(new[0].key) == 2
    assert tier.contains(new[0].key) and tier.contains(big[0].key)
    assert tier.tenant_bytes("t0") == 2 * OBJ
    store.close()


def test_a_transfer_into_a_full_tinylfu_level_is_not_filtered(clock: Clock) -> None:
    """KV received over a P/D transfer is needed now: a fresh block (seen once) would lose to
    any victim, and every transfer into a full TinyLFU level was refused."""
    from kvstrata.store.tinylfu import TinyLFUPolicy
    from kvstrata.transfer.ingress import StoreIngress

    store = TieredStore(
        [(HostTier(4 * OBJ, OBJ, clock=clock), TinyLFUPolicy(), TierConfig("host"))], clock=clock
    )
    for i in range(4):
        clock.now += 1
        meta, payload = _sized(f"old{i}", OBJ, clock)
        store.put(meta, filler(payload))
    ingress = StoreIngress(store)
    for i in range(3):
        slot = ingress.prepare_store(_sized(f"xfer{i}", OBJ, clock)[0])
        assert slot is not None, i
        ingress.complete_store(slot, False)
    store.close()


def test_an_object_older_than_a_levels_ttl_evicts_nothing_there(
    tmp_path: Path, clock: Clock
) -> None:
    """An object already past a level's TTL (a block that waited in the device pool, a
    demotion into a level with a shorter TTL) is refused there before any victim goes: it
    used to evict a live object and then be dropped as expired on sight."""
    host = HostTier(2 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host", ttl_s=60.0))], clock=clock)
    live = chain("live", 2, created_at=clock.now)
    put_all(store, live)
    clock.now += 30  # the live objects have 30 s left
    ((old, payload),) = chain("old", 1, created_at=clock.now - 100)
    assert not store.put(old, filler(payload))
    assert len(store.lookup(keys_of(live), RequestScope("t0"))) == 2
    rejected = store.metrics.value(
        "kvstrata_tier_admission_rejections_total", {"tier": "host", "reason": "expired"}
    )
    assert rejected == 1
    store.close()

    store = make_store(
        tmp_path, clock, host_objects=3, disk_objects=2, disk=TierConfig("disk", ttl_s=60.0)
    )
    ((hot, hot_payload),) = chain("hot", 1, created_at=clock.now)
    assert store.put(hot, filler(hot_payload))  # host and disk (write-through)
    clock.now += 100  # hot stays in host; its disk copy expired
    store.resident()  # sweeps the expired disk copy
    fresh = [chain(tag, 1, created_at=clock.now)[0] for tag in ("l1", "l2", "n")]
    put_all(store, fresh[:2])  # host [hot l1 l2], disk [l1 l2]
    assert store.put(fresh[2][0], filler(fresh[2][1]))  # host evicts hot: too old for disk
    disk = store.levels[1].tier
    assert not disk.contains(hot.key)
    refused = {"tier": "disk", "reason": "expired"}
    assert store.metrics.value("kvstrata_tier_admission_rejections_total", refused) == 1
    # the only disk victim is the one n's own write-through needed (l1), none for hot
    dropped = {"tier": "disk", "outcome": "dropped"}
    assert store.metrics.value("kvstrata_tier_evictions_total", dropped) == 1
    assert disk.contains(fresh[1][0].key) and disk.contains(fresh[2][0].key)
    store.close()


@pytest.mark.parametrize("quota", [None, 2 * OBJ])
def test_a_level_full_of_expired_objects_takes_the_next_put(
    clock: Clock, quota: int | None
) -> None:
    """After an idle spell longer than the TTL, the expired objects the victim search drops
    on sight make the room (or the tenant's quota): the next put was refused as no_room /
    quota_full."""
    host = HostTier((2 if quota is None else 8) * OBJ, OBJ, clock=clock)
    config = TierConfig("host", ttl_s=60.0, default_tenant_quota_bytes=quota)
    store = TieredStore([(host, LRUPolicy(), config)], clock=clock)
    put_all(store, chain("a", 2))
    clock.now += 61  # both expired; nobody looked at them since
    ((meta, payload),) = chain("b", 1, created_at=clock.now)
    assert store.put(meta, filler(payload))
    assert len(store.lookup([meta.key], RequestScope("t0"))) == 1
    store.close()


def test_bit_flip_on_disk_is_detected_and_counted(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock)
    objs = chain("n", 2)
    put_all(store, objs)
    store.set_enabled("host", False)
    disk = store.levels[1].tier
    assert isinstance(disk, DiskTier)
    path = disk.path_of(objs[1][0].key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    found = store.lookup(keys_of(objs), RequestScope("t0"))
    assert len(found) == 2
    assert read(store, objs[0][0].key) == objs[0][1]
    with store.load(found[1], "t0") as lease:
        assert lease is None
    assert (
        store.metrics.value(
            "kvstrata_tier_invalidated_total", {"tier": "disk", "reason": "digest_mismatch"}
        )
        == 1
    )
    assert len(store.lookup(keys_of(objs), RequestScope("t0"))) == 1
    store.close()


def test_restart_recovers_disk_objects_into_the_policy(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock)
    objs = chain("o", 3)
    put_all(store, objs)
    store.close()
    again = make_store(tmp_path, clock, disk_objects=3)
    found = again.lookup(keys_of(objs), RequestScope("t0"))
    assert [f.level for f in found] == [1, 1, 1]
    more = chain("o2", 2)
    put_all(again, more)  # full disk: the recovered objects must be evictable (policy knows them)
    assert len(again.lookup(keys_of(more), RequestScope("t0"))) == 2
    again.close()


def test_delete_removes_every_replica(store: TieredStore) -> None:
    objs = chain("r", 2)
    put_all(store, objs)
    assert store.delete(keys_of(objs)) == 4
    assert store.lookup(keys_of(objs), RequestScope("t0")) == []


def test_change_feed_records_commits_and_removals_in_order(tmp_path: Path, clock: Clock) -> None:
    levels = [
        (HostTier(2 * OBJ, OBJ, clock=clock), LRUPolicy(), TierConfig("host", ttl_s=60.0)),
        (
            DiskTier(tmp_path / "disk", 8 * OBJ, durable=False, clock=clock),
            LRUPolicy(),
            TierConfig("disk"),
        ),
    ]
    store = TieredStore(levels, clock=clock, record_events=True)
    a, b = chain("ev", 2, tenant="alice", created_at=clock())
    put_all(store, [a])
    stored = store.take_events()
    assert stored == [ObjectStored("host", stored[0].meta), ObjectStored("disk", stored[1].meta)]
    assert all(isinstance(e, ObjectStored) and e.meta.key == a[0].key for e in stored)
    assert store.take_events() == []  # drained
    clock.now += 61  # the host copy expires: the tier drops it by itself, the tenant is kept
    assert [f.level for f in store.lookup([a[0].key], RequestScope("alice"))] == [1]
    assert store.take_events() == [ObjectRemoved("host", a[0].key, "alice")]
    b = (replace(b[0], created_at=clock()), b[1])
    put_all(store, [b])
    assert [type(e) for e in store.take_events()] == [ObjectStored, ObjectStored]
    assert store.delete([b[0].key]) == 2
    assert store.take_events() == [
        ObjectRemoved("host", b[0].key, "alice"),
        ObjectRemoved("disk", b[0].key, "alice"),
    ]
    store.close()
    again = make_store(tmp_path, clock)  # without record_events: nothing recorded
    assert again.take_events() == []
    again.close()
    levels[1] = (
        DiskTier(tmp_path / "disk", 8 * OBJ, durable=False, clock=clock),
        LRUPolicy(),
        TierConfig("disk"),
    )
    levels[0] = (HostTier(2 * OBJ, OBJ, clock=clock), LRUPolicy(), TierConfig("host"))
    recovered = TieredStore(levels, clock=clock, record_events=True)
    [first] = recovered.take_events()  # recovered objects come first, as stored events
    assert first == ObjectStored("disk", first.meta) and first.meta.key == a[0].key
    recovered.close()
