"""``kvstrata up --engine vllm``: N vLLM OpenAI servers behind the kvstrata front door.

Each server runs in vLLM's venv (``--vllm-python``, default ``./.venv-vllm/bin/python``) with
vLLM's KV events and the kvstrata connector configured on free ports
(:mod:`kvstrata.fleet.vllm_servers`); this checkout's ``src`` goes on its ``PYTHONPATH`` so
the connector imports. The servers live exactly as long as ``up``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.errors import InvalidInput
from kvstrata.runtime.processes import source_root


def run_vllm_up(args: argparse.Namespace, serve: Callable[..., None]) -> int:
    """Start the servers, then ``serve`` (``up_cmd._serve_frontdoor``) until interrupted."""
    from kvstrata.engine.model_loader import MODEL_NAMES, ensure_checkpoint
    from kvstrata.fleet.vllm_servers import VllmServer, VllmServerSpec
    from kvstrata.fleet.vllm_workers import VllmSource
    from kvstrata.runtime.config import load_worker_config

    if args.workers < 1:
        raise InvalidInput("--workers must be at least 1")
    python = args.vllm_python or Path.cwd() / ".venv-vllm" / "bin" / "python"
    if not Path(python).is_file():
        raise InvalidInput(f"{python} is missing: run `make vllm-venv` or pass --vllm-python")
    model_dir = ensure_checkpoint(args.model) if args.model in MODEL_NAMES else Path(args.model)
    src = source_root()
    settings = load_worker_config(args.config, _overrides(args))
    with contextlib.ExitStack() as cleanup:
        run_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvstrata-vllm-")))
        secret_file = _secret_file(args.tenant_secret_file, settings.tenant_secret, run_dir)
        specs = [
            VllmServerSpec(
                worker_id=f"v{i}",
                model_dir=model_dir,
                python=Path(python),
                run_dir=(args.log_dir or run_dir) / f"v{i}",
                host_gib=args.host_gib if args.host_gib is not None else 0.25,
                kv_cache_blocks=args.vllm_kv_blocks,
                pythonpath=src,
                tenant_secret_file=secret_file,
            )
            for i in range(args.workers)
        ]
        servers = [VllmServer(spec) for spec in specs]
        for server in servers:
            cleanup.callback(server.stop)
            server.start()
        started = time.monotonic()
        for server in servers:
            server.wait_ready()
        print(
            f"{len(servers)} vLLM servers ready in {time.monotonic() - started:.1f} s", flush=True
        )
        source = VllmSource([spec.worker() for spec in specs], tenant_secret=settings.tenant_secret)
        serve(args, [spec.url for spec in specs], None, source=source)
    return 0


def _secret_file(given: Path | None, secret: bytes, run_dir: Path) -> Path | None:
    """The file the servers' connectors read the tenant secret from: the one given, or (a secret
    from ``--config``) a private copy in the run directory, removed with it."""
    if given is not None or not secret:
        return given
    copy = run_dir / "tenant-secret"
    copy.touch(mode=0o600)
    copy.write_bytes(secret)
    return copy


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return (
        {} if args.tenant_secret_file is None else {"tenant_secret_file": args.tenant_secret_file}
    )
