"""What the simulated router may know: a live router's view, and the service-time noise.

The simulator executes one :class:`~kvstrata.router.costs.CostProfile` (the *truth*); a live
router never sees it. By default (``SimConfig.oracle = False``) every routing policy — kvstrata
and every baseline alike — is handed :class:`RouterView`, built only from what the live fleet
(:mod:`kvstrata.fleet.workers`) gets:

* **Prefill cost model**: per worker, the live fleet's own :class:`kvstrata.costs.OnlinePrefillFit`
  (one implementation, shared), refitted from each completed prefill the worker reports —
  ``(new tokens, cached tokens, measured seconds)``, the measured seconds being its own
  compute (no host fetch, no decode steps interleaved) and carrying the noise below, as the
  reference engine reports its share of the steps up to a first token (``serve.timing``,
  ``Fleet.observe_prefill``). It starts from
  :func:`prior_prefill`, a prior of the kind ``fleet.workers.default_profile`` is: *one* fresh
  2,048-token prefill divided by its tokens, 20 ms fixed, **no attention term** (wrong for long
  prompts, which is what the fit has to learn), optionally scaled per worker by
  ``estimate_noise`` (a lognormal factor drawn once per worker).
* **Queue state**: the router's own estimate — per worker, the predictions it made for the
  requests it sent whose first token has not come back, minus the time elapsed since the head
  one can have started (its send time or the previous first token, whichever is later). Each
  prediction is **re-priced with the current fit** when the queue is read: it is scaled by
  ``fit_now(n, c) / fit_at_send(n, c)`` for the request's predicted new and cached tokens, so
  a queue filled while the fit was still the prior (which has no attention term and
  under-prices long prompts) corrects itself as first tokens come back, instead of keeping the
  stale under-estimate until it drains. Queued prompts that fit in one engine step pack
  and share its fixed cost, as the simulated worker serves them (the step budget is the
  engine's configuration; the live router assumes the reference engine's default). One rule,
  :func:`kvstrata.router.queue.queued_seconds`,
  which the live fleet's ``WorkerState.load`` applies to its own predictions too. The
  simulator's true remaining prefill time is never read.
* **Kept as the worker reports them, because a live router observes them**
  (:meth:`kvstrata.sim.worker.SimWorker.load`): ``queued_requests`` (its own in-flight
  record: sent, no first token yet), ``active_decodes`` (it proxies the stream, so it sees the
  first token and the end), ``queued_prefill_tokens`` (the router's own prediction from its
  index match, for every request without its first token — a prefill's start is not seen),
  ``active_kv_blocks`` / ``kv_utilisation`` counted as the live fleet counts them (prompt +
  the worker's running mean of completed outputs per request in flight; a request's true
  output length is never read before it ends; the engine's scraped gauge is not modelled),
  per-tier fetch seconds per block (the worker's measured figures in ``/kv/info``
  ``fetch_s_per_block``) and the decode step model (engine configuration; vLLM exports
  time-per-output-token). ``RouteRequest.expected_output_tokens`` is 0, as the live fleet
  sends for a request without ``max_tokens`` (a trace has none).
* **Request lifecycle**: a policy that keeps its own record of what it placed (the ``dynamo``
  baseline, as Dynamo's router does) is told each committed route, first token and end through
  :class:`kvstrata.router.Router` — the simulator reports them as the live fleet does.

**Service-time noise** (:class:`ServiceNoise`): each executed prefill (fetch + compute +
decode interference) lasts its model time × ``w · e``, with ``e ~ lognormal(0, σ)`` drawn
per job and ``w ~ lognormal(0, σ/2)`` drawn once per worker (a persistent slowdown: clocks,
thermals, a noisy neighbour). ``e`` is a function of (seed, request index) alone — common
random numbers: every policy compared on one trace and seed gives a request the same ``e``
wherever and whenever it runs, so policies differ by their placements, not by their luck.
Default σ = 0.1. Grounding, from ``docs/results-history.md``: fresh 2,048-token prefills on
the reference engine on a quiet machine (issue 9 table: 4.71–4.96 s over eight runs) have a
log-spread of ≈ 0.017 — a lower bound, one process alone; the same prefill on the loaded
shared machine ranged 2.8–9.3 s (log-spread ≈ 0.3) — an upper bound. 0.1 sits between them:
a busy but not overloaded serving host. ``--service-noise 0`` is deterministic.

``SimConfig.oracle = True`` keeps the old, optimistic information model for comparison
only: the router gets the true profile (or its ``estimate_noise`` perturbation) and the true
remaining time of a running prefill, and no service noise is applied.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Final

from kvstrata.costs import OnlinePrefillFit, PrefillModel
from kvstrata.router.costs import CostProfile
from kvstrata.router.model import WorkerLoad
from kvstrata.router.queue import Queued, queued_seconds

DEFAULT_SERVICE_NOISE: Final = 0.1
"""σ of the per-job lognormal service-time factor (module docstring)."""
PRIOR_PROMPT_TOKENS: Final = 2048
PRIOR_OVERHEAD_S: Final = 0.02


def prior_prefill(true: PrefillModel) -> PrefillModel:
    """The live fleet's kind of prior: one fresh 2k-token prefill ÷ its tokens, no context term."""
    per_token = true.seconds(PRIOR_PROMPT_TOKENS, 0) / PRIOR_PROMPT_TOKENS
    return PrefillModel(
        overhead_s=PRIOR_OVERHEAD_S,
        per_token_s=per_token,
        per_token_ctx_s=0.0,
        kv_bytes_per_token=true.kv_bytes_per_token,
        name="prior",
    )


