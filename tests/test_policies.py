"""Eviction policies: one contract suite for every policy, then each policy's own behaviour.

The contract is ``kvstrata.store.policy``'s: victims are present leaves that ``can_evict``
accepts and that belong to the requested tenant, expired objects first, never a removed key.
LRU is checked against a naive model with Hypothesis; ValuePolicy with scripted scenarios
(reuse, recompute cost, size, demotion target); Belady on a hand-computed sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation
from kvstrata.store.adaptive import AdaptivePolicy
from kvstrata.store.belady import NEVER, BeladyPolicy, FutureAccesses
from kvstrata.store.deployed import DEPLOYED_POLICIES
from kvstrata.store.policies import LRUPolicy, ValuePolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.value_policy import (
    DECAY,
    PENDING_SAMPLE,
    HitDensity,
    age_bucket,
    kvstrata_policy,
    use_class,
    value_per_byte,
)

REPRESENTATION = Representation(dtype="float32", layout="test", block_size=16, shape=(16,))


def key(number: int) -> BlockKey:
    return BlockKey(number.to_bytes(8, "little"))


def meta(
    number: int,
    parent: int | None = None,
    *,
    tenant: str = "t",
    size: int = 1000,
    recompute_s: float = 1.0,
    ttl_s: float | None = None,
    created_at: float = 0.0,
) -> KVObjectMeta:
    return KVObjectMeta(
        key=key(number),
        parent=None if parent is None else key(parent),
        tenant=tenant,
        representation=REPRESENTATION,
        size=size,
        digest=b"",
        created_at=created_at,
        ttl_s=ttl_s,
        recompute_s=recompute_s,
    )


def _belady_never() -> BeladyPolicy:
    return BeladyPolicy(lambda _key: NEVER)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "kvstrata": kvstrata_policy,
    "kvstrata-adaptive": AdaptivePolicy,
    "kvstrata-small-shadow": lambda: AdaptivePolicy(shadow_objects=2, half_life_references=4),
    "kvstrata-value": ValuePolicy,
    "kvstrata-ghost": lambda: ValuePolicy(ghost_factor=8.0, ghost_uses=True, ghost_censored=True),
    "belady": _belady_never,
    **{
        name: (lambda factory=factory: factory(None)) for name, factory in DEPLOYED_POLICIES.items()
    },
}


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return POLICIES[request.param]()


def _tree(policy: EvictionPolicy) -> None:
    """1 ← 2 ← 3 and 1 ← 4 ← 5: leaves 3 and 5."""
    for number, parent in ((1, None), (2, 1), (3, 2), (4, 1), (5, 4)):
        policy.on_insert(meta(number, parent), now=float(number))


# ---- the contract, for every policy ----------------------------------------------------------
def test_victims_are_leaves_and_drain_leaf_first(policy: EvictionPolicy) -> None:
    _tree(policy)
    parents = {2: 1, 3: 2, 4: 1, 5: 4}
    present = {1, 2, 3, 4, 5}
    while present:
        victim = policy.victim(10.0)
        assert victim is not None
        number = int.from_bytes(victim, "little")
        assert number in present
        assert all(parents.get(child) != number for child in present), "not a leaf"
        policy.on_remove(victim)
        present.discard(number)
    assert policy.victim(10.0) is None


def test_can_evict_is_respected(policy: EvictionPolicy) -> None:
    _tree(policy)
    assert policy.victim(10.0, can_evict=lambda k: k not in {key(3), key(5)}) is None
    assert policy.victim(10.0, can_evict=lambda k: k != key(3)) == key(5)


def test_tenant_restricts_candidates(policy: EvictionPolicy) -> None:
    policy.on_insert(meta(1, tenant="a"), now=1.0)
    policy.on_insert(meta(2, tenant="b"), now=2.0)
    policy.on_insert(meta(3, tenant="b"), now=3.0)
    assert policy.victim(5.0, tenant="a") == key(1)
    assert policy.victim(5.0, tenant="b") in {key(2), key(3)}
    assert policy.victim(5.0, tenant="nobody") is None


def test_expired_objects_go_first(policy: EvictionPolicy) -> None:
    policy.on_insert(meta(1), now=0.0)
    policy.on_insert(meta(2, ttl_s=5.0, created_at=8.0), now=8.0)  # newest, but expires at 13
    policy.on_access(key(2), now=9.0)
    assert policy.victim(12.0) == key(1)
    assert policy.victim(13.0) == key(2)


def test_expired_parent_waits_for_its_children(policy: EvictionPolicy) -> None:
    policy.on_insert(meta(1, ttl_s=1.0), now=0.0)
    policy.on_insert(meta(2, 1), now=0.0)
    assert policy.victim(5.0) == key(2)
    policy.on_remove(key(2))
    assert policy.victim(5.0) == key(1)


def test_removed_and_unknown_keys_are_ignored(policy: EvictionPolicy) -> None:
    _tree(policy)
    policy.on_remove(key(5))
    policy.on_remove(key(5))
    policy.on_remove(key(99))
    policy.on_access(key(99), now=11.0)
    seen = set()
    while (victim := policy.victim(12.0)) is not None:
        seen.add(victim)
        policy.on_remove(victim)
    assert key(5) not in seen and key(99) not in seen
    assert seen == {key(1), key(2), key(3), key(4)}


def test_child_arriving_before_parent_keeps_parent_interior(policy: EvictionPolicy) -> None:
    policy.on_insert(meta(2, 1), now=1.0)  # a demoted child can land before its parent
    policy.on_insert(meta(1), now=2.0)
    assert policy.victim(3.0) == key(2)


operations = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "remove", "victim"]),
        st.integers(min_value=0, max_value=11),
        st.sampled_from(["a", "b", None]),
        st.frozensets(st.integers(min_value=0, max_value=11), max_size=4),
    ),
    max_size=80,
)


def _parent_of(number: int) -> int | None:
    return None if number < 3 else number // 3 - 1  # a forest: 0,1,2 roots; 3..11 below


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_contract_against_naive_model(
    name: str, ops: list[tuple[str, int, str | None, frozenset[int]]]
) -> None:
    """Any interleaving: a victim is a present, evictable leaf of the tenant, or None only
    when no such leaf exists. For LRU it is exactly the naive model's least recent leaf."""
    policy = POLICIES[name]()
    present: dict[int, str] = {}
    last_touch: dict[int, int] = {}
    clock = 0
    for op, number, tenant, pinned in ops:
        clock += 1
        if op == "insert":
            parent = _parent_of(number)
            if number in present:
                policy.on_insert(meta(number, parent, tenant=present[number]), now=float(clock))
                last_touch[number] = clock
            else:
                owner = tenant or "a"
                policy.on_insert(meta(number, parent, tenant=owner), now=float(clock))
                present[number] = owner
                last_touch[number] = clock
        elif op == "access":
            policy.on_access(key(number), now=float(clock))
            if number in present:
                last_touch[number] = clock
        elif op == "remove":
            policy.on_remove(key(number))
            present.pop(number, None)
            last_touch.pop(number, None)
        else:
            candidates = [
                n
                for n, owner in present.items()
                if (tenant is None or owner == tenant)
                and n not in pinned
                and not any(_parent_of(child) == n for child in present)
            ]
            victim = policy.victim(
                float(clock),
                tenant=tenant,
                can_evict=lambda k, pinned=pinned: int.from_bytes(k, "little") not in pinned,
            )
            if not candidates:
                assert victim is None
                continue
            assert victim is not None
            number_out = int.from_bytes(victim, "little")
            assert number_out in candidates
            if name == "lru":
                assert number_out == min(candidates, key=lambda n: last_touch[n])


