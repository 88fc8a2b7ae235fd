"""What the router learns about each worker from its answers: in-flight load, an online
prefill fit and the serving overhead around it, decode interference (``WorkerState``). What
it reads of the worker itself (``/kv/info``, ``/kv/dump``) is ``fleet.worker_info``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from kvstrata.costs import OnlinePrefillFit, PrefillModel
from kvstrata.fleet.engine_load import ScrapedLoad, UnseenWork
from kvstrata.fleet.worker_info import WorkerInfo
from kvstrata.index.model import Medium
from kvstrata.router.costs import CostProfile
from kvstrata.router.disagg_inputs import InterferenceEstimate
from kvstrata.router.model import WorkerLoad
from kvstrata.router.queue import Queued, queued_seconds
from kvstrata.runtime.scheduler import SchedulerConfig

OVERHEAD_WINDOW = 32
"""Requests that ran alone the serving overhead is the median of: a few suffice (it barely
varies), and a median ignores the one whose admission fetched blocks from a slower tier."""


@dataclass
class _InFlight:
    prompt_tokens: int
    new_tokens: int
    cached_tokens: int
    predicted_prefill_s: float
    expected_output: int
    started: float
    active_at_start: int = 0
    queued_ahead: int = 0  # prefills not at their first token when this one was placed
    first_token: bool = False
    prefilled_elsewhere: bool = False  # a prefill worker computes it (disaggregation)
    joined_by: set[str] = field(default_factory=set)
    """Requests placed on the worker before this one's first token that prefill here. The
    engine packs a newcomer's first chunk into the step of this prompt's last one, so its
    TTFT is not its prefill alone (nor its prefill beside the decodes it started with)."""
    reported_s: float | None = None
    """The prefill compute the worker reported for it (``serve.timing``), if it did."""
    priced_s: float = 0.0
    """The prefill fit's seconds for its prompt when it was placed (``router.queue``)."""


