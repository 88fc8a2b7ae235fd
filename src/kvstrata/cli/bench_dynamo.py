"""``kvstrata bench dynamo-replay``: ``kvstrata sim`` against Dynamo's own trace replay.

A thin edge over :mod:`kvstrata.sim.dynamo_compare`: reads the trace (optionally its first N
requests, written to a temporary file for Dynamo), quiets Dynamo's per-request Rust logging
(``DYN_LOG=warn`` unless already set), runs both simulators and prints a table or, with
``--json``, one object. Exits 2 with the reason when the optional Dynamo packages are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstrata.cli.output import emit
from kvstrata.errors import InvalidInput
from kvstrata.sim.cluster import SimConfig
from kvstrata.sim.dynamo_compare import OURS, PAIRS, compare, dynamo_unavailable
from kvstrata.sim.profiles import PROFILES, profile
from kvstrata.workloads.mooncake import TraceRequest, read_trace

DEFAULT_TRACE = Path("..") / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "dynamo-replay",
        help="kvstrata sim's dynamo/round-robin baselines vs Dynamo's own trace replay",
        description=(
            "Runs NVIDIA Dynamo's offline trace replay (its KV router and round robin over "
            "its simulated vLLM engines; needs the optional ai-dynamo packages) and kvstrata "
            "sim with the dynamo-mocker profile on the same trace and load, and reports TTFT "
            "p50/p99 and prefix reuse of each with the ratios ours / Dynamo's."
        ),
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL")
    parser.add_argument("--limit", type=int, help="keep only the first N requests")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="arrival speed-up (Dynamo's ratio)"
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="dynamo-mocker")
    parser.add_argument("--repeats", type=int, default=3, help="Dynamo runs per router mode")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DYN_LOG", "warn")  # before the Rust runtime is first loaded
    reason = dynamo_unavailable()
    if reason is not None:
        print(f"bench dynamo-replay: {reason}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        raise InvalidInput(f"--repeats must be >= 1, got {args.repeats}")
    trace_path = Path(args.trace)
    trace = read_trace(trace_path)
    # Dynamo's mocker is deterministic: so are our engines here (no service noise). The
    # router still sees only a live router's view (its own fit and queue estimates).
    config = SimConfig(
        profile=profile(args.profile), workers=args.workers, seed=args.seed, service_noise=0.0
    )
    with tempfile.TemporaryDirectory(prefix="kvstrata-dynamo-") as tmp:
        if args.limit is not None:
            trace, trace_path = _slice(trace_path, args.limit, Path(tmp))
        report = compare(
            trace_path,
            trace,
            config,
            speedup=args.speedup,
            repeats=args.repeats,
            jobs=args.jobs,
            on_step=lambda step: print(step, file=sys.stderr, flush=True),
        )
    report["trace"] = str(args.trace) + (f" (first {args.limit})" if args.limit else "")
    rows: list[tuple[Any, ...]] = []
    for mode, figures in report["dynamo"].items():
        rows.append((f"dynamo {mode}", *_cells(figures), ""))
    for name in OURS:
        if name in report["kvstrata_sim"]:
            pair = report["pairs"].get(name)
            verdict = "" if pair is None else f"vs {PAIRS[name]}: goal {pair['goal_met']}"
            rows.append((f"kvstrata sim {name}", *_cells(report["kvstrata_sim"][name]), verdict))
    emit(
        report,
        as_json=args.json,
        title=(
            f"{report['trace']}: {report['requests']} requests, {args.workers} workers, "
            f"speed-up ×{args.speedup}; goal (reuse ±5%, TTFT p50/p99 ±25%) met "
            f"{report['goal_met']}"
        ),
        columns=("system / policy", "TTFT p50 s", "TTFT p99 s", "reuse", "check"),
        rows=rows,
    )
    return 0


def _cells(figures: dict[str, Any]) -> tuple[Any, Any, Any]:
    return figures["ttft_p50_s"], figures["ttft_p99_s"], figures["reuse_ratio"]


def _slice(path: Path, limit: int, tmp: Path) -> tuple[list[TraceRequest], Path]:
    """The first ``limit`` requests by timestamp, and a file holding them for Dynamo."""
    if limit < 1:
        raise InvalidInput(f"--limit must be >= 1, got {limit}")
    with path.open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rows = sorted(rows, key=lambda row: row["timestamp"])[:limit]
    sliced = tmp / path.name
    sliced.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return read_trace(sliced), sliced
