"""Deletion with tombstones: the store's levels, the disk tier's recovery, the remote server
(real Valkey), the device pool and the engine that composes them (tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvstrata.engine.engine import EngineConfig, ReferenceEngine, pool_config_for
from kvstrata.engine.kv_pool import BlockState, PagedKVPool, PoolConfig
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.objects.tombstone import ObjectRef, Tombstone
from kvstrata.runtime.blocks import DELETED, BlockInfo, EvictedBlock, ResidentBlock
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.security.audit import AuditLog
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.deletion import DeleteSelector, select
from kvstrata.store.levels import RequestScope
from kvstrata.store.policies import LRUPolicy, SharedLedgerPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.store.tombstones import Tombstones
from kvstrata.tiers.base import TierError
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.disk_tombstones import FILE_NAME, TombstoneFile, encode_line
from kvstrata.tiers.host import HostTier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from kvstrata.tiers.remote_format import decode_meta, key_of_meta, meta_pattern
from kvstrata.tiers.remote_tombstones import tomb_key
from tier_helpers import OBJ, FakeClock, make_object

B = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def key(n: int) -> BlockKey:
    return BlockKey(n.to_bytes(4, "little") * 8)


def chain_of(seeds: list[int], tenant: str, created_at: float) -> list[tuple[KVObjectMeta, bytes]]:
    """Objects whose parents are the previous seed's (a chain), created at ``created_at``."""
    out = []
    parent = None
    for seed in seeds:
        meta, payload = make_object(seed, tenant=tenant, created_at=created_at)
        meta = replace(meta, parent=parent)
        out.append((meta, payload))
        parent = meta.key
    return out


def put(store: TieredStore, meta: KVObjectMeta, payload: bytes) -> bool:
    def fill(buffer: memoryview) -> None:
        buffer[:] = payload

    return store.put(meta, fill, RequestScope(meta.tenant))


def two_level_store(
    tmp_path: Path, clock: FakeClock, *, write_back: bool = False, **kw: object
) -> TieredStore:
    disk_policy = WritePolicy.WRITE_BACK if write_back else WritePolicy.WRITE_THROUGH
    levels = [
        (HostTier(16 * OBJ, OBJ, clock=clock), LRUPolicy(), TierConfig("host")),
        (
            DiskTier(tmp_path / "disk", 16 * OBJ, durable=False, clock=clock),
            LRUPolicy(),
            TierConfig("disk", disk_policy),
        ),
    ]
    return TieredStore(levels, clock=clock, **kw)  # type: ignore[arg-type]


def held_keys(store: TieredStore) -> dict[str, set[BlockKey]]:
    return {name: {m.key for m in metas} for name, metas in store.resident()}


# ---- the pure pieces ------------------------------------------------------------------------
def test_tombstones_refuse_what_was_created_before_until_they_expire() -> None:
    marks = Tombstones(ttl_s=100.0)
    mark = marks.add(key(1), deleted_at=1000.0)
    assert mark == Tombstone(key(1), 1000.0, 1100.0)
    assert marks.covers(key(1), created_at=999.0, now=1050.0)
    assert marks.covers(key(1), created_at=1000.0, now=1050.0)  # at the deletion: refused
    assert not marks.covers(key(1), created_at=1000.5, now=1050.0)  # recomputed after: allowed
    assert not marks.covers(key(2), created_at=0.0, now=1050.0)
    assert not marks.covers(key(1), created_at=999.0, now=1100.0)  # expired
    assert len(marks) == 0
    marks.add(key(3), 2000.0)
    marks.add(key(3), 1500.0)  # an older deletion does not shorten a newer one
    assert marks.get(key(3), 2050.0) == Tombstone(key(3), 2000.0, 2100.0)
    assert marks.expire(2100.0) == 1 and len(marks) == 0
    with pytest.raises(InvalidInput):
        Tombstones(0.0)


