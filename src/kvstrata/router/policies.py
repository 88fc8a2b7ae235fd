"""Placement policies: kvstrata's and, re-exported, the baselines it is measured against.

The TTFT estimate all of them show is in :mod:`.estimate`; the baselines are implemented in
:mod:`.baselines` (and Dynamo's in :mod:`.dynamo_policy`).

Every policy sees the same inputs (the index's per-worker prefix matches and each worker's
load) and returns an explained :class:`RouteDecision`, so the live router and the simulator
run exactly this code. Baselines follow their public documentation:

- ``round-robin`` and ``least-loaded`` (fewest queued + running requests);
- ``prefix-affinity``: the longest cached prefix, ties to the least loaded;
- ``dynamo``: Dynamo's KV router cost over the router's own request bookkeeping, in
  :mod:`.dynamo_policy`;
- ``llm-d``: the scorer sum ``3·prefix_hit_ratio + 2·(1 − kv_utilisation) + 2·queue_score``
  (llm-d's published default profile), where ``queue_score`` is 1 for the shortest queue and 0
  for the longest; highest wins.

Every tunable policy is registered with its published defaults in :mod:`.registry`, so a
tuned variant is the spec ``"llm-d:prefix=6.0"`` and the defaults are one point of any sweep.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from kvstrata.costs import PrefillModel
from kvstrata.index.core import PrefixMatch
from kvstrata.router.baselines import (
    LeastLoadedPolicy,
    LlmdScorerPolicy,
    LlmdWeights,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
)
from kvstrata.router.costs import CostProfile
from kvstrata.router.estimate import TtftEstimator, healthy_loads, match_of
from kvstrata.router.model import (
    RouteDecision,
    RouteRequest,
    WorkerEstimate,
    WorkerLoad,
)

DEFAULT_WORK_WEIGHT: Final = 10.0
"""KvstrataPolicy's charge per second of prefill work it adds. Tuned with ``kvstrata sim`` on
the first half (0–1,768 s) of the Mooncake conversation trace, 16 gpu-a100-8b workers, at the
rate where the best baseline (llm-d) is 80% busy (×2.56): weights 1 / 3 / 5 / 10 / 20 gave
TTFT p99 38.0 / 31.2 / 28.1 / 27.5 / 29.0 s and hit rates 0.260 / 0.294 / 0.308 / 0.322 /
0.328 (bound 0.346; llm-d p99 40.3 s). Charging work is an M/G/1 argument: at utilisation
ρ a second of added work delays later arrivals by about ρ/(1−ρ) seconds each."""
DEFAULT_RISK_Z: Final = 1.2816
"""KvstrataPolicy prices the 90th percentile of queue wait and prefill (z of a normal's p90 on
the log scale of the cost model's error), not their mean: a wrong estimate costs a request
more when it under-states the wait (it joins a queue that is longer than believed) than
when it over-states it."""
MAX_LOG_RISK: Final = math.log(1e3)
"""The risk factor ``exp(z · spread)`` stops at 1,000×: a fit poisoned by an absurd timing must
price a worker as slow, never overflow (which failed every routing call)."""
_REFERENCE_BUSY: Final = 0.8
_MAX_LOAD_FACTOR: Final = 4.0


def _busy_cost(busy: float) -> float:
    return busy / (1.0 - busy + 0.05)


class _Popularity:
    """Exponentially decayed request counts per prefix (half-life in the caller's seconds)."""

    def __init__(self, half_life_s: float, max_entries: int = 100_000) -> None:
        self._rate = math.log(2) / half_life_s
        self._counts: dict[int, tuple[float, float]] = {}
        self._max = max_entries

    def peek(self, key: int, now: float) -> float:
        """The decayed count at ``now``, changing nothing."""
        count, last = self._counts.get(key, (0.0, now))
        return count * math.exp(-self._rate * max(0.0, now - last))

    def hit(self, key: int, now: float) -> float:
        count, last = self._counts.get(key, (0.0, now))
        count = count * math.exp(-self._rate * max(0.0, now - last)) + 1.0
        if len(self._counts) >= self._max and key not in self._counts:
            self._counts.clear()  # crude but bounded; popular prefixes re-earn their count fast
        self._counts[key] = (count, now)
        return count


@dataclass(frozen=True, slots=True)
class HotPrefixConfig:
    """When a popular prefix's best holder counts as overloaded and the request spills over.

    A prefix is popular after ``min_requests`` (decayed, ``half_life_s``) requests probed at
    ``probe_tokens``; its holder is overloaded when its queue exceeds
    ``queue_factor`` × the mean queue of healthy workers + ``min_queue_s``.
    """

    probe_tokens: int = 1024
    half_life_s: float = 30.0
    min_requests: float = 4.0
    queue_factor: float = 1.5
    min_queue_s: float = 0.25


class KvstrataPolicy:
    """Lowest estimated TTFT plus the work it adds, with hot-prefix spill-over.

    Score = ``ttft_s + work_weight · (prefill_s + fetch_s)``, the prefill priced by the
    median of the workers' fits (:meth:`_pooled_pricer`; each worker's queue is its own). Pure
    TTFT-greedy placement ignores what a choice costs *later* requests: recomputing a prefix
    another worker holds adds its prefill seconds to that worker's queue (everyone behind it
    waits) and a second copy of the prefix to a cache, so the next turns of other
    conversations miss more. The ``work_weight`` term charges that externality; 0 is plain
    lowest-TTFT.

    Robust to what a live router does not know (issue 15: its cost model is an online fit,
    its queues its own predictions):

    * the work charge never keeps a request waiting longer than a **whole TTFT elsewhere**:
      past that the holder's queue is the bottleneck, and recomputing on the fastest worker
      serves this request sooner and shortens the queue for the rest;
    * that guard is **risk-aware**: it compares upper quantiles (``risk_z``, p90 by default):
      what the prefill models price (queue wait, prefill) × ``exp(z · spread)``, the spread
      the median of the workers' fits' (:attr:`kvstrata.costs.PrefillModel.spread`, large
      while the router still prices with a prior), against what is measured (fetch, decode
      interference) as it is. One factor for every worker, as one price: a worker is not
      fled for its fit converging later than another's (:meth:`_risk_factor`). So the
      factor only weighs model-priced time against measured time: where the TTFT elsewhere
      has no fetch and no decode interference, it cancels and the guard compares means.

    (Measured, issue 15: pricing the upper quantile in the score itself, not only in the
    guard, lost on synthetic chat — it prefers whichever worker has the most samples so far
    — so the score keeps the mean.)
    """

    name = "kvstrata"

    def __init__(
        self,
        profiles: Callable[[str], CostProfile],
        *,
        hot: HotPrefixConfig | None = None,
        work_weight: float = DEFAULT_WORK_WEIGHT,
        load_adaptive: bool = True,
        risk_z: float = DEFAULT_RISK_Z,
        pooled_prefill: bool = True,
    ) -> None:
        self.estimator = TtftEstimator(profiles)
        self.pooled_prefill = pooled_prefill
        self.hot = hot or HotPrefixConfig()
        self.work_weight = work_weight
        self.risk_z = risk_z
        self.load_adaptive = load_adaptive
        self._popularity = _Popularity(self.hot.half_life_s)
        self._turns = 0
        """Committed decisions so far: exact ties rotate by it."""

    def choose(
        self,
        request: RouteRequest,
        matches: Mapping[str, PrefixMatch],
        loads: Sequence[WorkerLoad],
    ) -> RouteDecision:
        healthy = healthy_loads(loads)
        weight = self.work_weight * self._load_factor(healthy)
        estimates = []
        upper: dict[str, tuple[float, float]] = {}
        models = [self.estimator.profiles(w.worker_id).prefill for w in healthy]
        pooled = self._pooled_pricer(request, models)
        risk = self._risk_factor(models)
        for load in healthy:
            match = match_of(matches, load.worker_id)
            estimate = self.estimator.estimate(request, match, load)
            prefill_s = estimate.prefill_s if pooled is None else pooled(match, load.worker_id)
            upper[load.worker_id] = self._upper(estimate, prefill_s, risk)
            ttft = estimate.ttft_s - estimate.prefill_s + prefill_s
            added = prefill_s + estimate.fetch_s
            estimates.append(replace(estimate, score=ttft + weight * added))
        # Lowest score; ties go to the longer cached prefix, then the shorter queue, then
        # the emptier worker; exact ties rotate, so cold prompts spread over idle workers.
        utilisation = {w.worker_id: (w.kv_utilisation, w.cached_blocks) for w in healthy}
        ranked = sorted(
            estimates,
            key=lambda e: (e.score, -e.matched_blocks, e.queue_s, utilisation[e.worker_id]),
        )
        tied = [e for e in ranked if _same_rank(e, ranked[0], utilisation)]
        best, reason = tied[self._turns % len(tied)], "lowest_ttft_plus_work"
        # The work charge may keep a request behind a holder's queue to save recompute, but
        # never once the wait alone (at its upper quantile) exceeds a whole TTFT elsewhere:
        # then the holder's queue is the bottleneck, and recomputing elsewhere is faster for
        # this request and relieves the queue for the ones behind it.
        # Only a holder is kept by the work charge: a request without cached blocks anywhere
        # is placed by its TTFT alone, and the guard must not override that (comparing upper
        # quantiles across workers would favour whichever has the most samples so far).
        fastest = min(ranked, key=lambda e: upper[e.worker_id][1])
        if best.matched_blocks > 0 and upper[best.worker_id][0] > upper[fastest.worker_id][1]:
            best, reason = fastest, f"wait_exceeds_ttft_elsewhere:{best.worker_id}"
        holder = _holder(estimates)
        if holder is not None:
            spill = self._spill_target(request, holder, estimates, ranked)
            if spill is not None:
                best, reason = spill, f"hot_prefix_spill:{holder.worker_id}"
        return RouteDecision(
            request_id=request.request_id,
            policy=self.name,
            worker_id=best.worker_id,
            reason=reason,
            predicted_ttft_s=best.ttft_s,
            matched_blocks=best.matched_blocks,
            estimates=tuple(estimates),
        )

    def _probe_key(self, request: RouteRequest, holder: WorkerEstimate) -> int | None:
        """The hash popularity is counted on: the holder's matched prefix, up to
        ``probe_tokens`` of it (a shared system prompt followed by different user turns is
        one popular prefix, not many rare ones)."""
        blocks = len(request.hashes)
        if not blocks:
            return None
        block_size = self.estimator.profiles(holder.worker_id).block_size
        probe_blocks = max(1, self.hot.probe_tokens // block_size)
        probe = min(blocks, holder.matched_blocks, probe_blocks) - 1
        return int(request.hashes[probe])

    # RequestLifecycle: the Router tells committed decisions only.
    def routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """A committed decision: the tie rotation advances and the prefix's popularity counts
        it (both untouched by explanations)."""
        self._turns += 1
        holder = _holder(list(decision.estimates))
        key = None if holder is None else self._probe_key(request, holder)
        if key is not None:
            self._popularity.hit(key, request.arrival_s)

    def first_token(self, request_id: str) -> None:
        """Nothing to learn: the policy reads loads, not its own record."""

    def finished(self, request_id: str) -> None:
        """Nothing to forget (see :meth:`first_token`)."""

    def _upper(
        self, estimate: WorkerEstimate, prefill_s: float, factor: float
    ) -> tuple[float, float]:
        """Upper-quantile (``risk_z``) queue wait and TTFT of ``estimate``, its prefill
        priced ``prefill_s`` (the pooled price, :meth:`_pooled_pricer`), the model-priced
        parts × ``factor`` (:meth:`_risk_factor`).

        The queue and the prefill are both priced by prefill models, so both are off by
        about the same factor when the model is. Fetch (measured per block) and decode
        interference stay.
        """
        queue = estimate.queue_s * factor
        return queue, queue + prefill_s * factor + estimate.fetch_s + estimate.interference_s

    def _risk_factor(self, models: Sequence[PrefillModel]) -> float:
        """``exp(z · spread)`` with the median of the healthy workers' spreads
        (``PrefillModel.spread``, a fit's measured log error; large while the router still
        prices with a prior): one factor for every worker, as the price is one (the median
        fit).

        Each worker's own spread made the guard flee whichever worker's fit happened to
        converge later: on a live fleet of two identical workers (``bench calibrate``, stop
        38) 52 of 178 decisions moved a holder's request to the other worker, which served
        112 of the 160 requests at a p50 TTFT of 2.69 s against 1.96 s."""
        spread = statistics.median(model.spread for model in models)
        return math.exp(min(self.risk_z * spread, MAX_LOG_RISK))

    def _pooled_pricer(
        self, request: RouteRequest, models: Sequence[PrefillModel]
    ) -> Callable[[PrefixMatch, str], float] | None:
        """Prefill seconds of this request on a worker, priced alike on every worker: the
        median of the healthy workers' fits (``pooled_prefill``), in the score and the
        guard's TTFT elsewhere alike.

        Each worker's model is its own online fit; for the same tokens the fits disagree by
        their estimation error, and most for long prompts that few samples cover (the prior
        has no attention term). Scoring with each worker's own price picks whichever fit is
        most optimistic (the winner's curse) and, × the work weight (tens under load), makes
        that error outbid a queue: on the Mooncake trace at 0.9 load the p99 was cold
        60-120k-token prompts sent behind 20-34 s queues because that worker's fit priced
        them 2-3 s lower (issue 15). The tokens a worker would compute — what its cache
        saves, the real difference — are priced by the median fit, which pools every
        worker's samples; its queue and decode interference stay its own, and so do the
        estimates shown (``WorkerEstimate``, the predicted TTFT). The guard's "fastest
        elsewhere" is a minimum over workers too, so it uses the same price.
        """
        if not self.pooled_prefill:
            return None
        priced: dict[int, float] = {}

        def price(match: PrefixMatch, worker_id: str) -> float:
            cached, _own, _fetch = TtftEstimator.split(
                request, match, self.estimator.profiles(worker_id)
            )
            if cached not in priced:
                new = max(request.prompt_tokens, 1) - cached
                priced[cached] = statistics.median(m.seconds(new, cached) for m in models)
            return priced[cached]

        return price

    def _load_factor(self, healthy: Sequence[WorkerLoad]) -> float:
        """How much added work hurts now: ρ/(1−ρ) of the busy share ρ, 1 at ``ρ = 0.8``.

        The work a choice adds delays the requests that queue behind it; in a queue that
        is busy a share ρ of the time, that delay grows as ρ/(1−ρ). ρ is the share of healthy
        workers with a prefill queued or running, right now.
        """
        if not self.load_adaptive:
            return 1.0
        busy = sum(1 for w in healthy if w.queued_requests > 0) / len(healthy)
        return min(_MAX_LOAD_FACTOR, _busy_cost(busy) / _busy_cost(_REFERENCE_BUSY))

    def _spill_target(
        self,
        request: RouteRequest,
        holder: WorkerEstimate,
        estimates: list[WorkerEstimate],
        ranked: list[WorkerEstimate],
    ) -> WorkerEstimate | None:
        """The best non-holder if the prefix is popular and its holder overloaded, else None."""
        key = self._probe_key(request, holder)
        if key is None:
            return None
        # This request counts as one more: it is committed in ``routed``, not here, so an
        # explanation (``record=False``, ``/debug/route``) changes nothing.
        popularity = self._popularity.peek(key, request.arrival_s) + 1.0
        if popularity < self.hot.min_requests or ranked[0].worker_id != holder.worker_id:
            return None
        mean_queue = sum(e.queue_s for e in estimates) / len(estimates)
        if holder.queue_s <= self.hot.queue_factor * mean_queue + self.hot.min_queue_s:
            return None
        others = [e for e in ranked if e.matched_blocks < holder.matched_blocks]
        return others[0] if others else None


def _holder(estimates: Sequence[WorkerEstimate]) -> WorkerEstimate | None:
    """The worker with the longest cached prefix (the shorter queue among equals), if any
    holds one and there is an alternative to spill to."""
    holder = max(estimates, key=lambda e: (e.matched_blocks, -e.queue_s))
    return holder if holder.matched_blocks > 0 and len(estimates) > 1 else None


def _same_rank(
    a: WorkerEstimate, b: WorkerEstimate, utilisation: Mapping[str, tuple[float, int]]
) -> bool:
    return (
        math.isclose(a.score, b.score, rel_tol=1e-9, abs_tol=1e-12)
        and a.matched_blocks == b.matched_blocks
        and math.isclose(a.queue_s, b.queue_s, rel_tol=1e-9, abs_tol=1e-12)
        and utilisation[a.worker_id] == utilisation[b.worker_id]
    )


__all__ = [
    "DEFAULT_RISK_Z",
    "DEFAULT_WORK_WEIGHT",
    "HotPrefixConfig",
    "KvstrataPolicy",
    "LeastLoadedPolicy",
    "LlmdScorerPolicy",
    "LlmdWeights",
    "PrefixAffinityPolicy",
    "RoundRobinPolicy",
    "TtftEstimator",
]
