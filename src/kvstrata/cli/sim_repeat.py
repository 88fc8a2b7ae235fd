"""``kvstrata sim --loads … --repeats R``: the repeated, tuned experiment's edge.

Builds the tuning trace and the ``R`` evaluation traces from the same sources as a single
run (synthetic: seeds ``--trace-seed`` and the next ``R``; a trace file: ``R + 1`` disjoint
windows of ``--time-window`` or the whole trace, ``--limit`` requests per repeat), runs
:func:`kvstrata.sim.experiment.run_experiment` and prints its JSON or a table. Every figure
is the median and the range (min–max) of the ``R`` repeats (``median`` / ``lo`` / ``hi`` in
the JSON); ``R`` ≥ 5, and a p99 over fewer than 100 TTFTs per run is warned about on stderr.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstrata.cli.output import emit
from kvstrata.errors import InvalidInput
from kvstrata.sim.cluster import SimConfig
from kvstrata.sim.experiment import (
    MIN_REPEATS,
    RANGE_LABEL,
    p99_sample_warning,
    parse_loads,
    run_experiment,
    split_windows,
    window_bounds_s,
)
from kvstrata.sim.trace import parse_window, select_window
from kvstrata.workloads.mooncake import TraceRequest, read_trace
from kvstrata.workloads.synthetic import generate, preset

DEFAULT_LOADS = "0.5,0.7,0.9"
DEFAULT_REPEATS = 5


def repeat_traces(
    args: argparse.Namespace, repeats: int
) -> tuple[list[TraceRequest], list[list[TraceRequest]], dict[str, Any]]:
    """The tuning trace, the evaluation traces, and how they were drawn (for the report)."""
    limit: int | None = args.limit
    if args.synthetic:
        seeds = [args.trace_seed + k for k in range(repeats + 1)]
        traces = [
            sorted(generate(preset(args.synthetic, seed), Path(args.data_dir)), key=_arrival)
            for seed in seeds
        ]
        if limit is not None:
            traces = [trace[:limit] for trace in traces]
        source = {"synthetic": args.synthetic, "tuning_seed": seeds[0], "seeds": seeds[1:]}
        return traces[0], traces[1:], source
    requests = read_trace(Path(args.trace))
    if args.time_window:
        start, end = parse_window(args.time_window)
        requests = select_window(requests, start, end)
    windows = split_windows(requests, repeats + 1, limit=limit)
    bounds = window_bounds_s(windows)
    source = {"trace": args.trace, "tuning_window_s": bounds[0], "windows_s": bounds[1:]}
    return windows[0], windows[1:], source


def _arrival(request: TraceRequest) -> int:
    return request.timestamp_ms


def run_repeated(args: argparse.Namespace, policies: list[str], config: SimConfig) -> int:
    if args.rate_scale is not None or args.target_utilisation is not None or args.plot:
        raise InvalidInput("--loads/--repeats set the rate per load; drop --rate-scale/--plot")
    if args.work_weight is not None:
        raise InvalidInput("--loads/--repeats tune kvstrata's work weight; drop --work-weight")
    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    if repeats < MIN_REPEATS:
        raise InvalidInput(
            f"--repeats must be >= {MIN_REPEATS} with --loads, got {repeats}: each figure is "
            f"the median and range (min-max) of the repeats, too coarse with fewer"
        )
    loads = parse_loads(args.loads or DEFAULT_LOADS)
    tuning, evaluation, source = repeat_traces(args, repeats)
    for trace in (tuning, *evaluation):
        if not trace:
            raise InvalidInput("a repeat's trace is empty")
    warning = p99_sample_warning(
        min(len(trace) for trace in (tuning, *evaluation)), "the smallest repeat"
    )
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    console = Console(stderr=True, quiet=args.quiet)
    report = run_experiment(
        tuning,
        evaluation,
        policies,
        replace(config, seed=0),
        loads,
        jobs=args.jobs,
        on_step=lambda step: console.log(f"rate search: {step}"),
    )
    report = {"source": source, "workers": config.workers, "profile": config.profile.name, **report}
    rows = [
        (
            load["utilisation"],
            name,
            _fmt(figures["ttft_p50_s"]),
            _fmt(figures["ttft_p99_s"]),
            _fmt(figures["hit_rate"]),
            load["tuning"][name]["params"] or "-",
        )
        for load in report["loads"]
        for name, figures in load["policies"].items()
    ]
    goals = ", ".join(
        f"{load['utilisation']}: best {load['best_baseline']}, goal {load['goal_met']}"
        + (" (p99 goal under the floor)" if load["p99_goal_under_floor"] else "")
        + _paired_note(load.get("paired"))
        for load in report["loads"]
    )
    emit(
        report,
        as_json=args.json,
        title=f"{repeats} repeats, {config.workers} workers, each figure {RANGE_LABEL}; {goals}",
        columns=(
            "load",
            "policy",
            "TTFT p50 s [min, max]",
            "TTFT p99 s [min, max]",
            "hit rate [min, max]",
            "tuned",
        ),
        rows=rows,
    )
    return 0


def _paired_note(figures: dict[str, Any] | None) -> str:
    """The title's paired figure: kvstrata's p99 ÷ the best baseline's, repeat by repeat."""
    span = None if figures is None else figures.get("p99_vs_best")
    return "" if span is None else f", kvstrata p99 ÷ best's, paired {_fmt(span)}"


def _fmt(value: dict[str, float]) -> str:
    return f"{value['median']:.4g} [{value['lo']:.4g}, {value['hi']:.4g}]"
