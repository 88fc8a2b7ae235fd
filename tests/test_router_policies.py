"""Placement policies on hand-built loads and matches: each picks what its formula says.

Expected values are computed here from the documented formulas (``router/policies.py`` module
docstring, issue 4), not read back from the code under test.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvstrata.costs import PrefillModel
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import ConsistencyMode, GlobalIndex, PrefixMatch
from kvstrata.router import (
    POLICIES,
    CostProfile,
    HotPrefixConfig,
    KvstrataPolicy,
    NoWorkerAvailable,
    RouteDecision,
    Router,
    RouteRequest,
    WorkerLoad,
)

BS = 16
OVERHEAD, PER_TOKEN = 0.01, 1e-3
FETCH = (0.0, 2e-4, 1e-3, 4e-3)
PROFILE = CostProfile(
    prefill=PrefillModel(overhead_s=OVERHEAD, per_token_s=PER_TOKEN),
    fetch_s_per_block=FETCH,
    block_size=BS,
)


def profiles(_: str) -> CostProfile:
    return PROFILE


def prefill_s(new_tokens: int) -> float:
    return OVERHEAD + PER_TOKEN * new_tokens


def request(tokens: int, prefix: int = 1, rid: str = "r", arrival: float = 0.0) -> RouteRequest:
    """``prefix`` names the content: equal prefixes give equal hashes block for block."""
    hashes = [prefix * 1_000_003 + i for i in range(tokens // BS)]
    return RouteRequest(rid, "t", tokens, hashes, arrival_s=arrival)


def match(worker: str, tiers: tuple[int, int, int, int]) -> PrefixMatch:
    return PrefixMatch(worker, sum(tiers), tiers)


def matches(**tiers: tuple[int, int, int, int]) -> dict[str, PrefixMatch]:
    return {w: match(w, t) for w, t in tiers.items()}


def loads(*items: WorkerLoad) -> list[WorkerLoad]:
    return list(items)


def expected_ttft(req: RouteRequest, m: PrefixMatch, load: WorkerLoad) -> float:
    """queue + min(fetch + prefill of the rest, prefill of all); the last token is computed."""
    cached = min(m.blocks * BS, req.prompt_tokens - 1)
    fetch = sum(n * s for n, s in zip(m.tier_blocks, FETCH, strict=True))
    return load.queued_s + min(
        fetch + prefill_s(req.prompt_tokens - cached), prefill_s(req.prompt_tokens)
    )


# ------------------------------------------------------------------------------ kvstrata
def test_kvstrata_picks_the_lowest_ttft_estimate() -> None:
    policy = KvstrataPolicy(profiles, work_weight=0.0)
    req = request(1024)
    found = matches(a=(32, 0, 0, 0), b=(0, 0, 0, 0), c=(0, 0, 64, 0))
    load = loads(WorkerLoad("a", queued_s=0.5), WorkerLoad("b"), WorkerLoad("c"))
    decision = policy.choose(req, found, load)
    want = {w.worker_id: expected_ttft(req, found[w.worker_id], w) for w in load}
    assert want["c"] < want["a"] < want["b"]  # c: 64 disk blocks fetched beat recomputing
    assert decision.worker_id == "c" and decision.reason.startswith("lowest")
    for estimate in decision.estimates:
        assert estimate.ttft_s == pytest.approx(want[estimate.worker_id])
    assert decision.predicted_ttft_s == pytest.approx(want["c"])
    assert decision.matched_blocks == 64


def test_kvstrata_recomputes_when_fetching_is_slower() -> None:
    slow_disk = CostProfile(
        prefill=PROFILE.prefill, fetch_s_per_block=(0.0, 2e-4, 0.05, 0.1), block_size=BS
    )
    policy = KvstrataPolicy(lambda _: slow_disk, work_weight=0.0)
    req = request(1024)
    found = matches(a=(32, 0, 0, 0), c=(0, 0, 64, 0))
    decision = policy.choose(req, found, loads(WorkerLoad("a", queued_s=0.5), WorkerLoad("c")))
    by_worker = {e.worker_id: e for e in decision.estimates}
    assert by_worker["c"].fetch_s == 0.0  # 64 × 50 ms > a full prefill: recompute instead
    assert by_worker["c"].ttft_s == pytest.approx(prefill_s(1024))
    assert decision.worker_id == "a"


def test_kvstrata_charges_the_work_it_adds() -> None:
    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 0, 0))
    load = loads(WorkerLoad("h", queued_s=1.03), WorkerLoad("x"))
    greedy = KvstrataPolicy(profiles, work_weight=0.0).choose(req, found, load)
    assert greedy.worker_id == "x"  # 1.034 s vs 1.03 + 0.011 s
    weighted = KvstrataPolicy(profiles, work_weight=1.0, load_adaptive=False)
    decision = weighted.choose(req, found, load)
    assert decision.worker_id == "h"
    for estimate in decision.estimates:
        assert estimate.score == pytest.approx(
            estimate.ttft_s + 1.0 * (estimate.prefill_s + estimate.fetch_s)
        )


def test_kvstrata_work_charge_follows_the_busy_share() -> None:
    """Idle cluster: added work costs nobody, placement is TTFT-greedy; busy: it is charged."""
    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 0, 0))
    policy = KvstrataPolicy(profiles, work_weight=1.0)
    idle = loads(WorkerLoad("h", queued_s=1.03), WorkerLoad("x"))
    assert policy.choose(req, found, idle).worker_id == "x"
    busy = loads(
        WorkerLoad("h", queued_s=1.03, queued_requests=2), WorkerLoad("x", queued_requests=1)
    )
    decision = policy.choose(req, found, busy)
    assert decision.worker_id == "h"
    factor = min(4.0, (1.0 / 0.05) / (0.8 / 0.25))  # busy share 1 vs 0.8, capped at 4
    for estimate in decision.estimates:
        assert estimate.score == pytest.approx(
            estimate.ttft_s + factor * (estimate.prefill_s + estimate.fetch_s)
        )


def place(
    policy: KvstrataPolicy,
    req: RouteRequest,
    found: dict[str, PrefixMatch],
    load: list[WorkerLoad],
) -> RouteDecision:
    """A committed decision, as :class:`Router` makes one (choose, then ``routed``)."""
    decision = policy.choose(req, found, load)
    policy.routed(req, decision)
    return decision


def test_kvstrata_explanations_change_no_later_decision() -> None:
    """``/debug/route`` (``record=False``) neither makes a prefix popular nor turns ties."""
    explained = KvstrataPolicy(profiles, work_weight=0.0, hot=HotPrefixConfig(min_requests=4))
    fresh = KvstrataPolicy(profiles, work_weight=0.0, hot=HotPrefixConfig(min_requests=4))
    router = Router(GlobalIndex(FingerprintDigest(bytes(32)), BS), explained)
    found, load = _hot_setup()
    for _ in range(10):
        explained.choose(request(2048, rid="q"), found, load)  # what record=False runs
    for i in range(5):
        a = place(explained, request(2048, rid=f"r{i}"), found, load)
        b = place(fresh, request(2048, rid=f"r{i}"), found, load)
        assert (a.worker_id, a.reason) == (b.worker_id, b.reason)
    assert a.reason == "hot_prefix_spill:h"  # committed decisions still count
    idle = loads(WorkerLoad("x"), WorkerLoad("y"))
    explain = {router.route(request(64, rid="c"), idle, record=False).worker_id for _ in range(4)}
    assert len(explain) == 1  # explaining again says the same thing
    committed = {router.route(request(64, rid=f"c{i}"), idle).worker_id for i in range(4)}
    assert committed == {"x", "y"}  # exact ties rotate over committed decisions


def _hot_setup() -> tuple[dict[str, PrefixMatch], list[WorkerLoad]]:
    # h holds all 128 blocks and is overloaded: 2.0 s > 1.5 × mean(2.0, 0, 0.1) + 0.25.
    found = matches(h=(128, 0, 0, 0), x=(0, 0, 0, 0), y=(0, 0, 0, 0))
    load = loads(WorkerLoad("h", queued_s=2.0), WorkerLoad("x"), WorkerLoad("y", queued_s=0.1))
    return found, load


def test_kvstrata_spills_a_popular_prefix_away_from_an_overloaded_holder() -> None:
    policy = KvstrataPolicy(profiles, work_weight=0.0, hot=HotPrefixConfig(min_requests=4))
    found, load = _hot_setup()
    reasons = []
    for i in range(5):
        decision = place(policy, request(2048, rid=f"r{i}"), found, load)  # same instant
        reasons.append((decision.worker_id, decision.reason))
    # The first three go to the holder (lowest TTFT, prefix not yet popular) ...
    assert [w for w, _ in reasons[:3]] == ["h", "h", "h"]
    assert not any(r.startswith("hot_prefix_spill") for _, r in reasons[:3])
    # ... from the fourth on, the best non-holder takes it and becomes a second home.
    for worker, reason in reasons[3:]:
        assert worker == "x" and reason == "hot_prefix_spill:h"


def test_kvstrata_does_not_spill_an_unpopular_prefix_or_from_a_busy_but_fair_holder() -> None:
    policy = KvstrataPolicy(profiles, work_weight=0.0, hot=HotPrefixConfig(min_requests=4))
    found, load = _hot_setup()
    for i in range(8):  # every request another prefix: none becomes popular
        decision = place(policy, request(2048, prefix=100 + i, rid=f"u{i}"), found, load)
        assert decision.worker_id == "h" and not decision.reason.startswith("hot_prefix_spill")
    # A popular prefix whose holder is not overloaded (everyone is as busy) stays put.
    even = loads(*(WorkerLoad(w, queued_s=2.0) for w in ("h", "x", "y")))
    for i in range(8):
        decision = place(policy, request(2048, prefix=7, rid=f"p{i}"), found, even)
        assert decision.worker_id == "h" and not decision.reason.startswith("hot_prefix_spill")


def test_kvstrata_spills_a_popular_short_prefix_with_distinct_tails() -> None:
    """A 512-token prefix, then 512 tokens of each request's own; h holds the prefix.

    h is overloaded (0.45 s > 1.5 × mean 0.1125 s + 0.25 s) yet still has the lowest TTFT
    (0.45 + 0.522 s vs 1.034 s elsewhere), exactly the case spill-over exists for. With
    popularity keyed by the holder's matched prefix, the shared prefix becomes popular
    and the policy spills from the fourth request on.
    """
    policy = KvstrataPolicy(profiles, work_weight=0.0, hot=HotPrefixConfig(min_requests=4))
    found = matches(h=(32, 0, 0, 0), x=(0, 0, 0, 0), y=(0, 0, 0, 0), z=(0, 0, 0, 0))
    load = loads(WorkerLoad("h", queued_s=0.45), WorkerLoad("x"), WorkerLoad("y"), WorkerLoad("z"))
    shared = [7 * 1_000_003 + b for b in range(32)]
    reasons = []
    for i in range(8):
        tail = [(1000 + i) * 1_000_003 + b for b in range(32)]
        req = RouteRequest(f"s{i}", "t", 1024, shared + tail)
        reasons.append(place(policy, req, found, load).reason)
    assert reasons[-1] == "hot_prefix_spill:h"


# ------------------------------------------------------------------------------ baselines
def test_dynamo_prefers_device_cached_blocks() -> None:
    policy = POLICIES["dynamo"](profiles)
    req = request(1024)  # 64 blocks
    found = matches(dev=(32, 0, 0, 0), disk=(0, 0, 32, 0), host=(0, 32, 0, 0))
    load = loads(WorkerLoad("disk"), WorkerLoad("host"), WorkerLoad("dev"))
    decision = policy.choose(req, found, load)
    assert decision.worker_id == "dev" and decision.reason == "lowest_cost"
    scores = {e.worker_id: e.score for e in decision.estimates}
    # max(64 − credit, 0) with credits device 1.0, host 0.75, disk 0.25 per block, plus the
    # request's 64 blocks as new active blocks (load terms: tests/test_dynamo_policy.py)
    assert scores == pytest.approx({"dev": 32.0 + 64, "host": 40.0 + 64, "disk": 56.0 + 64})


def test_llmd_scores_the_documented_sum() -> None:
    policy = POLICIES["llm-d"](profiles)
    req = request(1024)  # 64 blocks
    found = matches(a=(64, 0, 0, 0), b=(32, 0, 0, 0), c=(0, 0, 0, 0))
    load = loads(
        WorkerLoad("a", queued_requests=4, kv_utilisation=0.9),
        WorkerLoad("b", queued_requests=0, kv_utilisation=0.2),
        WorkerLoad("c", queued_requests=2, kv_utilisation=0.0),
    )
    decision = policy.choose(req, found, load)
    scores = {e.worker_id: e.score for e in decision.estimates}
    # llm-d's published profile: 3·hit ratio + 2·(1 − kv utilisation)
    # + 2·(longest − queue) / (longest − shortest)
    assert scores == pytest.approx(
        {"a": 3.0 + 0.2 + 0.0, "b": 1.5 + 1.6 + 2.0, "c": 0.0 + 2.0 + 1.0}
    )
    assert decision.worker_id == "b" and decision.reason == "highest_score"


def test_round_robin_least_loaded_and_prefix_affinity() -> None:
    req = request(256)
    found = matches(a=(4, 0, 0, 0), b=(8, 0, 0, 0), c=(8, 0, 0, 0))
    load = loads(
        WorkerLoad("a", queued_requests=0, active_decodes=1),
        WorkerLoad("b", queued_requests=3, active_decodes=0),
        WorkerLoad("c", queued_requests=1, active_decodes=1, queued_s=0.3),
    )
    rr = POLICIES["round-robin"](profiles)
    assert [rr.choose(req, found, load).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert POLICIES["least-loaded"](profiles).choose(req, found, load).worker_id == "a"
    # b and c hold 8 blocks; c has fewer requests (2 vs 3).
    affinity = POLICIES["prefix-affinity"](profiles).choose(req, found, load)
    assert affinity.worker_id == "c" and affinity.matched_blocks == 8
    tie = loads(
        WorkerLoad("a", queued_requests=1), WorkerLoad("b", queued_requests=1, queued_s=0.1)
    )
    assert POLICIES["least-loaded"](profiles).choose(req, found, tie).worker_id == "a"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_workers_are_never_chosen(name: str) -> None:
    policy = POLICIES[name](profiles)
    req = request(1024)
    # The sick worker is the best by every measure: full prefix, idle, first in the list.
    found = matches(sick=(64, 0, 0, 0), ok1=(0, 0, 0, 0), ok2=(8, 0, 0, 0))
    load = loads(
        WorkerLoad("sick", healthy=False),
        WorkerLoad("ok1", queued_requests=3, queued_s=3.0, kv_utilisation=0.9),
        WorkerLoad("ok2", queued_requests=5, queued_s=5.0, active_kv_blocks=50),
    )
    for i in range(6):
        decision = policy.choose(request(1024, rid=f"r{i}", arrival=i), found, load)
        assert decision.worker_id != "sick"
        assert {e.worker_id for e in decision.estimates} == {"ok1", "ok2"}
    assert req.prompt_tokens == 1024


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_worker_available(name: str) -> None:
    policy = POLICIES[name](profiles)
    with pytest.raises(NoWorkerAvailable):
        policy.choose(request(64), {}, [WorkerLoad("a", healthy=False)])
    with pytest.raises(NoWorkerAvailable):
        policy.choose(request(64), {}, [])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decisions_serialise_to_json(name: str) -> None:
    policy = POLICIES[name](profiles)
    found = matches(a=(2, 1, 1, 0))
    decision = policy.choose(request(128), found, loads(WorkerLoad("a"), WorkerLoad("b")))
    body = json.loads(json.dumps(decision.to_dict()))
    assert body["policy"] == name and body["worker_id"] in {"a", "b"}
    assert body["request_id"] == "r"
    by_worker = {e["worker_id"]: e for e in body["estimates"]}
    assert by_worker["a"]["tier_blocks"] == [2, 1, 1, 0]
    assert by_worker["a"]["matched_blocks"] == 4 and by_worker["b"]["matched_blocks"] == 0


def test_a_missing_match_counts_as_no_prefix() -> None:
    decision = POLICIES["prefix-affinity"](profiles).choose(
        request(128), {}, loads(WorkerLoad("a"), WorkerLoad("b"))
    )
    assert decision.matched_blocks == 0 and decision.worker_id == "a"


# ------------------------------------------------------------------------------ router
def test_router_records_its_decisions_in_approximate_mode() -> None:
    index = GlobalIndex(
        FingerprintDigest(bytes(32)), BS, mode=ConsistencyMode.APPROXIMATE, clock=lambda: 0.0
    )
    router = Router(index, POLICIES["prefix-affinity"](profiles))
    tokens = list(range(64))
    hashes = index.request_hashes("t", tokens)
    req = RouteRequest("r1", "t", 64, hashes)
    workers = loads(WorkerLoad("a", queued_requests=1), WorkerLoad("b"))
    explain = router.route(req, workers, now=0.0, record=False)
    assert explain.worker_id == "b" and not router.recent
    assert all(m.blocks == 0 for m in index.match(hashes, now=0.0).values())
    first = router.route(req, workers, now=0.0)
    assert first.worker_id == "b" and list(router.recent) == [first]
    # Now b is predicted to hold the prefix: affinity keeps it there despite the queue.
    busy = loads(WorkerLoad("a"), WorkerLoad("b", queued_requests=2))
    second = router.route(RouteRequest("r2", "t", 64, hashes), busy, now=1.0)
    assert second.worker_id == "b" and second.matched_blocks == 4


# ------------------------------------------------------------ kvstrata under uncertainty
def test_kvstrata_never_waits_longer_than_a_whole_ttft_elsewhere() -> None:
    """The work charge keeps a request at the holder only while the wait there is shorter
    than recomputing on a free worker; past that, it recomputes elsewhere."""
    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 0, 0))
    policy = KvstrataPolicy(profiles, work_weight=10.0, load_adaptive=False)
    recompute = prefill_s(1024)  # x's whole TTFT
    short = policy.choose(
        req, found, loads(WorkerLoad("h", queued_s=0.9 * recompute), WorkerLoad("x"))
    )
    assert short.worker_id == "h" and short.reason == "lowest_ttft_plus_work"
    long = policy.choose(
        req, found, loads(WorkerLoad("h", queued_s=1.1 * recompute), WorkerLoad("x"))
    )
    assert long.worker_id == "x" and long.reason == "wait_exceeds_ttft_elsewhere:h"


def _profiles_with_spread(spreads: dict[str, float]) -> Callable[[str], CostProfile]:
    def lookup(worker_id: str) -> CostProfile:
        model = replace(PROFILE.prefill, spread=spreads.get(worker_id, 0.0))
        return PROFILE.with_prefill(model)

    return lookup


def test_kvstrata_guard_prices_an_upper_quantile_of_an_uncertain_wait() -> None:
    """The guard compares upper quantiles: the model-priced parts (queue, prefill) × one
    factor, the measured ones (fetch) as they are. A holder whose mean wait is just under
    x's mean TTFT (part of it a disk fetch) keeps the request with certain models; once
    the models are uncertain, its p90 wait exceeds x's p90 TTFT and x takes it."""
    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 32, 0))  # x: half the prompt on its disk
    x_mean = 32 * FETCH[2] + prefill_s(512)
    load = loads(WorkerLoad("h", queued_s=x_mean - 0.005), WorkerLoad("x"))
    certain = KvstrataPolicy(profiles, work_weight=10.0, load_adaptive=False)
    assert certain.choose(req, found, load).worker_id == "h"
    uncertain = _profiles_with_spread({"h": 0.3, "x": 0.3})
    mean = KvstrataPolicy(uncertain, work_weight=10.0, load_adaptive=False, risk_z=0.0)
    assert mean.choose(req, found, load).worker_id == "h"
    risky = KvstrataPolicy(uncertain, work_weight=10.0, load_adaptive=False)
    decision = risky.choose(req, found, load)
    factor = math.exp(1.2816 * 0.3)
    assert (x_mean - 0.005) * factor > prefill_s(512) * factor + 32 * FETCH[2]
    assert decision.worker_id == "x" and decision.reason == "wait_exceeds_ttft_elsewhere:h"
    # Scores and the predicted TTFT stay mean estimates.
    scores = {e.worker_id: e.score for e in decision.estimates}
    assert scores["x"] == pytest.approx(x_mean * 11.0)
    assert decision.predicted_ttft_s == pytest.approx(x_mean)


