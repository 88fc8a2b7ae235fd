"""``kvstrata bench hash``: throughput of storage keys, router hashes and vLLM's block hash."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.bench.hashing import run_hash_bench
from kvstrata.cli.output import emit


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "hash", help="hashing throughput: BLAKE3 keys, router hashes, vLLM sha256 baseline"
    )
    parser.add_argument("--tokens", type=int, default=131_072, help="tokens per request")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="rounds (one run of each scheme per round); medians are reported",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    result = run_hash_bench(tokens=args.tokens, block_size=args.block_size, repeat=args.repeat)
    runs = result.runs_tokens_per_s
    rows = [
        (
            "storage keys (BLAKE3 chain)",
            result.key_tokens_per_s,
            min(runs["keys"]),
            max(runs["keys"]),
        ),
        (
            "router hashes (numpy)",
            result.router_tokens_per_s,
            min(runs["router"]),
            max(runs["router"]),
        ),
        (
            "vLLM sha256/pickle baseline",
            result.baseline_tokens_per_s,
            min(runs["baseline"]),
            max(runs["baseline"]),
        ),
    ]
    emit(
        result.to_dict(),
        as_json=args.json,
        title=(
            f"hash throughput: {result.tokens} tokens, block size {result.block_size}, "
            f"{result.repeat} interleaved rounds; router/baseline = {result.ratio:.2f}x "
            f"(median; {result.ratio_min:.2f}–{result.ratio_max:.2f})"
        ),
        columns=("scheme", "tokens/s (median)", "min", "max"),
        rows=rows,
    )
    return 0
