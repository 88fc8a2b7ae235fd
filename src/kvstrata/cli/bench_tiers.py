"""``kvstrata bench tiers``: host slab, disk and remote tier throughput against memcpy, raw
reads and plain redis-py ``GET``/``SET``."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.cli.output import emit
from kvstrata.errors import InvalidInput


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "tiers",
        help="tier throughput: host get/put vs memcpy, disk read vs preadv into a preallocated "
        "buffer (warm and cold cache), "
        "remote get/put vs plain redis GET/SET",
    )
    parser.add_argument(
        "--sizes", default="1,2,4", help="object sizes in MiB, comma separated (fractions allowed)"
    )
    parser.add_argument("--objects", type=int, default=32, help="objects per size")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per measurement; best kept")
    parser.add_argument("--dir", default=None, help="parent directory for the disk tier's files")
    parser.add_argument(
        "--cold", action="store_true", help="drop the files' page cache before each read round"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for copies (0: default)"
    )
    parser.add_argument(
        "--remote-url",
        default=None,
        help="Redis/Valkey server of the remote section (default: start a local valkey-server)",
    )
    parser.add_argument("--no-remote", action="store_true", help="skip the remote section")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _parse_sizes(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise InvalidInput(f"--sizes must be comma-separated numbers of MiB, got {text!r}") from exc


def run(args: argparse.Namespace) -> int:
    from kvstrata.bench.tiers import run_tier_bench  # torch loads only when this bench runs

    result = run_tier_bench(
        _parse_sizes(args.sizes),
        objects=args.objects,
        repeat=args.repeat,
        directory=args.dir,
        cold=args.cold,
        threads=args.threads,
        remote=not args.no_remote,
        remote_url=args.remote_url,
    )
    rows = [
        (label, tier, metric, value)
        for label, entry in [
            ("all sizes", result),
            *((f"{s['size_mib']:g} MiB", s) for s in result["sizes"]),
        ]
        for tier in ("host", "disk", "remote")
        if tier in entry
        for metric, value in _flat(entry[tier])
        if ("_gbps" in metric or "ratio" in metric) and not isinstance(value, list)
    ]
    peers = "; ".join(f"{ratio} = {what}" for ratio, what in result["peers"].items())
    remote = result.get("remote")
    remote_title = (
        ""
        if remote is None
        else f", remote get/raw GET = {remote['ratio']:.2f}, put/raw SET = "
        f"{remote['put_ratio']:.2f}, read-ahead/sequential GET = "
        f"{remote['read_ahead']['read_ahead_ratio']:.2f}"
    )
    low, high = result["disk"]["ratio_spread"]
    emit(
        result,
        as_json=args.json,
        title=(
            f"kvstrata bench tiers ({result['objects']} objects per size, GB/s): "
            f"host get/memcpy = {result['host']['ratio']:.2f}, "
            f"disk read/readinto = {result['disk']['ratio']:.2f} (best rounds; median "
            f"{result['disk']['ratio_median']:.2f}, rounds {low:.2f}–{high:.2f}; cold: "
            f"{result['disk']['cold_ratio']:.2f}, vs os.read: "
            f"{result['disk']['ratio_vs_os_read']:.2f}); read verification costs "
            f"host {result['host']['verify_cost_ratio']:.2f}x, "
            f"disk {result['disk']['verify_cost_ratio']:.2f}x{remote_title}. Peers: {peers}"
        ),
        columns=("size", "tier", "metric", "value"),
        rows=rows,
    )
    return 0


def _flat(section: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, value in section.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{name}.")
        else:
            out.append((prefix + name, value))
    return out
