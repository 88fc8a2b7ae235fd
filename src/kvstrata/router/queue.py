"""A worker's queued prefill seconds as a router estimates them: one rule for the live fleet
(``fleet.workers.WorkerState.load``) and the simulated router (``sim.view.RouterView``).

Each request placed on the worker and not yet at its first token was predicted
``predicted_s`` when it was placed; the worker's prefill fit priced its prompt at ``then_s``
then. Read now:

* every prediction is **re-priced** with the current fit, × ``now_s / then_s`` for the same
  (new, cached) tokens (``then_s`` 0: kept as predicted), so a queue filled while the fit was
  still a prior corrects itself as first tokens come back instead of keeping the stale
  figure until it drains;
* the **head** (the oldest) has been running since the later of its placement and the
  previous first token on the worker: what it has run so far is taken off it (never below 0).

Pure: figures in, seconds out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Queued:
    """One request waiting for its first token, as the router priced it."""

    predicted_s: float
    then_s: float
    """The fit's seconds for its prompt when it was placed (0: never re-priced)."""
    now_s: float
    """The fit's seconds for the same prompt now."""

    def repriced_s(self) -> float:
        if self.then_s <= 0:
            return self.predicted_s
        return self.predicted_s * self.now_s / self.then_s


def queued_seconds(queue: Sequence[Queued], head_ran_s: float) -> float:
    """Seconds of prefill ahead of a new request: ``queue`` oldest first, re-priced, the head
    less the ``head_ran_s`` it has run."""
    if not queue:
        return 0.0
    seconds = [item.repriced_s() for item in queue]
    head = max(0.0, seconds[0] - max(0.0, head_ran_s))
    return head + sum(seconds) - seconds[0]
