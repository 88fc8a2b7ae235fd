"""The reference engine's prefill cost over several (new, cached) points, and its fit.

Each point ``(n, c)`` times one forward that computes ``n`` new tokens after ``c`` cached
ones and samples one token (a TTFT without queueing). ``c > 0`` points first store the
``c``-token prefix in the engine's emptied device pool (not timed) and check the timed run matched
exactly ``c`` tokens; ``c = 0`` points look nothing up. No timed run stores anything, so a
point never turns the next one into a hit. Every point is timed ``repeats`` times and the
minimum kept (as :func:`kvstrata.costs.calibrate` does: background load only adds time), or,
with ``stat="median"``, the median: the cost of a typical forward rather than the best one.
Every repeat's timing is kept (``timings``). The simulator centres its service-time noise on
its profile (``sim.view``, lognormal with median 1), so the median is the statistic that
matches it. The pinned ``reference-cpu`` timings (``kvstrata.costs.profiles``) are minima:
on an idle pinned core the two differed by at most 2.3 % (engine alone) and 1–3 % (served)
on the EPYC at stop 41, less than the machine's drift from one hour to the next.

**Served** (:func:`run_served_curve`, ``--served``): the same points timed as the fleet sees
a worker: a real ``kvstrata up --pin-cpus`` fleet (``bench calibrate``'s, one core and one
torch thread per worker), one request of ``max_tokens = 1`` at a time through its front door,
TTFT at the client. That adds what the engine alone does not pay: HTTP and routing,
tokenizing nothing (token-id prompts) but the worker's scheduler, whose 512-token step budget
splits a long prefill into chunks, and storing the computed blocks. A ``c > 0`` point first
sends the ``c``-token prefix (stored) and checks the timed request hit exactly ``c`` tokens;
every repeat uses fresh random tokens.

The fitted model is :func:`kvstrata.costs.fit`, the one least-squares fit the fleet's online
refit and ``bench calibrate`` use, so a profile built from these samples prices a forward
exactly as a fleet that measured the same timings would.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvstrata.bench.ttft import synthetic_prompt
from kvstrata.costs import PrefillModel, fit
from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import InvalidInput

STATS: Final[dict[str, Callable[[Sequence[float]], float]]] = {
    "min": min,
    "median": statistics.median,
}
"""How a point's repeats become its sample (module docstring)."""


@dataclass(frozen=True)
class PrefillCurve:
    model: str
    repeats: int
    stat: str
    timings: tuple[tuple[int, int, tuple[float, ...]], ...]
    """``(new_tokens, cached_tokens, every repeat's seconds)``."""
    fit_name: str
    samples: tuple[tuple[int, int, float], ...] = field(init=False)
    """``(new_tokens, cached_tokens, seconds)``: ``stat`` of the repeats."""
    fitted: PrefillModel = field(init=False)

    def __post_init__(self) -> None:
        _check_stat(self.stat)
        if any(not t for *_, t in self.timings):
            raise InvalidInput("every point needs at least one timing")
        reduce = STATS[self.stat]
        samples = tuple((n, c, float(reduce(t))) for n, c, t in self.timings)
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "fitted", fit(samples, name=self.fit_name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "repeats": self.repeats,
            "stat": self.stat,
            "samples": [
                {"new_tokens": n, "cached_tokens": c, "seconds": s, "timings": list(t)}
                for (n, c, s), (*_, t) in zip(self.samples, self.timings, strict=True)
            ],
            "fit": {**self.fitted.terms(), "spread": self.fitted.spread},
        }


def _forward_s(engine: ReferenceEngine, ids: list[int], cached: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    generation = engine.generate(ids, params, lookup=cached > 0, store=False).run()
    seconds = time.perf_counter() - started
    matched = sum(generation.record.matched_by_tier.values())
    if matched != cached:
        raise InvalidInput(f"expected {cached} cached tokens, the engine matched {matched}")
    return seconds


FLEET_BLOCK_TOKENS = 16
"""The block size of the fleet ``live_fleet`` starts (``kvstrata up``'s default): only whole
blocks of a prefix are cached, so a served point's cached tokens must be a multiple of it."""


def _check_stat(stat: str) -> None:
    if stat not in STATS:
        raise InvalidInput(f"stat must be one of {', '.join(STATS)}, got {stat!r}")


def _check(points: tuple[tuple[int, int], ...], repeats: int, block: int, stat: str) -> None:
    """Before any timing: a bad argument fails now, not after minutes of forwards."""
    if repeats < 1:
        raise InvalidInput(f"repeats must be >= 1, got {repeats}")
    _check_stat(stat)
    for n, c in points:
        if n < 1 or c < 0 or c % block:
            raise InvalidInput(
                f"point ({n}, {c}): need new tokens >= 1 and cached tokens a multiple of {block}"
            )


def run_prefill_curve(
    engine: ReferenceEngine,
    points: tuple[tuple[int, int], ...],
    *,
    model: str,
    repeats: int,
    stat: str = "min",
) -> PrefillCurve:
    """Time every point ``repeats`` times (``stat`` of them kept) and fit the three-term
    model."""
    _check(points, repeats, engine.config.block_size, stat)
    prompt = synthetic_prompt(engine, max(n + c for n, c in points))
    warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(prompt[:64], warm, lookup=False, store=False).run()  # first-call costs

    def measure(n: int, c: int) -> float:
        engine.pool.clear()  # no longer prefix stored for an earlier point may match
        if c:  # the prefix as a hit (stored, untimed); the same tokens every time
            engine.generate(prompt[:c], warm, lookup=False, store=True).run()
        return _forward_s(engine, prompt[: c + n], c)

    timings = tuple((n, c, tuple(measure(n, c) for _ in range(repeats))) for n, c in points)
    return PrefillCurve(model, repeats, stat, timings, f"{model}-measured")


def run_served_curve(
    points: tuple[tuple[int, int], ...],
    *,
    repeats: int,
    workers: int,
    pool_gib: float,
    model: str = "smollm2",
    stat: str = "min",
) -> PrefillCurve:
    """Time every point on a live fleet of ``model`` (module docstring) and fit the
    three-term model."""
    from kvstrata.bench.calibrate_live import live_fleet

    _check(points, repeats, FLEET_BLOCK_TOKENS, stat)
    with live_fleet(workers=workers, policy="kvstrata", pool_gib=pool_gib, model=model) as fleet:
        timings = tuple(fleet.time_points(points, repeats))
    return PrefillCurve(f"{model}-served", repeats, stat, timings, f"{model}-served")
