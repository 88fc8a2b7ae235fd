"""``kvstrata bench index``: event apply rate and long-request lookup time of the global index."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.bench.index import IndexBenchConfig, run_index_bench
from kvstrata.cli.output import emit


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "index", help="global index: BlockStored apply rate, lookup latency vs plain-dict peers"
    )
    defaults = IndexBenchConfig()
    parser.add_argument(
        "--blocks", type=int, default=defaults.blocks, help="fill until this many distinct blocks"
    )
    parser.add_argument("--workers", type=int, default=defaults.workers, help="worker count")
    parser.add_argument(
        "--request-tokens",
        type=int,
        default=defaults.request_tokens,
        help="tokens of the looked-up request",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help="lookups per round (p50/p99 over them)",
    )
    parser.add_argument(
        "--rounds", type=int, default=defaults.rounds, help="rounds (figures: medians over them)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    parser.add_argument(
        "--live-batches",
        type=int,
        default=defaults.live_batches,
        help="event batches applied between lookups in the live rounds (0: no live rounds)",
    )
    parser.add_argument("--no-naive", action="store_true", help="skip the per-worker-dict peer")
    parser.add_argument(
        "--no-peer-set", action="store_true", help="skip the hash → worker-set peer"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    result = run_index_bench(
        IndexBenchConfig(
            blocks=args.blocks,
            workers=args.workers,
            request_tokens=args.request_tokens,
            repeats=args.repeats,
            rounds=args.rounds,
            seed=args.seed,
            live_batches=args.live_batches,
            naive=not args.no_naive,
            peer_set=not args.no_peer_set,
        )
    ).to_dict()
    peer = result.get
    rows = [
        (
            "apply BlockStored (blocks/s)",
            result["events_blocks_per_s"],
            peer("peer_set_events_blocks_per_s"),
            peer("naive_events_blocks_per_s"),
        ),
        (
            "lookup p50 (ms)",
            result["lookup_p50_ms"],
            peer("peer_set_lookup_p50_ms"),
            peer("naive_lookup_p50_ms"),
        ),
        (
            "lookup p99 (ms)",
            result["lookup_p99_ms"],
            peer("peer_set_lookup_p99_ms"),
            peer("naive_lookup_p99_ms"),
        ),
        (
            "hash + lookup p99 (ms)",
            result["lookup_with_hash_p99_ms"],
            peer("peer_set_lookup_with_hash_p99_ms"),
            None,
        ),
        (
            f"hash + lookup p99 (ms), live: {peer('live_batches') or 0:.0f} event batches "
            f"before each (backlog median {peer('live_backlog_median') or 0:.0f} hashes)",
            peer("live_lookup_with_hash_p99_ms"),
            peer("peer_set_live_lookup_with_hash_p99_ms"),
            None,
        ),
        ("hash request, router hash (ms; both peers use it too)", result["hash_ms"], None, None),
        (
            "hash request, BLAKE3 storage keys (ms; not a peer's)",
            result["blake3_hash_ms"],
            None,
            None,
        ),
        ("index blocks (placements)", result["index_blocks"], None, None),
        ("index distinct blocks", result["index_entries"], None, None),
        ("bytes per block (RSS)", result["bytes_per_block"], None, None),
    ]
    ratio = peer("lookup_with_hash_vs_peer_set_p99")
    emit(
        result,
        as_json=args.json,
        title=(
            f"kvstrata bench index: {result['workers']} workers, "
            f"{result['request_tokens']}-token request; peers: hash → worker-set dict walked "
            "once (set), one dict per worker walked per worker (per-worker); "
            f"answers agree: {result['peer_agrees']}"
            + (
                ""
                if ratio is None
                else f"; hash + lookup p99 kvstrata / set = {ratio:.2f} (rounds "
                f"{peer('lookup_with_hash_vs_peer_set_p99_min'):.2f}–"
                f"{peer('lookup_with_hash_vs_peer_set_p99_max'):.2f}; medians of "
                f"{result['rounds']} rounds × {result['repeats']} lookups)"
            )
        ),
        columns=("figure", "kvstrata", "set peer", "per-worker peer"),
        rows=[
            (name, "-" if ours is None else ours, *("-" if v is None else v for v in peers))
            for name, ours, *peers in rows
        ],
    )
    return 0
