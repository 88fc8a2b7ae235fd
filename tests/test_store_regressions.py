"""Regression tests for bugs a review found in the store/engine seams (each failed before)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.engine.engine import EngineConfig
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.identity import BlockKey
from kvstrata.objects import Representation
from kvstrata.runtime.blocks import BlockInfo, EvictedBlock
from kvstrata.runtime.bridge import LoadOutcome, StoreBridge
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy, canary_bucket
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.tiered import RequestScope, TieredStore
from kvstrata.tiers.base import TierError
from kvstrata.tiers.host import HostTier
from test_tiered_store import OBJ, chain, filler, make_store
from tier_helpers import FakeClock, worker_tiers


def failing_on_call(function: Callable[..., Any], nth: int) -> Callable[..., Any]:
    """``function``, except that its ``nth`` call raises a medium error (EIO)."""
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == nth:
            raise TierError("EIO (injected)")
        return function(*args, **kwargs)

    return wrapper


def test_restoring_expired_keys_keeps_the_policy_in_step() -> None:
    clock = FakeClock()
    policy = LRUPolicy()
    host = HostTier(4 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, policy, TierConfig("host", ttl_s=10))], clock=clock)
    objs = [chain(f"k{i}", 1, created_at=clock())[0] for i in range(4)]
    for meta, payload in objs:
        store.put(meta, filler(payload))
    clock.now += 20
    for meta, payload in objs:
        store.put(replace(meta, created_at=clock()), filler(payload))
    assert host.object_count == len(policy) == 4
    meta, payload = chain("new", 1, created_at=clock())[0]
    assert store.put(meta, filler(payload))  # the policy can still evict


def test_a_pinned_victim_does_not_block_eviction(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(tmp_path, clock, host_objects=4)
    objs = [chain(f"p{i}", 1)[0] for i in range(4)]
    for meta, payload in objs:
        clock.now += 1
        store.put(meta, filler(payload))
    oldest = store.lookup([objs[0][0].key], RequestScope("t0"))[0]
    with store.load(oldest, "t0") as lease:  # the LRU victim is pinned by a reader
        assert lease is not None
        meta, payload = chain("late", 1)[0]
        assert store.put(meta, filler(payload))
    store.close()


def test_background_movements_respect_rollout_and_the_switch(tmp_path: Path) -> None:
    clock = FakeClock()
    disk = TierConfig(
        "disk", WritePolicy.WRITE_BACK, rollout=RolloutConfig(tenants=frozenset({"a"}))
    )
    store = make_store(tmp_path, clock, host_objects=2, disk=disk)
    for meta, payload in chain("b", 4, tenant="b"):
        store.put(meta, filler(payload))  # demotions of tenant b must not reach disk
    assert store.levels[1].tier.tenant_bytes("b") == 0
    a_objs = chain("a", 2, tenant="a")
    store.set_enabled("host", True)
    for meta, payload in a_objs:
        store.put(meta, filler(payload))
    store.set_enabled("disk", False)
    store.flush()  # the rollback switch: a disabled tier is not written either
    assert store.levels[1].tier.object_count == 0
    store.close()


def test_each_level_applies_its_own_ttl(tmp_path: Path) -> None:
    clock = FakeClock()
    host = TierConfig("host", ttl_s=10.0)
    store = make_store(tmp_path, clock, host=host)  # disk: write-through, no TTL
    meta, payload = chain("t", 1, created_at=clock())[0]
    store.put(meta, filler(payload))
    clock.now += 20
    found = store.lookup([meta.key], RequestScope("t0"))
    assert [f.level for f in found] == [1]
    store.close()


def test_write_back_flusher_survives_a_medium_failure(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(tmp_path, clock, disk=TierConfig("disk", WritePolicy.WRITE_BACK))
    disk = store.levels[1].tier
    disk.prepare_store = failing_on_call(disk.prepare_store, 1)  # type: ignore[method-assign]
    objs = chain("w", 3)
    for meta, payload in objs:
        store.put(meta, filler(payload))
    store.flush()
    assert store.metrics.value("kvstrata_tier_write_failures_total", {"tier": "disk"}) == 1
    assert store.bytes_at_risk(1) == 0
    assert disk.object_count == 2  # the failed one is lost to disk, the others went on
    store.close()


def test_a_failed_demotion_does_not_wedge_the_pool(tiny_model: LoadedModel) -> None:
    def toks(n: int, seed: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(10, 40000, size=n)]

    block = 2 * 2 * 2 * 16 * 16 * 4
    engine = build_engine(
        tiny_model,
        EngineConfig(block_size=16, pool_blocks=8),
        worker_tiers(host_bytes=64 * block, host=TierConfig("host", WritePolicy.WRITE_BACK)),
    )
    one = SamplingParams(max_tokens=1)
    engine.generate(toks(120, 1), one).run()
    assert engine.bridge is not None
    host = engine.bridge.store.levels[0].tier
    original = host.prepare_store
    host.prepare_store = failing_on_call(original, 2)  # type: ignore[method-assign]
    prompt = toks(120, 2)
    engine.generate(prompt, one).run()
    host.prepare_store = original  # type: ignore[method-assign]
    assert engine.pool._pending == {}
    assert engine.generate(prompt, one).run().record.matched_tokens == 112
    engine.pool.clear()
    assert engine.pool.blocks_used == 0
    engine.close()


@pytest.mark.parametrize("policy", [WritePolicy.SELECTIVE])
def test_put_fallback_does_not_bypass_a_selective_level(
    tmp_path: Path, policy: WritePolicy
) -> None:
    clock = FakeClock()
    store = make_store(tmp_path, clock, disk=TierConfig("disk", policy))
    store.set_enabled("host", False)
    meta, payload = chain("s", 1)[0]
    assert not store.put(meta, filler(payload))  # first use: a selective disk says no
    assert store.put(meta, filler(payload))  # second use: admitted
    store.close()


def test_delete_while_a_reader_holds_the_object(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make_store(tmp_path, clock)
    objs = chain("d", 2)
    for meta, payload in objs:
        store.put(meta, filler(payload))
    keys = [m.key for m, _ in objs]
    located = store.lookup(keys, RequestScope("t0"))
    with store.load(located[0], "t0") as lease:
        assert lease is not None
        removed = store.delete(keys)
        assert removed == 3  # host and disk copies of block 1, the disk copy of block 0
        assert store.lookup(keys, RequestScope("t0")) == []  # invisible at once
        meta, payload = objs[0]
        assert not store.put(meta, filler(payload))  # no resurrection while it is going
    assert not any(level.tier.reserved(keys[0]) for level in store.levels)
    assert not store.put(objs[0][0], filler(objs[0][1]))  # the old object: tombstoned
    clock.now += 1
    fresh = replace(objs[0][0], created_at=clock())
    assert store.put(fresh, filler(objs[0][1]))  # a fresh computation may store it again
    store.close()


def _bridge(store: TieredStore) -> StoreBridge:
    return StoreBridge(
        store,
        representation=Representation("uint8", "raw", 1, (OBJ,)),
        block_bytes=OBJ,
        model_id="",
        recompute_estimate=lambda n, c: 1.0,
    )


def test_an_incompatible_object_is_removed_and_never_booked_as_a_hit(tmp_path: Path) -> None:
    """A verified object of another representation: no hit, no policy use, no selective copy
    below; it leaves its level, so the next request does not fetch and reject it again."""
    clock = FakeClock()
    disk = TierConfig("disk", write_policy=WritePolicy.SELECTIVE, selective_min_uses=2)
    store = make_store(tmp_path, clock, disk=disk)
    ((meta, payload),) = chain("a", 1)
    meta = replace(meta, representation=Representation("uint8", "raw", 2, (OBJ,)))
    assert store.put(meta, filler(payload)) and not store.levels[1].tier.contains(meta.key)
    located = store.lookup([meta.key], RequestScope("t0"))[0]
    got: list[memoryview] = []
    assert _bridge(store).load_verified(located, "t0", got.append) is LoadOutcome.INCOMPATIBLE
    assert not got
    assert store.metrics.value("kvstrata_tier_hits_total", {"tier": "host"}) == 0
    assert store.lookup([meta.key], RequestScope("t0")) == []
    assert not store.levels[1].tier.contains(meta.key)  # no selective copy of it either
    labels = {"tier": "host", "reason": "incompatible"}
    assert store.metrics.value("kvstrata_tier_invalidated_total", labels) == 1


def test_a_consumer_that_raises_books_no_hit(tmp_path: Path) -> None:
    store = make_store(tmp_path, FakeClock())
    ((meta, payload),) = chain("a", 1)
    assert store.put(meta, filler(payload))
    located = store.lookup([meta.key], RequestScope("t0"))[0]
    with pytest.raises(RuntimeError), store.load(located, "t0") as lease:
        assert lease is not None
        raise RuntimeError("the consumer failed")
    assert store.metrics.value("kvstrata_tier_hits_total", {"tier": "host"}) == 0
    assert store.lookup([meta.key], RequestScope("t0"))  # still there: not the object's fault


def test_an_object_that_expires_under_a_reader_still_frees_its_room() -> None:
    """Asked for again while expired and pinned, the key stays known to the policy, so its
    room comes back once the reader leaves (it used to be forgotten and held for good)."""
    clock = FakeClock()
    host = HostTier(2 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host", ttl_s=10))], clock=clock)
    ((meta, payload),) = chain("a", 1, created_at=clock())
    assert store.put(meta, filler(payload))
    located = store.lookup([meta.key], RequestScope("t0"))[0]
    with store.load(located, "t0") as lease:
        assert lease is not None
        clock.now += 11
        with store.load(located, "t0") as again:
            assert again is None
    fresh = [chain(f"n{i}", 1, created_at=clock())[0] for i in range(3)]
    for new, data in fresh:
        assert store.put(new, filler(data))
    assert sum(host.contains(new.key) for new, _ in fresh) == 2  # both slots usable again
    assert not host.reserved(meta.key)


def test_a_refused_demotion_is_not_counted_as_demoted() -> None:
    clock = FakeClock()
    host = HostTier(4 * OBJ, OBJ, clock=clock)
    quota = TierConfig("host", tenant_quota_bytes={"t0": 1})  # nothing of t0 fits
    store = TieredStore([(host, LRUPolicy(), quota)], clock=clock)
    bridge = _bridge(store)
    evicted = EvictedBlock(0, BlockKey(b"k" * 32), None, 1, BlockInfo("t0", 0))
    bridge.demote(evicted, memoryview(bytes(OBJ)))
    assert not bridge.holds(evicted.key)
    value = store.metrics.value
    assert value("kvstrata_tier_evictions_total", {"tier": "device", "outcome": "demoted"}) == 0
    labels = {"tier": "device", "outcome": "demotion_refused"}
    assert value("kvstrata_tier_evictions_total", labels) == 1


def _corrupt_host_slot(host: HostTier, key: BlockKey) -> None:
    host.slab[host._index.records[key].extra["slot"] * OBJ] ^= 0xFF


def test_a_corrupt_object_is_counted_once_and_an_expiry_is_no_invalidation() -> None:
    clock = FakeClock()
    host = HostTier(4 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host", ttl_s=10))], clock=clock)
    (bad, bad_payload), (old, old_payload) = (
        chain("a", 1, created_at=clock())[0],
        chain("b", 1, created_at=clock())[0],
    )
    assert store.put(bad, filler(bad_payload)) and store.put(old, filler(old_payload))
    _corrupt_host_slot(host, bad.key)
    located = store.lookup([bad.key], RequestScope("t0"))[0]
    with store.load(located, "t0") as lease:
        assert lease is None
    clock.now += 11  # the other object expires
    assert store.lookup([old.key], RequestScope("t0")) == []
    store.take_events()
    value = store.metrics.value
    invalid = {
        reason: value("kvstrata_tier_invalidated_total", {"tier": "host", "reason": reason}) or 0
        for reason in ("digest_mismatch", "dropped_by_tier", "expired")
    }
    assert invalid == {"digest_mismatch": 1, "dropped_by_tier": 0, "expired": 0}
    assert value("kvstrata_tier_evictions_total", {"tier": "host", "outcome": "expired"}) == 1


def test_a_plain_miss_is_not_blamed_for_another_keys_corrupt_read() -> None:
    """Another thread's corrupt read of B lands while A's load misses: A is MISSING, B is the
    one counted (the store used to read a tier-wide counter and blame A)."""
    clock = FakeClock()
    host = HostTier(4 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host"))], clock=clock)
    (a, a_payload), (b, b_payload) = chain("a", 1)[0], chain("b", 1)[0]
    assert store.put(a, filler(a_payload)) and store.put(b, filler(b_payload))
    located = store.lookup([a.key], RequestScope("t0"))[0]
    assert host.remove(a.key)  # A goes (another thread evicted it)
    _corrupt_host_slot(host, b.key)
    real = host.prepare_load

    def racing(key: BlockKey) -> object:
        if key == a.key:
            assert real(b.key) is None  # the other thread's read of B finds it corrupt
        return real(key)

    host.prepare_load = racing  # type: ignore[method-assign]
    outcome = _bridge(store).load_verified(located, "t0", lambda view: None)
    assert outcome is LoadOutcome.MISSING
    labels = {"tier": "host", "reason": "digest_mismatch"}
    assert store.metrics.value("kvstrata_tier_invalidated_total", labels) == 1  # B's, once


def test_a_corrupt_read_is_reported_as_such_when_another_thread_drained_the_tier_first() -> None:
    """The read runs outside the lock: another thread (the events emitter, the lookup
    server) may drain the tier's drops before the load looks; the load still learns its key
    was corrupt."""
    clock = FakeClock()
    host = HostTier(4 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host"))], clock=clock)
    ((meta, payload),) = chain("a", 1)
    assert store.put(meta, filler(payload))
    _corrupt_host_slot(host, meta.key)
    real = host.prepare_load

    def drained(key: BlockKey) -> object:
        lease = real(key)
        store.has_events()  # another thread takes the lock (and drains the drops) here
        return lease

    host.prepare_load = drained  # type: ignore[method-assign]
    located = store.lookup([meta.key], RequestScope("t0"))[0]
    assert _bridge(store).load_verified(located, "t0", lambda view: None) is (
        LoadOutcome.DIGEST_MISMATCH
    )


def test_a_canary_level_takes_the_objects_of_its_share_of_requests() -> None:
    """Objects put for a request go to a canary level only when the request is in its share;
    an object without a request (a demotion) goes where the rollout targets it."""
    clock = FakeClock()
    host = HostTier(8 * OBJ, OBJ, clock=clock)
    canary = TierConfig("host", rollout=RolloutConfig(canary_fraction=0.5))
    store = TieredStore([(host, LRUPolicy(), canary)], clock=clock)
    ids = [f"r{i}" for i in range(40)]
    inside = next(r for r in ids if canary_bucket(r) < 0.5)
    outside = next(r for r in ids if canary_bucket(r) >= 0.5)
    (a, pa), (b, pb), (c, pc) = (chain(tag, 1)[0] for tag in "abc")
    assert not store.put(a, filler(pa), RequestScope("t0", request_id=outside))
    assert store.put(b, filler(pb), RequestScope("t0", request_id=inside))
    assert store.put(c, filler(pc), RequestScope("t0"))  # no request: targets only
    assert [host.contains(m.key) for m in (a, b, c)] == [False, True, True]


def _promote_while_making_room(store: TieredStore, bridge: StoreBridge, tag: str) -> list[str]:
    """What a pool does: each load first makes room, and the evicted block is demoted into
    the store (here: a new object put before each load)."""
    keys = [m.key for m, _ in chain(tag, 3)]
    located = bridge.plan_promotion(keys, 0, RequestScope("t0"))
    outcomes = []
    try:
        for i, loc in enumerate(located):
            meta, payload = chain(f"{tag}-demoted{i}", 1)[0]
            store.put(meta, filler(payload))
            outcomes.append(bridge.load_verified(loc, "t0", lambda _: None).value)
    finally:
        bridge.finish_promotion(located)
    return outcomes


def test_a_promotion_keeps_its_plan_while_its_loads_make_room() -> None:
    """A full level whose least valuable leaf is the plan's own tail: each demotion the loads
    cause used to evict the tail, so the plan lost it (``bench disagg`` found 1,488 of 2,047
    transferred tokens); held, the plan loads whole and the room comes from elsewhere."""
    clock = FakeClock()
    host = HostTier(5 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host"))], clock=clock)
    bridge = _bridge(store)
    for meta, payload in chain("plan", 3):
        clock.now += 1
        store.put(meta, filler(payload))
    for i in range(2):
        clock.now += 1
        meta, payload = chain(f"other{i}", 1)[0]
        store.put(meta, filler(payload))
    # 3 of 5 objects: past HOLD_SHARE, which caps reservations only, never a load under way
    assert _promote_while_making_room(store, bridge, "plan") == ["loaded"] * 3
    assert all(host.contains(m.key) for m, _ in chain("plan", 3))
    # Released: the plan's objects are ordinary victims again (LRU: the plan goes first).
    for i in range(5):
        clock.now += 1
        meta, payload = chain(f"later{i}", 1)[0]
        assert store.put(meta, filler(payload))
    assert not any(host.contains(m.key) for m, _ in chain("plan", 3))
    assert not store._held


def test_reservations_stop_at_half_a_level_so_it_always_has_room() -> None:
    """Reservations (received transfers, vLLM promises: holds for requests yet to come) that
    could cover a whole level would leave it nothing to evict. Past ``HOLD_SHARE`` of the
    level, every hold counted, a reservation is refused and counted; nested holds on held
    objects cost nothing; a load's own holds are never capped; a full level stores new
    objects by evicting what is not held."""
    clock = FakeClock()
    host = HostTier(6 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host"))], clock=clock)
    objs = chain("big", 5)
    for meta, payload in objs:
        clock.now += 1
        store.put(meta, filler(payload))
    keys = [m.key for m, _ in objs]
    located = store.lookup(keys, RequestScope("t0"))
    held = store.hold(located, reserve=True)
    assert [loc.key for loc in held] == keys[:3]  # 3 of 6 objects: the cap
    refused = store.metrics.holds_refused.labels(tier="host")._value.get()
    assert refused == 1
    again = store.hold(located[:3], reserve=True)  # held already: nested, no new bytes
    assert again == located[:3] and store._held_bytes == [3 * OBJ]
    loading = store.hold(located)  # a load in progress: not capped
    assert loading == located and store._held_bytes == [5 * OBJ]
    store.release(loading)
    for i in range(4):  # the level is full of the chain: new objects evict its free tail
        clock.now += 1
        meta, payload = chain(f"new{i}", 1)[0]
        assert store.put(meta, filler(payload))
    assert all(host.contains(k) for k in keys[:3]) and not any(host.contains(k) for k in keys[3:])
    store.release(again)
    store.release(held)
    assert not store._held and store._held_bytes == [0]
    reserved = store.hold(store.lookup(keys[:3], RequestScope("t0")), reserve=True)
    assert len(reserved) == 3  # room again


def test_a_hold_ends_at_what_left_and_does_not_stop_a_delete() -> None:
    clock = FakeClock()
    host = HostTier(8 * OBJ, OBJ, clock=clock)
    store = TieredStore([(host, LRUPolicy(), TierConfig("host"))], clock=clock)
    objs = chain("h", 3)
    for meta, payload in objs:
        store.put(meta, filler(payload))
    keys = [m.key for m, _ in objs]
    located = store.lookup(keys, RequestScope("t0"))
    assert store.delete(keys[2:]) == 1
    held = store.hold(located)
    assert [loc.key for loc in held] == keys[:2]  # the plan ends at the deleted block
    assert store.delete(keys[1:2]) == 1  # a hold keeps a block from eviction, not deletion
    assert store.lookup(keys, RequestScope("t0"))[-1].key == keys[0]
    store.release(held)
    assert not store._held
    store._moving.add((0, keys[0]))  # picked as a victim by another thread, being demoted
    assert store.hold(store.lookup(keys, RequestScope("t0"))) == []  # not held: it is going
    assert not store._held
