"""The router process's state: workers, the global index, the event plane, the router.

:class:`Fleet` is what the front door (:mod:`.frontdoor`) routes with; it attaches workers
(``/kv/info`` + the event plane's dump-and-resume), watches their health and reserves a worker
for each request.

Who owns what (the same rules are in ``docs/architecture.md``, section "Fleet"):

- **The fleet lock** (``Fleet._lock``) owns all mutable routing state: the
  :class:`GlobalIndex`, the :class:`Router` and its policy (tie rotation, hot-prefix counts)
  and every :class:`WorkerState` (health, failures, in-flight requests, online prefill fit,
  decode step). It is held for bookkeeping only, never across HTTP, ZMQ or a wait on the event
  plane (whose thread takes the same lock to apply batches and dumps; waiting on it while
  holding the lock would deadlock). The metrics collector takes it to read the index.
- **The worker table** (id → state, base URL → id) is copy-on-write: a writer builds a new
  immutable mapping and swaps the reference under the lock; a reader that must not hold the
  lock (the health round, which does HTTP per worker) iterates the snapshot it read once.
- **Worker lifecycle** (attach, detach: the event plane's commands, the table swaps) is done by
  one caller at a time: startup, then the health round. A request that cannot reach its worker
  only flags it unhealthy (no more traffic at once); the next health round detaches it or, if
  it answers again, re-attaches it from its dump.
- **Routing reserves.** :meth:`Fleet.reserve` reads the loads, matches the index, asks the
  policy and counts the request in flight on the chosen worker in one critical section, so
  the next request, on whatever thread, sees that reservation. The caller does the HTTP and
  hands the :class:`Reservation` back (:meth:`Fleet.first_token`, :meth:`Fleet.finish`,
  :meth:`Fleet.observe_prefill`, :meth:`Fleet.unreachable`); none of these does I/O.
- Outside the lock callers only see immutable values: :class:`Reservation`,
  :class:`WorkerView`, :class:`RouteDecision`, :class:`WorkerInfo`.

This module owns the fleet's state and the worker lifecycle; the request side (routing,
reservations, remote prefill plans) is :class:`~kvstrata.fleet.routing.FleetRouting`, its
base. Beside it, re-exported here: :class:`FleetConfig` (``fleet_config``),
:class:`FleetTokenizer` (``tokenizer``), :class:`Reservation` and :class:`WorkerView`
(``views``), the copy-on-write worker table (``table``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType

import httpx

from kvstrata.errors import ConfigError
from kvstrata.events.curve import CurveKeyError, KeyPair
from kvstrata.fleet.curve_keys import curve_refusal
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.fleet.fleet_config import FleetConfig
from kvstrata.fleet.metrics import FleetMetrics
from kvstrata.fleet.routing import FleetRouting
from kvstrata.fleet.source import KvstrataSource, WorkerSource
from kvstrata.fleet.table import Table
from kvstrata.fleet.tokenizer import FleetTokenizer
from kvstrata.fleet.views import Reservation, WorkerView
from kvstrata.fleet.vllm_workers import salted_batch
from kvstrata.fleet.worker_info import WorkerInfo, WorkerProtocolError, worker_tls
from kvstrata.fleet.workers import WorkerState, default_profile
from kvstrata.identity import secret_digest
from kvstrata.index.core import ConsistencyMode, GlobalIndex, IndexDeletion, Medium
from kvstrata.index.tombstones import StreamPosition
from kvstrata.router.core import Router
from kvstrata.router.costs import CostProfile
from kvstrata.router.registry import POLICIES

_log = logging.getLogger(__name__)
_MAX_PROBES = 32  # health probes in flight at once


class Fleet(FleetRouting):
    """The router process's state: workers, index, event plane, router, metrics.

    Starts no thread in its constructor: the event plane starts with the first :meth:`attach`
    (it needs the model's fingerprint) and stops in :meth:`close`.
    """

    def __init__(
        self,
        tokenizer: FleetTokenizer,
        config: FleetConfig,
        *,
        http: httpx.Client | None = None,
        source: WorkerSource | None = None,
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}; known: {', '.join(POLICIES)}")
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = FleetMetrics()
        self._lock = threading.Lock()
        self._secret_digest = secret_digest(config.tenant_secret)
        self._curve_keys: KeyPair | None = None
        if config.curve_client_secret_file is not None:
            try:
                self._curve_keys = KeyPair.from_file(config.curve_client_secret_file)
            except CurveKeyError as exc:
                raise ConfigError(str(exc), key="curve_client_secret_file") from exc
        self._table = Table(MappingProxyType({}), MappingProxyType({}))
        self._index: GlobalIndex | None = None
        self._router: Router | None = None
        self._events: EventPlane | None = None
        self._http = http or httpx.Client(timeout=10.0, verify=worker_tls(config.tls_ca_file))
        self._probe_http = http or httpx.Client(  # an injected client serves both
            timeout=config.health_timeout_s, verify=worker_tls(config.tls_ca_file)
        )
        self._dead_listeners: list[Callable[[str], None]] = []
        self._source: WorkerSource = source or KvstrataSource()

    # ------------------------------------------------------------------ workers
    def _profile(self, worker_id: str) -> CostProfile:
        """The policy's cost lookup; called by the router, so under the lock.

        Fetch figures are what each worker measured (``/kv/info``, every health round). A
        worker that has not fetched from the shared (remote) tier yet is priced with the
        mean of the other workers' remote figures: they read the same servers."""
        state = self._table.by_id.get(worker_id)
        if state is None:
            raise KeyError(worker_id)
        shared: float | None = None
        if state.measured_fetch[Medium.REMOTE] is None:
            figures = [
                f
                for s in self._table.by_id.values()
                if (f := s.measured_fetch[Medium.REMOTE]) is not None
            ]
            shared = sum(figures) / len(figures) if figures else None
        return state.profile(shared)

    def _ensure_index(self, info: WorkerInfo) -> EventPlane:
        """The index and event plane, made by the first attach (lifecycle: one caller)."""
        if self._index is None or self._events is None:
            index = GlobalIndex(
                info.fingerprint,
                info.block_size,
                mode=self.config.mode,
                tenant_secret=self.config.tenant_secret,
                tombstone_ttl_s=self.config.tombstone_ttl_s,
            )
            events = EventPlane(
                index,
                self._lock,
                curve_keys=self._curve_keys,
                api_key=self.config.api_key,
                verify=worker_tls(self.config.tls_ca_file),
                source=self._source,
                transform=salted_batch if self.config.engine == "vllm" else None,
            )
            # Registering may run the collector, which takes the lock: do it outside.
            self.metrics.export_index(index, events.stats, self._lock, events.resyncs)
            events.start()
            with self._lock:
                self._router = Router(index, POLICIES[self.config.policy](self._profile))
                self._index, self._events = index, events
            return events
        if info.fingerprint != self._index.fingerprint or info.block_size != self._index.block_size:
            raise WorkerProtocolError(
                f"worker {info.worker_id} serves another model or block size than the fleet"
            )
        return self._events

    def attach(self, base_url: str) -> WorkerInfo:
        """Read a worker's identity and attach its event stream (or, approximate: just add it).

        Lifecycle: one caller at a time (startup, then the health round). No lock is held
        while it talks to the worker or waits on the event plane.
        """
        info = self._source.info(self._http, base_url, self.config.api_key)
        holder = self._table.by_id.get(info.worker_id)
        if holder is not None and holder.healthy and holder.info.base_url != info.base_url:
            # two live workers with one id would take turns in one index slot, each attach
            # resetting the other's entries (workers started by hand from one config)
            self.metrics.worker_events.labels(info.worker_id, "refused_duplicate_id").inc()
            raise WorkerProtocolError(
                f"worker {info.worker_id} at {base_url}: that id is already served by "
                f"{holder.info.base_url}; give every worker its own events.worker_id"
            )
        if info.secret_digest != self._secret_digest:
            self.metrics.worker_events.labels(info.worker_id, "refused_secret").inc()
            raise WorkerProtocolError(
                f"worker {info.worker_id} at {base_url} salts tenants with another secret "
                f"(digest {info.secret_digest}, the router's {self._secret_digest}): refused; "
                "give router and workers the same tenant_secret_file"
            )
        self._check_curve(info)
        events = self._ensure_index(info)
        if self.config.mode is ConsistencyMode.EXACT:
            events.attach(info)
        state = WorkerState(info, default_profile(info.block_size))
        state.measured_fetch = info.fetch_s_per_block
        state.observe_scrape(info.scraped, time.time())
        with self._lock:
            assert self._index is not None
            self._index.set_shared_access(info.worker_id, info.reaches_shared_tier)
            if self.config.mode is not ConsistencyMode.EXACT:
                self._index.add_worker(info.worker_id, info.epoch)
            previous = self._table.by_id.get(info.worker_id)
            if previous is not None:  # keep what was learned about this machine's speed
                state.prefill_fit = previous.prefill_fit
                state.reports_prefill = previous.reports_prefill
                state.serving_overhead_s = previous.serving_overhead_s
                state.decode_step_s = previous.decode_step_s
                if previous.info.epoch == info.epoch:  # the same process, back after a
                    state.carry_requests(previous)  # failed request: its work still runs
            self._table = self._table.with_worker(state)
        self.metrics.worker_healthy.labels(info.worker_id).set(1)
        self.metrics.worker_events.labels(info.worker_id, "attached").inc()
        return info

    def _check_curve(self, info: WorkerInfo) -> None:
        refusal = curve_refusal(
            info, router_has_keys=self._curve_keys is not None, engine=self.config.engine
        )
        if refusal is not None:
            self.metrics.worker_events.labels(info.worker_id, "refused_curve").inc()
            raise refusal

    def mark_dead(self, worker_id: str) -> None:
        """Drop the worker's index entries, then stop its traffic (lifecycle: see the module).

        In that order, so a worker shown unhealthy holds nothing in the index; a request
        routed to it in between fails over like any other unreachable worker.
        """
        with self._lock:
            state = self._table.by_id.get(worker_id)
            if state is None or not state.attached:
                return
            state.attached = False
        if self._events is not None:
            try:  # waits on the event thread: outside the lock
                self._events.detach(worker_id)
            except TimeoutError:  # the detach stays queued and runs when the thread gets to it
                _log.warning("detaching %s is slow: stopping its traffic first", worker_id)
        with self._lock:
            self._stop_traffic(state)
            listeners = list(self._dead_listeners)
        for listener in listeners:
            listener(worker_id)

    def on_worker_dead(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(worker_id)`` (on the health round's thread, no lock held) each time
        a worker is declared dead: the front door re-routes what was in flight there."""
        with self._lock:
            self._dead_listeners.append(listener)

    def _probe(self, url: str) -> WorkerInfo | None:
        """One worker's ``/kv/info``; None when it cannot be reached or answers garbage."""
        try:
            return self._source.info(self._probe_http, url, self.config.api_key)
        except (httpx.HTTPError, WorkerProtocolError):
            return None
        except Exception:  # any garbage: this worker is unreachable, the round goes on
            _log.exception("probing %s failed", url)
            return None

    def check_health(self) -> None:
        """One health round (blocking; run off the event loop, one round at a time).

        Every worker is probed at once (threads: the probes are HTTP waits), so a worker that
        hangs — SIGSTOP, a wedged event loop — delays no other worker's round; then the
        answers are applied one worker at a time."""
        urls = list(self.config.worker_urls)
        if not urls:
            return
        with ThreadPoolExecutor(max_workers=min(len(urls), _MAX_PROBES)) as pool:
            probes = list(pool.map(self._probe, urls))
        for url, info in zip(urls, probes, strict=True):
            table = self._table  # one snapshot per worker: no lock held across the HTTP call
            worker_id = table.by_url.get(url)
            state = table.by_id.get(worker_id) if worker_id else None
            if info is None:
                if state is not None:
                    with self._lock:
                        state.failures += 1
                        dead = state.failures >= self.config.health_failures
                    if dead:
                        self.mark_dead(state.worker_id)
                continue
            with self._lock:
                stale = state is None or not state.healthy or info.epoch != state.info.epoch
            if stale:
                if state is not None and info.epoch != state.info.epoch:
                    self.metrics.worker_events.labels(info.worker_id, "epoch_changed").inc()
                try:
                    self.attach(url)
                except (httpx.HTTPError, WorkerProtocolError, TimeoutError) as exc:
                    _log.warning("attaching %s failed: %s", url, exc)
                    if state is not None and info.epoch != state.info.epoch:
                        # the incarnation the fleet knows is gone: its KV and its model with it
                        self.mark_dead(state.worker_id)
                    continue
            with self._lock:
                current = self._table.by_id.get(info.worker_id)
                if current is not None:
                    current.failures = 0
                    if current.info.epoch == info.epoch:
                        current.measured_fetch = info.fetch_s_per_block
                        current.observe_scrape(info.scraped, time.time())

    def worker_views(self) -> list[WorkerView]:
        """A consistent snapshot of every worker and what the index holds of it."""
        with self._lock:
            index = self._index
            return [
                WorkerView(
                    worker_id=state.worker_id,
                    url=state.info.base_url,
                    healthy=state.healthy,
                    epoch=state.info.epoch,
                    inflight=state.inflight(),
                    consistent=index is not None and index.is_consistent(state.worker_id),
                    blocks=(0, 0, 0, 0) if index is None else index.blocks_held(state.worker_id),
                    prefill_samples=state.prefill_fit.samples,
                    prefill_model=state.prefill_fit.model(),
                    serving_overhead_s=state.serving_overhead_s,
                    decode_step_s=state.decode_step_s,
                    step_tokens=state.interference.chunk_tokens,
                )
                for state in self._table.by_id.values()
            ]

    def deletion_targets(self) -> list[tuple[str | None, str]]:
        """Every worker a deletion must reach, healthy or not: (worker id if known, base URL)."""
        table = self._table
        urls = list(dict.fromkeys([*self.config.worker_urls, *table.by_url]))
        return [(table.by_url.get(url), url) for url in urls]

    def apply_deletion(
        self,
        tenant: str,
        *,
        everything: bool,
        tokens: list[int] | None,
        engine_hashes: Sequence[int],
        positions: Mapping[str, StreamPosition],
        from_token: int = 0,
        unsettled: Collection[str] = (),
    ) -> IndexDeletion | None:
        """The index side of a deletion (``GlobalIndex.delete``); None before any attach.
        ``tokens``' blocks from the one holding ``from_token`` on go, and their descendants
        (a chat's template-only head stays, as on the workers). ``unsettled``: workers whose
        answer left replicas for later (their entries go even if their stream is ahead)."""
        with self._lock:
            if self._index is None:
                return None
            index = self._index
            hashes: Sequence[int] = index.request_hashes(tenant, tokens).tolist() if tokens else []
            hashes = hashes[from_token // index.block_size :]
            return index.delete(
                tenant,
                everything=everything,
                router_hashes=hashes,
                engine_hashes=engine_hashes,
                positions=positions,
                unsettled=unsettled,
                now=time.time(),
            )

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        self._http.close()
        if self._probe_http is not self._http:
            self._probe_http.close()


__all__ = ["Fleet", "FleetConfig", "FleetTokenizer", "Reservation", "WorkerView"]
