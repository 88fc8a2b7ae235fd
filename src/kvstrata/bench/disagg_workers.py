"""The two ``kvstrata serve`` processes of ``bench disagg``: a decode and a prefill worker.

Both start at once (own process groups, output to a log each), share a tenant secret (their
block keys must agree) and are always killed on the way out. The decode worker opens its
transfer port (``--transfer-port 0``) and a host tier to receive into; its ``/kv/info``
``transfer`` entry gives the address and the layout the bench prices transfers with. Both
publish KV events (as under ``kvstrata up``), so both answer ``/kv/info``, whose ``compute``
entries say whether they share cores (on one machine they do, unless pinned apart).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstrata.bench.servers import free_port, http, kill_group, server_env, tail
from kvstrata.errors import InvalidInput
from kvstrata.router.placement import ComputePlace, shares_compute
from kvstrata.transfer.layout import KVLayout

READY_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class WorkerPair:
    decode: str  # base URLs
    prefill: str
    transfer_host: str
    transfer_port: int
    layout: KVLayout
    transfer_transport: str = "tcp"
    shared_compute: bool = False  # the two /kv/info ``compute`` entries overlap


def _command(model: str, port: int, secret: Path, pool_gib: float, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", model]
    command += ["--port", str(port), "--pool-gib", str(pool_gib), "--host-gib", str(pool_gib)]
    return [*command, "--tenant-secret-file", str(secret), "--log-level", "warning", *extra]


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise InvalidInput(f"{name} worker exited ({proc.returncode}):\n{tail(log)}")
        if time.monotonic() > deadline:
            raise InvalidInput(f"{name} worker not ready:\n{tail(log)}")
        try:
            http(f"{url}/health", timeout=2)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)


@contextlib.contextmanager
def worker_pair(
    model: str, scratch: Path, *, pool_gib: float = 0.5, transport: str = "tcp"
) -> Iterator[WorkerPair]:
    """Start both workers, wait until both answer, yield their addresses, kill both.
    ``transport``: what the decode worker's transfer listener speaks (``tcp``, ``nixl``)."""
    secret = scratch / "tenant-secret"
    secret.write_bytes(b"kvstrata-bench-disagg")
    env = server_env(scratch)
    env["PYTHONPATH"] = ":".join(p for p in sys.path if p)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls: list[str] = []
        events = ("--events-endpoint", "tcp://127.0.0.1:*")
        decode_flags = (*events, "--transfer-port", "0", "--transfer-transport", transport)
        if transport == "nixl":
            env.setdefault("UCX_NET_DEVICES", "lo")  # one machine: loopback only
        for name, extra in (("decode", decode_flags), ("prefill", events)):
            port = free_port()
            log = scratch / f"{name}.log"
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        _command(model, port, secret, pool_gib, *extra),
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url, name in zip(procs, urls, ("decode", "prefill"), strict=True):
            _wait_healthy(proc, url, scratch / f"{name}.log", name)
        decode_info = json.loads(http(f"{urls[0]}/kv/info", timeout=10))
        prefill_info = json.loads(http(f"{urls[1]}/kv/info", timeout=10))
        info = decode_info["transfer"]
        places = [ComputePlace.from_json(i["compute"]) for i in (decode_info, prefill_info)]
        yield WorkerPair(
            decode=urls[0],
            prefill=urls[1],
            transfer_host=str(info["host"]),
            transfer_port=int(info["port"]),
            layout=KVLayout(**info["layout"]),
            transfer_transport=str(info.get("transport", "tcp")),
            shared_compute=shares_compute(*places),
        )
    finally:
        for proc in procs:
            kill_group(proc)