def test_select_follows_descendants_across_holders_and_keeps_other_tenants() -> None:
    refs = [
        ObjectRef(key(1), None, "acme", 10.0),
        ObjectRef(key(2), key(1), "acme", 20.0),  # known to one holder ...
        ObjectRef(key(3), key(2), "acme", None),  # ... its child to another (no time known)
        ObjectRef(key(4), key(1), "acme", 90.0),
        ObjectRef(key(5), None, "acme", 95.0),
        ObjectRef(key(6), key(1), "other", 1.0),  # another tenant's (cannot chain, but filter)
    ]
    assert select(DeleteSelector("acme", keys=(key(2),)), refs, now=100.0) == [key(2), key(3)]
    assert set(select(DeleteSelector("acme", all=True), refs, 100.0)) == {
        key(i) for i in range(1, 6)
    }
    old = select(DeleteSelector("acme", older_than_s=50.0), refs, now=100.0)
    assert old[:2] == [key(1), key(2)] and set(old) == {key(1), key(2), key(3), key(4)}
    assert select(DeleteSelector("acme", older_than_s=0.0), refs, 100.0)[-1] == key(3)
    for bad in ({}, {"all": True, "keys": (key(1),)}, {"older_than_s": -1.0}):
        with pytest.raises(InvalidInput):
            DeleteSelector("acme", **bad)  # type: ignore[arg-type]


# ---- the device pool ------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.evicted: list[EvictedBlock] = []

    def block_committed(self, block: ResidentBlock) -> None:
        pass

    def block_evicted(self, block: EvictedBlock) -> None:
        self.evicted.append(block)


def test_pool_delete_frees_free_blocks_and_unpublishes_held_ones() -> None:
    heard = Recorder()
    pool = PagedKVPool(PoolConfig(8, 4, 1, 1, 2), listeners=[heard])
    ids = []
    parent = None
    for n in range(1, 4):  # chain 1 → 2 → 3, plus 9 under 1, plus an unrelated root 7
        block = pool.allocate(key(n), parent, BlockInfo("acme", 0))
        assert block is not None
        pool.commit(block)
        ids.append(block)
        parent = key(n)
    for n, parent_key in ((9, key(1)), (7, None)):
        block = pool.allocate(key(n), parent_key, BlockInfo("acme", 0))
        assert block is not None
        pool.commit(block)
    pool.acquire([ids[1]])  # a running sequence reads block 2
    result = pool.delete([key(1)])
    assert set(result.removed) == {key(1), key(3), key(9)} and result.held == [key(2)]
    assert [e.reason for e in heard.evicted] == [DELETED] * 4
    keys_heard = [e.key for e in heard.evicted]
    assert keys_heard.index(key(3)) < keys_heard.index(key(2)) < keys_heard.index(key(1))
    assert [b.key for b in pool.committed_blocks()] == [key(7)]
    assert pool.lookup_prefix([key(1)]) == [] and not pool.contains(key(2))
    assert pool._blocks[ids[1]].state is BlockState.UNPUBLISHED
    assert pool.blocks_free == 8 - 2
    # nothing can be built on the unpublished block, and it is freed at its release
    scratch = pool.allocate_scratch()
    assert scratch is not None
    assert not pool.publish(scratch, key(4), key(2))
    pool.free_scratch(scratch)
    pool.release([ids[1]])
    assert pool.blocks_free == 8 - 1 and pool.evictions == 0


# ---- the store: every level, write-back, pins, audit ---------------------------------------
@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


