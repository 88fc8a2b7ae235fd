"""Issue 15 item 3's goal on the public Mooncake trace, asserted so a regression fails CI:
kvstrata saves at least the prefill seconds of every deployed policy (LRU, S3-FIFO, ARC,
GDSF, TinyLFU in front of LRU) at every capacity, and at least 0.97× the best of them in tokens.

Two sets of peers. At their papers' defaults (``DEPLOYED_POLICIES``) and at their best
(``TUNED_PEERS``: each parameterised peer at the point a sweep of its main parameter chose on
the trace's first half, :mod:`kvstrata.store.deployed`). On the first slice both goals are
missed against the defaults and against the tuned peers (strict xfails: a fix turns them into
failures to be promoted); the whole trace is asserted, so a regression fails CI.

Slices: the trace's first ``REQUESTS`` requests (7.5 minutes from an empty tier), and the
whole trace (about an hour: what ``kvstrata bench all``'s eviction-mooncake publishes; both
goals hold there against the defaults and the tuned peers alike); simulated time, so the
figures do not depend on the machine; capacities 2%, 5% and 15% of the slice's distinct
blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstrata.bench.eviction import DEPLOYED_BASELINE, run_eviction_bench, versus_best_peer
from kvstrata.store.deployed import DEPLOYED_POLICIES, TUNED_PEERS
from kvstrata.workloads.mooncake import read_trace

MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mooncake"
) / "conversation_trace.jsonl"
REQUESTS = 1500
CAPACITY_FRACTIONS = (0.02, 0.05, 0.15)
DEFAULTS = (DEPLOYED_BASELINE, *DEPLOYED_POLICIES)  # LRU is deployed too (vLLM, LMCache)
EVERY_PEER = (*DEFAULTS, *TUNED_PEERS)
HALF_TUNED = ("gdsf:0.75",)
"""For the whole trace: the peers' points a sweep chooses on the trace's first half taken as
one window (6,000 requests) rather than as four of 1,500. S3-FIFO's is its ``-tuned`` one
again (0.002); TinyLFU's (2 at stop 31) was chosen before TinyLFU refused newcomers as its
paper says and is not re-swept on the half; GreedyDual*'s is β = 0.75, not 0.125 (scored as for
``TUNED_PEERS``: the geometric mean of √(seconds × tokens) over 2/5/15 % against the default;
β 0.5 / 0.75 / 1 / 1.5 / 2 / 3 scored 1.013 / 1.052 / 1 / 0.865 / 0.877 / 0.844)."""


def _run(requests_count: int | None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    if not MOONCAKE_TRACE.is_file():
        pytest.skip("Mooncake trace not present")
    requests = read_trace(MOONCAKE_TRACE)[:requests_count]
    distinct = len({block for request in requests for block in request.hash_ids})
    capacities = [int(distinct * fraction) for fraction in CAPACITY_FRACTIONS]
    policies = (*EVERY_PEER, *extra, "kvstrata")
    return run_eviction_bench(requests, capacities, policies=policies)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return _run(REQUESTS)


@pytest.fixture(scope="module")
def whole() -> dict[str, Any]:
    return _run(None, HALF_TUNED)


def _ratios(report: dict[str, Any], field: str, peers: tuple[str, ...]) -> list[float]:
    return [value or 0.0 for value in versus_best_peer(report[field], peers)]


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="goal missed (issue 15 item 3): since TinyLFU admits as its paper says (a rarer "
    "newcomer is refused and the victim stays; before, the victim went first and TinyLFU "
    "behaved almost as LRU), kvstrata saves 0.755 / 1.222 / 1.080x the best default peer's "
    "seconds at 2 / 5 / 15%",
)
def test_kvstrata_saves_at_least_the_seconds_of_every_default_deployed_policy(
    report: dict[str, Any],
) -> None:
    ratios = _ratios(report, "saved_prefill_s", DEFAULTS)
    assert min(ratios) >= 1.0, (ratios, report["saved_prefill_s"])


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="goal missed (issue 15 item 3): kvstrata saves 0.793 / 0.847 / 1.028x the best "
    "default peer's tokens at 2 / 5 / 15% (TinyLFU; 1.108 / 0.969 / 1.083 before TinyLFU "
    "refused newcomers as its paper says)",
)
def test_kvstrata_saves_at_least_097_of_the_best_default_deployed_tokens(
    report: dict[str, Any],
) -> None:
    ratios = _ratios(report, "saved_tokens", DEFAULTS)
    assert min(ratios) >= 0.97, (ratios, report["saved_tokens"])


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="goal missed (issue 15 item 3): against the tuned peers kvstrata saves 0.518 / "
    "0.433 / 0.879x the best seconds at 2 / 5 / 15% (GreedyDual* at beta 0.125)",
)
def test_kvstrata_saves_at_least_the_seconds_of_every_tuned_peer(report: dict[str, Any]) -> None:
    ratios = _ratios(report, "saved_prefill_s", EVERY_PEER)
    assert min(ratios) >= 1.0, (ratios, report["saved_prefill_s"])


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="goal missed (issue 15 item 3): against the tuned peers kvstrata saves 0.773 / "
    "0.706 / 0.988x the best tokens at 2 / 5 / 15% (TinyLFU at its tuned point 3)",
)
def test_kvstrata_saves_at_least_097_of_the_best_tuned_peer_tokens(
    report: dict[str, Any],
) -> None:
    ratios = _ratios(report, "saved_tokens", EVERY_PEER)
    assert min(ratios) >= 0.97, (ratios, report["saved_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "peers",
    [DEFAULTS, EVERY_PEER, (*EVERY_PEER, *HALF_TUNED)],
    ids=["defaults", "tuned", "tuned-on-half"],
)
def test_kvstrata_meets_both_goals_on_the_whole_trace(
    whole: dict[str, Any], peers: tuple[str, ...]
) -> None:
    """Where the results page's figures come from: both goals hold at every capacity, against
    the defaults and the tuned peers alike (at stop 31: seconds 1.53 / 1.12 / 1.02, tokens
    1.37 / 1.00 / 1.04; the tuned GreedyDual* that wins the first slice saves 0.60 / 0.64 /
    0.71x kvstrata's seconds here: its near-static order keeps stale chains). The margin at
    15 % is thin: GreedyDual* tuned on the whole trace itself (β 2 or 3, a budget kvstrata
    did not get) saves 1.011 / 1.006x kvstrata's seconds there."""
    seconds = _ratios(whole, "saved_prefill_s", peers)
    tokens = _ratios(whole, "saved_tokens", peers)
    assert min(seconds) >= 1.0 and min(tokens) >= 0.97, (seconds, tokens)