# ---- LRU ---------------------------------------------------------------------------------------
def test_lru_orders_leaves_by_last_use() -> None:
    policy = LRUPolicy()
    for number in (1, 2, 3):
        policy.on_insert(meta(number), now=float(number))
    policy.on_access(key(1), now=4.0)
    assert policy.victim(5.0) == key(2)
    policy.on_remove(key(2))
    assert policy.victim(5.0) == key(3)


# ---- ValuePolicy ------------------------------------------------------------------------------
def test_use_classes_and_age_buckets_are_monotone() -> None:
    assert [use_class(u) for u in (1, 2, 3, 4, 5, 6, 9, 10, 17, 18, 1000)] == [
        0,
        1,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        6,
    ]
    buckets = [age_bucket(age) for age in (0.0, 0.5, 1.0, 10.0, 100.0, 1e4, 1e12)]
    assert buckets == sorted(buckets) and buckets[0] == 0


def test_hit_density_learns_that_reused_classes_are_worth_more() -> None:
    density = HitDensity()
    for index in range(3000):
        # one-use objects: a third come back after 20 s, the rest leave unused at 30 s
        density.record(0, 20.0 if index % 3 == 0 else 30.0, hit=index % 3 == 0)
        density.record(1, 10.0, hit=True)  # two-use objects all come back after 10 s
    density.reconfigure()
    assert density.at(1, 5.0) > density.at(0, 5.0) > 0.0
    assert density.at(0, 60.0) == 0.0  # older than anything ever seen: no hits ahead


def _warm_reuse_history(policy: ValuePolicy, rounds: int = 40) -> float:
    """Hot blocks 1000+ are reused every 10 s; cold blocks 2000+ are used once and leave
    unused 10 s later (exit events of the one-use class)."""
    now = 0.0
    for number in range(1000, 1020):
        policy.on_insert(meta(number), now)
    cold = 2000
    for _ in range(rounds):
        now += 10.0
        for number in range(1000, 1020):
            policy.on_access(key(number), now)
        for number in range(cold - 60, cold) if cold > 2000 else ():
            policy.on_remove(key(number))
        for _ in range(60):
            policy.on_insert(meta(cold), now)
            cold += 1
    return now