def test_kvstrata_guard_does_not_flee_the_worker_whose_fit_is_less_certain() -> None:
    """Identical workers whose fits differ only in how well they have converged: the guard
    prices both with one factor (the median spread), as the score prices both with one
    model. With each worker's own spread it moved a holder's request to the other worker
    whenever the holder's fit was the less certain (stop 38, a live fleet: 52 of 178
    decisions, 112 of 160 requests on one of two workers)."""
    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 0, 0))
    load = loads(WorkerLoad("h", queued_s=0.9 * prefill_s(1024)), WorkerLoad("x"))
    for spreads in ({"h": 0.3}, {"x": 0.3}, {"h": 0.3, "x": 0.3}):
        policy = KvstrataPolicy(
            _profiles_with_spread(spreads), work_weight=10.0, load_adaptive=False
        )
        decision = policy.choose(req, found, load)
        assert decision.worker_id == "h", spreads
        assert decision.reason == "lowest_ttft_plus_work"


def test_kvstrata_guard_risk_is_the_median_spread() -> None:
    """Three workers, one of whose fits is very uncertain: the guard's factor is the median
    spread (0 here), not the mean or the largest, so a holder whose mean wait is just under
    x's mean TTFT (half of it a disk fetch) keeps the request."""
    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 32, 0), y=(0, 0, 0, 0))
    x_mean = 32 * FETCH[2] + prefill_s(512)
    load = loads(WorkerLoad("h", queued_s=x_mean - 0.005), WorkerLoad("x"), WorkerLoad("y"))
    policy = KvstrataPolicy(
        _profiles_with_spread({"y": 0.9}), work_weight=10.0, load_adaptive=False
    )
    decision = policy.choose(req, found, load)
    assert decision.worker_id == "h" and decision.reason == "lowest_ttft_plus_work"
    for aggregate in (0.3, 0.9):  # the mean or the largest spread would have fled h
        factor = math.exp(1.2816 * aggregate)
        assert (x_mean - 0.005) * factor > prefill_s(512) * factor + 32 * FETCH[2]


