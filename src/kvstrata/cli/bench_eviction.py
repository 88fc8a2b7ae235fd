"""``kvstrata bench eviction``: saved prefill of lru, the deployed peers (s3fifo, arc, gdsf,
tinylfu), kvstrata and belady on a trace.

A thin edge: reads a Mooncake-format trace (or generates a synthetic one), optionally keeps
one time half of it (or its first ``--requests``), resolves capacities, calls
``kvstrata.bench.eviction`` and prints the report (one JSON object with ``--json``, otherwise
a table). Progress goes to stderr.

``--remote-writers N`` switches to the multi-writer remote mode instead
(``kvstrata.bench.eviction_remote``): N writer processes against real Valkey servers, the
remote tier's shared value ledger vs the server's ``allkeys-lru``. Every block it stores costs
a few round trips, so it replays the first ``REMOTE_DEFAULT_REQUESTS`` requests unless
``--requests`` says otherwise, at ``--remote-capacity`` (default: the simulated mode's
smallest default capacity as a share of the Mooncake trace's distinct blocks).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.bench.eviction import (
    DEFAULT_CAPACITIES,
    POLICY_NAMES,
    known_policy,
    run_eviction_bench,
    run_windows,
    stderr_progress,
)
from kvstrata.bench.eviction_remote import REMOTE_CAPACITY_FRACTION, run_remote_multi_writer
from kvstrata.cli.output import emit
from kvstrata.cli.traces import load_source
from kvstrata.costs import PROFILES
from kvstrata.errors import InvalidInput
from kvstrata.workloads.mooncake import TraceRequest
from kvstrata.workloads.synthetic import PRESETS

DEFAULT_DATA_DIR = Path("..") / "shared" / "data"
REMOTE_DEFAULT_REQUESTS = 2000


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "eviction",
        help="replay a trace through the eviction policies (lru, deployed peers, kvstrata, belady)",
        description=(
            "Saved prefill tokens of each eviction policy per tier capacity, replaying a "
            "Mooncake-format trace in simulated time through the real policy objects."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake-format JSONL trace file")
    source.add_argument(
        "--synthetic", choices=sorted(PRESETS), help="generate a synthetic trace instead"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --synthetic (default 0)")
    parser.add_argument(
        "--data-dir",
        default=str(DEFAULT_DATA_DIR),
        help="shared data directory (Azure CSVs of --synthetic azure-conv)",
    )
    parser.add_argument(
        "--half",
        choices=("first", "second"),
        help="keep only the requests before / from the midpoint of the trace's time span",
    )
    parser.add_argument(
        "--capacities",
        type=_capacity_specs,
        default=tuple(str(capacity) for capacity in DEFAULT_CAPACITIES),
        help="comma-separated capacities in blocks, or in percent of the trace's distinct "
        "blocks (e.g. 5%%,15%%,50%%); default "
        + ",".join(str(capacity) for capacity in DEFAULT_CAPACITIES),
        metavar="N|P%[,...]",
    )
    parser.add_argument(
        "--cost-model",
        choices=sorted(PROFILES),
        default="smollm2-cpu",
        help="prefill cost model that prices blocks (default smollm2-cpu)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help="comma-separated subset of "
        + ",".join(POLICY_NAMES)
        + ", or a deployed peer at any point of its main parameter: s3fifo:F (small-queue "
        "share), tinylfu:K (sample size ÷ cache size), gdsf:B (GreedyDual* beta)",
    )
    parser.add_argument(
        "--skip",
        type=int,
        default=0,
        help="drop the first N requests (then --requests counts from there): a later window",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="replay only the first N requests (remote mode default "
        f"{REMOTE_DEFAULT_REQUESTS}; otherwise all)",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=1,
        help="replay N consecutive disjoint windows of --requests requests (from --skip), each "
        "on a fresh tier, and report kvstrata ÷ the best deployed policy per window and how "
        "many windows meet issue 15's goals (seconds ≥ 1.0, tokens ≥ 0.97)",
    )
    remote = parser.add_argument_group("multi-writer remote mode")
    remote.add_argument(
        "--remote-writers",
        type=int,
        default=0,
        help="N writer processes on real Valkey servers: the remote tier's value ledger vs "
        "the server's allkeys-lru (instead of the simulated policies)",
    )
    remote.add_argument(
        "--remote-capacity",
        type=_capacity_spec,
        default=f"{REMOTE_CAPACITY_FRACTION * 100:.4f}%",
        help="capacity in blocks or percent of the replayed distinct blocks (default "
        f"{REMOTE_CAPACITY_FRACTION * 100:.2f}%%: 10,000 of the Mooncake trace's 182,790)",
        metavar="N|P%",
    )
    remote.add_argument("--remote-repeat", type=int, default=3, help="runs of each mode")
    remote.add_argument(
        "--remote-payload-bytes", type=int, default=4096, help="stand-in payload per block"
    )
    remote.add_argument(
        "--remote-lru-budget",
        choices=("used", "blocks"),
        default="used",
        help="LRU server memory: the value server's measured data memory (used) or room for "
        "the same number of blocks (blocks)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.windows < 1:
        raise InvalidInput(f"--windows must be >= 1, got {args.windows}")
    if args.windows > 1 and (args.requests is None or args.remote_writers or args.half):
        raise InvalidInput(
            "--windows needs --requests (the window size), not --remote-writers or --half"
        )
    requests, source = _load(args)
    if args.remote_writers:
        return _run_remote(args, requests, source)
    policies = tuple(name.strip() for name in args.policies.split(",") if name.strip())
    unknown = [name for name in policies if not known_policy(name)]
    if unknown or not policies:
        raise InvalidInput(
            f"unknown policies {unknown}; expected some of {POLICY_NAMES} "
            "or a deployed peer's NAME:VALUE (e.g. gdsf:0.5)"
        )
    if args.windows > 1:
        return _run_windows(args, requests, source, policies)
    distinct = len({block for request in requests for block in request.hash_ids})
    capacities = [_resolve(spec, distinct) for spec in args.capacities]
    report = run_eviction_bench(
        requests,
        capacities,
        cost_model=PROFILES[args.cost_model](),
        policies=policies,
        progress=None if args.quiet else stderr_progress,
    )
    result: dict[str, Any] = {
        "trace": source,
        "requests": len(requests),
        "distinct_blocks": distinct,
        **report,
    }
    rows: list[tuple[Any, ...]] = []
    for index, capacity in enumerate(capacities):
        for name in policies:
            rows.append(
                (
                    capacity,
                    name,
                    report["saved_tokens"][name][index],
                    report["hit_rate"][name][index],
                    report["saved_prefill_s"][name][index],
                )
            )
        for label, key in (("kvstrata", "kvstrata_vs_best_peer"),
                           ("kvstrata-ghost1", "kvstrata_ghost1_vs_best_peer")):  # fmt: skip
            versus = report.get(key)
            if versus is None:
                continue
            tokens, seconds = versus["saved_tokens"][index], versus["saved_prefill_s"][index]
            rows.append(
                (
                    capacity,
                    f"{label} ÷ best deployed",
                    None if tokens is None else round(tokens, 3),
                    "",
                    None if seconds is None else round(seconds, 3),
                )
            )
    emit(
        result,
        as_json=args.json,
        title=f"Eviction policies on {source}",
        columns=("capacity (blocks)", "policy", "saved tokens", "token hit rate", "saved s"),
        rows=rows,
    )
    return 0


def _run_windows(
    args: argparse.Namespace, requests: list[TraceRequest], source: str, policies: tuple[str, ...]
) -> int:
    def capacities_of(chunk: Sequence[TraceRequest]) -> list[int]:
        distinct = len({block for request in chunk for block in request.hash_ids})
        return [_resolve(spec, distinct) for spec in args.capacities]

    report = run_windows(
        requests,
        args.requests,
        capacities_of,
        first_skip=args.skip,
        cost_model=PROFILES[args.cost_model](),
        policies=policies,
        progress=None if args.quiet else stderr_progress,
    )
    result: dict[str, Any] = {"trace": source, "capacity_specs": list(args.capacities), **report}

    def ratios(values: list[float | None]) -> str:
        return " / ".join("-" if value is None else f"{value:.3f}" for value in values)

    rows = [
        (
            f"{window['skip']}–{window['skip'] + window['requests']}",
            ratios(window["kvstrata_vs_best_peer"]["saved_prefill_s"]),
            ratios(window["kvstrata_vs_best_peer"]["saved_tokens"]),
            "yes" if window["goals_met"] else "no",
        )
        for window in report["windows"]
    ]
    emit(
        result,
        as_json=args.json,
        title=f"kvstrata ÷ the best deployed policy per window of {source}, capacities "
        f"{', '.join(args.capacities)}: {report['windows_meeting_goals']} of "
        f"{len(report['windows'])} windows meet both goals",
        columns=("requests", "saved seconds ratio", "saved tokens ratio", "both goals"),
        rows=rows,
    )
    return 0


def _run_remote(args: argparse.Namespace, requests: list[TraceRequest], source: str) -> int:
    distinct = len({block for request in requests for block in request.hash_ids})
    capacity = max(1, _resolve(args.remote_capacity, distinct))
    report = run_remote_multi_writer(
        requests,
        capacity,
        writers=args.remote_writers,
        repeats=args.remote_repeat,
        payload_bytes=args.remote_payload_bytes,
        cost_model=PROFILES[args.cost_model](),
        lru_budget=args.remote_lru_budget,
        progress=None if args.quiet else stderr_progress,
    )
    result: dict[str, Any] = {
        "trace": source,
        "requests": len(requests),
        "distinct_blocks": distinct,
        "remote_multi_writer": report,
    }
    rows: list[tuple[Any, ...]] = []
    for mode in ("value", "lru"):
        summary = report[mode]
        rows.append(
            (mode, "all", summary["requests"], summary["saved_prefill_s"],
             "{:.1f}-{:.1f}".format(*summary["saved_prefill_s_spread"]),
             summary["token_hit_rate"], summary["evictions"])
        )  # fmt: skip
        for writer in summary["per_writer"]:
            rows.append(
                (mode, writer["writer"], writer["requests"], writer["saved_prefill_s"], "",
                 writer["token_hit_rate"], "")
            )  # fmt: skip
    emit(
        result,
        as_json=args.json,
        title=(
            f"Multi-writer remote eviction on {source}: {args.remote_writers} writers, "
            f"{capacity} blocks, value/lru saved prefill = {report['ratio']}"
        ),
        columns=(
            "mode",
            "writer",
            "requests",
            "saved s (median)",
            "spread",
            "token hit rate",
            "evictions",
        ),
        rows=rows,
    )
    return 0


def _load(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    requests, source = load_source(args.trace, args.synthetic, args.seed, args.data_dir)
    if args.skip:
        if args.skip < 0:
            raise InvalidInput(f"--skip must be >= 0, got {args.skip}")
        requests = requests[args.skip :]
        source += f" (from request {args.skip})"
    limit = args.requests
    if limit is not None and args.windows > 1:
        limit *= args.windows
    if limit is None and args.remote_writers:
        limit = REMOTE_DEFAULT_REQUESTS
    if limit is not None:
        if limit < 1:
            raise InvalidInput(f"--requests must be >= 1, got {limit}")
        if limit < len(requests):
            requests = requests[:limit]
            source += f" (first {limit} requests)"
    if args.half is not None and requests:
        first = min(request.timestamp_ms for request in requests)
        last = max(request.timestamp_ms for request in requests)
        midpoint = (first + last) / 2
        keep_first = args.half == "first"
        requests = [r for r in requests if (r.timestamp_ms < midpoint) == keep_first]
        source += f" ({args.half} half)"
    return requests, source


def _capacity_specs(text: str) -> tuple[str, ...]:
    specs = tuple(part.strip() for part in text.split(",") if part.strip())
    if not specs:
        raise argparse.ArgumentTypeError(f"expected capacities, got {text!r}")
    return tuple(_capacity_spec(spec) for spec in specs)


def _capacity_spec(spec: str) -> str:
    try:
        value = float(spec[:-1]) if spec.endswith("%") else int(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad capacity {spec!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"capacity must be >= 0, got {spec!r}")
    return spec


def _resolve(spec: str, distinct_blocks: int) -> int:
    """A capacity in blocks: ``"10000"`` as is, ``"5%"`` of the trace's distinct blocks."""
    if spec.endswith("%"):
        return int(distinct_blocks * float(spec[:-1]) / 100)
    return int(spec)
