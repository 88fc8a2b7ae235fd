"""``kvstrata up --remote embedded``: one valkey-server for the fleet, shared by its workers.

A real ``up`` process (tiny model, 2 workers) starts its own valkey-server and says where it
is. Worker A answers a prompt (its blocks are written through to the remote tier); worker B,
asked directly, has never seen the prompt — no device or host hit of its own is possible —
yet reports cached tokens, all of them from the remote tier, and the same greedy answer. On
SIGTERM ``up`` stops the workers and the server before it ends. The server asks for a
password only ``up`` and its workers know.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from http_helpers import wait_until
from kvstrata.runtime.processes import free_port

pytestmark = pytest.mark.timeout(240)

PROMPT = "The keeper of the lighthouse on Gull Rock wrote down every ship she saw pass by " * 3


def _complete(client: httpx.Client, base: str) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    response = client.post(f"{base}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def _metric(client: httpx.Client, base: str, name: str, labels: str) -> float:
    for line in client.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_up_remote_embedded_shares_one_remote_tier_between_workers(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "up.out"
    command = [
        sys.executable, "-m", "kvstrata.cli.main", "up",
        "--model", "tiny", "--workers", "2", "--port", str(port),
        "--remote", "embedded", "--remote-gib", "0.25",
        "--pool-gib", "0.01", "--host-gib", "0",
        "--log-dir", str(tmp_path / "logs"), "--log-level", "warning",
    ]  # fmt: skip
    with out.open("wb") as log:
        up = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    client = httpx.Client(timeout=60.0)
    front = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            workers = client.get(f"{front}/fleet/workers").json()["workers"]
            return sum(w["healthy"] for w in workers) == 2

        wait_until(lambda: up.poll() is None and healthy(), 180, "up's front door and 2 workers")
        said = re.search(r"remote tier: (redis://127\.0\.0\.1:(\d+)/0) \(embedded", out.read_text())
        assert said is not None, out.read_text()
        server = redis.Redis(port=int(said.group(2)), socket_timeout=2)
        # it holds every tenant's KV and token ids: a local process without the password
        # (minted into up's 0700 run directory) is refused
        with pytest.raises(redis.AuthenticationError):
            server.ping()
        first, second = sorted(
            client.get(f"{front}/fleet/workers").json()["workers"], key=lambda w: w["worker_id"]
        )
        block = client.get(f"{second['url']}/kv/info").json()["block_size"]

        fresh = _complete(client, first["url"])
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        reused = _complete(client, second["url"])
        cached = reused["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompt_tokens = reused["usage"]["prompt_tokens"]
        assert prompt_tokens >= 3 * block
        assert cached == (prompt_tokens - 1) // block * block  # every full block but the last
        assert reused["choices"][0]["text"] == fresh["choices"][0]["text"]
        # B never saw the prompt: all of its hit is the remote tier's.
        base = second["url"]
        assert _metric(client, base, "kvstrata_matched_tokens_total", 'tier="remote"') == cached
        assert _metric(client, base, "kvstrata_matched_tokens_total", 'tier="device"') == 0
        assert _metric(client, base, "kvstrata_tier_hits_total", 'tier="remote"') == cached // block
    finally:
        client.close()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
    assert code == -signal.SIGTERM, out.read_text()[-3000:]
    # Everything up started is gone: the workers' ports and the server refuse connections.
    for worker in (first, second):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{worker['url']}/health", timeout=2)
    with pytest.raises(redis.ConnectionError):
        server.ping()
