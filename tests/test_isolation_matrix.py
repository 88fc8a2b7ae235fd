"""The cross-tenant isolation matrix: another tenant's identical prompt misses everywhere.

Every case is paired on one prompt: tenant A sends it first; then B sends the very same prompt
(the probe: it must miss) and A sends it again (the positive control: it must hit, from the
place under test, so the probe ran against a cache that did hold A's blocks). The places:

- the engine's device pool; the host, disk and remote tiers each alone (A's blocks cleared
  from the pool, so they live only in that tier); the remote tier across two stores sharing
  one server;
- the front door's global index and router (``POST /debug/route``, the routed answer);
- the vLLM connector: the scheduler-side planner with another ``cache_salt``, and the worker's
  lookup socket asked for A's keys in B's namespace;
- forgeries: B sending A's prompt as token ids with A's block keys in extra body fields; KV
  event batches on a worker's real ZMQ publisher announcing A's tokens and block hashes under
  B's namespace, re-announcing A's in A's namespace, or chaining a block named B's onto A's
  last one; ``/admin/delete`` naming block keys, or deleting B's copy, or all of B.

Real parts throughout: the tiny model, real uvicorn servers, real ZMQ sockets, the session's
Valkey server, a keys file with hashed keys. What an event may claim: the index believes what
an authenticated worker (CURVE, ``test_fleet_curve.py``) says about a namespace — an event
naming B's namespace is a claim about B's cache and can steer B's routing, but the worker
re-checks its own keys, so the forgery gets B nothing of A's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from http_helpers import serving
from kvstrata.connectors.vllm_identity import (
    KV_LAYOUT,
    VllmModelView,
    tenant_for_salt,
    vllm_attention_impl,
    vllm_fingerprint,
)
from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_lookup import LookupClient, LookupServer, endpoint_for
from kvstrata.connectors.vllm_plan import ScheduledRequest, SchedulerPlanner
from kvstrata.connectors.vllm_settings import connector_config
from kvstrata.connectors.vllm_worker import ConnectorWorker
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel, ensure_checkpoint
from kvstrata.engine.sampling import SamplingParams
from kvstrata.events import BlockStored, decode_batch
from kvstrata.fleet.fleet import Fleet, FleetConfig, FleetTokenizer
from kvstrata.fleet.frontdoor import create_frontdoor_app
from kvstrata.identity import BlockKey, ModelFacts, ModelFingerprint
from kvstrata.identity.keys import chain_keys, event_block_hash, namespace_root
from kvstrata.runtime.config import WorkerConfig, disk_tier, host_tier, remote_tier
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.runtime.store_factory import build_store
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.security import AuditLog, Authenticator, Role
from kvstrata.security.keys import keys_entry_toml
from kvstrata.serve.app import create_app
from kvstrata.serve.auth import HttpAuth
from kvstrata.telemetry import KvMetrics
from kvstrata.tiers.remote_client import RemoteConfig
from security_http_helpers import audit_records, auth, body, cached, key

pytestmark = pytest.mark.timeout(120)

B = 16
BLOCK = 2 * 2 * 2 * B * 16 * 4  # the tiny model's KV bytes per block (fp32)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
A, B_TENANT = "tenantA", "tenantB"
SENTINEL_SEEDS = itertools.count(1000)  # one fresh sentinel block per forged batch
PROMPT = "The archivist filed every letter the harbour master ever sent to the island. " * 2


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---- engine and tiers --------------------------------------------------------------------------
def _run(engine: ReferenceEngine, prompt: list[int], tenant: str) -> tuple[int, dict[str, int]]:
    record = engine.generate(prompt, ONE, tenant=tenant).run().record
    return record.matched_tokens, record.matched_by_tier


def _paired(engine: ReferenceEngine, prompt: list[int], tier: str) -> None:
    """B's probe misses everywhere; A's repeat hits all its full blocks from ``tier``."""
    assert _run(engine, prompt, B_TENANT) == (0, {})
    assert _run(engine, prompt, A) == (len(prompt) // B * B, {tier: len(prompt) // B * B})
    assert not set(engine.block_keys(prompt, A)) & set(engine.block_keys(prompt, B_TENANT))


def test_device_pool(tiny_model: LoadedModel) -> None:
    engine = build_engine(tiny_model, EngineConfig(block_size=B, pool_blocks=64))
    try:
        prompt = tokens(5 * B + 3, seed=1)
        assert _run(engine, prompt, A) == (0, {})
        _paired(engine, prompt, "device")
    finally:
        engine.close()


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_each_tier_alone(
    tiny_model: LoadedModel,
    tmp_path: Path,
    remote_server: ValkeyServer,
    remote_namespace: str,
    tier: str,
) -> None:
    spec = {
        "host": lambda: host_tier(64 * BLOCK),
        "disk": lambda: disk_tier(tmp_path / "disk", 64 * BLOCK, durable=False),
        "remote": lambda: remote_tier(
            RemoteConfig(url=remote_server.url, namespace=remote_namespace), 64 * BLOCK
        ),
    }[tier]()
    engine = build_engine(
        tiny_model, EngineConfig(block_size=B, pool_blocks=64), WorkerConfig(tiers=(spec,))
    )
    try:
        prompt = tokens(5 * B + 3, seed=2)
        assert _run(engine, prompt, A) == (0, {})
        assert engine.bridge is not None
        engine.bridge.store.flush()
        engine.call(engine.pool.clear).result()
        assert engine.pool.blocks_used == 0  # A's blocks live only in the tier now
        _paired(engine, prompt, tier)
    finally:
        engine.close()


def test_remote_tier_across_two_stores_sharing_the_server(
    tiny_model: LoadedModel, remote_server: ValkeyServer, remote_namespace: str
) -> None:
    def engine_on_server() -> ReferenceEngine:
        remote = RemoteConfig(url=remote_server.url, namespace=remote_namespace)
        tiers = WorkerConfig(tiers=(remote_tier(remote, 64 * BLOCK),))
        return build_engine(tiny_model, EngineConfig(block_size=B, pool_blocks=64), tiers)

    prompt = tokens(4 * B + 1, seed=3)
    writer = engine_on_server()
    try:
        assert _run(writer, prompt, A) == (0, {})
    finally:
        writer.close()  # drains its writes to the server
    reader = engine_on_server()  # never saw the prompt: any hit is the server's
    try:
        _paired(reader, prompt, "remote")
    finally:
        reader.close()


# ---- vLLM connector ----------------------------------------------------------------------------
BS = 4  # the connector's block size here (vLLM's, in tokens)


def _vllm_fingerprint() -> ModelFingerprint:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "vocab_size": 100,
    }
    facts = ModelFacts(
        architecture="LlamaForCausalLM",
        config=config,
        checkpoint_digest="c" * 64,
        tokenizer_digest="t" * 64,
        special_tokens={"<s>": 1},
        chat_template=None,
        attention_impl=vllm_attention_impl("0.32.0", "cpu"),
        kv_dtype="bfloat16",
        block_size=BS,
        kv_layout=KV_LAYOUT,
        tp_size=1,
    )
    built = vllm_fingerprint(VllmModelView(facts, device="cpu"))
    assert isinstance(built, ModelFingerprint)
    return built


def test_vllm_connector_cache_salt_and_lookup_socket(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    layers = {f"l{i}": torch.randn(6, 2, BS, 16, generator=gen).to(torch.bfloat16) for i in (0, 1)}
    settings = connector_config({"disk_dir": str(tmp_path / "disk"), "disk_gib": 0.01})
    codec = BlockCodec(layers, 6, BS)
    store = build_store(codec.block_bytes, settings, CollectorRegistry())
    assert store is not None
    worker = ConnectorWorker(store, codec, model="m", stats_path=tmp_path / "stats.json")
    planner = SchedulerPlanner(_vllm_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    prompt = list(range(1, 3 * BS + 2))
    server: LookupServer | None = None
    try:
        assert planner.matched_tokens("a1", prompt, "salt-a", 0) == 0
        planner.after_alloc("a1", [0, 1, 2, 3], 0)
        worker.save(planner.build([ScheduledRequest("a1", [0, 1, 2, 3], True, 0, 49)]).saves)
        assert worker.stats.blocks_saved == 3
        assert planner.matched_tokens("b", prompt, "salt-b", 0) == 0  # the probe
        assert planner.matched_tokens("a2", prompt, "salt-a", 0) == 3 * BS  # the control
        # Identity: other salts are other namespaces with other keys.
        ns_a, ns_b = tenant_for_salt("salt-a"), tenant_for_salt("salt-b")
        assert ns_a.name != ns_b.name
        digest = _vllm_fingerprint().digest()
        keys_a = chain_keys(namespace_root(digest, ns_a), prompt[: 3 * BS], BS)
        keys_b = chain_keys(namespace_root(digest, ns_b), prompt[: 3 * BS], BS)
        assert not set(keys_a) & set(keys_b)
        # The scheduler → worker lookup socket: B's namespace gets nothing, even for A's keys.
        endpoint = endpoint_for("iso", base=tmp_path)
        server = LookupServer(endpoint, worker.lookup).start()
        client = LookupClient("unused", timeout_ms=5000, endpoint=endpoint)
        try:
            assert client(ns_b.name, keys_b) == 0
            assert client(ns_b.name, keys_a) == 0  # a forged lookup: A's keys, B's namespace
            assert client(ns_a.name, keys_a) == 3
            assert client.timeouts == 0
        finally:
            client.close()
    finally:
        if server is not None:
            server.close()
        worker.close()


# ---- the front door: index, router, forged requests, events and deletions ----------------------
@dataclass
class Front:
    router: httpx.Client
    worker: httpx.Client
    engine: ReferenceEngine
    emitter: KVEventEmitter
    fleet: Fleet
    audit_path: Path

    def complete(self, payload: dict[str, Any], who: str, *, direct: bool = False) -> int:
        client = self.worker if direct else self.router
        return cached(client.post("/v1/completions", json=payload, headers=auth(who)))

    def matched(self, prompt: str | list[int], tenant: str) -> int:
        ids = self.engine.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        return self.fleet.route("probe", tenant, ids, None, False).matched_blocks

    def explained(self, prompt: str, who: str) -> dict[str, Any]:
        response = self.router.post("/debug/route", json=body(prompt), headers=auth(who))
        assert response.status_code == 200, response.text
        decision: dict[str, Any] = response.json()["decision"]
        return decision

    def publish(self, *events: BlockStored) -> None:
        """Send a batch on the worker's own ZMQ publisher (on the engine thread, which owns
        the socket), then wait until the fleet's index has applied it: the batch ends with a
        sentinel block whose entry appears only then."""
        sentinel_ids = tokens(B, seed=next(SENTINEL_SEEDS))
        keys = self.engine.block_keys(sentinel_ids, "sentinel")
        sentinel = _stored(keys, sentinel_ids, "sentinel", "device")
        batch = [*events, sentinel]
        self.engine.call(lambda: self.emitter.publisher.publish(batch)).result(timeout=10)
        _wait(lambda: self.matched(sentinel_ids, "sentinel") == 1, "the forged batch")


def _stored(keys: list[BlockKey], ids: list[int], namespace: str, medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=[event_block_hash(k) for k in keys],
        parent_block_hash=None,
        token_ids=ids[: len(keys) * B],
        block_size=B,
        lora_id=None,
        medium=medium,
        lora_name=None,
        namespace=namespace,
    )


def _keys_file(path: Path) -> Path:
    entries = {
        "A": (A, [Role.TENANT, Role.OBSERVER]),
        "B": (B_TENANT, [Role.TENANT, Role.OBSERVER]),
        "FLEET": ("ops", [Role.FLEET]),
        "ADMIN": ("ops", [Role.ADMIN]),
    }
    path.write_text(
        "".join(
            keys_entry_toml(f"id-{name}", key(name), tenant, roles, False)
            for name, (tenant, roles) in entries.items()
        )
    )
    return path


@pytest.fixture(scope="module")
def front(tiny_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    directory = tmp_path_factory.mktemp("iso")
    keys = _keys_file(directory / "keys.toml")
    with ExitStack() as stack:
        audit = stack.enter_context(AuditLog(directory / "audit.jsonl", component="iso"))
        events = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id="iso:1")
        emitter = KVEventEmitter.from_config(events, block_size=B).start()
        stack.callback(emitter.close)
        metrics = KvMetrics()
        tiers = WorkerConfig(tiers=(host_tier(64 * BLOCK),))
        config = EngineConfig(block_size=B, pool_blocks=64)
        engine = build_engine(tiny_model, config, tiers, metrics=metrics, events=emitter)
        stack.callback(engine.close)
        guard = HttpAuth(Authenticator(keys), audit)
        worker = stack.enter_context(
            serving(create_app(engine, model_name="tiny", metrics=metrics, auth=guard))
        )
        url = str(worker.base_url).rstrip("/")
        fleet = Fleet(
            FleetTokenizer(ensure_checkpoint("tiny")),
            FleetConfig(worker_urls=[url], api_key=key("FLEET")),
        )
        fleet.attach(url)
        router = stack.enter_context(serving(create_frontdoor_app(fleet, guard)))
        yield Front(router, worker, engine, emitter, fleet, directory / "audit.jsonl")


def _stored_by_a(front: Front, prompt: str) -> list[int]:
    """A sends ``prompt`` first (a miss); returns its token ids once the index holds it."""
    ids = front.engine.encode_prompt(prompt)
    assert front.complete(body(prompt), "A") == 0
    _wait(lambda: front.matched(ids, A) == len(ids) // B, "the index to hold A's prompt")
    return ids


def test_index_and_router(front: Front) -> None:
    prompt = "Routed. " + PROMPT
    ids = _stored_by_a(front, prompt)
    probe, control = front.explained(prompt, "B"), front.explained(prompt, "A")
    assert probe["matched_blocks"] == 0
    assert [e["matched_blocks"] for e in probe["estimates"]] == [0]
    assert control["matched_blocks"] == len(ids) // B
    assert front.complete(body(prompt), "B") == 0
    assert front.complete(body(prompt), "A") > 0


def test_forged_requests_get_nothing(front: Front) -> None:
    """Token ids are all a client controls; A's block keys in extra fields, or a tenant header
    naming A, get B nothing (the fields are ignored; the header is refused and audited)."""
    prompt = "Forged request. " + PROMPT
    ids = _stored_by_a(front, prompt)
    hexes = [k.hex() for k in front.engine.block_keys(ids, A)]
    forged = body(
        ids,
        block_hashes=hexes,
        kv_transfer_params={"block_hashes": hexes},
        cache_salt=A,
        kvstrata_namespace=A,
    )
    assert front.complete(forged, "B") == 0  # forwarded unchanged: the worker ignored them too
    claimed = body(ids, kvstrata_tenant=A)
    for client in (front.router, front.worker):
        refused = client.post("/v1/completions", json=claimed, headers=auth("B"))
        assert refused.status_code == 403, refused.text
    headers = {**auth("B"), "X-Kvstrata-Tenant": A, "X-Request-Id": "iso-claim"}
    claim = front.router.post("/v1/completions", json=body(ids), headers=headers)
    assert claim.status_code == 403
    (record,) = audit_records(front.audit_path, lambda r: r.get("request_id") == "iso-claim")
    assert (record["reason"], record["key_id"]) == ("namespace_denied", "id-B")
    assert front.complete(body(ids), "A") == len(ids) // B * B  # the control, as token ids


def test_forged_events_get_nothing(front: Front) -> None:
    prompt = "Forged events. " + PROMPT
    ids = _stored_by_a(front, prompt)
    keys_a = front.engine.block_keys(ids, A)
    dump = front.worker.get("/kv/dump", headers=auth("FLEET"))
    announced = {
        h
        for e in decode_batch(dump.content).batch.events
        if isinstance(e, BlockStored) and e.namespace == A
        for h in e.block_hashes
    }
    copied = _stored(keys_a, ids, A, "host")
    assert set(copied.block_hashes) <= announced  # exactly the hashes A's events carried
    # Re-announcing A's blocks in A's namespace (another medium), or chaining a block named
    # B's onto A's last one, gives B nothing.
    more = tokens(B, seed=5)
    child = _stored(front.engine.block_keys(ids + more, A)[-1:], more, B_TENANT, "device")
    child = msgspec.structs.replace(child, parent_block_hash=copied.block_hashes[-1])
    front.publish(copied, child)
    assert front.matched(ids, B_TENANT) == front.matched(ids + more, B_TENANT) == 0
    assert front.matched(ids + more, A) == len(keys_a)  # nor does it extend A's prefix
    assert front.explained(prompt, "B")["matched_blocks"] == 0
    # A's tokens and block hashes under B's namespace: a claim about B's cache. The router
    # believes the worker and routes B there, but the worker's own keys decide: a miss.
    front.publish(_stored(keys_a, ids, B_TENANT, "device"))
    assert front.matched(ids, B_TENANT) == len(keys_a)
    assert front.complete(body(prompt), "B") == 0
    assert front.complete(body(prompt), "A") > 0


def test_deletes_for_b_never_reach_a(front: Front) -> None:
    prompt = "Deleted for B. " + PROMPT
    ids = _stored_by_a(front, prompt)
    assert front.complete(body(prompt), "B") == 0  # B's own copy of the same prompt
    hexes = [k.hex() for k in front.engine.block_keys(ids, A)]

    def delete(selector: dict[str, Any]) -> httpx.Response:
        return front.router.post("/admin/delete", json=selector, headers=auth("ADMIN"))

    assert delete({"tenant": B_TENANT, "keys": hexes}).status_code == 400  # no key selector
    assert delete({"tenant": A, "keys": hexes}).status_code == 400
    deleted = delete({"tenant": B_TENANT, "prompt": prompt})
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["removed"].get("device", 0) > 0  # B's copy went
    assert front.matched(ids, A) == len(ids) // B
    again = delete({"tenant": B_TENANT, "prompt_token_ids": ids})
    assert again.status_code == 200 and sum(again.json()["removed"].values()) == 0
    everything = delete({"tenant": B_TENANT, "all": True})
    assert everything.status_code == 200, everything.text
    assert front.matched(ids, A) == len(ids) // B
    assert front.complete(body(prompt), "B") == 0  # B's copy is gone
    assert front.complete(body(prompt), "A") > 0  # A's identical prompt is intact