def scaled_prefill(model: PrefillModel, factor: float) -> PrefillModel:
    """``model`` with its per-token terms × ``factor`` (a uniformly slower/faster worker)."""
    return replace(
        model,
        per_token_s=model.per_token_s * factor,
        per_token_ctx_s=model.per_token_ctx_s * factor,
    )


def worker_factors(workers: int, sigma: float, seed: int) -> list[float]:
    """One lognormal factor per worker (all 1.0 when ``sigma`` is 0)."""
    if sigma <= 0:
        return [1.0] * workers
    rng = random.Random(seed * 7919 + 17)
    return [math.exp(rng.gauss(0.0, sigma)) for _ in range(workers)]


def oracle_profiles(
    true: CostProfile, workers: int, estimate_noise: float, seed: int
) -> Callable[[str], CostProfile]:
    """Oracle mode: the true profile, or a per-worker perturbed copy (``estimate_noise``)."""
    if estimate_noise <= 0:
        return lambda _worker_id: true
    factors = worker_factors(workers, estimate_noise, seed)
    noisy = {
        f"w{i}": true.with_prefill(scaled_prefill(true.prefill, f)) for i, f in enumerate(factors)
    }
    return lambda worker_id: noisy.get(worker_id, true)


class ServiceNoise:
    """Per-job × per-worker lognormal service-time factors (module docstring); deterministic
    for a seed. ``sigma = 0`` returns 1.0 always."""

    def __init__(self, workers: int, sigma: float, seed: int) -> None:
        self.sigma = sigma
        self.seed = seed
        self.worker_factor = worker_factors(workers, sigma / 2, seed * 31 + 5)

    def job_factor(self, request_index: int) -> float:
        """``e`` of request ``request_index``: one draw from a generator seeded by (seed,
        index) only (a string seed is hashed with SHA-512: stable across processes and
        platforms), so it does not depend on the policy, the worker or the event order."""
        if self.sigma <= 0:
            return 1.0
        rng = random.Random(f"kvstrata.sim.service:{self.seed}:{request_index}")
        return math.exp(rng.gauss(0.0, self.sigma))

    def factor(self, worker: int, request_index: int) -> float:
        """``w · e`` for request ``request_index`` executed on ``worker``."""
        if self.sigma <= 0:
            return 1.0
        return self.worker_factor[worker] * self.job_factor(request_index)


