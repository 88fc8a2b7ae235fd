"""Repeated, tuned, multi-load experiments: median and range of the repeats, peers at their best.

The protocol (issue 15, item 1), for each target utilisation:

1. **Data.** A synthetic preset gives seed ``s`` as the tuning trace and seeds ``s+1 … s+R``
   as the evaluation traces (``s`` = ``--trace-seed``, 0 by default). A trace file is cut by
   :func:`split_windows` into ``R + 1`` disjoint half-open time windows of equal length:
   window 0 tunes, windows ``1 … R`` evaluate. Nothing of the tuning data is evaluated.
2. **Load.** :func:`~kvstrata.sim.report.search_rate_scale` on the tuning trace, with every
   baseline at its published defaults: the utilisation of a rate scale is that of the *best
   baseline* (lowest p99 TTFT) at that scale — the same definition ``--target-utilisation``
   uses. The scale found is applied unchanged to every evaluation trace, whose own measured
   utilisation is reported per policy.
3. **Tuning, a like budget (Dynamo one point more).** Every policy (each baseline and kvstrata) runs
   its sweep (:data:`SWEEPS`, 4 points, Dynamo 5; the published defaults always the first) on
   the tuning trace at that scale; the point with the lowest p99 TTFT of that one run wins
   (ties keep the earlier point, so the default wins ties). The JSON records every point.
4. **Evaluation.** Each chosen variant replays every evaluation trace, with
   ``SimConfig.seed`` = the repeat's index (so seeded simulator randomness varies too).
5. **Ranges** (:func:`interval`): the median and the range (min–max) of the ``R``
   per-repeat values — ``lo`` is the smallest repeat, ``hi`` the largest. It describes the
   repeats that ran; it is neither a confidence interval of the median nor a prediction
   interval for a new repeat (of ``R`` exchangeable repeats a fresh one falls outside
   their range with probability ``2 / (R + 1)``: a third at ``R`` = 5). The CLI asks for
   ``R`` ≥ :data:`MIN_REPEATS`, and warns when a per-repeat p99 rests on fewer than
   :data:`MIN_P99_SAMPLES` TTFTs (:func:`p99_sample_warning`): such a p99 is one of the
   largest few samples, not a tail estimate.
6. **Goal** (:func:`goal_met`): the upper end (max) of kvstrata's p99 range ≤
   ``GOAL_P99_RATIO`` × the best baseline's median p99 (best = lowest median p99), and
   kvstrata's median hit rate ≥ ``GOAL_HIT_RATIO`` × the median over the evaluation traces of
   :func:`~kvstrata.sim.trace.infinite_cache_hit_rate` (the one bound the report uses).
   ``ttft_p99_floor_s`` (:func:`~kvstrata.sim.trace.ttft_p99_floor`, over the evaluation
   traces) says how far below the best baseline any placement could go: where
   ``GOAL_P99_RATIO`` × the best median lies under the floor's upper end, no router meets
   the p99 goal at that load (``p99_goal_under_floor``: true).
7. **Paired figures** (:func:`paired`, ``paired`` in the JSON): the goal above sets
   kvstrata's worst repeat against the best baseline's median repeat. Every policy replays
   the same repeats, so each repeat also gives a paired ratio: kvstrata's p99 ÷ the best
   baseline's on that repeat (``p99_vs_best``), ÷ the lowest baseline p99 of that repeat
   (``p99_vs_repeat_best``: each repeat's own winner), and each of the two p99s ÷ that
   repeat's floor (``kvstrata_p99_vs_floor``, ``best_p99_vs_floor``: how much of the tail
   is placement at all). Median and range as in 5. They report; the goal is 6.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from kvstrata.errors import InvalidInput
from kvstrata.router import POLICIES
from kvstrata.router.specs import format_spec, parse_spec
from kvstrata.sim.cluster import SimConfig
from kvstrata.sim.report import (
    GOAL_HIT_RATIO,
    GOAL_P99_RATIO,
    KVSTRATA,
    run_policies,
    search_rate_scale,
    summarize,
)
from kvstrata.sim.trace import infinite_cache_hit_rate, prepare, ttft_p99_floor
from kvstrata.workloads.mooncake import TraceRequest

SWEEPS: Final[Mapping[str, Sequence[Mapping[str, float]]]] = {
    KVSTRATA: ({"work_weight": 3.0}, {"work_weight": 5.0}, {"work_weight": 20.0}),
    "dynamo": (
        {"prefill_load_scale": 2.0},
        {"prefill_load_scale": 4.0},
        {"prefill_load_scale": 8.0},
        {"prefill_load_scale": 16.0},
    ),
    "llm-d": ({"prefix": 1.5}, {"prefix": 6.0}, {"prefix": 12.0}),
}
"""Each policy's main parameter, besides its published default (always the first point):
kvstrata's work weight, Dynamo's ``prefill_load_scale`` (the load-vs-overlap trade-off its
docs tell operators to tune), llm-d's prefix-scorer weight against its load scorers.
Dynamo gets one point more than the others: with ``0.5 / 2 / 4`` its tuning chose 4.0, the
edge, at every load on both workloads (docs/bench/2026-12-01-sim2.json) and never 0.5, so
its sweep runs ``2 / 4 / 8 / 16`` — the extra point can only help the baseline.
Round-robin, least-loaded and prefix-affinity have no parameter: one point each."""

FIGURES: Final = ("ttft_p99_s", "ttft_p50_s", "hit_rate", "utilisation")
MIN_REPEATS: Final = 5
"""Fewest repeats ``kvstrata sim --loads`` accepts (module docstring, 5)."""
MIN_P99_SAMPLES: Final = 100
"""Fewer TTFTs than this in one run and its p99 is warned about (module docstring, 5)."""
RANGE_LABEL: Final = "median [min, max] of the repeats"


@dataclass(frozen=True, slots=True)
class Interval:
    """The median of the repeats and their range: ``lo`` = min, ``hi`` = max."""

    median: float
    lo: float
    hi: float

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi}


def interval(values: Sequence[float]) -> Interval:
    """Median and range (min–max) of ``values`` (module docstring, 5)."""
    if not values:
        raise InvalidInput("an interval needs at least one value")
    data = np.asarray(values, dtype=np.float64)
    median = float(np.median(data))
    lo, hi = float(data.min()), float(data.max())
    return Interval(round(median, 4), round(lo, 4), round(hi, 4))


def p99_sample_warning(samples: int, what: str) -> str | None:
    """A warning when ``samples`` TTFTs (per run of ``what``) are too few for a p99."""
    if samples >= MIN_P99_SAMPLES:
        return None
    return (
        f"warning: the p99 TTFT of {what} rests on {samples} TTFT samples "
        f"(< {MIN_P99_SAMPLES}): it is one of the largest few values, not a tail estimate"
    )


def goal_met(
    kvstrata_p99: Interval,
    best_baseline_p99_median: float,
    kvstrata_hit_rate_median: float,
    infinite_hit_rate: float,
) -> bool:
    """Issue 15's goal at one load (module docstring, 6)."""
    return (
        kvstrata_p99.hi <= GOAL_P99_RATIO * best_baseline_p99_median
        and kvstrata_hit_rate_median >= GOAL_HIT_RATIO * infinite_hit_rate
    )


