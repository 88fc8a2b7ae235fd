"""The TTFT estimate every placement policy shows, and the helpers all policies share.

:class:`TtftEstimator` prices a request on a worker from its cost profile, prefix match and
load; kvstrata's policy scores with it and every baseline reports it beside its own choice
(:func:`decide`), so decisions compare on the same figures in ``/debug/route`` and the
simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from kvstrata.errors import NoWorkerAvailable
from kvstrata.index.core import PrefixMatch
from kvstrata.router.costs import CostProfile
from kvstrata.router.model import RouteDecision, RouteRequest, WorkerEstimate, WorkerLoad

_NO_MATCH: Final = (0, 0, 0, 0)


def healthy_loads(loads: Sequence[WorkerLoad]) -> list[WorkerLoad]:
    healthy = [load for load in loads if load.healthy]
    if not healthy:
        raise NoWorkerAvailable("no healthy worker")
    return healthy


def match_of(matches: Mapping[str, PrefixMatch], worker_id: str) -> PrefixMatch:
    return matches.get(worker_id) or PrefixMatch(worker_id, 0, _NO_MATCH)


class TtftEstimator:
    """Estimated time to first token of a request on a worker (see :mod:`.costs`).

    ``queue + min(fetch + prefill of the missing tokens, prefill of all but the device
    prefix) + interference``: blocks in the device pool are used in place; the blocks beyond
    them (host, disk, remote — a remote block priced with the worker's measured fetch cost)
    are fetched unless recomputing them is faster, as the engine's break-even rule decides
    for the store's part of a prefix. The last prompt token is always computed.
    """

    def __init__(self, profiles: Callable[[str], CostProfile]) -> None:
        self.profiles = profiles

    def estimate(
        self,
        request: RouteRequest,
        match: PrefixMatch,
        load: WorkerLoad,
        score: float | None = None,
    ) -> WorkerEstimate:
        profile = self.profiles(load.worker_id)
        prompt = max(request.prompt_tokens, 1)
        cached, prefill_s, fetch_s = self.split(request, match, profile)
        interference_s = profile.interference_s(prompt - cached, load.active_decodes)
        ttft = load.queued_s + prefill_s + fetch_s + interference_s
        return WorkerEstimate(
            worker_id=load.worker_id,
            matched_blocks=match.blocks,
            tier_blocks=match.tier_blocks,
            queue_s=load.queued_s,
            prefill_s=prefill_s,
            fetch_s=fetch_s,
            interference_s=interference_s,
            ttft_s=ttft,
            score=ttft if score is None else score,
        )

    @staticmethod
    def split(
        request: RouteRequest, match: PrefixMatch, profile: CostProfile
    ) -> tuple[int, float, float]:
        """``(cached tokens used, prefill seconds, fetch seconds)`` on ``profile``: the device
        prefix in place, the rest fetched unless recomputing it is faster (class docstring)."""
        prompt = max(request.prompt_tokens, 1)
        cached = min(match.blocks * profile.block_size, prompt - 1)
        prefill_s = profile.prefill.seconds(prompt - cached, cached)
        fetch_s = profile.fetch_s(match.tier_blocks)
        on_device = min(match.tier_blocks[0] * profile.block_size, cached)
        recompute_s = profile.prefill.seconds(prompt - on_device, on_device)
        if fetch_s + prefill_s > recompute_s:
            return on_device, recompute_s, 0.0
        return cached, prefill_s, fetch_s


def decide(
    policy: str,
    request: RouteRequest,
    matches: Mapping[str, PrefixMatch],
    healthy: Sequence[WorkerLoad],
    estimator: TtftEstimator,
    worker_id: str,
    reason: str,
    scores: Mapping[str, float] | None = None,
) -> RouteDecision:
    """A baseline's decision, with the same TTFT estimates kvstrata's shows (for comparison)."""
    estimates = tuple(
        estimator.estimate(
            request,
            match_of(matches, load.worker_id),
            load,
            None if scores is None else scores[load.worker_id],
        )
        for load in healthy
    )
    chosen = next(e for e in estimates if e.worker_id == worker_id)
    return RouteDecision(
        request_id=request.request_id,
        policy=policy,
        worker_id=worker_id,
        reason=reason,
        predicted_ttft_s=chosen.ttft_s,
        matched_blocks=chosen.matched_blocks,
        estimates=estimates,
    )
