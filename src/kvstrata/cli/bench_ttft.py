"""``kvstrata bench ttft``: fresh prefill vs a cached hit, same prompt, same run."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.cli.output import emit

if TYPE_CHECKING:
    from kvstrata.bench.ttft import TtftResult
    from kvstrata.engine.model_loader import LoadedModel


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "ttft", help="time to first token, hit vs fresh"
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model directory")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each kind")
    parser.add_argument(
        "--tier",
        choices=("device", "host", "disk", "remote"),
        default="device",
        help="tier of the hit (remote: the only tier below the device pool)",
    )
    parser.add_argument("--cold", action="store_true", help="disk: drop the page cache first")
    parser.add_argument("--disk-dir", type=Path, default=None, help="disk tier directory")
    parser.add_argument(
        "--remote-url",
        default=None,
        help="remote: Redis/Valkey server (default: start a local valkey-server)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.bench.remote_servers import remote_target
    from kvstrata.engine.model_loader import load_model

    loaded = load_model(args.model)
    with contextlib.ExitStack() as stack:
        remote_url = None
        if args.tier == "remote":
            remote_url = stack.enter_context(remote_target(args.remote_url))
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstrata-ttft-")))
        result = _measure(args, loaded, scratch, remote_url)
    data = result.to_dict()
    emit(
        data,
        as_json=args.json,
        title=f"kvstrata bench ttft ({args.model}, {result.prompt_tokens} tokens, {args.tier})",
        columns=("field", "value"),
        rows=list(data.items()),
    )
    return 0


def _measure(
    args: argparse.Namespace, loaded: LoadedModel, scratch: Path, remote_url: str | None
) -> TtftResult:
    from kvstrata.bench.remote_servers import bench_namespace, delete_namespace, remote_tier_spec
    from kvstrata.bench.ttft import run_ttft
    from kvstrata.engine.engine import EngineConfig, pool_config_for
    from kvstrata.engine.factory import build_engine
    from kvstrata.runtime.config import WorkerConfig, disk_tier, host_tier
    from kvstrata.store.config import TierConfig, WritePolicy

    blocks_needed = 2 * (args.tokens + 64) // args.block_size + 8
    block_bytes = pool_config_for(loaded, args.block_size, 1).bytes_per_block
    capacity = blocks_needed * block_bytes
    namespace = bench_namespace("ttft")
    tiers = None
    if args.tier == "remote":  # the only tier below the pool, written through
        assert remote_url is not None
        tiers = WorkerConfig(tiers=(remote_tier_spec(remote_url, namespace, capacity),))
    elif args.tier != "device":
        specs = [host_tier(capacity)]
        if args.tier == "disk":  # host → disk written back in the background
            write_back = TierConfig("disk", WritePolicy.WRITE_BACK)
            specs.append(disk_tier(args.disk_dir or scratch, capacity, write_back))
        tiers = WorkerConfig(tiers=tuple(specs))
    engine = build_engine(
        loaded, EngineConfig(block_size=args.block_size, pool_blocks=blocks_needed), tiers
    )
    try:
        return run_ttft(
            engine,
            model=args.model,
            n_tokens=args.tokens,
            repeats=args.repeat,
            tier=args.tier,
            cold=args.cold,
        )
    finally:
        engine.close()
        if remote_url is not None:
            delete_namespace(remote_url, namespace)