def paired(numerators: Sequence[float], denominators: Sequence[float]) -> Interval | None:
    """Median and range of the per-repeat ratios ``numerators[i] / denominators[i]`` (module
    docstring, 7); None when a denominator is not positive or the lengths differ."""
    if len(numerators) != len(denominators) or not numerators or min(denominators) <= 0:
        return None
    return interval([a / b for a, b in zip(numerators, denominators, strict=True)])


def _paired_figures(
    values: Mapping[str, Mapping[str, Sequence[float]]],
    best: str,
    baselines: Sequence[str],
    floors: Sequence[float],
) -> dict[str, dict[str, float] | None]:
    mine = values[KVSTRATA]["ttft_p99_s"]
    theirs = values[best]["ttft_p99_s"]
    winners = [min(values[b]["ttft_p99_s"][i] for b in baselines) for i in range(len(mine))]
    figures = {
        "p99_vs_best": paired(mine, theirs),
        "p99_vs_repeat_best": paired(mine, winners),
        "kvstrata_p99_vs_floor": paired(mine, floors),
        "best_p99_vs_floor": paired(theirs, floors),
    }
    return {name: None if span is None else span.as_dict() for name, span in figures.items()}


def p99_goal_under_floor(floor: Interval, best_baseline_p99_median: float) -> bool:
    """Whether the p99 half of :func:`goal_met` asks for less than the floor at this load.

    A trace's p99 TTFT is at least its floor (up to service noise, median 1, which can take a
    run a little below it), so the upper end of any policy's p99 range is at least about
    the floor's upper end: where that exceeds ``GOAL_P99_RATIO`` × the best median, no
    placement meets the goal."""
    return floor.hi > GOAL_P99_RATIO * best_baseline_p99_median


