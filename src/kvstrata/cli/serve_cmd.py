"""``kvstrata serve``: the reference engine behind an OpenAI-compatible HTTP API.

Settings are one ``WorkerConfig`` (``--config FILE``, flags override it). The device pool is
sized in GiB and converted to blocks from the model's KV bytes per block, so the same setting
means the same memory for every model. With ``--events-endpoint`` the
worker publishes its KV events (every tier) over ZMQ and serves ``/kv/info`` and ``/kv/dump``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from kvstrata.cli import security_args
from kvstrata.engine.model_loader import MODEL_NAMES, LoadedModel
from kvstrata.errors import InvalidInput
from kvstrata.runtime.config import WorkerConfig, load_worker_config
from kvstrata.runtime.config_overrides import OVERRIDES
from kvstrata.runtime.config_schema import EVICTION_POLICIES, GIB
from kvstrata.security import AuditLog, SecurityConfig
from kvstrata.store.config import WritePolicy


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="serve the reference engine over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible /v1/completions and /v1/chat/completions with exact "
        "prefix reuse, plus Prometheus /metrics. Settings come from --config (TOML, see "
        "docs/configuration.md); every other flag overrides the file.",
    )
    parser.add_argument("--config", type=Path, default=None, help="worker configuration (TOML)")
    parser.add_argument(
        "--model",
        default=None,
        help=f"{' | '.join(MODEL_NAMES)} | PATH to a local HF model directory (default: smollm2)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    parser.add_argument("--pool-gib", type=float, default=None, help="device KV pool size in GiB")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as 'model' (default: the model value)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    batching = parser.add_argument_group("continuous batching")
    batching.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    batching.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens computed per step"
    )
    batching.add_argument(
        "--max-waiting", type=int, default=None, help="queued requests before 429 (default 64)"
    )
    limits = parser.add_argument_group("limits (what one request may ask for and send)")
    limits.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="most output tokens a request may ask for; also the default (limits.max_tokens)",
    )
    limits.add_argument(
        "--max-body-mib", type=float, default=None, help="largest request body (413 above it)"
    )
    limits.add_argument(
        "--body-timeout-s",
        type=float,
        default=None,
        help="seconds a request body may take to arrive (408 after it)",
    )
    tiers = parser.add_argument_group("tiers (the tiered store below the device pool)")
    tiers.add_argument("--host-gib", type=float, default=None, help="host DRAM tier (0: none)")
    tiers.add_argument(
        "--host-write-policy",
        choices=[p.value for p in WritePolicy],
        default=None,
        help="device → host: copy at commit (write-through) or only on eviction",
    )
    tiers.add_argument("--disk-dir", type=Path, default=None, help="local disk tier directory")
    tiers.add_argument("--disk-gib", type=float, default=None, help="disk tier size (0: none)")
    tiers.add_argument("--disk-write-policy", choices=[p.value for p in WritePolicy], default=None)
    tiers.add_argument(
        "--remote-url",
        default=None,
        help="remote tier on Redis/Valkey, redis://host:port/db (shared by every worker that "
        "names the same server and namespace)",
    )
    tiers.add_argument(
        "--remote-gib", type=float, default=None, help="remote tier capacity (0: none)"
    )
    tiers.add_argument(
        "--remote-password-file",
        type=Path,
        default=None,
        help="the remote server's password (a file: not on the command line)",
    )
    tiers.add_argument("--tier-ttl-s", type=float, default=None, help="object TTL in every tier")
    tiers.add_argument("--eviction-policy", choices=list(EVICTION_POLICIES), default=None)
    tiers.add_argument(
        "--tier-tenants", default=None, help="comma list: only these tenants use the tiers"
    )
    tiers.add_argument(
        "--tier-canary", type=float, default=None, help="share of requests that use the tiers"
    )
    tiers.add_argument(
        "--min-reusable-tokens",
        type=int,
        default=None,
        help="break-even: below this many reusable tokens from a tier, recompute",
    )
    tiers.add_argument("--admin-token", default=None, help="require this bearer token on /admin")
    tiers.add_argument(
        "--tenant-secret-file",
        type=Path,
        default=None,
        help="file whose bytes salt every tenant's namespace (router and workers must agree)",
    )
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
    _curve_arguments(events)
    events.add_argument(
        "--debug-endpoints",
        action="store_true",
        default=None,
        help="serve POST /kv/debug/drop-events (event gap injection, for recovery tests)",
    )
    disagg = parser.add_argument_group("disaggregated prefill (docs/disaggregation.md)")
    disagg.add_argument(
        "--transfer-port",
        type=int,
        default=None,
        help="receive KV transfers (decode role) on this TCP port (0: any free port; "
        "advertised in /kv/info); off by default",
    )
    disagg.add_argument(
        "--transfer-host", default=None, help="transfer listener address (127.0.0.1)"
    )
    disagg.add_argument(
        "--transfer-transport",
        default=None,
        choices=("tcp", "nixl"),
        help="what the transfer listener speaks (tcp; nixl needs the optional extra)",
    )
    disagg.add_argument(
        "--allowed-transfer-targets",
        default=None,
        metavar="LIST",
        help="where POST /kv/prefill may stream KV, comma-separated (IPs, CIDRs, host names, "
        "each optionally :PORT; default loopback only; `*`: any)",
    )
    disagg.add_argument(
        "--transfer-layer-delay-s",
        type=float,
        default=0.0,
        help=argparse.SUPPRESS,  # tests only: a pause before each layer a prefill sends
    )
    security_args.add_serve_arguments(parser)
    parser.set_defaults(func=run)


def _curve_arguments(group: Any) -> None:
    """CURVE on the event and replay sockets (``events.curve_*``; ``up`` generates both)."""
    group.add_argument(
        "--curve-secret-file",
        type=Path,
        default=None,
        help="this worker's CURVE certificate (zmq.auth secret file): encrypts the event and "
        "replay sockets; required for endpoints beyond loopback",
    )
    group.add_argument(
        "--curve-clients-dir",
        type=Path,
        default=None,
        help="directory of the public certificates of the subscribers (routers) allowed in",
    )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The worker configuration: ``--config`` (or the defaults) with the flags on top."""
    overrides = {name: getattr(args, name) for name in OVERRIDES if hasattr(args, name)}
    config = load_worker_config(args.config, overrides)
    if config.events is not None and config.events.worker_id is None:
        worker_id = f"{socket.gethostname()}:{args.port}"
        config = config.with_events(dataclasses.replace(config.events, worker_id=worker_id))
    return config


