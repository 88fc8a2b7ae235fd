"""A disaggregated fleet behind the front door, real processes (``kvstrata up --prefill-workers
1 --decode-workers 1``, tiny model) beside a colocated one (``up --workers 1``).

Answers must equal the colocated cluster's (greedy decoding: wrong KV would show). A short
prompt stays local; a long prompt on a decode worker busy with running decodes goes to the
prefill worker and hits the transferred KV on the decode side; with the prefill worker
SIGKILLed requests are still answered, locally, and counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from http_helpers import wait_until
from kvstrata.runtime.processes import free_port
from security_helpers import ADMIN_KEY, bearer, write_keys_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin d0 and p0 apart"
    ),
]

LONG, SHORT = 2048, 24
WEIGHT = "50"  # a second of delay to a running decode weighs 50 s of TTFT: load decides


@dataclass
class Cluster:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def complete(self, tokens: list[int], **extra: Any) -> tuple[str, int]:
        body = {"prompt": tokens, "max_tokens": 6, "temperature": 0, **extra}
        response = httpx.post(
            f"{self.url}/v1/completions", json=body, timeout=120, headers=bearer(ADMIN_KEY)
        )
        assert response.status_code == 200, response.text
        payload = response.json()
        return payload["choices"][0]["text"], payload["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    def route(self, tokens: list[int]) -> dict[str, Any]:
        body = {"prompt": tokens, "max_tokens": 6}
        response = httpx.post(f"{self.url}/debug/route", json=body, headers=bearer(ADMIN_KEY))
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def decisions(self, path: str) -> float:
        total = 0.0
        metrics = httpx.get(f"{self.url}/metrics", timeout=10, headers=bearer(ADMIN_KEY))
        for line in metrics.text.splitlines():
            if line.startswith("kvstrata_disagg_decisions_total{") and f'path="{path}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


def _up(tmp: Path, name: str, *flags: str) -> Cluster:
    port = free_port()
    log = tmp / f"{name}.log"
    command = [sys.executable, "-m", "kvstrata.cli.main", "up", "--model", "tiny"]
    command += ["--port", str(port), "--pool-gib", "0.1", "--host-gib", "0.1"]
    command += ["--log-level", "warning", "--log-dir", str(tmp / name), *flags]
    command += ["--keys-file", str(tmp / "keys.toml")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Cluster(process, f"http://127.0.0.1:{port}", log)


def _ready(cluster: Cluster, workers: int) -> bool:
    assert cluster.process.poll() is None, cluster.log.read_text()[-3000:]
    body = httpx.get(f"{cluster.url}/fleet/workers", timeout=2, headers=bearer(ADMIN_KEY)).json()
    return sum(w["healthy"] for w in body["workers"]) == workers


@dataclass
class Clusters:
    disagg: Cluster
    colocated: Cluster


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    from kvstrata.engine.model_loader import ensure_checkpoint

    ensure_checkpoint("tiny")
    tmp = tmp_path_factory.mktemp("fleet-disagg")
    write_keys_file(tmp / "keys.toml")
    # --pin-cpus: d0 and p0 on disjoint CPUs, so the router prices them as two machines (on
    # shared cores a remote prefill is no relief for d0's decodes, and it would stay local)
    disagg = _up(tmp, "disagg", "--prefill-workers", "1", "--decode-workers", "1",
                 "--disagg-interference-weight", WEIGHT, "--pin-cpus")  # fmt: skip
    colocated = _up(tmp, "colocated", "--workers", "1")
    try:
        wait_until(lambda: _ready(disagg, 2), 240, "the disaggregated fleet")
        wait_until(lambda: _ready(colocated, 1), 240, "the colocated fleet")
        yield Clusters(disagg, colocated)
    finally:
        for cluster in (disagg, colocated):
            cluster.process.send_signal(signal.SIGTERM)
        for cluster in (disagg, colocated):
            try:
                cluster.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                cluster.process.kill()


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 5000 + 3 for i in range(length)]


def _streams(cluster: Cluster, count: int) -> list[threading.Thread]:
    """``count`` long streamed decodes through the front door (they land on the decode worker)."""

    def run(seed: int) -> None:
        body = {"prompt": _prompt(1000 + seed, 8), "max_tokens": 800, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        url = f"{cluster.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=300, headers=bearer(ADMIN_KEY)) as r:
            for _ in r.iter_bytes():
                pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _infos(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Each worker's ``/kv/info``, by worker id."""
    listing = httpx.get(f"{cluster.url}/fleet/workers", timeout=5, headers=bearer(ADMIN_KEY))
    infos = {}
    for worker in listing.json()["workers"]:
        info = httpx.get(f"{worker['url']}/kv/info", timeout=5, headers=bearer(ADMIN_KEY))
        assert info.status_code == 200, info.text
        infos[worker["worker_id"]] = info.json()
    return infos