def test_value_policy_keeps_a_reused_block_over_a_one_hit_block() -> None:
    policy = ValuePolicy()
    now = _warm_reuse_history(policy)
    for number in range(1000, 1020):
        policy.on_remove(key(number))
    policy.on_insert(meta(1), now)  # reused below
    policy.on_access(key(1), now + 1.0)
    policy.on_access(key(1), now + 2.0)
    policy.on_insert(meta(2), now + 2.0)  # one use, and more recent
    assert policy.victim(now + 4.0) == key(2)


def test_value_policy_prefers_evicting_cheaper_recompute() -> None:
    policy = ValuePolicy()
    policy.on_insert(meta(1, recompute_s=2.0), now=0.0)
    policy.on_insert(meta(2, recompute_s=1.0), now=0.0)
    assert policy.victim(1.0) == key(2)


def test_value_policy_evicts_larger_objects_first() -> None:
    policy = ValuePolicy()
    policy.on_insert(meta(1, size=2000), now=0.0)
    policy.on_insert(meta(2, size=1000), now=0.0)
    assert policy.victim(1.0) == key(1)


def test_value_policy_prices_demotion_at_the_target_fetch_cost() -> None:
    demoting = ValuePolicy(demotion_fetch_s_per_byte=1e-4)  # 0.1 s for 1000 bytes
    assert demoting.saved_s(meta(1, recompute_s=5.0)) == pytest.approx(0.1)
    assert demoting.saved_s(meta(1, recompute_s=0.05)) == pytest.approx(0.05)
    assert ValuePolicy().saved_s(meta(1, recompute_s=5.0)) == 5.0
    # both capped to the same fetch cost: the older one goes first
    demoting.on_insert(meta(1, recompute_s=5.0), now=0.0)
    demoting.on_insert(meta(2, recompute_s=9.0), now=1.0)
    assert demoting.victim(2.0) == key(1)


def test_value_policy_falls_back_when_samples_are_pinned() -> None:
    policy = ValuePolicy(samples=1)
    for number in range(50):
        policy.on_insert(meta(number), now=float(number))
    assert policy.victim(60.0, can_evict=lambda k: k == key(7)) == key(7)


# ---- Belady -----------------------------------------------------------------------------------
def test_belady_evicts_the_leaf_used_farthest_in_the_future() -> None:
    # steps: A B C A C B D A (capacity 2); hand-computed optimal victims.
    steps = [[1], [2], [3], [1], [3], [2], [4], [1]]
    oracle: FutureAccesses[BlockKey] = FutureAccesses([[key(n) for n in s] for s in steps])
    policy = BeladyPolicy(oracle.next_use)
    resident: set[int] = set()
    victims: list[int] = []
    for step, (number,) in enumerate(steps):
        oracle.advance(step)
        if number in resident:
            policy.on_access(key(number), float(step))
            continue
        if len(resident) == 2:
            victim = policy.victim(float(step))
            assert victim is not None
            victims.append(int.from_bytes(victim, "little"))
            resident.discard(victims[-1])
            policy.on_remove(victim)
        resident.add(number)
        policy.on_insert(meta(number), float(step))
    # at C: A next at 3, B at 5 → B. at B(5): A next 7, C never → C. at D: B never, A 7 → B.
    assert victims == [2, 3, 2]


def test_future_accesses_next_use() -> None:
    oracle: FutureAccesses[str] = FutureAccesses([["a"], ["b", "a"], ["c"]])
    oracle.advance(0)
    assert oracle.next_use("a") == 1.0
    assert oracle.next_use("c") == 2.0
    oracle.advance(1)
    assert oracle.next_use("a") == NEVER
    assert oracle.next_use("zzz") == NEVER


def test_value_policy_ghost_records_a_returning_key_as_a_hit_at_its_reuse_age() -> None:
    """A key removed and inserted again 30 s after its last use is, for the histograms, a
    hit at age 30 s in its old class (what keeping it would have earned), and with
    ``ghost_uses`` it comes back with its use count."""
    policy = ValuePolicy(ghost_factor=8.0, ghost_uses=True)
    policy.on_insert(meta(1), now=0.0)
    policy.on_access(meta(1).key, now=5.0)  # two uses, last at 5 s
    policy.on_remove(meta(1).key)
    bucket = age_bucket(30.0)
    before = policy.density.hits[use_class(2)][bucket]
    policy.on_insert(meta(1), now=35.0)
    assert policy.density.hits[use_class(2)][bucket] == before + 1.0
    assert policy._uses[meta(1).key] == 3
    plain = ValuePolicy()
    plain.on_insert(meta(1), now=0.0)
    plain.on_remove(meta(1).key)
    plain.on_insert(meta(1), now=35.0)
    assert plain.density.hits[0][age_bucket(35.0)] == 0.0


