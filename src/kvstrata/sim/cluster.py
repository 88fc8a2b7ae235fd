"""The discrete-event loop: arrivals → the real router → simulated workers → the real index.

One run = one routing policy over one trace. Everything that decides is project code:

* placement: ``kvstrata.router.Router`` with a policy from ``router.policies.POLICIES``.
  Every policy sees the same information, a live router's (:mod:`kvstrata.sim.view`): per
  worker an online prefill fit refitted from completed prefills, starting from a prior that
  is not the truth, and its own estimate of each queue; executed prefills carry lognormal
  service-time noise (``service_noise``). ``oracle=True`` keeps, for comparison only, the old
  best case: the router prices with the true profile (optionally perturbed by
  ``estimate_noise``) and reads the true remaining time of a running prefill, without noise;
* what the router believes: ``kvstrata.index.GlobalIndex`` in ``exact`` mode fed by the
  workers' own stores and evictions through ``store_hashes``/``remove_hashes`` (immediately,
  or ``event_lag_s`` later), or in ``approximate`` mode from the router's own decisions;
* what a worker holds: ``kvstrata.store`` eviction policy objects (``lru`` or the
  ``kvstrata`` value policy) per tier (:mod:`kvstrata.sim.worker`).

Events live in one heap of ``(time, seq, kind, worker, version)``; ``seq`` orders equal
times deterministically, and a worker's decode completion is rescheduled with a new version
whenever its decode rate changes (stale versions are skipped). Arrivals are merged from the
sorted trace rather than pushed, and processed after every event at the same instant.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

from kvstrata.errors import InvalidInput
from kvstrata.identity import DEFAULT_TENANT
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index.core import ConsistencyMode, GlobalIndex, Medium
from kvstrata.objects import Representation
from kvstrata.objects.chains import ChainMetas, chain_metas
from kvstrata.router import POLICIES, CostProfile, KvstrataPolicy, Router, RouteRequest
from kvstrata.sim.profiles import BLOCK_TOKENS, SimProfile
from kvstrata.sim.trace import SimRequest
from kvstrata.sim.view import DEFAULT_SERVICE_NOISE, RouterView, ServiceNoise, oracle_profiles
from kvstrata.sim.worker import Job, SimWorker
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.value_policy import kvstrata_policy

EVICTION_POLICIES: Final = ("lru", "kvstrata")
_FINGERPRINT = FingerprintDigest(b"kvstrata.sim".ljust(32, b"\0"))


class _Kind(IntEnum):
    PREFILL_DONE = 0
    DECODE = 1
    INDEX = 2


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything one run needs besides the trace and the routing policy."""

    profile: SimProfile
    workers: int = 16
    device_eviction: str = "lru"
    host_eviction: str = "lru"
    index_mode: ConsistencyMode = ConsistencyMode.EXACT
    event_lag_s: float = 0.0
    estimate_noise: float = 0.0
    """σ of a per-worker lognormal factor on the router's prefill model: on the fit's prior
    (default) or on the true profile (``oracle``)."""
    seed: int = 0
    work_weight: float | None = None
    """Override of ``KvstrataPolicy.work_weight`` (None: the policy's default)."""
    service_noise: float = DEFAULT_SERVICE_NOISE
    """σ of the per-job lognormal service-time factor (:mod:`kvstrata.sim.view`); 0: none.
    Ignored under ``oracle``."""
    oracle: bool = False
    """Give the router the true profile and the true remaining prefill time, no service noise
    (comparison only). Its load counts and KV figures stay what a live router sees
    (:meth:`kvstrata.sim.worker.SimWorker.load`): no policy ever reads a request's true
    output length before the request ends."""

    @property
    def effective_service_noise(self) -> float:
        return 0.0 if self.oracle else self.service_noise

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidInput(f"workers must be >= 1, got {self.workers}")
        for name in (self.device_eviction, self.host_eviction):
            if name not in EVICTION_POLICIES:
                raise InvalidInput(f"unknown eviction policy {name!r}; {EVICTION_POLICIES}")
        # NaN passes ``< 0``: a NaN σ never ends a run, a NaN lag reorders the event heap.
        for name, value in (
            ("event lag", self.event_lag_s),
            ("estimate noise", self.estimate_noise),
            ("service noise", self.service_noise),
            ("work weight", 0.0 if self.work_weight is None else self.work_weight),
        ):
            if not math.isfinite(value) or value < 0:
                raise InvalidInput(f"{name} must be a finite number >= 0, got {value}")
        for name, blocks in (
            ("device blocks", self.profile.device_blocks),
            ("host blocks", self.profile.host_blocks),
        ):
            if blocks < 0:
                raise InvalidInput(f"{name} must be >= 0, got {blocks}")