def test_kvstrata_prices_added_work_alike_on_every_worker() -> None:
    """No worker holds the prompt: its prefill and the work it adds are priced alike (the
    median fit), so the shorter queue wins, though ``fast``'s own fit prices it lower (issue
    15: × the weight, per-worker fit differences became a preference for long queues)."""
    cheap = PROFILE.with_prefill(PrefillModel(overhead_s=OVERHEAD, per_token_s=0.8 * PER_TOKEN))

    def fits(worker_id: str) -> CostProfile:
        return cheap if worker_id == "fast" else PROFILE

    req = request(1024)
    found = matches(fast=(0, 0, 0, 0), idle=(0, 0, 0, 0), other=(0, 0, 0, 0))
    load = loads(WorkerLoad("fast", queued_s=0.5), WorkerLoad("idle"), WorkerLoad("other"))
    own = KvstrataPolicy(fits, work_weight=10.0, load_adaptive=False, pooled_prefill=False)
    assert own.choose(req, found, load).worker_id == "fast"  # 0.2 s cheaper × 11 > 0.5 s
    pooled = KvstrataPolicy(fits, work_weight=10.0, load_adaptive=False)
    decision = pooled.choose(req, found, load)
    assert decision.worker_id == "idle"
    work = prefill_s(1024)  # the median of the three fits
    for estimate in decision.estimates:
        assert estimate.score == pytest.approx(estimate.queue_s + 11.0 * work)
    # The estimates shown stay each worker's own.
    assert {e.worker_id: e.prefill_s for e in decision.estimates}["fast"] < work
    # A cached prefix still earns its saving, priced with the same median model.
    held = matches(fast=(0, 0, 0, 0), idle=(0, 0, 0, 0), other=(32, 0, 0, 0))
    kept = pooled.choose(req, held, load)
    assert kept.worker_id == "other"
    by_worker = {e.worker_id: e for e in kept.estimates}
    assert by_worker["other"].score == pytest.approx(11.0 * prefill_s(1024 - 32 * BS))


