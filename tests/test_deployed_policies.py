"""The deployed peers' own behaviour (the contract is ``test_policies``'s, run over them too):
each policy's defining move from its paper, on scripted sequences."""

from __future__ import annotations

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation
from kvstrata.store.arc import ARCPolicy
from kvstrata.store.gdsf import GDSFPolicy
from kvstrata.store.s3fifo import S3FIFOPolicy
from kvstrata.store.tinylfu import CountMinSketch, TinyLFUPolicy

REPRESENTATION = Representation(dtype="float32", layout="test", block_size=16, shape=(16,))


def key(number: int) -> BlockKey:
    return BlockKey(number.to_bytes(8, "little"))


def meta(
    number: int, parent: int | None = None, *, size: int = 1000, recompute_s: float = 1.0
) -> KVObjectMeta:
    return KVObjectMeta(
        key=key(number),
        parent=None if parent is None else key(parent),
        tenant="t",
        representation=REPRESENTATION,
        size=size,
        digest=b"",
        created_at=0.0,
        ttl_s=None,
        recompute_s=recompute_s,
    )


def _evict(policy: S3FIFOPolicy | ARCPolicy | GDSFPolicy | TinyLFUPolicy, now: float) -> int:
    victim = policy.victim(now)
    assert victim is not None
    policy.on_remove(victim)
    return int.from_bytes(victim, "little")


# ---- S3-FIFO -----------------------------------------------------------------------------------
def test_s3fifo_quick_demotion_and_promotion_to_main() -> None:
    policy = S3FIFOPolicy()
    for number in range(1, 11):
        policy.on_insert(meta(number), now=float(number))
    policy.on_access(key(1), now=11.0)  # the oldest, but hit while in S: goes to M
    assert _evict(policy, 12.0) == 2  # one-hit objects leave first, in FIFO order
    assert _evict(policy, 12.0) == 3
    assert key(1) in policy


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    policy = S3FIFOPolicy()
    for number in range(1, 21):
        policy.on_insert(meta(number), now=float(number))
    assert _evict(policy, 21.0) == 1  # into the ghost queue
    policy.on_insert(meta(1), now=22.0)  # back: admitted to M, so S's tail goes next
    assert _evict(policy, 23.0) == 2
    assert key(1) in policy


def test_s3fifo_skips_non_leaves_at_the_tail() -> None:
    policy = S3FIFOPolicy()
    policy.on_insert(meta(1), now=1.0)
    policy.on_insert(meta(2, 1), now=2.0)
    policy.on_insert(meta(3), now=3.0)
    assert _evict(policy, 4.0) == 2  # 1 is older but interior
    assert _evict(policy, 4.0) == 1  # now a leaf, at its old place


# ---- ARC ---------------------------------------------------------------------------------------
def test_arc_protects_the_frequent_list_and_adapts_on_ghost_hits() -> None:
    policy = ARCPolicy()
    for number in range(1, 5):
        policy.on_insert(meta(number), now=float(number))
    policy.on_access(key(1), now=5.0)  # 1 moves to T2
    assert _evict(policy, 6.0) == 2  # |T1| = 3 > p = 0: T1's LRU
    assert policy.p == 0.0
    policy.on_insert(meta(2), now=7.0)  # a B1 ghost hit: p grows, 2 enters T2
    assert policy.p >= 1.0
    assert _evict(policy, 8.0) == 3


# ---- GDSF --------------------------------------------------------------------------------------
def test_gdsf_prices_frequency_cost_and_size_and_inflates() -> None:
    policy = GDSFPolicy()
    policy.on_insert(meta(1, recompute_s=1.0), now=0.0)
    policy.on_insert(meta(2, recompute_s=3.0), now=0.0)
    policy.on_insert(meta(3, recompute_s=1.0, size=500), now=0.0)  # same cost, half the size
    policy.on_access(key(1), now=1.0)
    policy.on_access(key(1), now=2.0)  # H(1) = 3 × 1e-3 s/B, H(2) = 3e-3, H(3) = 2e-3
    assert _evict(policy, 3.0) == 3  # the least value per byte goes first
    assert policy.inflation == 2e-3  # L = the victim's H
    assert _evict(policy, 3.0) == 2  # ties 1; priced earlier


