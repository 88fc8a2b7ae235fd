"""``kvstrata bench disagg``: local prefill vs remote prefill + KV transfer, two real workers."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from kvstrata.cli.output import emit


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(",") if part.strip())
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"need comma-separated integers >= 0: {text!r}")
    return values


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "disagg", help="disaggregated prefill: local vs remote + transfer, and choose()'s picks"
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model directory")
    parser.add_argument("--lengths", type=_ints, default=(256, 512, 1024, 2048))
    parser.add_argument("--loads", type=_ints, default=(0, 2, 4), help="decode streams running")
    parser.add_argument(
        "--queued",
        type=_ints,
        default=(2048,),
        help="queued points: one prefill of N tokens ahead on the decode worker (0: none)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each path")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens per decode stream")
    parser.add_argument("--pool-gib", type=float, default=0.5, help="each worker's pool and host")
    parser.add_argument(
        "--transport", choices=("tcp", "nixl"), default="tcp", help="the transfer's transport"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.bench.disagg import DisaggBenchConfig, run_disagg_bench
    from kvstrata.bench.disagg_workers import worker_pair
    from kvstrata.bench.servers import sigterm_unwinds

    if args.repeats < 1 or min(args.lengths) < 2:
        raise SystemExit("need --repeats >= 1 and --lengths >= 2")
    config = DisaggBenchConfig(
        model=args.model,
        lengths=args.lengths,
        loads=args.loads,
        queued=tuple(q for q in args.queued if q > 0),
        repeats=args.repeats,
        stream_tokens=args.stream_tokens,
    )
    with tempfile.TemporaryDirectory(prefix="kvstrata-disagg-") as scratch, sigterm_unwinds():
        result = run_disagg_bench(
            config,
            lambda: worker_pair(
                args.model, Path(scratch), pool_gib=args.pool_gib, transport=args.transport
            ),
        )
    rows = [
        (
            p["prompt_tokens"], p["load"], p["queued_tokens"], f"{p['ttft_local_s']:.4f}",
            f"{p['ttft_disagg_s']:.4f}",
            p["chosen"], p["best"], p["decode_hit_tokens"],
        )
        for p in result["points"]
    ]  # fmt: skip
    summary = (
        f"choice_accuracy {result['choice_accuracy']:.2f}  transfer {result['transfer_gbps']:.3f}"
        f" GB/s vs raw socket {result['raw_socket_gbps']:.3f} GB/s"
        f" ({result['transfer_vs_raw']:.2f})  prefill+send {result['prefill_send_gbps']:.3f}"
        f" GB/s  overlap {result['overlap']:.2f}"
    )
    emit(
        result,
        as_json=args.json,
        title=f"kvstrata bench disagg ({args.model}, {args.repeats} repeats) — {summary}",
        columns=(
            "tokens",
            "load",
            "queued",
            "ttft_local_s",
            "ttft_disagg_s",
            "chosen",
            "best",
            "hit",
        ),
        rows=rows,
    )
    return 0
