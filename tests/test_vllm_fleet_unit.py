"""The vLLM worker adapter's pure parts: metrics, --worker syntax, salts, load estimate."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import zmq

from kvstrata.cli.vllm_fleet import _secret_file
from kvstrata.connectors.vllm_identity import tenant_for_salt
from kvstrata.connectors.vllm_settings import connector_config
from kvstrata.events.schema import BlockRemoved, BlockStored, KVEventBatch, encode_batch, make_batch
from kvstrata.events.subscriber import ZmqEventSubscriber
from kvstrata.fleet.engine_load import ScrapedLoad
from kvstrata.fleet.frontdoor import _engine_tenant
from kvstrata.fleet.vllm_servers import VllmServerSpec
from kvstrata.fleet.vllm_workers import (
    DEFAULT_TENANT,
    VLLM_STEP_TOKENS,
    VllmSource,
    VllmWorker,
    parse_metrics,
    router_fingerprint,
    salted_batch,
    tenant_of_body,
)
from kvstrata.fleet.worker_info import WorkerInfo
from kvstrata.fleet.workers import WorkerState, default_profile
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index import GlobalIndex, PrefixMatch
from kvstrata.router import KvstrataPolicy, RouteRequest
from kvstrata.security import Role
from kvstrata.security.keys import ANONYMOUS, Principal

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
process_start_time_seconds 1.7646e+09
vllm:prompt_tokens_total{engine="0",model_name="m"} 99.0
"""


def test_metrics_give_load_and_start_time() -> None:
    load, started = parse_metrics(METRICS)
    assert load == ScrapedLoad(waiting=4, running=2, kv_usage=0.25)
    assert started == pytest.approx(1.7646e9)
    assert parse_metrics("garbage line\n")[1] is None
    broken = METRICS.replace("1.7646e+09", "NaN").replace(" 3.0", " +Inf")
    load, started = parse_metrics(broken)  # a figure that is no number is no figure
    assert started is None and load == ScrapedLoad(waiting=1, running=2, kv_usage=0.25)


def test_worker_argument() -> None:
    worker = VllmWorker.parse(
        "http://h:1/,events=tcp://h:2,replay=tcp://h:3,lower=tcp://h:4,id=a", 5, 32
    )
    assert worker == VllmWorker("a", "http://h:1", "tcp://h:2", "tcp://h:3", "tcp://h:4", None, 32)
    assert VllmWorker.parse("http://h:1,events=tcp://h:2", 7, 32).worker_id == "v7"
    with pytest.raises(ValueError, match="events="):
        VllmWorker.parse("http://h:1", 0, 32)
    with pytest.raises(ValueError, match="unknown part"):
        VllmWorker.parse("http://h:1,events=tcp://h:2,bogus=1", 0, 32)
    assert worker.step_tokens == VLLM_STEP_TOKENS == 2048  # vLLM's default: it reports none
    tuned = VllmWorker.parse("http://h:1,events=tcp://h:2,step_tokens=8192", 0, 32)
    assert tuned.step_tokens == 8192
    for bad in ("0", "-1", "many", "1e3", str(1 << 30)):
        with pytest.raises(ValueError, match="step_tokens"):
            VllmWorker.parse(f"http://h:1,events=tcp://h:2,step_tokens={bad}", 0, 32)


def _stored(parent: int | None, extra: list[tuple[object, ...] | None] | None) -> BlockStored:
    return BlockStored([1], parent, [0] * 4, 4, None, None, None, extra_keys=extra)


def test_salt_becomes_the_connectors_tenant() -> None:
    salted, child, plain = _stored(None, [("s1",)]), _stored(1, [None]), _stored(None, None)
    batch = salted_batch(KVEventBatch(0.0, [salted, child, plain, BlockRemoved([1], None)]))
    events = batch.events
    assert isinstance(events[0], BlockStored)
    assert events[0].namespace == tenant_for_salt("s1").name
    assert events[1] is child and events[2] is plain  # only a chain's first block is salted
    unsalted = KVEventBatch(0.0, [plain])
    assert salted_batch(unsalted) is unsalted
    assert tenant_of_body({"cache_salt": "s1"}) == tenant_for_salt("s1").name
    assert tenant_of_body({"cache_salt": ""}) is None and tenant_of_body({}) is None


def test_fingerprint_is_per_model_and_block_size() -> None:
    assert router_fingerprint("m", 32) == router_fingerprint("m", 32)
    assert router_fingerprint("m", 32) != router_fingerprint("m", 64)
    assert router_fingerprint("m", 32) != router_fingerprint("n", 32)