def test_store_delete_removes_prefix_and_descendants_on_every_level(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = two_level_store(tmp_path, clock, record_events=True)
    prefix = chain_of([1, 2, 3], "acme", clock.now)
    branch = chain_of([4], "acme", clock.now)
    branch = [(replace(branch[0][0], parent=key(1)), branch[0][1])]
    other_prefix = chain_of([5, 6], "acme", clock.now)
    other_tenant = chain_of([7, 8], "beta", clock.now)
    for meta, payload in prefix + branch + other_prefix + other_tenant:
        assert put(store, meta, payload)
    store.take_events()
    survey = store.objects_of("acme")
    assert {r.key for r in survey.refs} == {key(n) for n in range(1, 7)} and not survey.unreachable
    keys = select(DeleteSelector("acme", keys=(key(1),)), survey.refs, clock.now)
    result = store.delete_keys(keys)
    assert result.removed == {"host": 4, "disk": 4} and result.pending == 0
    held = held_keys(store)
    for name in ("host", "disk"):
        assert held[name] == {key(5), key(6), key(7), key(8)}
    assert len(store.take_events()) == 8  # one removal per replica, for the index
    store.close()


def test_all_and_older_than_select_the_tenants_objects(tmp_path: Path, clock: FakeClock) -> None:
    store = two_level_store(tmp_path, clock)
    old = chain_of([1, 2], "acme", created_at=clock.now - 3600)
    young = chain_of([3], "acme", created_at=clock.now)
    young_child_of_old = [(replace(young[0][0], key=key(4), parent=key(2)), young[0][1])]
    for meta, payload in old + young + young_child_of_old + chain_of([5], "beta", 0.0):
        assert put(store, meta, payload)
    refs = store.objects_of("acme").refs
    keys = select(DeleteSelector("acme", older_than_s=600.0), refs, clock.now)
    assert set(keys) == {key(1), key(2), key(4)}  # the old ones and what hangs under them
    store.delete_keys(keys)
    assert held_keys(store)["host"] == {key(3), key(5)}
    everything = select(DeleteSelector("acme", all=True), store.objects_of("acme").refs, clock.now)
    store.delete_keys(everything)
    assert held_keys(store) == {"host": {key(5)}, "disk": {key(5)}}
    store.close()


def test_a_write_back_queued_before_the_delete_never_lands_and_late_writes_are_refused(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The delete removes the host copy before the flush, so the queued write-back finds no
    source (the race with a write-back under way is the next test); a late put of the old
    object is refused by the tombstone, a recomputed one is not."""
    audit_path = tmp_path / "audit.jsonl"
    audit = AuditLog(audit_path).start()
    store = two_level_store(tmp_path, clock, write_back=True, audit=audit)  # flusher not started
    ((meta, payload),) = chain_of([1], "acme", clock.now)
    assert put(store, meta, payload)
    assert store.bytes_at_risk(1) == OBJ  # queued for the disk
    clock.now += 1
    assert store.delete([meta.key]) == 1
    store.flush()  # the late flush
    assert held_keys(store) == {"host": set(), "disk": set()}
    # a late demotion or write-back of the old object (created before the delete): refused
    assert not put(store, meta, payload)
    assert (
        store.metrics.value(
            "kvstrata_tier_admission_rejections_total", {"tier": "host", "reason": "tombstoned"}
        )
        == 1
    )
    assert store.lookup([meta.key], RequestScope("acme")) == []
    # recomputed after the delete: allowed, deletion removes data, it does not ban a prompt
    clock.now += 1
    fresh = replace(meta, created_at=clock.now)
    assert put(store, fresh, payload)
    store.flush()
    assert held_keys(store) == {"host": {meta.key}, "disk": {meta.key}}
    store.close()
    audit.close()
    lines = [json.loads(line) for line in audit_path.read_text().splitlines()]
    refused = [line for line in lines if line["audit"] == "tombstone_refused"]
    assert refused and refused[0]["objects"] == [meta.key.hex()]
    assert refused[0]["tenant"] == "acme" and refused[0]["reason"] == "late_write"


@pytest.mark.parametrize("point", ["prepare_store", "complete_store"])
def test_a_write_back_in_flight_when_the_delete_lands_never_lands(
    tmp_path: Path, clock: FakeClock, point: str
) -> None:
    """The flusher has read the host copy and is writing the disk one when the delete comes
    (before the disk reservation, or between it and the commit): its write is refused by
    the tombstone, and the object is in no level afterwards. (The test above deletes before
    the flush, when the write-back finds no source at all.)"""
    store = two_level_store(tmp_path, clock, write_back=True)  # flusher not started
    ((meta, payload),) = chain_of([1], "acme", clock.now)
    assert put(store, meta, payload)
    disk = store.levels[1].tier
    real = getattr(disk, point)
    deleted: list[int] = []
    seen_after: list[object] = []

    def delete_then(*args: object) -> object:
        if not deleted:
            clock.now += 1
            deleted.append(store.delete([meta.key]))
        result = real(*args)
        seen_after.append(store.lookup([meta.key], RequestScope("acme")))
        return result

    setattr(disk, point, delete_then)
    store.flush()
    assert deleted  # the delete came while the write-back ran
    assert seen_after and all(found == [] for found in seen_after)  # never visible again
    assert held_keys(store) == {"host": set(), "disk": set()}
    assert not any(disk.contains(meta.key) for disk in [store.levels[1].tier])
    store.close()


def test_older_than_reaches_a_block_demoted_after_it_was_computed(
    tiny_model: LoadedModel,
) -> None:
    """A block computed long ago and demoted just now keeps its compute time: the demotion
    stamped the copy's time, so ``older_than`` missed it (and TTLs restarted)."""
    block = pool_config_for(tiny_model, 16, 1).bytes_per_block
    config = TierConfig("host", write_policy=WritePolicy.WRITE_BACK)
    store = TieredStore([(HostTier(64 * block, block), LRUPolicy(), config)])
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=16, pool_blocks=32), store=store)
    try:
        prompt = [int(t) for t in np.random.default_rng(1).integers(10, 4000, size=3 * 16 + 1)]
        engine.generate(prompt, SamplingParams(max_tokens=1), tenant="acme").run()
        keys = engine.block_keys(prompt, "acme")
        time.sleep(0.4)  # the KV is now 0.4 s old
        engine.call(engine.pool.clear).result()  # evicted: demoted into the host level now
        assert all(store.levels[0].tier.contains(k) for k in keys)
        selector = DeleteSelector("acme", older_than_s=0.3)
        engine.call(lambda: engine.delete(selector)).result()
        assert [k for k in keys if store.levels[0].tier.contains(k)] == []
    finally:
        engine.close()