def test_kvstrata_guard_prices_the_ttft_elsewhere_with_the_median_fit() -> None:
    """The guard's "whole TTFT elsewhere" is a minimum over workers; with each worker's own
    fit it is the most optimistic fit's. ``x``'s fit prices the prompt at half: the holder's
    wait (0.8 of a prefill) exceeds that, not the median price, so the holder keeps it."""
    cheap = PROFILE.with_prefill(PrefillModel(overhead_s=OVERHEAD / 2, per_token_s=PER_TOKEN / 2))

    def fits(worker_id: str) -> CostProfile:
        return cheap if worker_id == "x" else PROFILE

    req = request(1024)
    found = matches(h=(64, 0, 0, 0), x=(0, 0, 0, 0), y=(0, 0, 0, 0))
    load = loads(WorkerLoad("h", queued_s=0.8 * prefill_s(1024)), WorkerLoad("x"), WorkerLoad("y"))
    own = KvstrataPolicy(fits, work_weight=10.0, load_adaptive=False, pooled_prefill=False)
    assert own.choose(req, found, load).reason == "wait_exceeds_ttft_elsewhere:h"
    pooled = KvstrataPolicy(fits, work_weight=10.0, load_adaptive=False)
    decision = pooled.choose(req, found, load)
    assert decision.worker_id == "h" and decision.reason == "lowest_ttft_plus_work"