def pool_blocks_for(loaded: LoadedModel, block_size: int, pool_bytes: int) -> int:
    """How many KV blocks of this model fit in ``pool_bytes`` (fp32 KV, as the engine keeps)."""
    from kvstrata.engine.engine import pool_config_for

    per_block = pool_config_for(loaded, block_size, 1).bytes_per_block
    blocks = pool_bytes // per_block
    if blocks < 1:
        raise InvalidInput(f"a pool of {pool_bytes} B holds no block of {per_block} bytes")
    return blocks


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise InvalidInput("--port must lie in 1..65535")
    config = worker_config(args)

    from kvstrata.engine.engine import EngineConfig
    from kvstrata.engine.factory import build_engine
    from kvstrata.engine.model_loader import load_model
    from kvstrata.engine.threads import hand_kernels_to_step_thread
    from kvstrata.runtime.events import KVEventEmitter
    from kvstrata.serve.app import create_app
    from kvstrata.telemetry import KvMetrics

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    hand_kernels_to_step_thread()  # before the first torch kernel: one OpenMP team per process
    loaded = load_model(config.model)
    blocks = pool_blocks_for(loaded, config.block_size, config.pool_bytes)
    metrics = KvMetrics()
    emitter = None
    terminated = False
    tls = config.security.tls
    audit = AuditLog(config.security.audit_path, component="worker").start()
    if config.events is not None:
        emitter = KVEventEmitter.from_config(config.events, block_size=config.block_size).start()
    try:
        engine_config = EngineConfig(
            block_size=config.block_size,
            pool_blocks=blocks,
            tenant_secret=config.tenant_secret,
            scheduler=config.scheduler,
            read_layouts=config.read_layouts,
        )
        engine = build_engine(
            loaded, engine_config, config, metrics=metrics, events=emitter, audit=audit
        )
        try:
            name = config.served_model_name or config.model
            _banner(name, args.host, args.port, engine.device, blocks, config.block_size, tls)
            disagg = _disaggregation(engine, args, config, metrics, audit)
            app = create_app(
                engine,
                model_name=name,
                metrics=metrics,
                auth=security_args.worker_auth(
                    config.security, args.admin_token or config.admin_token, audit
                ),
                debug_endpoints=config.debug_endpoints,
                limits=config.limits,
                disagg=disagg,
            )
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
            terminated = _serve(app, args.host, args.port, args.log_level, config.security)
        finally:
            engine.close()  # demote the device pool, flush write-back queues to disk
    finally:
        if emitter is not None:
            emitter.close()
        audit.close()
    if terminated:  # end as a SIGTERM ends a process, now that everything is persisted
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 0