def test_gdsf_inflation_lets_new_objects_outrank_stale_frequent_ones() -> None:
    policy = GDSFPolicy()
    policy.on_insert(meta(1), now=0.0)
    for step in range(3):
        policy.on_access(key(1), now=float(step))  # H(1) = 4 × 1e-3
    for number in range(2, 5):  # each newcomer is evicted, raising L by 1e-3 each time
        policy.on_insert(meta(number), now=10.0)
        assert _evict(policy, 10.0) == number
    policy.on_insert(meta(5), now=11.0)  # H = L + 1e-3 = H(1): the stale object goes
    assert _evict(policy, 12.0) == 1


# ---- TinyLFU -----------------------------------------------------------------------------------
def test_count_min_sketch_counts_caps_and_halves() -> None:
    sketch = CountMinSketch(1024)
    for _ in range(20):
        sketch.add(key(1))
    sketch.add(key(2))
    assert sketch.estimate(key(1)) == 15 and sketch.estimate(key(2)) >= 1
    sketch.halve()
    assert sketch.estimate(key(1)) == 7


def test_tinylfu_keeps_the_victim_over_a_rarer_newcomer() -> None:
    """The paper's admission: with the tier full, a newcomer is stored only when its estimate
    (this request counted) exceeds the LRU victim's; otherwise the victim stays."""
    policy = TinyLFUPolicy()
    policy.on_insert(meta(1), now=0.0)
    for step in range(1, 4):
        policy.on_access(key(1), now=float(step))
    victim = policy.victim(5.0)
    assert victim == key(1)
    assert not policy.admit(meta(2), victim, 5.0)  # seen once against 1's four
    assert key(1) in policy and key(2) not in policy
    for _ in range(4):
        policy.on_refused(key(2), 6.0)  # requested again, behind a refused ancestor
    assert policy.admit(meta(2), victim, 7.0)  # now seen six times: admitted
    counted = policy.sketch.estimate(key(2))  # 3: the 10th event halved every counter
    policy.on_remove(victim)
    policy.on_insert(meta(2), now=7.0)
    assert policy.sketch.estimate(key(2)) == counted  # admit counted it; the insert did not


def test_the_eviction_replay_asks_tinylfu_before_evicting() -> None:
    """``bench eviction``'s replay: a one-off prompt does not push a hot one out of a full
    tier under TinyLFU (the victim stays), while LRU evicts it."""
    from kvstrata.bench.eviction import SimulatedTrace, make_policy, replay
    from kvstrata.costs import DEFAULT_PREFILL_MODEL
    from kvstrata.workloads.mooncake import TraceRequest

    hot = (1, 2)
    requests = [TraceRequest(1000 * t, 1024, 1, hot) for t in range(6)]
    requests.append(TraceRequest(6000, 1024, 1, (7, 8)))  # a one-off: refused under TinyLFU
    requests.append(TraceRequest(7000, 1024, 1, hot))
    trace = SimulatedTrace.build(requests, DEFAULT_PREFILL_MODEL)
    lru = replay(trace, make_policy("lru", trace), 2)
    tinylfu = replay(trace, make_policy("tinylfu", trace), 2)
    assert lru.saved_tokens == 5 * 1024  # requests 2-6 hit; the last misses
    assert tinylfu.saved_tokens == 6 * 1024 and tinylfu.evictions == 0


# ---- registration ------------------------------------------------------------------------------
def test_every_deployed_policy_is_a_tier_choice() -> None:
    from kvstrata.runtime.config_schema import EVICTION_POLICIES
    from kvstrata.runtime.store_factory import eviction_policy
    from kvstrata.store.deployed import DEPLOYED_POLICIES

    for name in DEPLOYED_POLICIES:
        assert name in EVICTION_POLICIES
        assert eviction_policy(name, 1e-9).name == name
    capped = eviction_policy("gdsf", 1e-4)  # GDSF's cost is capped at the demotion fetch
    assert isinstance(capped, GDSFPolicy)
    capped.on_insert(meta(1, recompute_s=5.0), now=0.0)
    capped.on_insert(meta(2, recompute_s=0.05), now=0.0)
    assert _evict(capped, 1.0) == 2