def _state(scraped: ScrapedLoad | None) -> WorkerState:
    info = WorkerInfo(
        "v0", "http://h", 1, "m", router_fingerprint("m", 32), 32, "tcp://h:1", None, 0,
        scraped=scraped,
    )  # fmt: skip
    return WorkerState(info, default_profile(32))


def test_scraped_load_raises_the_ttft_estimate() -> None:
    idle, busy = _state(ScrapedLoad(0, 0, 0.0)), _state(ScrapedLoad(3, 2, 0.9))
    for state in (idle, busy):
        state.begin("r1", 256, 0, 0.5, 16, now=0.0)
        state.observe_scrape(state.info.scraped, now=0.0)  # r1 is one of the 3 waiting
    quiet, loaded = idle.load(0.0), busy.load(0.0)
    assert quiet.queued_requests == 1 and quiet.queued_s == pytest.approx(0.5)
    # two unseen waiting requests priced like the router's own queued one, plus decodes
    assert loaded.queued_requests == 3
    assert loaded.queued_s == pytest.approx(quiet.queued_s + 2 * 0.5)
    assert loaded.active_decodes == 2
    assert loaded.kv_utilisation == pytest.approx(0.9)
    assert _state(None).load(0.0).queued_requests == 0


def test_unseen_work_drains_with_time() -> None:
    state = _state(None)
    state.begin("mine", 256, 0, 0.5, 16, now=0.0)
    state.observe_scrape(ScrapedLoad(waiting=3, running=1, kv_usage=0.5), now=10.0)
    # mine is one of the 3 waiting: 2 unseen waiting (0.5 s each) and 1 unseen running.
    assert state.load(10.0).queued_s == pytest.approx(0.5 + 1.0)
    half = state.load(10.6)  # 0.6 s of the 1.0 s backlog worked off
    assert half.queued_requests == 1 + 1 and half.queued_s == pytest.approx(0.5 + 0.4)
    decode_s = state.mean_output_tokens * state.decode_step_s
    later = state.load(10.0 + max(1.0, decode_s) + 0.01)
    # mine could start when the unseen backlog drained (11.0 s): what it ran since is done
    ran = max(1.0, decode_s) + 0.01 - 1.0
    assert later.queued_requests == 1 and later.queued_s == pytest.approx(0.5 - ran)
    assert later.active_decodes == 0 and later.kv_utilisation == 0.0


def test_own_requests_that_finish_do_not_reappear_as_unseen() -> None:
    state = _state(None)
    state.begin("mine", 256, 0, 0.5, 16, now=0.0)
    state.observe_scrape(ScrapedLoad(waiting=0, running=1, kv_usage=0.2), now=0.1)
    state.first_token("mine", 0.3, alone=True)
    state.finish("mine", 0.4, completion_tokens=8, ttft_s=0.3)
    load = state.load(0.4)
    assert load.queued_requests == 0 and load.active_decodes == 0 and load.queued_s == 0.0