@dataclass
class RunResult:
    """Raw outcome of one policy's run (``report`` turns it into the JSON figures)."""

    policy: str
    ttft_s: list[float]
    prefill_s: list[float]
    hit_tokens: int
    prompt_tokens: int
    output_tokens: int
    busy_s: list[float]
    kv_occupancy: list[float]
    """Per worker: mean share of the device pool held by running requests in the window."""
    decode_demand: float
    """Output tokens asked for per worker-second of the arrival window ÷ the most a worker can
    decode per second (``1 / decode_interference_s``, the batch-size limit of the step model)."""
    first_arrival_s: float
    window_end_s: float
    last_done_s: float
    device_evictions: int
    host_evictions: int
    predicted_ttft_s: list[float] = field(default_factory=list)
    worker_of: list[int] = field(default_factory=list)
    """Per request, in request order (as ``ttft_s``): the index of the worker it ran on."""


_REPRESENTATION = Representation(
    dtype="bfloat16", layout="sim", block_size=BLOCK_TOKENS, shape=(BLOCK_TOKENS,)
)


def build_metas(requests: Sequence[SimRequest], profile: SimProfile) -> ChainMetas:
    """One ``KVObjectMeta`` per distinct block id (:func:`kvstrata.objects.chains.chain_metas`).

    A request's ``hashes`` name full blocks only, so each chain covers ``512 · len(hashes)``
    tokens and every block is priced as a full block: the marginal prefill seconds of 512
    tokens at its position (no fixed overhead).
    """
    return chain_metas(
        ((request.hashes, len(request.hashes) * BLOCK_TOKENS) for request in requests),
        block_tokens=BLOCK_TOKENS,
        block_bytes=profile.block_bytes,
        representation=_REPRESENTATION,
        recompute_s=profile.cost.prefill.marginal_s,
    )


def _eviction_policy(name: str, profile: SimProfile, *, device: bool, seed: int) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    # A device victim is still in the host tier (write-through): losing it costs a fetch.
    fetch = profile.cost.fetch_s_per_block[Medium.HOST] / profile.block_bytes
    return kvstrata_policy(fetch if device else None, seed=seed)  # the store's own "kvstrata"


def router_profiles(config: SimConfig) -> Callable[[str], CostProfile]:
    """Oracle mode's per-worker cost profiles: the true one, or a perturbed copy per worker."""
    return oracle_profiles(config.profile.cost, config.workers, config.estimate_noise, config.seed)


