"""``kvstrata serve``: the reference engine behind an OpenAI-compatible HTTP API.

The device pool is sized in GiB and converted to blocks from the model's KV bytes per
block, so the same flag means the same memory for every model. With ``--events-endpoint`` the
worker publishes its KV events (every tier) over ZMQ and serves ``/kv/info`` and ``/kv/dump``.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from kvstrata.engine.factory import TierOptions
from kvstrata.engine.kv_events import KVEventsConfig
from kvstrata.engine.model_loader import MODEL_NAMES, LoadedModel
from kvstrata.errors import InvalidInput
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy

GIB = 1 << 30


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="serve the reference engine over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible /v1/completions and /v1/chat/completions with exact "
        "prefix reuse, plus Prometheus /metrics.",
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help=f"{' | '.join(MODEL_NAMES)} | PATH to a local HF model directory (default: smollm2)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--pool-gib", type=float, default=1.0, help="device KV pool size in GiB (default: 1.0)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as 'model' (default: the --model value)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    tiers = parser.add_argument_group("tiers (the tiered store below the device pool)")
    tiers.add_argument("--host-gib", type=float, default=0.0, help="host DRAM tier (0: none)")
    tiers.add_argument(
        "--host-write-policy",
        choices=[p.value for p in WritePolicy],
        default=WritePolicy.WRITE_THROUGH.value,
        help="device → host: copy at commit (write-through) or only on eviction",
    )
    tiers.add_argument("--disk-dir", type=Path, default=None, help="local disk tier directory")
    tiers.add_argument("--disk-gib", type=float, default=0.0, help="disk tier size (0: none)")
    tiers.add_argument(
        "--disk-write-policy",
        choices=[p.value for p in WritePolicy],
        default=WritePolicy.WRITE_BACK.value,
    )
    tiers.add_argument("--tier-ttl-s", type=float, default=None, help="object TTL in the tiers")
    tiers.add_argument("--eviction-policy", choices=["kvstrata", "lru"], default="kvstrata")
    tiers.add_argument(
        "--tier-tenants", default=None, help="comma list: only these tenants use the tiers"
    )
    tiers.add_argument(
        "--tier-canary", type=float, default=1.0, help="share of requests that use the tiers"
    )
    tiers.add_argument(
        "--min-reusable-tokens",
        type=int,
        default=0,
        help="break-even: below this many reusable tokens from a tier, recompute",
    )
    tiers.add_argument("--admin-token", default=None, help="require this bearer token on /admin")
    events = parser.add_argument_group("KV events (what this worker holds, for a fleet index)")
    events.add_argument(
        "--events-endpoint",
        default=None,
        help="ZMQ endpoint to publish KV events on, e.g. tcp://127.0.0.1:* (random port); "
        "unset: no events",
    )
    events.add_argument(
        "--replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint answering replay requests for missed batches",
    )
    events.add_argument(
        "--worker-id", default=None, help="this worker's id in events (default: HOSTNAME:PORT)"
    )
    events.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="serve POST /kv/debug/drop-events (event gap injection, for recovery tests)",
    )
    parser.set_defaults(func=run)


def tier_options(args: argparse.Namespace) -> TierOptions | None:
    """The tiers asked for on the command line, or None for the device pool alone."""
    if args.host_gib < 0 or args.disk_gib < 0:
        raise InvalidInput("--host-gib and --disk-gib must be >= 0")
    if (args.disk_gib > 0) != (args.disk_dir is not None):
        raise InvalidInput("give both --disk-dir and --disk-gib, or neither")
    if not 0.0 <= args.tier_canary <= 1.0:
        raise InvalidInput("--tier-canary must lie in [0, 1]")
    if args.host_gib == 0 and args.disk_gib == 0:
        return None
    tenants = frozenset(t for t in (args.tier_tenants or "").split(",") if t) or None
    rollout = RolloutConfig(
        tenants=tenants,
        canary_fraction=args.tier_canary,
        min_reusable_tokens=args.min_reusable_tokens,
    )
    ttl = args.tier_ttl_s
    return TierOptions(
        host_bytes=int(args.host_gib * GIB),
        host=TierConfig("host", WritePolicy(args.host_write_policy), ttl, rollout=rollout),
        disk_dir=args.disk_dir,
        disk_bytes=int(args.disk_gib * GIB),
        disk=TierConfig("disk", WritePolicy(args.disk_write_policy), ttl, rollout=rollout),
        policy=args.eviction_policy,
    )


def events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    """The KV event plane asked for on the command line, or None (no events)."""
    if args.events_endpoint is None:
        if args.replay_endpoint is not None or args.worker_id is not None:
            raise InvalidInput("--replay-endpoint and --worker-id need --events-endpoint")
        return None
    for flag, value in (
        ("--events-endpoint", args.events_endpoint),
        ("--replay-endpoint", args.replay_endpoint),
    ):
        if value is not None and "://" not in value:
            raise InvalidInput(
                f"{flag} must be a ZMQ endpoint like tcp://127.0.0.1:*, got {value!r}"
            )
    if args.worker_id is not None and not args.worker_id.strip():
        raise InvalidInput("--worker-id must not be empty")
    worker_id = args.worker_id or f"{socket.gethostname()}:{args.port}"
    return KVEventsConfig(args.events_endpoint, args.replay_endpoint, worker_id=worker_id)


def pool_blocks_for(loaded: LoadedModel, block_size: int, pool_gib: float) -> int:
    """How many KV blocks of this model fit in ``pool_gib`` GiB (fp32 KV, as the engine keeps)."""
    from kvstrata.engine.engine import pool_config_for

    per_block = pool_config_for(loaded, block_size, 1).bytes_per_block
    blocks = int(pool_gib * GIB) // per_block
    if blocks < 1:
        raise InvalidInput(f"--pool-gib {pool_gib} holds no block of {per_block} bytes")
    return blocks


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1:
        raise InvalidInput("--block-size must be at least 1")
    if not 0 < args.port < 65536:
        raise InvalidInput("--port must lie in 1..65535")
    if args.pool_gib <= 0:
        raise InvalidInput("--pool-gib must be positive")

    import uvicorn

    from kvstrata.engine.engine import EngineConfig
    from kvstrata.engine.factory import build_engine
    from kvstrata.engine.kv_events import KVEventEmitter
    from kvstrata.engine.model_loader import load_model
    from kvstrata.serve.app import create_app
    from kvstrata.telemetry import KvMetrics

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    tiers = tier_options(args)
    events_options = events_config(args)
    loaded = load_model(args.model)
    blocks = pool_blocks_for(loaded, args.block_size, args.pool_gib)
    metrics = KvMetrics()
    emitter = None
    if events_options is not None:
        emitter = KVEventEmitter.from_config(events_options, block_size=args.block_size).start()
    try:
        engine = build_engine(
            loaded,
            EngineConfig(block_size=args.block_size, pool_blocks=blocks),
            tiers,
            metrics=metrics,
            events=emitter,
        )
        try:
            name = args.served_model_name or args.model
            app = create_app(
                engine,
                model_name=name,
                metrics=metrics,
                admin_token=args.admin_token,
                debug_endpoints=args.debug_endpoints,
            )
            _banner(name, args.host, args.port, engine.device, blocks, args.block_size)
            if engine.bridge is not None:
                levels = ", ".join(
                    f"{lvl.name} {lvl.tier.capacity_bytes / GIB:.2f} GiB "
                    f"({lvl.config.write_policy.value})"
                    for lvl in engine.bridge.store.levels
                )
                print(
                    f'  tiers: {levels}; rollback: POST {{"enabled": false}} to /admin/tiers/NAME'
                )
            if emitter is not None:
                publisher = emitter.publisher
                print(
                    f"  KV events: worker {emitter.worker_id!r} epoch {emitter.epoch} on "
                    f"{publisher.endpoint} (replay {publisher.replay_endpoint}); /kv/info, /kv/dump"
                )
            sys.stdout.flush()
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        finally:
            engine.close()  # flush write-back queues to disk (and publish what that stored)
    finally:
        if emitter is not None:
            emitter.close()
    return 0


def _banner(name: str, host: str, port: int, device: str, blocks: int, block_size: int) -> None:
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown_host}:{port}"
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    lines = [
        f"kvstrata serve: model {name!r} on {device}, pool {blocks} blocks x {block_size} tokens",
        f"  OpenAI base URL: {base}/v1   metrics: {base}/metrics   health: {base}/health",
        "  try:",
        f"    curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"      -d '{body}'",
        "  tenant namespaces: header 'X-Kvstrata-Tenant: NAME' (or body field kvstrata_tenant)",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
