"""``kvstrata bench eviction``: saved prefill of lru / kvstrata / belady on a trace.

A thin edge: reads a Mooncake-format trace (or generates a synthetic one), optionally keeps
one time half of it, resolves capacities, calls ``kvstrata.bench.eviction`` and prints the
report (one JSON object with ``--json``, otherwise a table). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.bench.eviction import (
    DEFAULT_CAPACITIES,
    POLICY_NAMES,
    run_eviction_bench,
    stderr_progress,
)
from kvstrata.cli.output import emit
from kvstrata.cli.traces import load_source
from kvstrata.costs import PROFILES
from kvstrata.errors import InvalidInput
from kvstrata.workloads.mooncake import TraceRequest
from kvstrata.workloads.synthetic import PRESETS

DEFAULT_DATA_DIR = Path("..") / "shared" / "data"


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "eviction",
        help="replay a trace through the eviction policies (lru, kvstrata, belady)",
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
        help="comma-separated subset of " + ",".join(POLICY_NAMES),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    requests, source = _load(args)
    policies = tuple(name.strip() for name in args.policies.split(",") if name.strip())
    unknown = [name for name in policies if name not in POLICY_NAMES]
    if unknown or not policies:
        raise InvalidInput(f"unknown policies {unknown}; expected some of {POLICY_NAMES}")
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
    emit(
        result,
        as_json=args.json,
        title=f"Eviction policies on {source}",
        columns=("capacity (blocks)", "policy", "saved tokens", "token hit rate", "saved s"),
        rows=rows,
    )
    return 0


def _load(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    requests, source = load_source(args.trace, args.synthetic, args.seed, args.data_dir)
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
    for spec in specs:
        try:
            value = float(spec[:-1]) if spec.endswith("%") else int(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad capacity {spec!r}") from exc
        if value < 0:
            raise argparse.ArgumentTypeError(f"capacity must be >= 0, got {spec!r}")
    return specs


def _resolve(spec: str, distinct_blocks: int) -> int:
    """A capacity in blocks: ``"10000"`` as is, ``"5%"`` of the trace's distinct blocks."""
    if spec.endswith("%"):
        return int(distinct_blocks * float(spec[:-1]) / 100)
    return int(spec)