def split_windows(
    trace: Sequence[TraceRequest], count: int, *, limit: int | None = None
) -> list[list[TraceRequest]]:
    """``count`` disjoint windows ``[t0 + k·L, t0 + (k+1)·L)`` covering the trace's span.

    ``L`` = span / count; the last window also takes the final instant. ``limit`` keeps the
    first N requests of each window (a short run that still samples the whole trace).
    """
    if count < 1:
        raise InvalidInput(f"window count must be >= 1, got {count}")
    if not trace:
        raise InvalidInput("cannot split an empty trace into windows")
    ordered = sorted(trace, key=lambda r: r.timestamp_ms)
    start, end = ordered[0].timestamp_ms, ordered[-1].timestamp_ms
    length = (end - start) / count
    windows: list[list[TraceRequest]] = [[] for _ in range(count)]
    for request in ordered:
        k = (
            count - 1
            if length <= 0
            else min(int((request.timestamp_ms - start) / length), count - 1)
        )
        windows[k].append(request)
    if limit is not None:
        if limit < 1:
            raise InvalidInput(f"limit must be >= 1, got {limit}")
        windows = [window[:limit] for window in windows]
    empty = [k for k, window in enumerate(windows) if not window]
    if empty:
        raise InvalidInput(f"time windows {empty} of {count} hold no request; use fewer repeats")
    return windows


def window_bounds_s(windows: Sequence[Sequence[TraceRequest]]) -> list[list[float]]:
    """First and last arrival (trace seconds) of each window, for the report."""
    return [[w[0].timestamp_ms / 1000.0, w[-1].timestamp_ms / 1000.0] if w else [] for w in windows]


def sweep_points(policy: str) -> list[str]:
    """The specs a policy is tuned over: its published defaults first, then :data:`SWEEPS`."""
    defaults = POLICIES.defaults(parse_spec(policy)[0])
    points = [format_spec(policy, defaults)]
    for variant in SWEEPS.get(policy, ()):
        spec = format_spec(policy, {**defaults, **variant})
        if spec not in points:
            points.append(spec)
    return points


def tune(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    config: SimConfig,
    rate_scale: float,
    *,
    jobs: int = 1,
) -> dict[str, dict[str, Any]]:
    """Per policy: every sweep point's tuning-run figures and the chosen spec (lowest p99)."""
    prepared = prepare(requests, rate_scale)
    points = {policy: sweep_points(policy) for policy in policies}
    every = [spec for specs in points.values() for spec in specs]
    runs = run_policies(prepared, every, config, jobs=jobs)
    record: dict[str, dict[str, Any]] = {}
    for policy, specs in points.items():
        sweep = []
        for spec in specs:
            figures = summarize(runs[spec])
            sweep.append(
                {
                    "params": parse_spec(spec)[1],
                    "ttft_p99_s": figures["ttft_p99_s"],
                    "hit_rate": figures["hit_rate"],
                }
            )
        best = min(range(len(specs)), key=lambda i: (sweep[i]["ttft_p99_s"], i))
        record[policy] = {"sweep": sweep, "chosen": specs[best], "params": sweep[best]["params"]}
    return record


def evaluate(
    traces: Sequence[Sequence[TraceRequest]],
    chosen: Mapping[str, str],
    config: SimConfig,
    rate_scale: float,
    *,
    jobs: int = 1,
) -> tuple[dict[str, dict[str, list[float]]], list[float], list[float]]:
    """Per policy and figure, one value per evaluation trace; each trace's hit bound and
    p99 TTFT floor (:func:`~kvstrata.sim.trace.ttft_p99_floor`)."""
    values: dict[str, dict[str, list[float]]] = {p: {f: [] for f in FIGURES} for p in chosen}
    bounds: list[float] = []
    floors: list[float] = []
    for repeat, trace in enumerate(traces, start=1):
        prepared = prepare(trace, rate_scale)
        bounds.append(infinite_cache_hit_rate(prepared))
        floors.append(ttft_p99_floor(prepared, config.profile.cost.prefill))
        specs = list(dict.fromkeys(chosen.values()))
        runs = run_policies(prepared, specs, replace(config, seed=repeat), jobs=jobs)
        for policy, spec in chosen.items():
            figures = summarize(runs[spec])
            for name in FIGURES:
                values[policy][name].append(float(figures[name]))
    return values, bounds, floors