@dataclass(frozen=True, slots=True)
class _Sent:
    """One request in flight: its predicted seconds and what they were priced from."""

    predicted_s: float
    new_tokens: int
    cached_tokens: int
    priced_s: float
    """The fit's prefill seconds for ``(new_tokens, cached_tokens)`` when it was sent."""
    sent_s: float

    def queued(self, model: PrefillModel) -> Queued:
        """As :func:`kvstrata.router.queue.queued_seconds` reads it, priced now by ``model``."""
        return Queued.priced(
            self.predicted_s,
            self.priced_s,
            model,
            self.new_tokens,
            self.cached_tokens,
            model.overhead_s,
            self.sent_s,
        )


@dataclass
class _Flights:
    """One worker's requests sent and not yet through prefill, as the router recorded them."""

    fit: OnlinePrefillFit
    base: CostProfile
    predictions: deque[_Sent] = field(default_factory=deque)
    head_since_s: float = 0.0
    profile: CostProfile | None = None


class RouterView:
    """The router's beliefs about every worker (module docstring); the simulation feeds it
    what a live router would observe: each send, each first token with the worker's
    measured prefill time."""

    def __init__(
        self, true: CostProfile, workers: int, *, estimate_noise: float = 0.0, seed: int = 0
    ) -> None:
        prior = prior_prefill(true.prefill)
        factors = worker_factors(workers, estimate_noise, seed)
        self._flights = [
            _Flights(
                OnlinePrefillFit(scaled_prefill(prior, f)),
                true.with_prefill(scaled_prefill(prior, f)),
            )
            for f in factors
        ]
        self._by_id = {f"w{i}": i for i in range(workers)}

    def fit(self, worker: int) -> OnlinePrefillFit:
        return self._flights[worker].fit

    def profile(self, worker_id: str) -> CostProfile:
        """The router's cost profile for ``worker_id``: known figures + the current fit."""
        flights = self._flights[self._by_id[worker_id]]
        if flights.profile is None:
            flights.profile = flights.base.with_prefill(flights.fit.model())
        return flights.profile

    def sent(
        self,
        worker: int,
        predicted_s: float,
        now: float,
        new_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """A request sent to ``worker``, predicted ``predicted_s`` for ``new_tokens`` after
        ``cached_tokens`` (both 0: the prediction is never re-priced)."""
        flights = self._flights[worker]
        if not flights.predictions:
            flights.head_since_s = now
        priced = flights.fit.seconds(new_tokens, cached_tokens) if new_tokens > 0 else 0.0
        flights.predictions.append(_Sent(predicted_s, new_tokens, cached_tokens, priced, now))

    def first_token(
        self, worker: int, new_tokens: int, cached_tokens: int, measured_s: float, now: float
    ) -> None:
        """The head request's first token; refit from the worker's measured prefill."""
        flights = self._flights[worker]
        flights.predictions.popleft()
        flights.head_since_s = now
        flights.fit.observe(new_tokens, cached_tokens, measured_s)
        flights.profile = None

    def queued_s(self, worker: int, now: float) -> float:
        """Predicted prefill seconds ahead of a new request on ``worker``."""
        flights = self._flights[worker]
        if not flights.predictions:
            return 0.0
        model = flights.fit.model()
        queue = [sent.queued(model) for sent in flights.predictions]
        step_tokens = flights.base.prefill_chunk_tokens  # the engine's configuration
        since = flights.head_since_s
        return queued_seconds(queue, now - since, step_tokens, since)

    def load(self, worker: int, observable: WorkerLoad, now: float) -> WorkerLoad:
        """``observable`` (the counts a live router sees) with the router's own queue time."""
        return replace(observable, queued_s=self.queued_s(worker, now))
