"""The vLLM worker adapter's pure parts: metrics, --worker syntax, salts, load estimate."""

from __future__ import annotations

import pytest

from kvstrata.connectors.vllm_identity import tenant_for_salt
from kvstrata.events.schema import BlockRemoved, BlockStored, KVEventBatch
from kvstrata.fleet.vllm_workers import (
    VllmWorker,
    parse_metrics,
    router_fingerprint,
    salted_batch,
    tenant_of_body,
)
from kvstrata.fleet.workers import ScrapedLoad, WorkerInfo, WorkerState, default_profile

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
    state = WorkerState(info, default_profile(32))
    state.scraped = scraped
    return state


def test_scraped_load_raises_the_ttft_estimate() -> None:
    idle, busy = _state(ScrapedLoad(0, 0, 0.0)), _state(ScrapedLoad(3, 2, 0.9))
    for state in (idle, busy):
        state.begin("r1", 256, 0, 0.5, 16, now=0.0)
    quiet, loaded = idle.load(), busy.load()
    assert quiet.queued_requests == 1 and quiet.queued_s == pytest.approx(0.5)
    # two unseen waiting requests priced like the router's own queued one, plus decodes
    assert loaded.queued_requests == 3
    assert loaded.queued_s > quiet.queued_s + 2 * 0.5 - 1e-9
    assert loaded.active_decodes == 2
    assert loaded.kv_utilisation == pytest.approx(0.9)
    assert _state(None).load().queued_requests == 0