def test_a_holder_seen_busy_by_another_client_keeps_its_prefix() -> None:
    """The live failure (``tests_vllm/test_vllm_fleet.py``): v0 held 10 of the prompt's 14
    blocks, but the health round had read v0's /metrics while a client that bypasses the
    router ran one request there (running=1, 17% KV), and the router priced that as a
    1.28 s queue until the next scrape, so the request went to the empty v1. A running
    decode delays a new prefill only by interference, and its work drains with time."""
    tokens = 14 * 32 + 20
    v0, v1 = _state(None), _state(None)
    v1 = WorkerState(replace(v1.info, worker_id="v1"), default_profile(32))
    v0.observe_scrape(ScrapedLoad(waiting=0, running=1, kv_usage=0.1746), now=100.0)
    v1.observe_scrape(ScrapedLoad(waiting=0, running=0, kv_usage=0.0), now=100.0)
    states = {"v0": v0, "v1": v1}
    policy = KvstrataPolicy(lambda w: states[w].profile())
    found = {"v0": PrefixMatch("v0", 10, (10, 0, 0, 0)), "v1": PrefixMatch("v1", 0, (0, 0, 0, 0))}
    request = RouteRequest("early", "t", tokens, list(range(tokens // 32)), 8, 100.2)
    for now in (100.0, 100.2, 102.0):
        decision = policy.choose(request, found, [v0.load(now), v1.load(now)])
        assert decision.worker_id == "v0", decision.to_dict()
    # A real backlog of waiting prefills there still sends it elsewhere.
    v0.observe_scrape(ScrapedLoad(waiting=6, running=1, kv_usage=0.9), now=100.0)
    decision = policy.choose(request, found, [v0.load(100.2), v1.load(100.2)])
    assert decision.worker_id == "v1", decision.to_dict()


def test_server_command_configures_both_event_streams(tmp_path: Path) -> None:
    spec = VllmServerSpec("v3", tmp_path / "model", Path("python"), tmp_path / "run")
    argv = spec.command()
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    # vLLM binds only an endpoint with "*" in it; the router connects to the host's port
    assert events["endpoint"] == f"tcp://*:{spec.events_port}"
    assert events["replay_endpoint"] == f"tcp://*:{spec.replay_port}"
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = transfer["kv_connector_extra_config"]
    worker = spec.worker()
    assert worker.events_endpoint == f"tcp://127.0.0.1:{spec.events_port}"
    assert extra["events_endpoint"] == worker.lower_events_endpoint
    assert extra["events_replay_endpoint"] == worker.lower_replay_endpoint
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert "--enable-prefix-caching" in argv
    assert len({spec.port, spec.events_port, spec.replay_port, spec.lower_events_port}) == 4
    bare = VllmServerSpec("v4", tmp_path, Path("python"), tmp_path, connector=False)
    assert "--kv-transfer-config" not in bare.command()
    assert bare.worker().lower_events_endpoint is None


def test_a_started_server_tells_the_router_its_step_budget(tmp_path: Path) -> None:
    """The router packs a vLLM server's queue by the budget the server was given; vLLM's
    default is left to vLLM and assumed (``VLLM_STEP_TOKENS``)."""
    default = VllmServerSpec("v0", tmp_path, Path("python"), tmp_path)
    assert "--max-num-batched-tokens" not in default.command()
    assert default.worker().step_tokens == VLLM_STEP_TOKENS
    given = VllmServerSpec("v1", tmp_path, Path("python"), tmp_path, step_tokens=4096)
    argv = given.command()
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "4096"
    assert given.worker().step_tokens == 4096
    for extra in (["--max-num-batched-tokens", "1024"], ["--max-num-batched-tokens=1024"]):
        spec = VllmServerSpec("v2", tmp_path, Path("python"), tmp_path, extra_args=extra)
        assert spec.worker().step_tokens == 1024
    with pytest.raises(ValueError, match="step_tokens"):
        VllmWorker("v3", "http://h", "tcp://h:1", None, step_tokens=0)


def test_up_hands_the_tenant_secret_to_every_connector(tmp_path: Path) -> None:
    """The router and the servers' connectors salt tenants with the same secret, whether it
    came as ``--tenant-secret-file`` or from ``--config`` (a private copy in the run dir)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret-for-tenants")
    spec = VllmServerSpec("v0", tmp_path, Path("python"), tmp_path, tenant_secret_file=secret)
    argv = spec.command()
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert connector_config(extra).tenant_secret == b"s3cret-for-tenants"
    assert _secret_file(secret, b"s3cret-for-tenants", tmp_path) == secret
    copy = _secret_file(None, b"from-config", tmp_path / "")
    assert copy is not None and copy.read_bytes() == b"from-config"
    assert copy.stat().st_mode & 0o077 == 0
    assert _secret_file(None, b"", tmp_path) is None
    bare = VllmServerSpec("v1", tmp_path, Path("python"), tmp_path).command()
    bare_extra = json.loads(bare[bare.index("--kv-transfer-config") + 1])
    assert "tenant_secret_file" not in bare_extra["kv_connector_extra_config"]


def test_subscriber_reads_vllms_replay_frames() -> None:
    """vLLM's ROUTER answers ``[id, "", topic, seq, payload]`` and ends with ``[id, "", "",
    -1, ""]`` (``vllm/distributed/kv_events.py``, ``_service_replay``): one frame more than
    kvstrata's publisher. The subscriber takes both."""
    context = zmq.Context.instance()
    pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    payloads = [encode_batch(KVEventBatch(float(i), [_stored(None, None)])) for i in range(3)]

    def serve() -> None:
        client, _, start = router.recv_multipart()
        # vLLM buffers a batch before it sends it live, so its replay holds the live frame's
        # seq too (a replay that does not is the subscriber's sign of a forged frame)
        for seq in range(int.from_bytes(start, "big"), 3):
            router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payloads[seq]))
        router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sub = ZmqEventSubscriber(
        f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", replay_timeout_s=5.0
    ).start()
    try:
        received: list[int] = []
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            pub.send_multipart((b"", (2).to_bytes(8, "big"), payloads[2]))
            result = sub.poll(100)
            received = [b.seq for b in result.batches]
        assert received == [0, 1, 2]
        assert not result.resync_needed
    finally:
        sub.close()
        pub.close(linger=0)
        thread.join(timeout=5)
        router.close(linger=0)


