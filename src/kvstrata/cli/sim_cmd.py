"""``kvstrata sim``: replay a trace on N simulated workers under every routing policy.

A thin edge: loads a Mooncake-format trace (or generates a synthetic one), keeps a time
window and/or the first N requests, optionally searches the rate scale at which the best
baseline runs the cluster at a target utilisation, runs ``kvstrata.sim`` and prints one JSON
object (``--json``) or a table. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from kvstrata.cli.output import emit
from kvstrata.cli.sim_repeat import run_repeated
from kvstrata.cli.traces import load_source
from kvstrata.errors import InvalidInput
from kvstrata.index.core import ConsistencyMode
from kvstrata.sim.cluster import EVICTION_POLICIES, SimConfig
from kvstrata.sim.experiment import p99_sample_warning
from kvstrata.sim.plot import plot_ttft_cdf
from kvstrata.sim.profiles import PROFILES, profile
from kvstrata.sim.report import KVSTRATA, parse_policies, search_rate_scale, simulate_report
from kvstrata.sim.trace import parse_window, select_window
from kvstrata.sim.view import DEFAULT_SERVICE_NOISE
from kvstrata.workloads.mooncake import TraceRequest
from kvstrata.workloads.synthetic import PRESETS

DEFAULT_DATA_DIR = Path("..") / "shared" / "data"


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "sim",
        help="simulate a cluster replaying a trace under every routing policy",
        description=(
            "Discrete-event simulation of N workers driven by the real router, index and "
            "eviction policies, with calibrated cost models; reports TTFT, hit rate, "
            "throughput and load balance per routing policy."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake-format JSONL trace")
    source.add_argument("--synthetic", choices=sorted(PRESETS), help="generate a trace instead")
    parser.add_argument("--trace-seed", type=int, default=0, help="seed of --synthetic")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="shared data dir")
    parser.add_argument("--time-window", help="START:END seconds of the trace to keep")
    parser.add_argument(
        "--limit",
        type=int,
        help="keep only the first N requests (after the window; with --loads: of each repeat)",
    )
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--policies", default="all", help="'all' or a comma-separated list")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu-a100-8b")
    parser.add_argument("--device-blocks", type=int, help="device KV pool per worker (blocks)")
    parser.add_argument("--host-blocks", type=int, help="host tier per worker (blocks; 0 = none)")
    parser.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default="lru",
        help="eviction policy of both tiers (default lru)",
    )
    parser.add_argument(
        "--host-eviction", choices=EVICTION_POLICIES, help="override --eviction for the host tier"
    )
    parser.add_argument("--index", choices=[m.value for m in ConsistencyMode], default="exact")
    parser.add_argument("--event-lag", type=float, default=0.0, help="index event lag (s)")
    parser.add_argument(
        "--estimate-noise",
        type=float,
        default=0.0,
        help="sigma of a per-worker lognormal error on the router's prefill prior "
        "(with --oracle: on the true profile)",
    )
    parser.add_argument(
        "--service-noise",
        type=float,
        default=DEFAULT_SERVICE_NOISE,
        metavar="SIGMA",
        help=f"sigma of the per-job lognormal service-time noise (default {DEFAULT_SERVICE_NOISE};"
        " 0 = deterministic; ignored with --oracle)",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="comparison only: the router knows the true profile and remaining times, no noise",
    )
    parser.add_argument("--work-weight", type=float, help="override kvstrata's work weight")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--rate-scale", type=float, default=None, help="arrival rate multiplier")
    rate.add_argument(
        "--target-utilisation",
        type=float,
        help="search the rate scale where the best baseline reaches this",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="policies simulated in parallel processes",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write TTFT CDFs per policy to this PNG")
    parser.add_argument(
        "--loads",
        help="repeated experiment at these utilisations, e.g. 0.5,0.7,0.9 (sim/experiment.py);"
        " each figure is the median and the range (min-max) of the repeats",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="evaluation seeds (synthetic) or time windows (trace); default and minimum 5 with"
        " --loads",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trace, source = _load(args)
    if not trace:
        raise InvalidInput("the trace selection is empty")
    policies = parse_policies(args.policies)
    base = profile(args.profile).with_capacities(args.device_blocks, args.host_blocks)
    config = SimConfig(
        profile=base,
        workers=args.workers,
        device_eviction=args.eviction,
        host_eviction=args.host_eviction or args.eviction,
        index_mode=ConsistencyMode(args.index),
        event_lag_s=args.event_lag,
        estimate_noise=args.estimate_noise,
        seed=args.seed,
        work_weight=args.work_weight,
        service_noise=args.service_noise,
        oracle=args.oracle,
    )
    if args.loads is not None or args.repeats is not None:
        return run_repeated(args, policies, config)
    warning = p99_sample_warning(len(trace), "this run")
    if warning is not None:
        _stderr(warning)
    console = Console(stderr=True, quiet=args.quiet)
    search: list[dict[str, Any]] | None = None
    rate_scale = args.rate_scale if args.rate_scale is not None else 1.0
    if args.target_utilisation is not None:
        baselines = [name for name in policies if name != KVSTRATA]
        rate_scale, search = search_rate_scale(
            trace,
            config,
            target=args.target_utilisation,
            baselines=baselines,
            jobs=args.jobs,
            on_step=lambda step: console.log(f"rate search: {step}"),
        )
    parallel = args.jobs > 1 and len(policies) > 1
    with Progress(console=console, disable=args.quiet, transient=True) as bar:
        if parallel:
            tasks = {"policies": bar.add_task("policies", total=len(policies))}
        else:
            tasks = {name: bar.add_task(name, total=len(trace)) for name in policies}
        state = {"policy": policies[0]}

        def on_done(name: str) -> None:
            if parallel:
                bar.advance(tasks["policies"])
                return
            bar.update(tasks[name], completed=len(trace))
            following = policies.index(name) + 1
            state["policy"] = policies[min(following, len(policies) - 1)]

        def progress(done: int) -> None:
            bar.update(tasks[state["policy"]], completed=done)

        report, runs = simulate_report(
            trace,
            policies,
            config,
            rate_scale=rate_scale,
            source=source,
            jobs=args.jobs if parallel else 1,
            on_done=on_done,
            progress=progress,
        )
    if search is not None:
        report["target_utilisation"] = args.target_utilisation
        report["rate_search"] = search
    if args.plot:
        plot_ttft_cdf(
            {name: run.ttft_s for name, run in runs.items()},
            args.plot,
            title=f"TTFT, {source}, {config.workers} workers, rate ×{rate_scale:.3g}",
        )
        report["plot"] = args.plot
    rows = [
        (
            name,
            s["ttft_p50_s"],
            s["ttft_p99_s"],
            s["throughput_tok_s"],
            s["hit_rate"],
            s["utilisation"],
            s["load_imbalance"],
        )
        for name, s in report["policies"].items()
    ]
    emit(
        report,
        as_json=args.json,
        title=(
            f"{source}: {report['requests']} requests, {config.workers} workers, rate "
            f"×{report['rate_scale']}, infinite-cache hit rate "
            f"{report['infinite_cache_hit_rate']}; best baseline {report['best_baseline']}, "
            f"kvstrata p99 ÷ best {report['kvstrata_p99_vs_best_baseline']}, hit ÷ bound "
            f"{report['kvstrata_hit_rate_vs_infinite']}, goal met {report['goal_met']}"
        ),
        columns=(
            "policy",
            "TTFT p50 s",
            "TTFT p99 s",
            "tok/s",
            "hit rate",
            "utilisation",
            "imbalance",
        ),
        rows=rows,
    )
    return 0


def _load(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    requests, source = load_source(args.trace, args.synthetic, args.trace_seed, args.data_dir)
    if args.time_window:
        start, end = parse_window(args.time_window)
        requests = select_window(requests, start, end)
        source += f" [{args.time_window}]"
    if args.limit is not None:
        if args.limit < 1:
            raise InvalidInput(f"--limit must be >= 1, got {args.limit}")
        requests = sorted(requests, key=lambda r: r.timestamp_ms)[: args.limit]
        source += f" (first {args.limit})"
    return requests, source


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
