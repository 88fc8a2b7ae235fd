"""A graceful stop keeps what the write policies promise: ``kvstrata serve`` processes, SIGTERM.

Each test runs the real CLI (tiny model) on a disk tier, sends requests, stops it with SIGTERM,
and starts it again on the same directory: the same prompts must then be served from the disk
tier. With a write-through tier every block is on disk at commit; with a write-back one the
blocks are still only in the device pool (or in a write-back queue) when the signal arrives,
and only a shutdown that demotes and drains them before the process ends keeps them (uvicorn
re-raises SIGTERM after its graceful shutdown, which used to kill the process before
``engine.close()``). A write-back queue between host and disk is drained the same way, which
``test_engine_tiers`` checks in-process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvstrata.runtime.processes import free_port

PROMPTS = [
    f"[shutdown {i}] A graceful stop must keep every block the write policy promised. " * 2
    for i in range(5)
]


def _disk_only_write_back(tmp_path: Path, disk: Path) -> list[str]:
    config = tmp_path / "worker.toml"
    config.write_text(
        f'[[tiers]]\nname = "disk"\npath = "{disk}"\ngib = 1\nwrite_policy = "write-back"\n'
    )
    return ["--config", str(config)]


def _flags_write_through(_tmp_path: Path, disk: Path) -> list[str]:
    return ["--host-gib", "0", "--disk-dir", str(disk), "--disk-gib", "1"]


SETUPS = {
    "flags-write-through": _flags_write_through,
    "file-disk-write-back": _disk_only_write_back,
}


@contextmanager
def _serve(args: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``kvstrata serve`` process on a free port, ready; killed if the test leaves it up."""
    port = free_port()
    command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", "tiny"]
    command += ["--port", str(port), "--pool-gib", "0.05", "--log-level", "warning", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"serve exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"serve did not start:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def _complete(url: str, prompt: str) -> tuple[int, int]:
    """(cached tokens in usage, X-Kvstrata-Matched-Tokens) of a greedy completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    cached = int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached, int(response.headers["x-kvstrata-matched-tokens"])


def _disk_matched_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('kvstrata_matched_tokens_total{tier="disk"} '):
            return float(line.split()[-1])
    return 0.0


def _terminate(process: subprocess.Popen[bytes], log: Path) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGTERM, log.read_text()


@pytest.mark.parametrize("setup", list(SETUPS))
def test_sigterm_persists_what_the_write_policy_promised(tmp_path: Path, setup: str) -> None:
    disk = tmp_path / "disk"
    args = SETUPS[setup](tmp_path, disk)
    log = tmp_path / "serve.log"
    with _serve(args, log) as (process, url):
        for prompt in PROMPTS:
            assert _complete(url, prompt) == (0, 0)
        assert _disk_matched_tokens(url) == 0
        _terminate(process, log)
    assert list(disk.glob("objects/*/*.kv")), "nothing was written to the disk tier"

    with _serve(args, log) as (process, url):
        for prompt in PROMPTS:
            cached, matched = _complete(url, prompt)
            assert cached > 0 and matched == cached, (cached, matched)
        assert _disk_matched_tokens(url) > 0  # every hit came from the restarted disk tier
        _terminate(process, log)