def test_a_restarted_server_is_a_new_epoch_and_drops_its_old_entries() -> None:
    """``process_start_time_seconds`` is the epoch; a restart re-attaches the worker (the
    fleet's health round compares epochs) and its empty snapshot clears the old entries,
    which the new process's replay then rebuilds."""
    started = [1_764_600_000.25]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=f"process_start_time_seconds {started[0]}\n")
        return httpx.Response(200, json={"data": [{"id": "smol"}]})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    worker = VllmWorker("v0", "http://v0", "tcp://127.0.0.1:1", None, step_tokens=8192)
    source = VllmSource([worker])
    first = source.info(http, "http://v0", None)
    assert first.epoch == 1_764_600_000_250 and first.model == "smol"
    assert first.step_tokens == 8192  # the router packs its queue by the server's budget
    assert WorkerState(first, default_profile(4)).interference.chunk_tokens == 8192
    index = GlobalIndex(first.fingerprint, 4)
    dump = source.dump(http, first, None)
    index.replace_worker("v0", dump.epoch, dump.events, next_seq=dump.next_seq)
    index.apply_batch("v0", KVEventBatch(0.0, [_stored(None, None)]), seq=1)
    assert sum(index.blocks_held("v0")) == 1
    assert source.info(http, "http://v0", None).epoch == first.epoch  # same process
    started[0] += 30.0  # the server restarted
    second = source.info(http, "http://v0", None)
    assert second.epoch != first.epoch
    dump = source.dump(http, second, None)
    index.replace_worker("v0", dump.epoch, dump.events, next_seq=dump.next_seq)
    assert index.blocks_held("v0") == (0, 0, 0, 0)


def test_with_keys_the_front_door_salts_a_vllm_request_with_the_keys_namespace() -> None:
    """vLLM namespaces KV by ``cache_salt`` alone. With keys, the front door sets the salt from
    the key's namespace (folding in the client's), so a tenant that sends another tenant's
    salt, or none, shares nobody's KV. Before, the salt went through as sent."""
    fleet = cast(Any, SimpleNamespace(config=SimpleNamespace(engine="vllm")))
    acme = Principal("k1", "acme", frozenset({Role.TENANT}))
    globex = Principal("k2", "globex", frozenset({Role.TENANT}))

    def namespace(principal: Principal, salt: str | None) -> tuple[str, object]:
        payload: dict[str, Any] = {} if salt is None else {"cache_salt": salt}
        return _engine_tenant(fleet, principal, principal.tenant, payload), payload["cache_salt"]

    acme_salted, sent = namespace(acme, "s1")
    assert isinstance(sent, str) and "acme" in sent and "s1" in sent
    assert namespace(globex, "s1")[0] != acme_salted  # acme's salt, another key: apart
    assert namespace(acme, "s1")[0] == acme_salted  # the same key and salt: shared
    assert namespace(acme, None)[0] not in (DEFAULT_TENANT, namespace(globex, None)[0])
    assert namespace(acme, "s2")[0] != acme_salted  # a salt still splits within a tenant
    # one tenant, no keys: the client's salt is its namespace, as vLLM itself has it
    assert namespace(ANONYMOUS, "s1") == (tenant_of_body({"cache_salt": "s1"}), "s1")
    assert _engine_tenant(fleet, ANONYMOUS, ANONYMOUS.tenant, {}) == DEFAULT_TENANT


def test_a_salted_chain_continued_by_a_later_event_matches_and_deletes_whole() -> None:
    """vLLM puts the salt in a chain's first block only: a later event extending the chain has
    none. The index hashed it in the default namespace, so the tenant's 8-block prompt matched
    4 blocks and deleting the tenant left the other 4 (review finding, stop 35)."""
    index = GlobalIndex(FingerprintDigest(b"\x02" * 32), 4)
    prompt, more = list(range(100, 116)), list(range(500, 516))
    first = BlockStored([11, 12, 13, 14], None, prompt, 4, None, "GPU", None,
                        extra_keys=[("s3cret",), None, None, None])  # fmt: skip
    later = BlockStored([15, 16, 17, 18], 14, more, 4, None, "GPU", None)
    index.apply_batch("w", salted_batch(make_batch([first], ts=0.0)), seq=0)
    index.apply_batch("w", salted_batch(make_batch([later], ts=0.0)), seq=1)
    tenant = tenant_of_body({"cache_salt": "s3cret"})
    assert index.match(index.request_hashes(tenant, prompt + more))["w"].blocks == 8
    assert index.match(index.request_hashes(None, prompt + more))["w"].blocks == 0
    index.delete(tenant, everything=True)
    assert sum(index.blocks_held("w")) == 0
