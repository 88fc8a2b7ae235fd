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

import kvstrata
from kvstrata.errors import InvalidInput


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
    src = str(Path(kvstrata.__file__).resolve().parent.parent)
    with contextlib.ExitStack() as cleanup:
        run_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvstrata-vllm-")))
        specs = [
            VllmServerSpec(
                worker_id=f"v{i}",
                model_dir=model_dir,
                python=Path(python),
                run_dir=(args.log_dir or run_dir) / f"v{i}",
                host_gib=args.host_gib if args.host_gib is not None else 0.25,
                kv_cache_blocks=args.vllm_kv_blocks,
                pythonpath=src,
                extra_args=_secret_args(args),
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
        settings = load_worker_config(args.config, _overrides(args))
        source = VllmSource([spec.worker() for spec in specs], tenant_secret=settings.tenant_secret)
        serve(args, [spec.url for spec in specs], None, source=source)
    return 0


def _secret_args(args: argparse.Namespace) -> list[str]:
    if args.tenant_secret_file is None:
        return []
    raise InvalidInput("--engine vllm: --tenant-secret-file is not passed to vLLM servers yet")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return (
        {} if args.tenant_secret_file is None else {"tenant_secret_file": args.tenant_secret_file}
    )
