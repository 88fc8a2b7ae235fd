"""What the connector's scheduler side was promised is held until the load (``vllm_holds``)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from test_vllm_connector_parts import BLOCKS, BS, _fingerprint, _stats_file, cpu_layer

from kvstrata.connectors.vllm_holds import LOOKUP_HOLD_S, LookupHolds
from kvstrata.connectors.vllm_identity import tenant_for_salt
from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_plan import RequestLoad, ScheduledRequest, SchedulerPlanner
from kvstrata.connectors.vllm_settings import connector_config
from kvstrata.connectors.vllm_worker import ConnectorWorker
from kvstrata.runtime.store_factory import build_store

BLOCK_BYTES = 2 * 2 * BS * 16 * 2  # two layers of [H=2, N=BS, 2*D=16] bfloat16 per block
PROMPT_BLOCKS = 2


def _save(worker: ConnectorWorker, planner: SchedulerPlanner, req: str, first: int) -> None:
    tokens = list(range(first, first + PROMPT_BLOCKS * BS + 1))
    planner.matched_tokens(req, tokens, None, 0)
    planner.after_alloc(req, [0, 1, 2], 0)
    worker.save(planner.build([ScheduledRequest(req, [0, 1, 2], True, 0, len(tokens))]).saves)


def _promise(planner: SchedulerPlanner, req: str) -> list[RequestLoad]:
    tokens = list(range(1, PROMPT_BLOCKS * BS + 2))
    assert planner.matched_tokens(req, tokens, None, 0) == PROMPT_BLOCKS * BS
    planner.after_alloc(req, [3, 4, 5], PROMPT_BLOCKS * BS)
    return planner.build([ScheduledRequest(req, [3, 4, 5], True, PROMPT_BLOCKS * BS, 1)]).loads


def _host_worker(tmp_path: Path) -> tuple[ConnectorWorker, SchedulerPlanner]:
    """A worker whose only tier is a host tier of 6 blocks (LRU), the prompt saved in it."""
    codec = BlockCodec({"l0": cpu_layer(0), "l1": cpu_layer(1)}, BLOCKS, BS)
    assert codec.block_bytes == BLOCK_BYTES
    settings = connector_config({"host_gib": 6 * BLOCK_BYTES / 2**30, "policy": "lru"})
    store = build_store(codec.block_bytes, settings, CollectorRegistry())
    assert store is not None
    worker = ConnectorWorker(store, codec, model="m", stats_path=tmp_path / "stats.json")
    planner = SchedulerPlanner(_fingerprint(), BS, worker.lookup, tenant_of=tenant_for_salt)
    _save(worker, planner, "a", 1)
    return worker, planner


def test_promised_blocks_survive_saves_that_fill_the_tier_until_their_load(
    tmp_path: Path,
) -> None:
    """Between the scheduler's lookup and the worker's load, other requests' saves fill the
    host tier three times over; the promised prompt (the tier's oldest objects: LRU's first
    victims) is held and loads whole, then the hold ends with the load."""
    worker, planner = _host_worker(tmp_path)
    loads = _promise(planner, "b")
    assert len(worker._holds) == 1
    for i in range(8):
        _save(worker, planner, f"other{i}", 1000 * (i + 1))
    assert worker.load(loads) == set()
    assert worker.stats.load_missing == 0
    assert worker.stats.blocks_loaded == PROMPT_BLOCKS
    assert len(worker._holds) == 0
    assert not worker.store._held  # every hold ended: the promotion's and the promise's
    worker.close()


def test_without_the_hold_the_same_saves_break_the_promise(tmp_path: Path) -> None:
    """The test above with holds turned off: the load finds the prompt evicted."""
    worker, planner = _host_worker(tmp_path)
    worker._holds.take = lambda req_id, located: None  # type: ignore[method-assign]
    loads = _promise(planner, "b")
    for i in range(8):
        _save(worker, planner, f"other{i}", 1000 * (i + 1))
    assert worker.load(loads) == {3, 4}  # vLLM recomputes both blocks
    assert worker.stats.load_missing == 1
    worker.close()


def test_a_promise_never_loaded_is_released_when_no_lookup_renews_it(tmp_path: Path) -> None:
    """A request looked up and then aborted (never loaded) holds its blocks for
    ``LOOKUP_HOLD_S``; a renewed lookup restarts that time; past it the next engine step
    ends the hold and counts it, with no lookup needed; ``close`` ends the rest."""
    worker, planner = _host_worker(tmp_path)
    now = [0.0]
    worker._holds = LookupHolds(worker.store, clock=lambda: now[0])
    _promise(planner, "aborted")
    now[0] = LOOKUP_HOLD_S - 1
    _promise(planner, "aborted")  # still waiting in vLLM's queue: asked again, renewed
    now[0] = LOOKUP_HOLD_S + 1
    _promise(planner, "other")
    worker.end_step()
    assert len(worker._holds) == 2 and worker.stats.lookup_holds_expired == 0
    now[0] = 2 * LOOKUP_HOLD_S
    worker.end_step()  # "aborted" was last renewed LOOKUP_HOLD_S + 1 s ago
    assert len(worker._holds) == 1 and worker.stats.lookup_holds_expired == 1
    worker.close()
    assert len(worker._holds) == 0 and not worker.store._held
    assert _stats_file(tmp_path)["lookup_holds_expired"] == 1


def test_a_load_that_never_ran_still_ends_its_hold(tmp_path: Path) -> None:
    """A step's fetch thread stops at a failing request: the requests after it are never
    fetched, and their promises must not wait for expiry (``finish_load`` ends them)."""
    worker, planner = _host_worker(tmp_path)
    loads = _promise(planner, "b")

    def fail(request: RequestLoad, place: object) -> int:
        raise RuntimeError("the fetch thread failed")

    worker.fetch = fail  # type: ignore[assignment,method-assign]
    assert worker.load(loads) == {3, 4}
    assert len(worker._holds) == 0 and not worker.store._held
    worker.close()
