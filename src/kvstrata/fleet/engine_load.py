"""What an engine says of its own load (vLLM's ``/metrics``), and how the router ages it.

Pure: time is passed in. :class:`~kvstrata.fleet.workers.WorkerState` fixes the unseen work
at each scrape (``observe_scrape``) and reads it aged (``load(now)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    """Load figures an engine reports itself (vLLM's ``/metrics``): requests waiting and
    running there — the router's own in-flight count misses clients that bypass it — and
    the share of its KV cache in use (0..1)."""

    waiting: int
    running: int
    kv_usage: float


@dataclass(frozen=True, slots=True)
class UnseenWork:
    """Other clients' work on an engine, as its scraped gauges showed it at ``since``.

    Pure; aged by :meth:`at`. Waiting requests are a prefill backlog the engine works off at
    wall-clock rate; running ones add decode interference (vLLM schedules a new prefill
    beside running decodes, it does not queue it behind them) until they are expected to
    have finished, one mean output length of decode steps later; the KV usage is theirs and
    the router's own at that instant, kept as long as any of that work is expected to be
    left.
    """

    since: float
    waiting: int
    backlog_s: float
    running: int
    decode_s: float
    kv_usage: float

    def at(self, now: float | None) -> UnseenWork:
        elapsed = 0.0 if now is None else max(0.0, now - self.since)
        if elapsed <= 0.0:
            return self
        backlog = max(0.0, self.backlog_s - elapsed)
        waiting = math.ceil(self.waiting * backlog / self.backlog_s) if self.backlog_s else 0
        running = self.running if elapsed < self.decode_s else 0
        left = elapsed < max(self.backlog_s, self.decode_s)
        return UnseenWork(
            self.since, waiting, backlog, running, self.decode_s, self.kv_usage if left else 0.0
        )