@dataclass
class WorkerState:
    """The router's live view of one worker: health, in-flight requests and learned costs.

    The reference engine runs one engine call at a time, so a request queues behind the
    prefills of those ahead of it and shares decode steps with those already decoding;
    ``load()`` turns that into the :class:`WorkerLoad` the policies read.

    Not thread-safe, on purpose: every field and method belongs to the fleet lock
    (:mod:`kvstrata.fleet.fleet`), which also guards the index and the routing decision, so a
    request is placed and counted in flight in one critical section. ``info`` is immutable.
    ``attached`` is whether the index holds the worker's entries (cleared by the health round).
    """

    info: WorkerInfo
    profile_prior: CostProfile
    healthy: bool = True
    attached: bool = True
    failures: int = 0
    prefill_fit: OnlinePrefillFit = field(init=False)
    """Fitted from each request's prefill compute the worker reports (``serve.timing``), or,
    from a worker that reports none (vLLM), from the TTFTs of requests that ran alone."""
    reports_prefill: bool = False
    """The worker has reported a prefill compute: its TTFTs teach the serving overhead, never
    the fit (a TTFT holds more than the compute)."""
    serving_overhead_s: float = 0.0
    """What a TTFT holds beyond the compute its worker reports (HTTP, tokenizing, admission,
    sampling, the relay): the median of TTFT − reported compute over the last requests that
    ran alone (0 before one). Priced as part of every prefill (:meth:`prefill_model`)."""
    interference: InterferenceEstimate = field(init=False)
    """What each running decode adds to a prefill step here, learned from loaded TTFTs; its
    ``chunk_tokens`` is the worker's step budget (``WorkerInfo.step_tokens``, else the
    reference engine's default), which also packs the queue estimate."""
    decode_step_s: float = 0.02
    mean_output_tokens: float = 64.0
    kv_blocks_capacity: int = 0
    measured_fetch: tuple[float | None, float | None, float | None, float | None] = (
        None,
        None,
        None,
        None,
    )
    """The worker's own fetch figures per medium (``WorkerInfo.fetch_s_per_block``), updated
    by every health round."""
    scraped: ScrapedLoad | None = None
    """The engine's own load figures from the last health round (``WorkerInfo.scraped``);
    set through :meth:`observe_scrape`, which also fixes the unseen work they imply."""
    _unseen: UnseenWork | None = None
    _inflight: dict[str, _InFlight] = field(default_factory=dict)
    _recent_outputs: deque[int] = field(default_factory=lambda: deque(maxlen=128))
    _overheads: deque[float] = field(default_factory=lambda: deque(maxlen=OVERHEAD_WINDOW))
    _last_first_token_at: float = 0.0

    def __post_init__(self) -> None:
        self.prefill_fit = OnlinePrefillFit(self.profile_prior.prefill)
        step_tokens = self.info.step_tokens
        if step_tokens is None:  # not reported: the reference engine's default
            step_tokens = SchedulerConfig().max_num_batched_tokens
        self.interference = InterferenceEstimate(step_tokens)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def profile(self, shared_fetch_s: float | None = None) -> CostProfile:
        """The prior with the refitted prefill model and the measured fetch figures;
        ``shared_fetch_s`` stands in for an unmeasured remote figure (other workers' figure
        for the same shared tier)."""
        measured = list(self.measured_fetch)
        if measured[Medium.REMOTE] is None:
            measured[Medium.REMOTE] = shared_fetch_s
        prior = self.profile_prior.fetch_s_per_block
        a, b, c, d = (p if m is None else m for m, p in zip(measured, prior, strict=True))
        profile = self.profile_prior.with_prefill(self.prefill_model())
        return replace(profile, fetch_s_per_block=(a, b, c, d))

    def begin(
        self,
        request_id: str,
        prompt_tokens: int,
        cached_tokens: int,
        predicted_prefill_s: float,
        max_tokens: int | None,
        now: float,
    ) -> None:
        expected = int(self.mean_output_tokens)
        if max_tokens is not None:
            expected = min(expected, max_tokens)
        for flight in self._inflight.values():
            if not flight.first_token:
                flight.joined_by.add(request_id)
        new_tokens = prompt_tokens - cached_tokens
        self._inflight[request_id] = _InFlight(
            prompt_tokens,
            new_tokens,
            cached_tokens,
            predicted_prefill_s,
            expected,
            now,
            active_at_start=self.active_decodes(),
            queued_ahead=sum(1 for f in self._inflight.values() if not f.first_token),
            priced_s=self.prefill_model().seconds(new_tokens, cached_tokens) if new_tokens else 0.0,
        )

    def carry_requests(self, previous: WorkerState) -> None:
        """Take over ``previous``'s requests in flight (the same incarnation re-attached):
        a fresh, empty table made a busy worker look idle until they ended."""
        self._inflight = previous._inflight
        self._last_first_token_at = previous._last_first_token_at
        self._recent_outputs = previous._recent_outputs
        self.mean_output_tokens = previous.mean_output_tokens

    def prefilled_elsewhere(self, request_id: str) -> None:
        """A prefill worker computes this request's prompt: this worker only waits for the KV
        (nothing queued here for it), and its TTFT says nothing about this worker's prefill;
        nor did it join the prefills running here (its KV arrives as a decode row)."""
        flight = self._inflight.get(request_id)
        if flight is not None:
            flight.prefilled_elsewhere = True
            flight.predicted_prefill_s = 0.0
        for other in self._inflight.values():
            other.joined_by.discard(request_id)

    def prefill_model(self) -> PrefillModel:
        """The prefill fit priced as a TTFT: its fixed cost plus the serving overhead."""
        model = self.prefill_fit.model()
        if self.serving_overhead_s <= 0:
            return model
        return replace(model, overhead_s=model.overhead_s + self.serving_overhead_s)

    def observe_prefill(
        self, request_id: str, new_tokens: int, cached_tokens: int, seconds: float
    ) -> None:
        """The worker reported this request's prefill compute (``serve.timing``): refit."""
        self.reports_prefill = True
        self.prefill_fit.observe(new_tokens, cached_tokens, seconds)
        flight = self._inflight.get(request_id)
        if flight is not None:
            flight.reported_s = seconds

    def first_token(self, request_id: str, now: float, *, alone: bool) -> float | None:
        """Mark the first token. If nothing else was running (``alone``: when it was placed)
        and no other request joined before it (``joined_by``), its TTFT is its prefill alone
        with the serving around it: it teaches the serving overhead (TTFT − the compute the
        worker reported) or, from a worker that reports none, the prefill fit. Placed beside
        running decodes with nothing queued ahead, it teaches their interference."""
        flight = self._inflight.get(request_id)
        if flight is None or flight.first_token:
            return None
        flight.first_token = True
        self._last_first_token_at = max(self._last_first_token_at, now)
        ttft = now - flight.started
        if flight.prefilled_elsewhere or flight.joined_by:
            return ttft
        if alone and flight.reported_s is not None:
            self._overheads.append(max(0.0, ttft - flight.reported_s))
            self.serving_overhead_s = statistics.median(self._overheads)
        elif alone and not self.reports_prefill:
            self.prefill_fit.observe(flight.new_tokens, flight.cached_tokens, ttft)
        elif flight.active_at_start > 0 and flight.queued_ahead == 0:  # no queue wait in it
            alone_s = self.prefill_model().seconds(flight.new_tokens, flight.cached_tokens)
            self.interference.observe(ttft, alone_s, flight.new_tokens, flight.active_at_start)
        return ttft

    def finish(
        self,
        request_id: str,
        now: float,
        completion_tokens: int | None,
        ttft_s: float | None,
    ) -> None:
        flight = self._inflight.pop(request_id, None)
        if flight is None or completion_tokens is None:
            return
        self._recent_outputs.append(completion_tokens)
        self.mean_output_tokens = sum(self._recent_outputs) / len(self._recent_outputs)
        if ttft_s is not None and completion_tokens > 1:
            step = (now - flight.started - ttft_s) / (completion_tokens - 1)
            if step > 0:
                self.decode_step_s = 0.8 * self.decode_step_s + 0.2 * step

    def active_decodes(self) -> int:
        return sum(1 for f in self._inflight.values() if f.first_token)

    def queued_prefill_s(self, exclude: str | None = None) -> float:
        """Predicted prefill seconds queued here ahead of ``exclude`` (not yet first token):
        the wait before a new prefill starts (running decodes share its steps instead)."""
        return sum(
            f.predicted_prefill_s
            for rid, f in self._inflight.items()
            if not f.first_token and rid != exclude
        )

    def running_alone(self) -> bool:
        return len(self._inflight) <= 1

    def observe_scrape(self, scraped: ScrapedLoad | None, now: float) -> None:
        """The engine's own figures, read at ``now`` (a health round).

        They count the router's own requests too, as they were at that instant: what exceeds
        them is other clients' work, fixed here — the router's own requests that finish
        later must not reappear as unseen ones until the next scrape. That work then drains
        with time (:class:`UnseenWork`): a gauge read before a burst ended must not keep a
        worker looking busy for a whole health interval after it went idle.
        """
        self.scraped = scraped
        if scraped is None:
            self._unseen = None
            return
        flights = list(self._inflight.values())
        queued = [f for f in flights if not f.first_token]
        # vLLM counts a request still in prefill as running: compare totals first.
        total = max(0, scraped.waiting + scraped.running - len(flights))
        waiting = min(total, max(0, scraped.waiting - len(queued)))
        running = total - waiting
        typical = (
            sum(f.predicted_prefill_s for f in queued) / len(queued)
            if queued
            else self._typical_prefill_s()
        )
        self._unseen = UnseenWork(
            since=now,
            waiting=waiting,
            backlog_s=waiting * typical,
            running=running,
            decode_s=self.mean_output_tokens * self.decode_step_s if running else 0.0,
            kv_usage=min(1.0, max(0.0, scraped.kv_usage)),
        )

    def load(self, now: float | None = None) -> WorkerLoad:
        """What the policies read; ``now`` ages the engine's scraped figures (None: as read)."""
        flights = list(self._inflight.values())
        queued = [f for f in flights if not f.first_token]  # in placement order
        decoding = [f for f in flights if f.first_token]
        queued_s = self._queued_prefill_s(queued, now)
        # Decode steps of the requests already running interleave with the queued prefills.
        queued_s += (
            sum(f.expected_output for f in decoding) * self.decode_step_s / max(1, len(decoding))
        )
        active_blocks = sum(f.prompt_tokens + f.expected_output for f in flights)
        active_blocks //= self.info.block_size
        capacity = self.kv_blocks_capacity
        utilisation = min(1.0, active_blocks / capacity) if capacity else 0.0
        queued_requests, decodes = len(queued), len(decoding)
        if self._unseen is not None:
            unseen = self._unseen.at(now)
            queued_s += unseen.backlog_s
            queued_requests += unseen.waiting
            decodes += unseen.running
            utilisation = max(utilisation, unseen.kv_usage)
        return WorkerLoad(
            worker_id=self.worker_id,
            queued_requests=queued_requests,
            queued_prefill_tokens=sum(f.new_tokens for f in queued),
            queued_s=queued_s,
            active_decodes=decodes,
            active_kv_blocks=active_blocks,
            kv_utilisation=utilisation,
            healthy=self.healthy,
        )

    def _queued_prefill_s(self, queued: list[_InFlight], now: float | None) -> float:
        """``router.queue.queued_seconds`` over the requests without their first token:
        re-priced with today's fit, packed into the engine's steps (the worker's step budget,
        ``interference.chunk_tokens``), the head less what it ran since it could start (the
        latest of its placement, the worker's last first token and the end of other
        clients' scraped backlog; not aged when ``now`` is None)."""
        if not queued:
            return 0.0
        model = self.prefill_model()
        step_fixed_s = self.prefill_fit.model().overhead_s  # the engine's, not the serving's
        items = [
            Queued.priced(
                f.predicted_prefill_s,
                f.priced_s,
                model,
                f.new_tokens,
                f.cached_tokens,
                step_fixed_s,
                f.started,
            )
            for f in queued
        ]
        head_since = max(queued[0].started, self._last_first_token_at)
        if self._unseen is not None:  # other clients' backlog goes first
            head_since = max(head_since, self._unseen.since + self._unseen.backlog_s)
        ran_s = 0.0 if now is None else now - head_since
        return queued_seconds(items, ran_s, self.interference.chunk_tokens, head_since)

    def _typical_prefill_s(self) -> float:
        """One fresh prefill of a typical prompt (the recent mean output length stands in
        for nothing: prompts are not remembered, so a 512-token prompt is assumed)."""
        return self.prefill_model().seconds(512, 0)

    def inflight(self) -> int:
        return len(self._inflight)


def default_profile(block_size: int) -> CostProfile:
    """A prior for a CPU reference worker until its own requests refit the prefill model.

    The per-token cost is SmolLM2's fresh 2k-token prefill on this project's 2-core machines
    (``bench ttft``, ``docs/results-history.md``) divided by its tokens; host-tier fetches cost
    about 1/25 of recomputing per token there. The online fit replaces both within a few requests.
    """
    return CostProfile(
        prefill=PrefillModel(overhead_s=0.02, per_token_s=2.3e-3, per_token_ctx_s=0.0),
        fetch_s_per_block=(0.0, block_size * 9e-5, block_size * 1.2e-4, block_size * 4e-4),
        decode_interference_s=0.0,
        block_size=block_size,
    )
