"""The router's vocabulary: a request to place, each worker's load, and an explained decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from kvstrata.identity.router_hash import RouterHashes
from kvstrata.index.core import PrefixMatch


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request: its tenant, size and router hashes (full blocks)."""

    request_id: str
    tenant: str
    prompt_tokens: int
    hashes: Sequence[int] | RouterHashes
    """Router hashes of the full blocks (a numpy array from the hasher, or plain ints)."""
    expected_output_tokens: int = 0
    arrival_s: float = 0.0
    """Arrival time on the caller's clock (wall or simulated): popularity decays with it."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as the router (live) or the simulator sees it at decision time.

    ``queued_s`` is the estimated wait before the worker can start this request's prefill;
    ``queued_prefill_tokens`` / ``active_kv_blocks`` / ``kv_utilisation`` are the raw figures
    the baselines (Dynamo, llm-d) score on.
    """

    worker_id: str
    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    queued_s: float = 0.0
    active_decodes: int = 0
    active_kv_blocks: int = 0
    kv_utilisation: float = 0.0
    cached_blocks: int = 0
    """Blocks the worker holds in any tier: between equal choices, the emptier cache wins."""
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class WorkerEstimate:
    """One candidate's figures for a decision (what ``/debug/route`` shows)."""

    worker_id: str
    matched_blocks: int
    tier_blocks: tuple[int, int, int, int]
    queue_s: float
    prefill_s: float
    fetch_s: float
    interference_s: float
    ttft_s: float
    score: float
    """The policy's own score (lower is better for cost policies, higher for llm-d)."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    request_id: str
    policy: str
    worker_id: str
    reason: str
    predicted_ttft_s: float
    matched_blocks: int
    estimates: tuple[WorkerEstimate, ...]

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["estimates"] = [asdict(e) for e in self.estimates]
        return body


class RoutingPolicy(Protocol):
    """A placement rule; the live router and the simulator call the very same objects."""

    name: str

    def choose(
        self,
        request: RouteRequest,
        matches: Mapping[str, PrefixMatch],
        loads: Sequence[WorkerLoad],
    ) -> RouteDecision: ...


@runtime_checkable
class RequestLifecycle(Protocol):
    """A policy that keeps its own record of the requests it placed (Dynamo's router does).

    :class:`~kvstrata.router.core.Router` calls ``routed`` for each committed decision and
    forwards ``first_token`` / ``finished`` from its caller — the simulator and the live fleet
    both report these, as a live router proxying the stream sees them.
    """

    def routed(self, request: RouteRequest, decision: RouteDecision) -> None: ...

    def first_token(self, request_id: str) -> None: ...

    def finished(self, request_id: str) -> None: ...
