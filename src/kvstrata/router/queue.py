"""A worker's queued prefill seconds as a router estimates them: one rule for the live fleet
(``fleet.workers.WorkerState.load``) and the simulated router (``sim.view.RouterView``).

Each request placed on the worker and not yet at its first token was predicted
``predicted_s`` when it was placed; the worker's prefill fit priced its prompt at ``then_s``
then. Read now:

* every prediction is **re-priced** with the current fit, × ``now_s / then_s`` for the same
  (new, cached) tokens (``then_s`` 0: kept as predicted), so a queue filled while the fit was
  still a prior corrects itself as first tokens come back instead of keeping the stale
  figure until it drains;
* prompts **pack** into steps as the engine serves them (:func:`packs_with`): with a step
  budget of ``step_tokens`` new tokens, queued prompts that fit in one step beside the one
  ahead of them share its fixed cost (the fit's ``fixed_s``, paid once per step, not once
  per request). The simulated worker packs by the same rule (``sim.worker``);
* the **head** (the oldest pack) has been running since the later of its placement and the
  previous first token on the worker (``head_since_s``): what it has run so far is taken off
  it (never below 0), and only requests placed before it started can be in it (a step that
  has begun takes no newcomer).

Pure: figures in, seconds out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.costs import PrefillModel


def packs_with(step_new_tokens: int, new_tokens: int, step_tokens: int) -> bool:
    """Whether a prompt of ``new_tokens`` joins a step that already computes
    ``step_new_tokens`` under a budget of ``step_tokens`` (0: no packing, one prompt per
    step). The engine's scheduler (``runtime.scheduler``) fills each step's token budget from
    the waiting queue in order; a prompt that overflows it takes the rest of the step as a
    chunk and goes on in the next. This rule counts a prompt in a step only when it fits
    whole, a longer prompt as steps of its own, and one of unknown size (0) never packs."""
    return step_tokens > 0 and new_tokens > 0 and step_new_tokens + new_tokens <= step_tokens


@dataclass(frozen=True, slots=True)
class Queued:
    """One request waiting for its first token, as the router priced it."""

    predicted_s: float
    then_s: float
    """The fit's seconds for its prompt when it was placed (0: never re-priced)."""
    now_s: float
    """The fit's seconds for the same prompt now."""
    new_tokens: int = 0
    """Its predicted new tokens (what it adds to a step)."""
    fixed_s: float = 0.0
    """The fit's fixed cost of a step now: what it saves when it packs behind another."""
    placed_s: float = 0.0
    """When it was placed (the caller's clock, as ``head_since_s``)."""

    @classmethod
    def priced(
        cls,
        predicted_s: float,
        then_s: float,
        model: PrefillModel,
        new_tokens: int,
        cached_tokens: int,
        fixed_s: float,
        placed_s: float,
    ) -> Queued:
        """A request placed at ``placed_s`` with its prompt priced now by ``model`` (a
        prediction never priced, ``then_s`` 0, is kept as it was)."""
        now_s = model.seconds(new_tokens, cached_tokens) if then_s > 0 else 0.0
        return cls(predicted_s, then_s, now_s, new_tokens, fixed_s, placed_s)

    def repriced_s(self) -> float:
        if self.then_s <= 0:
            return self.predicted_s
        return self.predicted_s * self.now_s / self.then_s


def queued_seconds(
    queue: Sequence[Queued],
    head_ran_s: float,
    step_tokens: int = 0,
    head_since_s: float = math.inf,
) -> float:
    """Seconds of prefill ahead of a new request: ``queue`` oldest first, re-priced, packed
    into steps of ``step_tokens`` new tokens (0: no packing; the head's pack takes only
    requests placed before ``head_since_s``, when it could start), the head pack less the
    ``head_ran_s`` it has run."""
    packs: list[float] = []
    step_new = 0
    for item in queue:
        seconds = item.repriced_s()
        started = len(packs) == 1 and item.placed_s >= head_since_s
        if packs and not started and packs_with(step_new, item.new_tokens, step_tokens):
            packs[-1] += max(0.0, seconds - item.fixed_s)
            step_new += item.new_tokens
        else:
            packs.append(seconds)
            # a prompt of unknown size closes its step: nothing is known to fit beside it
            step_new = item.new_tokens if item.new_tokens > 0 else step_tokens
    if not packs:
        return 0.0
    return max(0.0, packs[0] - max(0.0, head_ran_s)) + sum(packs[1:])
