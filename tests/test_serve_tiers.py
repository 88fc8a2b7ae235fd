"""The tier rollback switch over HTTP, with a served engine that has host and disk tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from http_helpers import serving
from kvstrata.engine.engine import EngineConfig, ReferenceEngine, pool_config_for
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.serve.app import create_app
from security_helpers import ADMIN_KEY, admin_auth, bearer
from tier_helpers import worker_tiers

PROMPT = "Tiered caches keep what the device pool forgets. " * 6


@pytest.fixture()
def served(
    tiny_model: LoadedModel, tmp_path: Path
) -> Iterator[tuple[ReferenceEngine, httpx.Client]]:
    block = pool_config_for(tiny_model, 16, 1).bytes_per_block
    tiers = worker_tiers(
        host_bytes=128 * block,
        disk_dir=tmp_path / "disk",
        disk_bytes=512 * block,
        durable_disk=False,
    )
    engine = build_engine(tiny_model, EngineConfig(pool_blocks=64), tiers)
    app = create_app(engine, model_name="tiny", metrics=engine.metrics, auth=admin_auth())
    with serving(app) as client:
        yield engine, client
    engine.close()


def complete(client: httpx.Client) -> dict[str, int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]  # type: ignore[no-any-return]


def test_admin_requires_the_token(served: tuple[ReferenceEngine, httpx.Client]) -> None:
    _, client = served
    assert client.get("/admin/tiers").status_code == 401
    bad = client.post(
        "/admin/tiers/host", json={"enabled": False}, headers={"Authorization": "Bearer nope"}
    )
    assert bad.status_code == 401


def test_rollback_switch_at_run_time_keeps_data(
    served: tuple[ReferenceEngine, httpx.Client],
) -> None:
    engine, client = served
    auth = bearer(ADMIN_KEY)
    listed = client.get("/admin/tiers", headers=auth).json()["tiers"]
    assert [t["name"] for t in listed] == ["host", "disk"] and all(t["enabled"] for t in listed)
    complete(client)
    engine.pool.clear()
    assert complete(client)["prompt_tokens_details"]["cached_tokens"] > 0  # from host

    for name in ("host", "disk"):
        response = client.post(f"/admin/tiers/{name}", json={"enabled": False}, headers=auth)
        assert response.status_code == 200
    engine.pool.clear()
    assert complete(client)["prompt_tokens_details"]["cached_tokens"] == 0  # tiers off
    metrics = client.get("/metrics").text
    assert 'kvstrata_tier_enabled{tier="host"} 0.0' in metrics

    client.post("/admin/tiers/host", json={"enabled": True}, headers=auth)
    engine.pool.clear()
    assert complete(client)["prompt_tokens_details"]["cached_tokens"] > 0  # data was kept


def test_admin_bad_requests(served: tuple[ReferenceEngine, httpx.Client]) -> None:
    _, client = served
    auth = bearer(ADMIN_KEY)
    assert (
        client.post("/admin/tiers/nope", json={"enabled": False}, headers=auth).status_code == 404
    )
    assert client.post("/admin/tiers/host", json={"enabled": "no"}, headers=auth).status_code == 400
    bad_json = client.post("/admin/tiers/host", content=b"{", headers=auth)
    assert bad_json.status_code == 400
    assert client.get("/health").status_code == 200