def _pid_of_worker(worker_id: str, parent: int) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"--worker-id" in argv and worker_id.encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no process for worker {worker_id}")


def test_disaggregated_fleet_answers_as_colocated_and_chooses_by_load(clusters: Clusters) -> None:
    disagg, colocated = clusters.disagg, clusters.colocated
    short, long_prompt, after_kill = _prompt(1, SHORT), _prompt(2, LONG), _prompt(3, LONG)
    expected = {tuple(t): colocated.complete(t)[0] for t in (short, long_prompt, after_kill)}

    local = disagg.decisions("local")
    route = disagg.route(short)
    assert route["decision"]["worker_id"] == "d0" and route["disagg"]["path"] == "local"
    assert disagg.complete(short)[0] == expected[tuple(short)]
    assert disagg.decisions("local") == local + 1

    threads = _streams(disagg, 4)
    wait_until(
        lambda: disagg.route(long_prompt)["disagg"]["path"] == "disagg", 60, "a busy decoder"
    )
    explained = disagg.route(long_prompt)["disagg"]
    assert explained["prefill_worker_id"] == "p0" and explained["reason"] == "cost"
    cpus = {w: set(info["compute"]["cpus"]) for w, info in _infos(disagg).items()}
    assert cpus["d0"] and cpus["p0"] and not cpus["d0"] & cpus["p0"]
    assert disagg.route(short)["disagg"]["path"] == "local"  # one step either way
    sent = disagg.decisions("disagg")
    text, cached = disagg.complete(long_prompt)
    assert text == expected[tuple(long_prompt)]
    assert cached >= LONG - 16  # the transferred blocks, hit on the decode side
    assert disagg.decisions("disagg") == sent + 1

    os.kill(_pid_of_worker("p0", disagg.process.pid), signal.SIGKILL)
    # at once (the front door may not know yet: refused, or the decode worker's wait ends
    # in a local prefill) and once the health round detached it: answered either way
    before = disagg.decisions("local") + disagg.decisions("disagg")
    assert disagg.complete(after_kill)[0] == expected[tuple(after_kill)]
    assert disagg.decisions("local") + disagg.decisions("disagg") == before + 1
    wait_until(lambda: not _ready(disagg, 2), 30, "the front door to see the prefill worker gone")
    local, sent = disagg.decisions("local"), disagg.decisions("disagg")
    assert disagg.complete(short)[0] == expected[tuple(short)]
    text, _ = disagg.complete(long_prompt)  # a hit from the transfer before: local anyway
    assert text == expected[tuple(long_prompt)]
    assert disagg.decisions("local") == local + 2 and disagg.decisions("disagg") == sent
    metrics = httpx.get(f"{disagg.url}/metrics", timeout=10, headers=bearer(ADMIN_KEY)).text
    assert any(r in metrics for r in ('reason="prefill_unreachable"', 'reason="no_prefill_worker"'))
    assert disagg.route(long_prompt)["disagg"]["reason"] == "no_prefill_worker"
    assert explained["candidates"][0]["worker_id"] == "p0"
    del threads  # daemon streams: the fixture's SIGTERM ends them with the fleet
