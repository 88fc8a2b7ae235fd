"""The ``dynamo`` baseline computes Dynamo's KV router cost from the router's own record.

Dynamo (``lib/kv-router``, see :mod:`kvstrata.router.dynamo_policy`):
``cost = max(0, (active_prefill_tokens + isl) / block − overlap_credit) + active_unique_blocks
+ new_blocks``, where ``active_prefill_tokens`` are the uncached tokens of requests routed and
not yet at their first token, and the blocks are the unique prompt blocks of routed, unfinished
requests plus the new request's blocks not among them.
"""

from __future__ import annotations

import pytest

from kvstrata.costs import PrefillModel
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import ConsistencyMode, GlobalIndex, PrefixMatch
from kvstrata.router import POLICIES, CostProfile, Router, RouteRequest, WorkerLoad
from kvstrata.router.dynamo_policy import DynamoLinearPolicy

BS = 16
PROFILE = CostProfile(
    prefill=PrefillModel(overhead_s=0.01, per_token_s=1e-3),
    fetch_s_per_block=(0.0, 2e-4, 1e-3, 4e-3),
    block_size=BS,
)


def profiles(_: str) -> CostProfile:
    return PROFILE


def request(tokens: int, rid: str, prefix: int = 1) -> RouteRequest:
    return RouteRequest(rid, "t", tokens, [prefix * 1_000_003 + i for i in range(tokens // BS)])


def device(**blocks: int) -> dict[str, PrefixMatch]:
    return {w: PrefixMatch(w, n, (n, 0, 0, 0)) for w, n in blocks.items()}


def place(policy: DynamoLinearPolicy, req: RouteRequest, worker: str, cached: int) -> None:
    """Route ``req`` to ``worker`` (its only candidate) and commit the decision."""
    decision = policy.choose(req, device(**{worker: cached}), [WorkerLoad(worker)])
    assert decision.worker_id == worker
    policy.routed(req, decision)


def scores(policy: DynamoLinearPolicy, req: RouteRequest, found: dict[str, PrefixMatch]) -> dict:
    decision = policy.choose(req, found, [WorkerLoad("a"), WorkerLoad("b")])
    return {e.worker_id: e.score for e in decision.estimates} | {"pick": decision.worker_id}


def test_cost_is_dynamos_formula_over_the_routers_own_record() -> None:
    policy = POLICIES["dynamo"](profiles)
    assert isinstance(policy, DynamoLinearPolicy)
    place(policy, request(320, "r1"), "a", cached=4)  # 20 blocks, 256 uncached tokens
    place(policy, request(160, "r2"), "a", cached=0)  # its 10 blocks are r1's: shared
    q = request(480, "q")  # 30 blocks; the first 20 are active on a and cached there
    found = device(a=20)
    # a: max(0, (256 + 160 + 480)/16 − 20) + 20 unique active + 10 new = 36 + 30
    # b: 480/16 + 0 + 30 new
    assert scores(policy, q, found) == pytest.approx({"a": 66.0, "b": 60.0, "pick": "b"})
    # r1's first token: its 256 tokens leave the prefill term, its blocks stay.
    policy.first_token("r1")
    assert scores(policy, q, found) == pytest.approx({"a": 50.0, "b": 60.0, "pick": "a"})
    # r1 ends: only r2's 10 blocks stay active (q then adds 20), r2 still prefilling.
    policy.finished("r1")
    assert scores(policy, q, found) == pytest.approx({"a": 50.0, "b": 60.0, "pick": "a"})
    policy.finished("r2")
    assert scores(policy, q, found)["a"] == pytest.approx(30 - 20 + 30)
    assert len(policy.active) == 0 and policy.active.active_blocks("a") == 0


def test_tier_credits_and_worker_telemetry_is_not_read() -> None:
    policy = POLICIES["dynamo"](profiles)
    q = request(1024, "q")  # 64 blocks
    found = {
        "a": PrefixMatch("a", 32, (32, 0, 0, 0)),
        "b": PrefixMatch("b", 32, (0, 32, 0, 0)),
        "c": PrefixMatch("c", 32, (0, 0, 32, 0)),
    }
    # The simulator's/worker's own counts do not enter: Dynamo's router tracks its own.
    busy = [
        WorkerLoad("a", queued_prefill_tokens=10_000, active_kv_blocks=500),
        *map(WorkerLoad, "bc"),
    ]
    decision = policy.choose(q, found, busy)
    got = {e.worker_id: e.score for e in decision.estimates}
    # max(64 − credit, 0) + 64 new blocks; credits device 1.0, host 0.75, disk 0.25 per block
    assert got == pytest.approx({"a": 32.0 + 64, "b": 40.0 + 64, "c": 56.0 + 64})
    assert decision.worker_id == "a"


def test_router_tells_the_policy_only_of_committed_routes() -> None:
    index = GlobalIndex(
        FingerprintDigest(bytes(32)), BS, mode=ConsistencyMode.EXACT, clock=lambda: 0.0
    )
    policy = POLICIES["dynamo"](profiles)
    assert isinstance(policy, DynamoLinearPolicy)
    router = Router(index, policy)
    tokens = list(range(64))
    req = RouteRequest("r1", "t", 64, index.request_hashes("t", tokens))
    workers = [WorkerLoad("a"), WorkerLoad("b")]
    router.route(req, workers, now=0.0, record=False)
    assert len(policy.active) == 0
    first = router.route(req, workers, now=0.0)
    assert policy.active.prefill_tokens(first.worker_id) == 64
    assert policy.active.active_blocks(first.worker_id) == 4
    # A second, unrelated request goes to the other worker: the first one loads its worker.
    other = RouteRequest("r2", "t", 64, index.request_hashes("t", list(range(100, 164))))
    assert router.route(other, workers, now=0.0).worker_id != first.worker_id
    router.first_token("r1")
    assert policy.active.prefill_tokens(first.worker_id) == 0
    router.finished("r1")
    router.finished("r2")
    router.finished("unknown")  # a request the policy never saw is ignored
    assert len(policy.active) == 0
