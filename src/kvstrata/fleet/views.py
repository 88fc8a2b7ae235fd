"""The immutable values the fleet hands out, read outside the fleet lock: a request's
:class:`Reservation` on one incarnation of a worker, and a :class:`WorkerView` snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.costs import PrefillModel
from kvstrata.router.model import RouteDecision


@dataclass(frozen=True, slots=True)
class Reservation:
    """A request placed on one incarnation of a worker, in its load until :meth:`Fleet.finish`."""

    request_id: str
    worker_id: str
    epoch: int
    base_url: str
    decision: RouteDecision
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the index says the worker holds (the last one is always computed)."""
    started: float
    alone: bool
    """Nothing else was in flight on the worker when it was placed: its TTFT is its prefill
    time alone unless another request joins before its first token (``WorkerState``)."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as ``/fleet/workers``, ``/health`` and ``/metrics`` show it (a snapshot)."""

    worker_id: str
    url: str
    healthy: bool
    epoch: int
    inflight: int
    consistent: bool
    blocks: tuple[int, int, int, int]
    prefill_samples: int
    prefill_model: PrefillModel
    """The router's online prefill fit for this worker (its spread too)."""
    serving_overhead_s: float
    """What the router adds to the fit's fixed cost to price a TTFT (``WorkerState``)."""
    decode_step_s: float
    """The router's running estimate of one decode step on this worker."""
    step_tokens: int
    """The step budget the router packs this worker's queue by (``WorkerState``)."""