def _disaggregation(
    engine: Any, args: argparse.Namespace, config: WorkerConfig, metrics: Any, audit: AuditLog
) -> Any:
    """Both roles of ``serve.disagg``: ``/kv/prefill`` always (to the allowed targets), the
    receiver with a port (``[transfer]``, the flags override it)."""
    from kvstrata.serve.disagg import DisaggMetrics, Disaggregation
    from kvstrata.serve.transfer_receiver import DecodeTransfers
    from kvstrata.telemetry.transfer_metrics import TransferMetrics

    transfer, secret = config.transfer, config.tenant_secret
    receiver = None
    if transfer.port is not None:
        receiver = DecodeTransfers(
            engine,
            host=transfer.host,
            port=transfer.port,
            transport=transfer.transport,
            metrics=TransferMetrics(metrics.registry),
            audit=audit,
            tenant_secret=secret,
        )
    return Disaggregation(
        engine,
        DisaggMetrics(metrics.registry),
        receiver=receiver,
        targets=transfer,
        tenant_secret=secret,
        layer_delay_s=max(0.0, float(args.transfer_layer_delay_s)),
        audit=audit,
    )


class _Terminated(Exception):
    """SIGTERM, raised from our handler once uvicorn has finished its graceful shutdown."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise _Terminated


def _serve(app: Any, host: str, port: int, log_level: str, security: SecurityConfig) -> bool:
    """Run uvicorn until it stops; True when SIGTERM stopped it.

    On SIGTERM uvicorn shuts down gracefully, restores the handler it found and raises the
    signal again. Under the default handler that kills the process on the spot, before the
    caller's ``engine.close()`` persists the device pool and the write-back queues; so the
    handler it finds is this one, which turns the second SIGTERM into an exception.
    """
    import uvicorn

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        certfile, keyfile = security_args.tls_files(security)
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )
    except _Terminated:
        return True
    finally:
        signal.signal(signal.SIGTERM, previous)
    return False


def _banner(
    name: str, host: str, port: int, device: str, blocks: int, block_size: int, tls: bool
) -> None:
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"{'https' if tls else 'http'}://{shown_host}:{port}"
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    lines = [
        f"kvstrata serve: model {name!r} on {device}, pool {blocks} blocks x {block_size} tokens",
        f"  OpenAI base URL: {base}/v1   metrics: {base}/metrics   health: {base}/health",
        "  try:",
        f"    curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"      -d '{body}'",
        "  tenant namespaces: the API key's tenant; 'X-Kvstrata-Tenant: NAME' narrows it "
        "(single-tenant: names it)",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
