"""The request side of the fleet: route a request, then take its reservation back.

:class:`FleetRouting` holds the methods of :class:`~kvstrata.fleet.fleet.Fleet` that requests
call (the front door, the disaggregation proxy). :meth:`~FleetRouting.reserve` reads the loads,
matches the index, asks the policy and counts the request in flight on the chosen worker in
one critical section; :meth:`~FleetRouting.first_token`, :meth:`~FleetRouting.observe_prefill`,
:meth:`~FleetRouting.finish` and :meth:`~FleetRouting.unreachable` hand the
:class:`Reservation` back; :meth:`~FleetRouting.plan_disagg` and
:meth:`~FleetRouting.finish_prefill` do the same for a remote prefill. Each is bookkeeping
under the fleet lock and does no I/O. The state is the ``Fleet``'s (declared here, set by
``Fleet.__init__`` and its worker lifecycle): one owner, as the fleet module's docstring says.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from kvstrata.errors import NoWorkerAvailable
from kvstrata.fleet.disagg import DisaggPlan, plan
from kvstrata.fleet.fleet_config import FleetConfig
from kvstrata.fleet.metrics import FleetMetrics
from kvstrata.fleet.table import Table
from kvstrata.fleet.views import Reservation
from kvstrata.fleet.workers import WorkerState
from kvstrata.index.core import GlobalIndex
from kvstrata.router.core import Router
from kvstrata.router.model import RouteDecision, RouteRequest
from kvstrata.serve.timing import PrefillTiming

_log = logging.getLogger("kvstrata.fleet.fleet")  # the fleet's logger, as before the split


class FleetRouting:
    """Routing and reservations over the fleet's state; a base of :class:`Fleet` only."""

    config: FleetConfig
    metrics: FleetMetrics
    _lock: threading.Lock
    _table: Table
    _index: GlobalIndex | None
    _router: Router | None

    def _stop_traffic(self, state: WorkerState) -> None:
        """Under the lock: no more requests to this incarnation (counted once)."""
        if state.healthy and self._table.by_id.get(state.worker_id) is state:
            state.healthy = False
            self.metrics.worker_healthy.labels(state.worker_id).set(0)
            self.metrics.worker_events.labels(state.worker_id, "detached").inc()
            _log.warning("worker %s is unreachable: no more traffic", state.worker_id)

    def _decide(
        self,
        request_id: str,
        tenant: str,
        tokens: list[int],
        max_tokens: int | None,
        record: bool,
        now: float,
    ) -> RouteDecision:
        """Under the lock: the loads and the index as they are now, and the policy's choice."""
        if self._router is None or self._index is None:
            raise NoWorkerAvailable("no worker attached")
        index = self._index
        prefill_only = self.config.prefill_urls
        loads = [
            replace(state.load(now), cached_blocks=sum(index.blocks_held(state.worker_id)))
            for state in self._table.by_id.values()
            if state.info.base_url not in prefill_only
        ]
        request = RouteRequest(
            request_id=request_id,
            tenant=tenant,
            prompt_tokens=len(tokens),
            hashes=index.request_hashes(tenant, tokens),
            expected_output_tokens=max_tokens or 0,
            arrival_s=now,
        )
        return self._router.route(request, loads, now=now, record=record)

    def route(
        self, request_id: str, tenant: str, tokens: list[int], max_tokens: int | None, record: bool
    ) -> RouteDecision:
        """Where the request would go, reserving nothing (``/debug/route``)."""
        with self._lock:
            return self._decide(request_id, tenant, tokens, max_tokens, record, time.time())

    def reserve(
        self, request_id: str, tenant: str, tokens: list[int], max_tokens: int | None
    ) -> Reservation:
        """Choose a worker and count the request in flight there, atomically.

        The decision and the reservation share one critical section: a concurrent request
        routed next sees this one in the chosen worker's queue, so a burst spreads instead of
        piling onto whichever worker looked idle to all of them at once.
        """
        with self._lock:
            now = time.time()
            decision = self._decide(request_id, tenant, tokens, max_tokens, True, now)
            state = self._table.by_id[decision.worker_id]
            cached = min(decision.matched_blocks * state.info.block_size, max(0, len(tokens) - 1))
            chosen = next(e for e in decision.estimates if e.worker_id == decision.worker_id)
            state.begin(
                request_id, len(tokens), cached, chosen.prefill_s + chosen.fetch_s, max_tokens, now
            )
            return Reservation(
                request_id=request_id,
                worker_id=state.worker_id,
                epoch=state.info.epoch,
                base_url=state.info.base_url,
                decision=decision,
                prompt_tokens=len(tokens),
                cached_tokens=cached,
                started=now,
                alone=state.running_alone(),
            )

    def plan_disagg(
        self, worker_id: str, request_id: str, tenant: str, tokens: list[int], *, record: bool
    ) -> DisaggPlan:
        """Local or remote prefill for a request placed on a decode worker (``fleet.disagg``);
        ``record``: a disaggregated plan is counted in flight on its prefill worker."""
        settings = self.config.disagg
        with self._lock:
            decode = self._table.by_id.get(worker_id)
            if settings is None or decode is None or self._index is None:
                return DisaggPlan("local", "no_prefill_worker")
            prefill = [
                s for s in self._table.by_id.values() if s.info.base_url in self.config.prefill_urls
            ]
            hashes = self._index.request_hashes(tenant, tokens)
            matches = self._index.match(hashes, now=time.time())
            chosen = plan(
                request_id=request_id,
                prompt_tokens=len(tokens),
                decode=decode,
                prefill_workers=prefill,
                matches=matches,
                settings=settings,
            )
            if record and chosen.path == "disagg" and chosen.prefill_worker_id is not None:
                remote = self._table.by_id[chosen.prefill_worker_id]
                assert chosen.choice is not None
                remote.begin(  # its own busy time, not the request's TTFT (which has its queue)
                    request_id, len(tokens), chosen.prefill_cached_tokens,
                    chosen.choice.prefill_busy_s, 1, time.time(),
                )  # fmt: skip
                decode.prefilled_elsewhere(request_id)
            return chosen

    def finish_prefill(
        self,
        request_id: str,
        chosen: DisaggPlan,
        *,
        reachable: bool,
        prompt_tokens: int = 0,
        seconds: float | None = None,
        timing: PrefillTiming | None = None,
    ) -> None:
        """A remote prefill ended; an unreachable prefill worker gets no more traffic. The
        prefill worker's fit learns the compute its reply reports (``timing``), or else
        the reply's whole ``seconds`` (the transfer included) when it ran alone."""
        with self._lock:
            state = self._table.by_id.get(chosen.prefill_worker_id or "")
            if state is None or state.info.epoch != chosen.prefill_epoch:
                return
            if timing is not None and timing.matched_tokens <= prompt_tokens:
                matched = timing.matched_tokens
                state.observe_prefill(
                    request_id, prompt_tokens - matched, matched, timing.compute_s
                )
            elif seconds is not None and state.running_alone() and not state.reports_prefill:
                cached = chosen.prefill_cached_tokens
                state.prefill_fit.observe(prompt_tokens - cached, cached, seconds)
            state.finish(request_id, time.time(), None, None)
            if not reachable:
                self._stop_traffic(state)

    def _state_of(self, reservation: Reservation) -> WorkerState | None:
        """Under the lock: the incarnation the reservation was made on, if still current."""
        state = self._table.by_id.get(reservation.worker_id)
        if state is None or state.info.epoch != reservation.epoch:
            return None
        return state

    def first_token(self, reservation: Reservation, now: float) -> float | None:
        """Record the first token (TTFT); learn from it if it ran alone (nothing in flight
        when placed, nothing placed beside it before this token): ``WorkerState.first_token``."""
        with self._lock:
            if self._router is not None:
                self._router.first_token(reservation.request_id)
            state = self._state_of(reservation)
            if state is None:
                return None
            return state.first_token(reservation.request_id, now, alone=reservation.alone)

    def observe_prefill(
        self, reservation: Reservation, matched_tokens: int, seconds: float
    ) -> None:
        """Refit the worker's prefill model from the prefill time its engine reported (its
        own share of the steps up to its first token: ``serve.timing``)."""
        if not 0 <= matched_tokens <= reservation.prompt_tokens:
            return
        with self._lock:
            state = self._state_of(reservation)
            if state is not None:
                new_tokens = reservation.prompt_tokens - matched_tokens
                state.observe_prefill(reservation.request_id, new_tokens, matched_tokens, seconds)

    def finish(
        self,
        reservation: Reservation,
        now: float,
        completion_tokens: int | None,
        ttft_s: float | None,
    ) -> None:
        """Release the reservation; learn the output length and decode step from it."""
        with self._lock:
            if self._router is not None:
                self._router.finished(reservation.request_id)
            state = self._state_of(reservation)
            if state is not None:
                state.finish(reservation.request_id, now, completion_tokens, ttft_s)

    def unreachable(self, reservation: Reservation) -> None:
        """The worker refused the request: release it and send no more traffic there.

        Its index entries are dropped (or it is re-attached) by the next health round, the
        one owner of worker lifecycle; an unhealthy worker is never chosen meanwhile.
        """
        with self._lock:
            if self._router is not None:
                self._router.finished(reservation.request_id)
            state = self._state_of(reservation)
            if state is not None:
                state.finish(reservation.request_id, time.time(), None, None)
                self._stop_traffic(state)