# ---- parameters and the benchmark's tuned peers ------------------------------------------------
def test_peer_specs_build_the_named_point() -> None:
    from kvstrata.store.deployed import PEER_PARAMETERS, TUNED_PEERS, is_peer_spec, peer_policy

    assert TUNED_PEERS == ("s3fifo-tuned", "tinylfu-tuned", "gdsf-tuned")
    for name, parameter in PEER_PARAMETERS.items():
        assert parameter.default in parameter.swept and parameter.tuned in parameter.swept
        assert peer_policy(name).name == name
        assert peer_policy(f"{name}-tuned").name == name
        assert peer_policy(f"{name}:{parameter.swept[0]}").name == name
        assert is_peer_spec(f"{name}:0.5") and is_peer_spec(f"{name}-tuned")
    assert isinstance(peer_policy("s3fifo-tuned"), S3FIFOPolicy)
    assert peer_policy("s3fifo-tuned")._small_fraction == PEER_PARAMETERS["s3fifo"].tuned
    assert peer_policy("tinylfu:2.5")._sample_factor == 2.5
    assert is_peer_spec("arc") and not is_peer_spec("arc-tuned") and not is_peer_spec("arc:1")
    assert not is_peer_spec("lru") and not is_peer_spec("kvstrata")


def test_bad_peer_specs_are_refused_clearly() -> None:
    import pytest

    from kvstrata.errors import InvalidInput
    from kvstrata.store.deployed import peer_policy

    for spec in (
        "gdsf:0",
        "gdsf:-1",
        "gdsf:nan",
        "gdsf:inf",
        "gdsf:x",
        "arc:1",
        "arc-tuned",
        "lru",
    ):
        with pytest.raises(InvalidInput):
            peer_policy(spec)


def test_greedydual_star_beta_trades_cost_against_aging() -> None:
    """β = 1 is GDSF: a dearer object inserted before the inflation rose goes before a cheaper
    fresh one. A small β magnifies the cost gap so that the inflation no longer overtakes it:
    the cheap one goes."""

    def victim_after_inflation(beta: float) -> int:
        policy = GDSFPolicy(beta=beta)
        policy.on_insert(meta(1, size=1000, recompute_s=1.5), now=0.0)  # dearer, old
        policy.on_insert(meta(2, size=1000, recompute_s=1.0), now=0.0)
        assert _evict(policy, 1.0) == 2  # L rises to the cheap one's priority
        policy.on_insert(meta(3, size=1000, recompute_s=1.0), now=2.0)  # cheap, fresh: L + v
        return _evict(policy, 3.0)

    assert victim_after_inflation(1.0) == 1  # H: 1.5e-3 against L + 1e-3 = 2e-3
    assert victim_after_inflation(0.25) == 3  # H: 5.1e-12 against L + 1e-12 = 2e-12


def test_a_tier_can_run_a_peer_at_any_point_and_bad_points_are_config_errors() -> None:
    import pytest

    from kvstrata.errors import ConfigError
    from kvstrata.runtime.config import load_worker_config
    from kvstrata.runtime.store_factory import eviction_policy

    def tier_policy(name: object) -> str:
        raw = {"tiers": [{"name": "host", "gib": 1, "eviction_policy": name}]}
        return load_worker_config(raw=raw, source="test").tiers[0].eviction_policy

    for name in ("gdsf:0.125", "gdsf-tuned", "s3fifo:0.05", "tinylfu-tuned", "kvstrata"):
        assert tier_policy(name) == name
        assert eviction_policy(name, 1e-9) is not None
    for bad in ("gdsf:0", "gdsf:nan", "arc:1", "arc-tuned", "fifo", 3):
        with pytest.raises(ConfigError, match="eviction_policy"):
            tier_policy(bad)
    star = eviction_policy("gdsf:0.25", None)  # the store's construction: GreedyDual* at 0.25
    assert isinstance(star, GDSFPolicy) and star._exponent == 4.0


def test_a_refused_newcomer_inserted_later_is_counted_again() -> None:
    """A refused ``admit`` must not leave the key marked as counted: its next insert (with
    room, no admission asked) is a new request and counts."""
    policy = TinyLFUPolicy()
    policy.on_insert(meta(1), now=0.0)
    policy.on_access(key(1), now=1.0)
    assert not policy.admit(meta(2), key(1), 2.0)
    policy.on_insert(meta(2), now=3.0)
    assert policy.sketch.estimate(key(2)) == 2
