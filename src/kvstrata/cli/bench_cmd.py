"""``kvstrata bench …``: one subcommand per benchmark."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.cli import (
    bench_all,
    bench_calibrate,
    bench_disagg,
    bench_dynamo,
    bench_eviction,
    bench_hash,
    bench_index,
    bench_prefill,
    bench_reuse,
    bench_serving,
    bench_tiers,
    bench_ttft,
    bench_vllm,
)


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("bench", help="run a benchmark")
    bench_sub = parser.add_subparsers(dest="bench", required=True)
    bench_reuse.register(bench_sub)
    bench_ttft.register(bench_sub)
    bench_hash.register(bench_sub)
    bench_eviction.register(bench_sub)
    bench_tiers.register(bench_sub)
    bench_index.register(bench_sub)
    bench_vllm.register(bench_sub)
    bench_serving.register(bench_sub)
    bench_calibrate.register(bench_sub)
    bench_prefill.register(bench_sub)
    bench_dynamo.register(bench_sub)
    bench_disagg.register(bench_sub)
    bench_all.register(bench_sub)