def test_value_policy_ghost_censored_counts_pending_ghosts_only_while_reconfiguring() -> None:
    """A key still in the ghost is an exit at its current age for the density computation,
    so one return and one pending key give half the density of one return alone; the stored
    exit histogram is left as it was (the pending key may still come back)."""
    densities = []
    for censored in (False, True):
        policy = ValuePolicy(ghost_factor=8.0, ghost_censored=censored)
        for number in (1, 2):
            policy.on_insert(meta(number), now=0.0)
            policy.on_remove(meta(number).key)
        policy.on_insert(meta(1), now=100.0)  # key 1 returns at age 100 s; key 2 pending
        exits_before = [row[:] for row in policy.density.exits]
        policy.density.reconfigure()
        assert policy.density.exits == [[v * DECAY for v in row] for row in exits_before]
        densities.append(policy.density.at(0, 0.0))
    assert densities[0] > 0.0
    assert densities[1] == pytest.approx(densities[0] / 2, rel=0.2)


def test_the_seconds_weight_trades_seconds_for_tokens() -> None:
    """``saved_s^w · tokens^(1−w) / size``: 1 is seconds alone; lower weights narrow the gap
    between a deep block (costly to recompute) and a shallow one of the same tokens."""
    deep, shallow = meta(1, recompute_s=8.0, size=1000), meta(2, recompute_s=0.5, size=1000)
    assert value_per_byte(deep) == pytest.approx(8.0 / 1000)
    assert value_per_byte(deep, seconds_weight=1.0) == value_per_byte(deep)
    assert value_per_byte(deep, seconds_weight=0.4) == pytest.approx(8.0**0.4 * 16**0.6 / 1000)
    assert value_per_byte(deep, seconds_weight=0.0) == value_per_byte(shallow, seconds_weight=0.0)
    ratio = [value_per_byte(deep, None, w) / value_per_byte(shallow, None, w) for w in (1, 0.4)]
    assert ratio[0] == pytest.approx(16.0) and ratio[1] == pytest.approx(16.0**0.4)
    with pytest.raises(InvalidInput):
        ValuePolicy(seconds_weight=1.5)


@pytest.mark.parametrize(
    "ghosts", [0, 10, PENDING_SAMPLE, PENDING_SAMPLE + 1, 5 * PENDING_SAMPLE + 3]
)
def test_censored_ghosts_are_sampled_with_weights_that_sum_to_the_ghost(ghosts: int) -> None:
    """A reconfiguration looks at no more than PENDING_SAMPLE ghost keys; the exits they add
    still count every key (the full scan of a big tier's ghost stalled every 1,024 events)."""
    policy = kvstrata_policy()
    for number in range(ghosts):  # a ghost, as removed objects leave one
        policy._ghost[key(number)] = (1 + number % 5, float(number))
    pending = policy._pending_ghosts()
    assert len(pending) <= PENDING_SAMPLE
    assert sum(weight for _, _, weight in pending) == pytest.approx(ghosts)
    if ghosts <= PENDING_SAMPLE:
        assert all(weight == 1.0 for _, _, weight in pending)


def test_a_tier_that_never_evicted_reconfigures_with_an_empty_ghost() -> None:
    """1,024 hits before the first eviction: the reconfiguration met an empty ghost (a
    ValueError from the sampling stride once, out of the store's path)."""
    policy = kvstrata_policy()
    policy.on_insert(meta(1), 0.0)
    for step in range(2 * 1024 + 1):
        policy.on_access(key(1), float(step))
    assert policy.victim(3000.0) == key(1)


def test_removed_objects_deadlines_do_not_pile_up(policy: EvictionPolicy) -> None:
    """A tier of 100 objects with a day's TTL, 20k inserts and removals: each removal left
    its deadline in the heap until the day passed (200k entries for 1k objects, measured)."""
    from kvstrata.store.leafheap import LeafHeapPolicy

    for number in range(20_000):
        policy.on_insert(meta(number, ttl_s=86_400.0, created_at=float(number)), float(number))
        if number >= 100:
            policy.on_remove(key(number - 100))
    candidates = getattr(policy, "_live", None)  # the adaptive policy's candidate policies
    inner = [policy, *(candidates if isinstance(candidates, list) else ())]
    held = [p for p in inner if isinstance(p, LeafHeapPolicy)]
    assert held, "no leaf-heap policy was checked"
    for leaf_heap in held:
        assert len(leaf_heap._deadlines) <= 2 * len(leaf_heap) + 1024 + 1
