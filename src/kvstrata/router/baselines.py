"""The baseline placement policies kvstrata is measured against, as their documentation
describes them (see :mod:`.policies`): round-robin, least-loaded, prefix-affinity and llm-d's
scorer. Dynamo's KV router is in :mod:`.dynamo_policy`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstrata.index.core import PrefixMatch
from kvstrata.router.costs import CostProfile
from kvstrata.router.estimate import TtftEstimator, decide, healthy_loads, match_of
from kvstrata.router.model import RouteDecision, RouteRequest, WorkerLoad


class _PickPolicy:
    """A baseline that picks one worker by a rule (``_pick``) and shows the TTFT estimate of
    every worker beside it (:func:`decide`), with a fixed ``reason``."""

    name: str
    reason: str

    def __init__(self, profiles: Callable[[str], CostProfile]) -> None:
        self.estimator = TtftEstimator(profiles)

    def _pick(self, healthy: list[WorkerLoad], matches: Mapping[str, PrefixMatch]) -> WorkerLoad:
        raise NotImplementedError

    def choose(
        self, request: RouteRequest, matches: Mapping[str, PrefixMatch], loads: Sequence[WorkerLoad]
    ) -> RouteDecision:
        healthy = healthy_loads(loads)
        pick = self._pick(healthy, matches)
        return decide(
            self.name, request, matches, healthy, self.estimator, pick.worker_id, self.reason
        )


class RoundRobinPolicy(_PickPolicy):
    name = "round-robin"
    reason = "next_in_turn"

    def __init__(self, profiles: Callable[[str], CostProfile]) -> None:
        super().__init__(profiles)
        self._counter = itertools.count()

    def _pick(self, healthy: list[WorkerLoad], matches: Mapping[str, PrefixMatch]) -> WorkerLoad:
        return healthy[next(self._counter) % len(healthy)]


class LeastLoadedPolicy(_PickPolicy):
    name = "least-loaded"
    reason = "fewest_requests"

    def _pick(self, healthy: list[WorkerLoad], matches: Mapping[str, PrefixMatch]) -> WorkerLoad:
        return min(healthy, key=lambda w: (w.queued_requests + w.active_decodes, w.queued_s))


class PrefixAffinityPolicy(_PickPolicy):
    name = "prefix-affinity"
    reason = "longest_prefix"

    def _pick(self, healthy: list[WorkerLoad], matches: Mapping[str, PrefixMatch]) -> WorkerLoad:
        return max(
            healthy,
            key=lambda w: (
                match_of(matches, w.worker_id).blocks,
                -(w.queued_requests + w.active_decodes),
            ),
        )


@dataclass(frozen=True, slots=True)
class LlmdWeights:
    """llm-d's default scheduling profile for the inference-scheduling path.

    llm-d/llm-d ``guides/inference-scheduling/scheduler/inference-scheduling.values.yaml``
    (commit 086f217d643a6932b261a60f8f337b2ca2629d80): ``prefix-cache-scorer`` weight 3,
    ``kv-cache-utilization-scorer`` 2, ``queue-scorer`` 2. (Before issue 15 this project used
    2/1/1, which is no published profile.)
    """

    prefix: float = 3.0
    kv_utilisation: float = 2.0
    queue: float = 2.0


class LlmdScorerPolicy:
    name = "llm-d"

    def __init__(
        self, profiles: Callable[[str], CostProfile], weights: LlmdWeights | None = None
    ) -> None:
        self.estimator = TtftEstimator(profiles)
        self.weights = weights or LlmdWeights()

    def choose(
        self, request: RouteRequest, matches: Mapping[str, PrefixMatch], loads: Sequence[WorkerLoad]
    ) -> RouteDecision:
        healthy = healthy_loads(loads)
        w = self.weights
        block_size = self.estimator.profiles(healthy[0].worker_id).block_size
        total_blocks = max(1, request.prompt_tokens // block_size)
        queues = [load.queued_requests for load in healthy]
        low, high = min(queues), max(queues)
        scores: dict[str, float] = {}
        for load in healthy:
            hit_ratio = min(1.0, match_of(matches, load.worker_id).blocks / total_blocks)
            queue_score = 1.0 if high == low else (high - load.queued_requests) / (high - low)
            scores[load.worker_id] = (
                w.prefix * hit_ratio
                + w.kv_utilisation * (1.0 - load.kv_utilisation)
                + w.queue * queue_score
            )
        pick = max(healthy, key=lambda load: scores[load.worker_id])
        return decide(
            self.name,
            request,
            matches,
            healthy,
            self.estimator,
            pick.worker_id,
            "highest_score",
            scores,
        )
