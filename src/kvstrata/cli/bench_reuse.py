"""``kvstrata bench reuse``: prefix-reuse statistics of a Mooncake-format trace.

A thin edge: parses arguments, reads the trace, calls ``kvstrata.bench.reuse.analyse_reuse``
and prints the report (one JSON object with ``--json``, otherwise a table).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.bench.reuse import DEFAULT_CAPACITIES, analyse_reuse
from kvstrata.cli.output import emit
from kvstrata.workloads.mooncake import read_trace


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "reuse",
        help="prefix-cache hit rates and reuse distances of a request trace",
        description=(
            "Token hit rate of an infinite and of LRU prefix caches, reuse-distance "
            "percentiles and reuse concentration of a Mooncake-format JSONL trace."
        ),
    )
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace file")
    parser.add_argument(
        "--capacities",
        type=_capacities,
        default=DEFAULT_CAPACITIES,
        help="comma-separated LRU capacities in blocks (default: "
        + ",".join(str(capacity) for capacity in DEFAULT_CAPACITIES)
        + ")",
        metavar="N[,N...]",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = analyse_reuse(read_trace(args.trace), args.capacities)
    result: dict[str, Any] = {"trace": str(args.trace), **report.to_dict()}
    rows: list[tuple[str, Any]] = [
        ("requests", report.requests),
        ("total prompt tokens", report.total_tokens),
        ("infinite cache hit rate", report.infinite_hit_rate),
    ]
    rows += [
        (f"LRU {entry.capacity_blocks} blocks hit rate", entry.hit_rate) for entry in report.lru
    ]
    rows += [
        ("block accesses", report.block_accesses),
        ("distinct blocks", report.distinct_blocks),
        ("reuses", report.reuses),
        ("reused access share", report.reused_access_share),
    ]
    for unit, percentiles in (
        ("blocks", report.reuse_distance_blocks),
        ("s", report.reuse_distance_s),
    ):
        for name in ("p50", "p90", "p99"):
            rows.append((f"reuse distance {name} ({unit})", getattr(percentiles, name)))
    rows.append(("top 1% blocks' share of reuses", report.top1pct_reuse_share))
    emit(
        result,
        as_json=args.json,
        title=f"Prefix reuse of {Path(args.trace).name}",
        columns=("metric", "value"),
        rows=rows,
    )
    return 0


def _capacities(text: str) -> tuple[int, ...]:
    """Parse ``"10000,100000"``; argparse turns the ValueError into a usage error."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from exc
    if not values or any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected non-negative capacities, got {text!r}")
    return values
