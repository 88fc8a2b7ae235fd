"""``kvstrata router --prefill-worker URL`` (attach mode): running ``kvstrata serve`` workers
become a disaggregated fleet behind the front door, as ``up --prefill-workers`` starts one.

Real processes (tiny model): a decode worker with its transfer port and a prefill worker, on
disjoint CPUs, attached by a router process. The prefill worker is never a routing candidate;
every request is planned against it (``/debug/route`` ``disagg``); answers come back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from http_helpers import wait_until
from kvstrata.cli.main import build_parser
from kvstrata.cli.up_cmd import run_router
from kvstrata.errors import InvalidInput
from kvstrata.fleet.supervisor import Supervisor, WorkerSpec
from kvstrata.runtime.processes import free_port, split_cpus
from security_helpers import ADMIN_KEY, bearer, fleet_security


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker", "http://a:1", "--prefill-worker", "http://a:1"],
        [
            "--engine",
            "vllm",
            "--worker",
            "http://a:1,events=tcp://a:2",
            "--prefill-worker",
            "http://b:1",
        ],
    ],
    ids=["both-roles", "vllm"],
)
def test_bad_prefill_workers_are_refused_before_anything_starts(argv: list[str]) -> None:
    args = build_parser().parse_args(["router", "--model", "tiny", *argv])
    with pytest.raises(InvalidInput, match="prefill-worker"):
        run_router(args)


@pytest.fixture
def attached(tmp_path: Path) -> Iterator[str]:
    from kvstrata.engine.model_loader import ensure_checkpoint

    ensure_checkpoint("tiny")
    security, router_flags = fleet_security(tmp_path)
    config = tmp_path / "worker.toml"
    secret = tmp_path / "tenant.secret"  # the decode worker's transfer listener needs one
    secret.write_bytes(b"attach-disagg-secret")
    config.write_text(f'tenant_secret_file = "{secret}"\n{security}')
    shares = split_cpus(2, sorted(os.sched_getaffinity(0)))
    specs = [
        WorkerSpec(worker_id=name, port=free_port(), pool_gib=0.05, host_gib=0.05,
                   config=config, extra_args=extra, cpus=cpus,
                   log_path=tmp_path / f"{name}.log", api_key=ADMIN_KEY)
        for name, extra, cpus in (("d0", ["--transfer-port", "0"], shares[0]),
                                  ("p0", [], shares[1]))
    ]  # fmt: skip
    supervisor = Supervisor(specs)
    supervisor.start()
    port = free_port()
    command = [sys.executable, "-m", "kvstrata.cli.main", "router", "--model", "tiny"]
    command += ["--worker", specs[0].url, "--prefill-worker", specs[1].url, "--link-gbps", "1"]
    command += ["--port", str(port), "--log-level", "warning", "--config", str(config)]
    command += router_flags
    log = tmp_path / "router.log"
    with log.open("ab") as out:
        router = subprocess.Popen(
            command, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert router.poll() is None, log.read_text()[-3000:]
            body = httpx.get(f"{url}/fleet/workers", headers=bearer(ADMIN_KEY), timeout=2).json()
            return sum(w["healthy"] for w in body["workers"]) == 2

        wait_until(ready, 120, "the router to attach both workers")
        yield url
    finally:
        router.terminate()
        router.wait(timeout=30)
        supervisor.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_attached_prefill_worker_is_planned_against_and_never_routed_to(attached: str) -> None:
    client = httpx.Client(base_url=attached, headers=bearer(ADMIN_KEY), timeout=60)
    prompt = list(range(3, 3 + 300))
    route = client.post("/debug/route", json={"prompt": prompt, "max_tokens": 4}).json()
    assert route["decision"]["worker_id"] == "d0"
    plan = route["disagg"]
    assert plan["reason"] == "cost" and plan["path"] in {"local", "disagg"}
    assert [c["worker_id"] for c in plan["candidates"]] == ["p0"]
    for _ in range(3):
        answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvstrata-worker"] == "d0"