def test_a_pinned_replica_is_invisible_at_once_and_goes_when_released(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = two_level_store(tmp_path, clock)
    ((meta, payload),) = chain_of([1], "acme", clock.now)
    assert put(store, meta, payload)
    found = store.lookup([meta.key], RequestScope("acme"))
    with store.load(found[0], "acme") as lease:
        assert lease is not None
        result = store.delete_keys([meta.key])
        assert result.removed == {"host": 0, "disk": 1} and result.pending == 1
        assert store.lookup([meta.key], RequestScope("acme")) == []
        assert held_keys(store) == {"host": set(), "disk": set()}  # no snapshot announces it
        assert bytes(lease.buffer) == payload  # the reader finishes with its bytes
    assert not store.levels[0].tier.reserved(meta.key)
    assert held_keys(store) == {"host": set(), "disk": set()}
    store.close()


def test_a_replica_that_cannot_go_yet_is_retried_when_the_key_is_stored_again(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The disk cannot delete the file once (a read-only remount): the delete reports it
    pending, the key stays invisible, and the next store of the key (a fresh computation)
    retries the removal, announces it, and then caches the fresh object. Before, the disk
    dropped the object from its index before the failed unlink, so the removal was never
    announced, and the key stayed pending for good: every later store of it was refused."""
    store = two_level_store(tmp_path, clock, record_events=True)
    ((meta, payload),) = chain_of([1], "acme", clock.now)
    assert put(store, meta, payload)
    store.take_events()
    disk = store.levels[1].tier
    assert isinstance(disk, DiskTier)
    unlink, failures = disk._unlink, [1]

    def read_only_once(path: str | Path) -> None:
        if failures:
            failures.pop()
            raise TierError(f"cannot delete {path}: read-only file system (simulated)")
        unlink(path)

    disk._unlink = read_only_once  # type: ignore[method-assign]
    result = store.delete_keys([meta.key])
    assert result.removed == {"host": 1, "disk": 0} and result.pending == 1
    assert disk.contains(meta.key)  # still indexed: the retry finds it
    assert store.lookup([meta.key], RequestScope("acme")) == []
    assert [(type(e).__name__, e.tier) for e in store.take_events()] == [("ObjectRemoved", "host")]
    clock.now += 1
    fresh = replace(meta, created_at=clock.now)
    assert put(store, fresh, payload)
    events = [(type(e).__name__, e.tier) for e in store.take_events()]
    assert events[0] == ("ObjectRemoved", "disk") and ("ObjectStored", "host") in events
    assert store.lookup([meta.key], RequestScope("acme")) != []
    store.close()


def test_tombstones_expire_after_their_ttl(tmp_path: Path, clock: FakeClock) -> None:
    store = two_level_store(tmp_path, clock, tombstone_ttl_s=60.0)
    ((meta, payload),) = chain_of([1], "acme", clock.now)
    assert put(store, meta, payload)
    store.delete([meta.key])
    clock.now += 59
    assert not put(store, meta, payload)
    clock.now += 1
    assert put(store, meta, payload)  # the TTL is over: an old object is a plain object again
    store.close()


# ---- the disk tier: tombstones outlive the process ------------------------------------------
_CHILD = textwrap.dedent(
    """
    import sys
    from dataclasses import replace
    from kvstrata.objects.tombstone import Tombstone
    from kvstrata.tiers.disk import DiskTier
    from tier_helpers import make_object, store
    tier = DiskTier(sys.argv[1], 1 << 20, durable=True)
    for seed in (1, 2, 3):
        meta, payload = make_object(seed, created_at=1000.0)
        assert store(tier, meta, payload)
    # A deletion of 1 and 2 at t=1500 got its tombstones to disk, then the process died
    # before any unlink. Object 3 is not deleted; 2 is re-stored after the deletion.
    tier.bury([Tombstone(make_object(s)[0].key, 1500.0, 1e12) for s in (1, 2)])
    tier.remove(make_object(2)[0].key)
    meta, payload = make_object(2, created_at=2000.0)
    assert store(tier, meta, payload)
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_disk_recovery_removes_what_a_tombstone_covers_after_sigkill(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path("src").resolve()), "tests"])}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"ready"
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    with open(tmp_path / FILE_NAME, "ab") as f:
        f.write(encode_line(Tombstone(key(9), 1.0, 2.0))[:20])  # a torn last line
    tier = DiskTier(tmp_path, 1 << 20, durable=False)
    assert tier.recovery.tombstoned == 1 and tier.recovery.recovered == 2
    first, second, third = (make_object(s)[0].key for s in (1, 2, 3))
    assert sorted(tier.keys()) == sorted([second, third])
    meta = tier.meta(second)
    assert meta is not None and meta.created_at == 2000.0  # the one stored after the deletion
    assert not tier.path_of(first).exists()
    assert {m.key for m in tier.recovered_tombstones()} == {first, second}
    store = TieredStore([(tier, LRUPolicy(), TierConfig("disk"))], clock=lambda: 1600.0)
    old, payload = make_object(1, created_at=1000.0)
    assert not put(store, old, payload)  # the recovered tombstone still refuses it
    store.close()