class Simulation:
    """One policy over one trace; ``run()`` once."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        policy: str,
        config: SimConfig,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise InvalidInput(
                f"unknown routing policy {policy!r}; expected one of {list(POLICIES)}"
            )
        too_big = [r.index for r in requests if r.kv_blocks > config.profile.device_blocks]
        if too_big:
            raise InvalidInput(
                f"{len(too_big)} request(s) need more than the device pool's "
                f"{config.profile.device_blocks} blocks (first: #{too_big[0]})"
            )
        self.requests = requests
        self.policy_name = policy
        self.config = config
        self.now = 0.0
        self._progress = progress
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        built = build_metas(requests, config.profile)
        self._block_keys = built.keys
        metas, block_ids = built.metas, built.block_ids()
        self.index = GlobalIndex(
            _FINGERPRINT, BLOCK_TOKENS, mode=config.index_mode, clock=lambda: self.now
        )
        self._pending_index: dict[int, tuple[str, list[int], Medium, bool]] = {}
        self._exact = config.index_mode is ConsistencyMode.EXACT
        report = self._report if self._exact else _ignore_report
        self.workers: list[SimWorker] = []
        for i in range(config.workers):
            worker_id = f"w{i}"
            self.index.add_worker(worker_id)
            self.workers.append(
                SimWorker(
                    worker_id,
                    config.profile,
                    device_policy=_eviction_policy(
                        config.device_eviction, config.profile, device=True, seed=config.seed + i
                    ),
                    host_policy=_eviction_policy(
                        config.host_eviction, config.profile, device=False, seed=config.seed + i
                    ),
                    metas=metas,
                    block_ids=block_ids,
                    report=report,
                )
            )
        self._by_id = {w.worker_id: n for n, w in enumerate(self.workers)}
        if requests and requests[-1].arrival_s > requests[0].arrival_s:
            for worker in self.workers:  # KV occupancy counts inside the arrival window only
                worker.window_end_s = requests[-1].arrival_s
        self.noise = ServiceNoise(config.workers, config.effective_service_noise, config.seed)
        for n, worker in enumerate(self.workers):
            worker.service_factor = _factor_of(self.noise, n)
        self.view: RouterView | None = None
        if config.oracle:
            profiles = router_profiles(config)
        else:
            self.view = RouterView(
                config.profile.cost,
                config.workers,
                estimate_noise=config.estimate_noise,
                seed=config.seed,
            )
            profiles = self.view.profile
        routing = (
            KvstrataPolicy(profiles, work_weight=config.work_weight)
            if policy == KvstrataPolicy.name and config.work_weight is not None
            else POLICIES[policy](profiles)
        )
        self.router = Router(self.index, routing, keep_decisions=1)
        self.jobs: list[Job] = []
        self._predicted: list[float] = []

    # ---------------------------------------------------------------- index reports
    def _report(
        self, worker_id: str, ids: list[int], medium: Medium, stored: bool, now: float
    ) -> None:
        if self.config.event_lag_s <= 0.0:
            self._apply(worker_id, ids, medium, stored)
            return
        self._seq += 1
        self._pending_index[self._seq] = (worker_id, ids, medium, stored)
        heapq.heappush(
            self._heap, (now + self.config.event_lag_s, self._seq, _Kind.INDEX, -1, self._seq)
        )

    def _apply(self, worker_id: str, ids: list[int], medium: Medium, stored: bool) -> None:
        if stored:
            self.index.store_hashes(worker_id, ids, medium)
        else:
            self.index.remove_hashes(worker_id, ids, medium)

    # ---------------------------------------------------------------- loop
    def _push(self, at: float, kind: _Kind, worker: int, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, worker, version))

    def _schedule_decode(self, n: int) -> None:
        worker = self.workers[n]
        at = worker.next_decode_s(self.now)
        if at is not None:
            self._push(at, _Kind.DECODE, n, worker.decode_version)

    def _start(self, n: int) -> None:
        worker = self.workers[n]
        end = worker.try_start(self.now)
        if end is not None:
            self._push(end, _Kind.PREFILL_DONE, n)
        self._schedule_decode(n)

    def _handle(self, kind: int, n: int, version: int) -> None:
        if kind == _Kind.INDEX:
            self._apply(*self._pending_index.pop(version))
            return
        worker = self.workers[n]
        if kind == _Kind.PREFILL_DONE:
            for job in worker.finish_prefill(self.now):
                if self.view is not None:
                    new_tokens = job.request.prompt_tokens - job.hit_tokens
                    self.view.first_token(n, new_tokens, job.hit_tokens, job.compute_s, self.now)
                self.router.first_token(str(job.request.index))
                if job.finished:
                    self.router.finished(str(job.request.index))
            self._start(n)
        elif kind == _Kind.DECODE:
            if version != worker.decode_version:
                return
            for done in worker.finish_decodes(self.now):
                self.router.finished(str(done.request.index))
            self._start(n)

    def run(self) -> RunResult:
        heap = self._heap
        total = len(self.requests)
        for count, request in enumerate(self.requests):
            while heap and heap[0][0] <= request.arrival_s:
                at, _, kind, n, version = heapq.heappop(heap)
                self.now = at
                self._handle(kind, n, version)
            self.now = max(self.now, request.arrival_s)
            self._arrive(request)
            if self._progress is not None and (count + 1) % 256 == 0:
                self._progress(count + 1)
        while heap:
            at, _, kind, n, version = heapq.heappop(heap)
            self.now = at
            self._handle(kind, n, version)
        if self._progress is not None:
            self._progress(total)
        return self._result()

    def _arrive(self, request: SimRequest) -> None:
        now = self.now
        view = self.view
        if view is None:
            loads = [worker.load(now) for worker in self.workers]
        else:
            loads = [view.load(n, w.load(now), now) for n, w in enumerate(self.workers)]
        route = RouteRequest(
            request_id=str(request.index),
            tenant=DEFAULT_TENANT,
            prompt_tokens=request.prompt_tokens,
            hashes=request.hashes,
            expected_output_tokens=0,  # as the live fleet without max_tokens: the truth is unknown
            arrival_s=now,
        )
        decision = self.router.route(route, loads, now=now)
        n = self._by_id[decision.worker_id]
        chosen = next(e for e in decision.estimates if e.worker_id == decision.worker_id)
        cached = request.hit_tokens(chosen.matched_blocks)
        job = Job(
            request=request,
            keys=tuple(self._block_keys[h] for h in request.hashes),
            estimate_s=chosen.prefill_s + chosen.fetch_s + chosen.interference_s,
            predicted_new_tokens=request.prompt_tokens - cached,
        )
        self.jobs.append(job)
        self._predicted.append(decision.predicted_ttft_s)
        job.worker = n
        if view is not None:
            view.sent(n, job.estimate_s, now, job.predicted_new_tokens, cached)
        self.workers[n].enqueue(job)
        self._start(n)

    def _window_end(self) -> float:
        """Last arrival; with one instant of arrivals, the last prefill end instead."""
        if not self.requests:
            return 0.0
        first, last = self.requests[0].arrival_s, self.requests[-1].arrival_s
        if last > first:
            return last
        return max((j.start_s + j.prefill_s for j in self.jobs), default=last)

    def _busy_in_window(self) -> list[float]:
        """Per worker, prefill-busy seconds inside the arrival window (see ``worker``)."""
        end = self._window_end()
        busy = [0.0] * len(self.workers)
        for job in self.jobs:
            if job.leads:  # a packed batch is busy once, not once per prompt
                busy[job.worker] += max(0.0, min(job.start_s + job.prefill_s, end) - job.start_s)
        return busy

    def _decode_demand(self) -> float:
        per_token_s = self.config.profile.cost.decode_interference_s
        if not self.requests or per_token_s <= 0:
            return 0.0
        span = max(self._window_end() - self.requests[0].arrival_s, 1e-9)
        wanted = sum(r.output_tokens for r in self.requests) / (span * len(self.workers))
        return wanted * per_token_s

    def _kv_occupancy(self) -> list[float]:
        start, end = (self.requests[0].arrival_s if self.requests else 0.0), self._window_end()
        span = max(end - start, 1e-9)
        out = []
        for worker in self.workers:
            worker.window_end_s = end
            worker.kv_tick(end)
            out.append(worker.kv_block_s / (span * max(worker.device_capacity, 1)))
        return out

    def _result(self) -> RunResult:
        jobs = self.jobs
        unfinished = sum(1 for job in jobs if not job.finished)
        if unfinished:
            raise RuntimeError(f"simulation ended with {unfinished} unfinished requests")
        return RunResult(
            policy=self.policy_name,
            ttft_s=[job.ttft_s for job in jobs],
            prefill_s=[job.prefill_s for job in jobs],
            hit_tokens=sum(job.hit_tokens for job in jobs),
            prompt_tokens=sum(job.request.prompt_tokens for job in jobs),
            output_tokens=sum(job.request.output_tokens for job in jobs),
            busy_s=self._busy_in_window(),
            kv_occupancy=self._kv_occupancy(),
            decode_demand=self._decode_demand(),
            first_arrival_s=self.requests[0].arrival_s if self.requests else 0.0,
            window_end_s=self._window_end(),
            last_done_s=max((j.done_s for j in jobs), default=0.0),
            device_evictions=sum(w.device_evictions for w in self.workers),
            host_evictions=sum(w.host_evictions for w in self.workers),
            predicted_ttft_s=self._predicted,
            worker_of=[job.worker for job in jobs],
        )


def _factor_of(noise: ServiceNoise, worker: int) -> Callable[[int], float]:
    return lambda request_index: noise.factor(worker, request_index)


def _ignore_report(
    worker_id: str, ids: list[int], medium: Medium, stored: bool, now: float
) -> None:
    """Approximate mode: workers report nothing; the router's decisions are the index."""


def simulate(
    requests: Sequence[SimRequest],
    policy: str,
    config: SimConfig,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    return Simulation(requests, policy, config, progress=progress).run()
