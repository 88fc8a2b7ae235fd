"""Prefetch for queued requests: a bounded background runner of ``TieredStore.prefetch``.

Why: a request that waits in an engine's queue behind other work will, once admitted, load
its prefix from wherever the store holds it. When that is a shared (remote) level, the load
costs network round trips inside the request's admission — on the engine's step thread, in
every running request's critical path. Fetching those blocks into the host level while the
request still waits moves that time off the critical path; admission then finds them in host.

Contract:
- ``submit(request_id, keys, scope)`` never blocks: the job is queued (at most ``max_jobs``;
  beyond that the newest is dropped and counted) and returns at once. ``keys`` is a callable
  run on the prefetch thread, so hashing a long prompt costs the submitter nothing.
- ``skip(key)`` names the keys the caller's device pool holds: the leading run of them is
  left out of the job (the pool is prefix-closed, so nothing after the first miss is held),
  because admission references those in place and fetching them would be pure waste.
- ``cancel(request_id)``: the request was admitted (or finished) — a queued job is dropped,
  a running one stops before its next block. Prefetching what admission is loading anyway
  would only duplicate it.
- ``start()`` / ``close()``: one daemon thread, started explicitly, joined on close (queued
  jobs are dropped, the running one is cancelled). Without ``start`` nothing is prefetched.
- Outcomes are counted in ``kvstrata_prefetch_requests_total{outcome}``; bytes (prefetched,
  used, wasted) by the store itself (``store.state``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.store.levels import RequestScope
from kvstrata.store.tiered import TieredStore

logger = logging.getLogger("kvstrata.store")

KeysOf = Callable[[], Sequence[BlockKey]]


@dataclass
class _Job:
    request_id: str
    keys: KeysOf
    scope: RequestScope
    cancelled: bool = False


def can_prefetch(store: TieredStore) -> bool:
    """Is there a shared level below a local one (something to fetch, somewhere to put it)?"""
    local = False
    for level in store.levels:
        if not level.tier.evicts_itself:
            local = True
        elif local:
            return True
    return False


class Prefetcher:
    """Runs prefetch jobs on one background thread (see the module docstring)."""

    def __init__(
        self,
        store: TieredStore,
        *,
        skip: Callable[[BlockKey], bool] = lambda key: False,
        max_jobs: int = 64,
    ) -> None:
        self.store = store
        self._skip = skip
        self._max_jobs = max_jobs
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, _Job] = OrderedDict()
        self._running: _Job | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="kvstrata-prefetch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            if self._queue:
                self.store.metrics.prefetch_requests.labels(outcome="cancelled").inc(
                    len(self._queue)
                )
            self._queue.clear()
            if self._running is not None:
                self._running.cancelled = True
            self._cond.notify_all()
        thread.join()
        with self._cond:
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def submit(self, request_id: str, keys: KeysOf, scope: RequestScope) -> bool:
        """Queue a prefetch for a waiting request; False when not started or the queue is full."""
        with self._cond:
            if self._thread is None or self._stopping:
                return False
            if len(self._queue) >= self._max_jobs:
                self._count("dropped_queue_full")
                return False
            self._queue[request_id] = _Job(request_id, keys, scope)
            self._cond.notify_all()
        return True

    def cancel(self, request_id: str) -> None:
        """The request no longer waits: drop its job, or stop it before its next block."""
        with self._cond:
            job = self._queue.pop(request_id, None)
            if job is not None:
                self._count("cancelled")
            elif self._running is not None and self._running.request_id == request_id:
                self._running.cancelled = True

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no job is queued or running (tests, benchmarks); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and self._running is None, timeout=timeout_s
            )

    # ---- the prefetch thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or bool(self._queue))
                if self._stopping:
                    return
                _, job = self._queue.popitem(last=False)
                self._running = job
            try:
                self._count(self._prefetch(job))
            except KvstrataError:
                logger.exception("prefetch for request %s failed", job.request_id)
                self._count("failed")
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _prefetch(self, job: _Job) -> str:
        keys = job.keys()
        held = 0
        while held < len(keys) and self._skip(keys[held]):
            held += 1
        if job.cancelled:
            return "cancelled"
        placed = self.store.prefetch(keys[held:], job.scope, cancelled=lambda: job.cancelled)
        if placed:
            return "copied"
        return "cancelled" if job.cancelled else "nothing_to_fetch"

    def _count(self, outcome: str) -> None:
        self.store.metrics.prefetch_requests.labels(outcome=outcome).inc()