def test_the_tombstone_file_stays_bounded(tmp_path: Path) -> None:
    marks = TombstoneFile(tmp_path, durable=False, compact_min=8)
    for n in range(40):  # each expires before the next one is written
        marks.append([Tombstone(key(n), float(n), n + 0.5)], now=float(n))
    lines = (tmp_path / FILE_NAME).read_bytes().splitlines()
    assert len(lines) <= 8
    again = TombstoneFile(tmp_path, durable=False)
    assert set(again.load(now=39.0)) == {key(39)}


# ---- the remote tier: tombstones on the server, across workers ------------------------------
def remote_store(server: ValkeyServer, namespace: str) -> TieredStore:
    tier = RemoteTier(RemoteConfig(url=server.url, namespace=namespace), 64 * OBJ)
    return TieredStore([(tier, SharedLedgerPolicy(), TierConfig("remote"))], record_events=True)


def server_metas(tier: RemoteTier, namespace: str) -> dict[BlockKey, KVObjectMeta]:
    conn = tier.client.single
    assert conn is not None
    out = {}
    for name in conn.scan_iter(match=meta_pattern(namespace), count=1000):
        k = key_of_meta(namespace, name.decode())
        assert k is not None
        raw = conn.get(name)
        meta = decode_meta(raw, k) if isinstance(raw, bytes) else None
        assert meta is not None
        out[k] = meta
    return out


