"""A fleet of two real workers sharing a remote tier on the session's real Valkey server.

What one worker writes to the shared tier counts, in the router's index, as remote blocks of
the other worker too, and the router prices those with the fetch cost that worker measured
(its ``/kv/info``), once it has fetched from the shared tier itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from http_helpers import wait_until
from kvstrata.fleet.supervisor import Supervisor, WorkerSpec
from kvstrata.runtime.processes import free_port
from kvstrata.runtime.valkey_server import ValkeyServer
from security_helpers import ADMIN_KEY, FLEET_KEY, bearer, fleet_security
from test_fleet import PROMPTS, FleetUnderTest

AUTH = bearer(ADMIN_KEY)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _config(tmp_path: Path, server: ValkeyServer, namespace: str) -> tuple[Path, list[str]]:
    security, router_args = fleet_security(tmp_path)
    config = tmp_path / "worker.toml"
    config.write_text(
        "[pool]\ngib = 0.002\n"
        '[[tiers]]\nname = "host"\ngib = 0.004\n'
        f'[[tiers]]\nname = "remote"\nurl = "{server.url}"\nnamespace = "{namespace}"\n'
        "gib = 0.01\n" + security
    )
    return config, router_args


@pytest.fixture
def fleet(
    tmp_path: Path, remote_server: ValkeyServer, remote_namespace: str
) -> Iterator[FleetUnderTest]:
    config, router_args = _config(tmp_path, remote_server, remote_namespace)
    specs = [
        WorkerSpec(
            worker_id=f"w{i}",
            port=free_port(),
            pool_gib=None,
            host_gib=None,
            config=config,
            log_path=tmp_path / f"w{i}.log",
            api_key=FLEET_KEY,
        )
        for i in range(2)
    ]
    under_test = FleetUnderTest(
        Supervisor(specs),
        free_port(),
        router_args=["--config", str(config), *router_args],
        router_log=tmp_path / "router.log",
    )
    try:
        under_test.supervisor.start(ready_timeout_s=120)
        under_test.start_router()
        yield under_test
    finally:
        under_test.close()


def _estimates(fleet: FleetUnderTest, prompt: str) -> dict[str, dict[str, Any]]:
    return {e["worker_id"]: e for e in fleet.explain(prompt)["estimates"]}


def test_remote_blocks_count_for_every_worker_priced_with_its_measured_fetch(
    fleet: FleetUnderTest,
) -> None:
    first, second = PROMPTS[0], PROMPTS[1]
    _, writer, _ = fleet.complete(first)
    reader = next(w for w in ("w0", "w1") if w != writer)
    # The writer's blocks reach the shared tier; the reader never saw the prompt.
    wait_until(lambda: _estimates(fleet, first)[reader]["matched_blocks"] > 0, 30, "remote blocks")
    est = _estimates(fleet, first)[reader]
    assert est["tier_blocks"][3] == est["matched_blocks"]  # all remote for the reader
    assert _estimates(fleet, first)[writer]["tier_blocks"][0] == est["matched_blocks"]

    # The reader fetches the prompt from the shared tier itself (sent to it directly) ...
    url = fleet.worker(reader).spec.url
    body = {"prompt": first, "max_tokens": 8, "temperature": 0.0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0, headers=AUTH).json()
    assert answer["choices"][0]["text"] == fleet.answers[first]  # exact, from remote KV
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    measured = httpx.get(f"{url}/kv/info", headers=AUTH).json()["fetch_s_per_block"]["remote"]
    assert measured is not None and measured > 0

    # ... and from then on the router prices the reader's remote blocks with that figure.
    _, writer2, _ = fleet.complete(second)
    other = next(w for w in ("w0", "w1") if w != writer2)

    def figure(worker: str) -> float | None:
        info = httpx.get(f"{fleet.worker(worker).spec.url}/kv/info", headers=AUTH).json()
        value: float | None = info["fetch_s_per_block"]["remote"]
        return value

    def priced() -> bool:
        est = _estimates(fleet, second)[other]
        # Its own figure; one that never fetched remotely is priced with the others' mean.
        per_block = figure(other)
        if per_block is None:
            per_block = figure(reader if other != reader else writer)
        blocks = est["tier_blocks"][3]
        return (
            per_block is not None
            and blocks > 0
            and est["fetch_s"] == pytest.approx(blocks * per_block, rel=1e-6)
        )

    wait_until(priced, 30, "the router to price with the measured remote figure")