def run_load(
    tuning: Sequence[TraceRequest],
    evaluation: Sequence[Sequence[TraceRequest]],
    policies: Sequence[str],
    config: SimConfig,
    target: float,
    *,
    jobs: int = 1,
    start_scale: float = 1.0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """One load: rate search and tuning on ``tuning``, evaluation over ``evaluation``."""
    baselines = [p for p in policies if p != KVSTRATA]
    scale, search = search_rate_scale(
        tuning,
        config,
        target=target,
        baselines=baselines,
        jobs=jobs,
        start=start_scale,
        on_step=on_step,
    )
    record = tune(tuning, policies, config, scale, jobs=jobs)
    chosen = {policy: entry["chosen"] for policy, entry in record.items()}
    values, bounds, floors = evaluate(evaluation, chosen, config, scale, jobs=jobs)
    figures = {
        policy: {name: interval(series).as_dict() for name, series in per.items()}
        for policy, per in values.items()
    }
    best = min(baselines, key=lambda p: figures[p]["ttft_p99_s"]["median"], default=None)
    infinite = interval(bounds).median
    mine = figures.get(KVSTRATA)
    out: dict[str, Any] = {
        "utilisation": target,
        "rate_scale": round(scale, 4),
        "rate_search": search,
        "tuning": record,
        "policies": figures,
        "best_baseline": best,
        "infinite_cache_hit_rate": infinite,
        "ttft_p99_floor_s": interval(floors).as_dict(),
        "kvstrata_p99_hi_vs_best_median": None,
        "kvstrata_hit_rate_vs_infinite": None,
        "p99_goal_under_floor": None,
        "paired": None,
        "goal_met": False,
    }
    if mine is None or best is None:
        return out
    best_p99 = figures[best]["ttft_p99_s"]["median"]
    p99 = Interval(**mine["ttft_p99_s"])
    hit = mine["hit_rate"]["median"]
    out["p99_goal_under_floor"] = p99_goal_under_floor(interval(floors), best_p99)
    out["paired"] = _paired_figures(values, best, baselines, floors)
    if best_p99 > 0:
        out["kvstrata_p99_hi_vs_best_median"] = round(p99.hi / best_p99, 4)
    if infinite > 0:
        out["kvstrata_hit_rate_vs_infinite"] = round(hit / infinite, 4)
    out["goal_met"] = goal_met(p99, best_p99, hit, infinite)
    return out


def run_experiment(
    tuning: Sequence[TraceRequest],
    evaluation: Sequence[Sequence[TraceRequest]],
    policies: Sequence[str],
    config: SimConfig,
    loads: Sequence[float],
    *,
    jobs: int = 1,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every load in turn (module docstring); each rate search starts from the last scale."""
    if not evaluation:
        raise InvalidInput("an experiment needs at least one evaluation trace")
    if not [p for p in policies if p != KVSTRATA]:
        raise InvalidInput("an experiment needs at least one baseline policy")
    results: list[dict[str, Any]] = []
    scale, previous = 1.0, None
    for target in loads:
        if previous is not None:
            scale = results[-1]["rate_scale"] * target / previous
        results.append(
            run_load(
                tuning,
                evaluation,
                policies,
                config,
                target,
                jobs=jobs,
                start_scale=scale,
                on_step=on_step,
            )
        )
        previous = target
    return {
        "repeats": len(evaluation),
        "interval": "median and range (min-max) of the repeats: lo = min, hi = max",
        "utilisation_defined_by": "best baseline (lowest p99) at published defaults, tuning data",
        "loads": results,
        "goal_met_all_loads": all(load["goal_met"] for load in results),
    }


def parse_loads(text: str) -> list[float]:
    """``"0.5,0.7,0.9"`` → target utilisations, each in (0, 1)."""
    try:
        loads = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise InvalidInput(f"bad --loads {text!r}") from exc
    if not loads or any(not 0.0 < load < 1.0 for load in loads):
        raise InvalidInput(f"--loads must be utilisations in (0, 1), got {text!r}")
    return loads