def test_a_deletion_on_one_worker_refuses_another_workers_late_write(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    a, b = (
        remote_store(remote_server, remote_namespace),
        remote_store(remote_server, remote_namespace),
    )
    tier_a, tier_b = a.levels[0].tier, b.levels[0].tier
    assert isinstance(tier_a, RemoteTier) and isinstance(tier_b, RemoteTier)
    now = time.time()  # the tiers' clock: the server's tombstones live from here
    objects = chain_of([1, 2, 3], "acme", created_at=now - 10)
    for meta, payload in objects[:2]:
        assert put(a, meta, payload)
    late, late_payload = objects[2]
    slot = tier_b.prepare_store(late.with_ttl(None))  # b reserved it before the deletion
    assert slot is not None
    survey = a.objects_of("acme")  # the server's view: a's objects and b's reservation
    assert {r.key for r in survey.refs} == {key(1), key(2), key(3)}
    keys = select(DeleteSelector("acme", keys=(key(1),)), survey.refs, now)
    result = a.delete_keys(keys, now=now)
    assert result.removed == {"remote": 2} and result.pending == 0
    assert server_metas(tier_a, remote_namespace) == {}
    slot.buffer[:] = late_payload
    assert not tier_b.complete_store(slot, True)  # its commit finds the entry gone
    (old, payload) = objects[0]
    assert not put(b, old, payload)  # b's late write-back of an object created before
    assert (
        b.metrics.value(
            "kvstrata_tier_admission_rejections_total", {"tier": "remote", "reason": "tombstoned"}
        )
        == 1
    )
    assert server_metas(tier_a, remote_namespace) == {}
    conn = tier_a.client.single
    assert conn is not None
    ttl_ms = conn.pttl(tomb_key(remote_namespace, old.key))
    assert 0 < ttl_ms <= 24 * 3600 * 1000
    fresh = replace(old, created_at=now + 1)  # recomputed after the delete: accepted
    assert put(b, fresh, payload)
    assert set(server_metas(tier_a, remote_namespace)) == {old.key}
    assert [f.key for f in a.lookup([old.key], RequestScope("acme"))] == [old.key]
    a.close()
    b.close()


# ---- the engine: pool + every tier, one report ----------------------------------------------
def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


@pytest.fixture()
def engine(
    tiny_model: LoadedModel, tmp_path: Path, remote_server: ValkeyServer, remote_namespace: str
) -> Iterator[ReferenceEngine]:
    block = pool_config_for(tiny_model, B, 1).bytes_per_block
    levels = [
        (HostTier(256 * block, block), LRUPolicy(), TierConfig("host")),
        (DiskTier(tmp_path / "disk", 256 * block, durable=False), LRUPolicy(), TierConfig("disk")),
        (
            RemoteTier(
                RemoteConfig(url=remote_server.url, namespace=remote_namespace), 256 * block
            ),
            SharedLedgerPolicy(),
            TierConfig("remote"),
        ),
    ]
    store = TieredStore(levels, record_events=True)
    e = ReferenceEngine(tiny_model, EngineConfig(block_size=B, pool_blocks=96), store=store)
    yield e
    e.close()


def descends(key_: BlockKey, root: BlockKey, parents: dict[BlockKey, BlockKey | None]) -> bool:
    seen: BlockKey | None = key_
    while seen is not None:
        if seen == root:
            return True
        seen = parents.get(seen)
    return False


def leftovers(engine: ReferenceEngine, root: BlockKey, deleted_at: float) -> list[str]:
    """Everything of the prefix ``root`` created at or before ``deleted_at``, on every tier,
    the remote server's raw keys included."""
    assert engine.bridge is not None
    store = engine.bridge.store
    found: list[tuple[str, BlockKey, BlockKey | None, float | None]] = []
    for block in engine.pool.committed_blocks():
        info = block.info
        assert isinstance(info, BlockInfo)
        found.append(("device", block.key, block.parent_key, info.created_at))
    for name, metas in store.resident():
        found += [(name, m.key, m.parent, m.created_at) for m in metas if name != "remote"]
    remote = store.levels[2].tier
    assert isinstance(remote, RemoteTier)
    ns = remote.config.namespace
    found += [("server", k, m.parent, m.created_at) for k, m in server_metas(remote, ns).items()]
    parents = {k: p for _, k, p, _ in found}
    return [
        f"{where}:{k.hex()[:8]}"
        for where, k, _, created in found
        if descends(k, root, parents) and (created is None or created <= deleted_at)
    ]


def test_engine_delete_empties_every_tier_and_the_next_request_is_a_full_miss(
    engine: ReferenceEngine,
) -> None:
    prompt = tokens(5 * B + 3, seed=1)
    longer = prompt[: 4 * B] + tokens(3 * B, seed=2)  # shares 4 blocks: a descendant branch
    other_prefix = tokens(3 * B + 1, seed=3)
    for tenant, ids in (
        ("acme", prompt),
        ("acme", longer),
        ("acme", other_prefix),
        ("beta", prompt),
    ):
        engine.generate(ids, GREEDY, tenant=tenant).run()
    root = engine.block_keys(prompt, "acme")[0]
    keep = engine.block_keys(other_prefix, "acme") + engine.block_keys(prompt, "beta")
    before = {where.split(":")[0] for where in leftovers(engine, root, float("inf"))}
    assert before == {"device", "host", "disk", "server"}  # the scan sees every tier
    selector = DeleteSelector("acme", keys=tuple(engine.block_keys(prompt[: 2 * B], "acme")))
    report = engine.call(lambda: engine.delete(selector)).result()
    assert set(report.removed) == {"device", "host", "disk", "remote"}
    assert all(report.removed[tier] >= 5 + 3 for tier in report.removed), report.removed
    assert report.pending == 0 and not report.unreachable
    assert root in report.keys and not set(keep) & set(report.keys)
    assert leftovers(engine, root, deleted_at=float("inf")) == []
    assert engine.bridge is not None
    store = engine.bridge.store
    for k in keep:
        assert engine.pool.contains(k)
        assert all(level.tier.contains(k) for level in store.levels[:2])
    again = engine.generate(prompt, GREEDY, tenant="acme").run()
    fresh = engine.generate(prompt, GREEDY, tenant="acme", use_cache=False).run()
    assert again.record.matched_tokens == 0
    assert again.output_ids == fresh.output_ids
    beta = engine.generate(prompt, GREEDY, tenant="beta").run()
    assert beta.record.matched_tokens >= 5 * B  # another tenant's identical prompt: untouched


def test_delete_while_generations_run_leaves_nothing_created_before_it(
    engine: ReferenceEngine,
) -> None:
    base = tokens(4 * B, seed=7)
    prompts = [base + tokens(B + i, seed=10 + i) for i in range(6)]
    engine.generate(prompts[0], GREEDY, tenant="acme").run()
    engine.start_loop()
    root = engine.block_keys(base, "acme")[0]
    errors: list[BaseException] = []
    started = threading.Barrier(4)

    def traffic(worker: int) -> None:
        try:
            started.wait(timeout=30)
            for i in range(4):
                ids = prompts[(worker + i) % len(prompts)]
                engine.generate(ids, GREEDY, tenant="acme").run()
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=traffic, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    deleted_at = time.time()
    selector = DeleteSelector("acme", keys=(root,))
    report = engine.call(lambda: engine.delete(selector, deleted_at)).result()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    engine.stop_loop()
    assert engine.bridge is not None
    engine.bridge.store.flush()
    assert root in report.keys and report.total > 0
    assert leftovers(engine, root, deleted_at) == []
    # what the traffic recomputed after the delete is there again, and the scan sees it
    assert leftovers(engine, root, float("inf"))


def test_the_first_tombstone_file_is_made_durable_with_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable tier fsyncs the tombstone file it appends to; the first append also creates
    it, and a name is only durable once its directory is fsync'd (it was not: a crash could
    lose the whole file, and with it deletions the recovery scan must replay)."""
    from kvstrata.objects.tombstone import Tombstone
    from kvstrata.tiers import disk_tombstones

    synced: list[Path] = []
    monkeypatch.setattr(disk_tombstones, "fsync_dir", synced.append)
    marks = disk_tombstones.TombstoneFile(tmp_path, durable=True)
    key = BlockKey(bytes(32))
    marks.append([Tombstone(key, 1.0, 100.0)], now=2.0)
    marks.append([Tombstone(key, 3.0, 100.0)], now=4.0)
    assert synced == [tmp_path]
    reread = disk_tombstones.TombstoneFile(tmp_path, durable=True).load(5.0)
    assert [m.deleted_at for m in reread.values()] == [3.0]
