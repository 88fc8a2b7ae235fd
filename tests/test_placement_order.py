"""Requests are admitted in the order the router placed them (``runtime.scheduler``,
``runtime.placement``).

Stop 39's diagnosis: the front door placed a 829-token request on a worker and then a
2,978-token one behind it; both were proxied at once, the second reached the engine first and
took the steps the first had been priced for (predicted 1.74 s, measured 11.8 s). The front
door now sends when it placed each request, and the engine admits an earlier-placed request
before later-placed ones that reached it moments before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from http_helpers import serving, tiny_fleet
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.runtime import scheduler as scheduler_module
from kvstrata.runtime.config import ServeLimits
from kvstrata.runtime.placement import PLACED_AT_HEADER, parse_placed_at, placed_at_header
from kvstrata.runtime.scheduler import REORDER_WINDOW_S, Admission, Scheduler, SchedulerConfig
from kvstrata.telemetry import KvMetrics


@dataclass(eq=False)
class _Seq:
    name: str
    pending_tokens: int = 8


def _names(scheduler: Scheduler[_Seq]) -> list[str]:
    return [seq.name for seq in scheduler.waiting]


def test_an_earlier_placement_goes_before_later_ones_that_arrived_just_before() -> None:
    scheduler: Scheduler[_Seq] = Scheduler(SchedulerConfig())
    scheduler.add(_Seq("direct"), arrived_s=10.0)  # a client's own request: no placement
    scheduler.add(_Seq("b"), placed_at=2.0, arrived_s=10.01)
    scheduler.add(_Seq("c"), placed_at=3.0, arrived_s=10.02)
    scheduler.add(_Seq("a"), placed_at=1.0, arrived_s=10.03)
    assert _names(scheduler) == ["direct", "a", "b", "c"]  # never ahead of an unplaced one
    scheduler.add(_Seq("d"), placed_at=2.5, arrived_s=10.04)
    assert _names(scheduler) == ["direct", "a", "b", "d", "c"]
    scheduler.add(_Seq("e"), arrived_s=10.05)  # no placement: last
    assert _names(scheduler) == ["direct", "a", "b", "d", "c", "e"]


def test_the_window_bounds_how_far_a_placement_can_go() -> None:
    scheduler: Scheduler[_Seq] = Scheduler(SchedulerConfig())
    scheduler.add(_Seq("early"), placed_at=5.0, arrived_s=0.0)
    scheduler.add(_Seq("recent"), placed_at=6.0, arrived_s=1.0)
    scheduler.add(_Seq("old-stamp"), placed_at=0.5, arrived_s=1.0 + REORDER_WINDOW_S / 2)
    # ahead of what arrived within the window, not of what waited longer
    assert _names(scheduler) == ["early", "old-stamp", "recent"]


def test_once_planned_a_request_is_not_overtaken() -> None:
    scheduler: Scheduler[_Seq] = Scheduler(SchedulerConfig())
    scheduler.add(_Seq("b"), placed_at=2.0, arrived_s=0.0)
    assert scheduler.plan(lambda _seq: Admission.WAIT) == []  # b was the head: it waits there
    scheduler.add(_Seq("a"), placed_at=1.0, arrived_s=0.01)
    assert _names(scheduler) == ["b", "a"]
    removed = _Seq("gone")
    scheduler.add(removed, placed_at=0.1, arrived_s=0.02)
    scheduler.remove(removed)
    assert _names(scheduler) == ["b", "a"] and not scheduler._placed.get(id(removed))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1796589012.304518", 1796589012.304518),
        (placed_at_header(12.5), 12.5),
        (None, None),
        ("", None),
        ("soon", None),
        ("nan", None),
        ("inf", None),
        ("-3", None),
        ("0", None),
        ("1" * 40, None),
    ],
)
def test_a_bad_placement_is_ignored(value: str | None, expected: float | None) -> None:
    assert parse_placed_at(value) == expected


def test_the_engine_admits_in_placement_order(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "REORDER_WINDOW_S", 60.0)  # a slow CI machine
    config = EngineConfig(
        block_size=16,
        pool_blocks=64,
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
    )
    engine = ReferenceEngine(tiny_model, config, metrics=KvMetrics())
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # still running
    later = engine.generate([11] * 40, params, placed_at=2.0)  # reached the engine first
    earlier = engine.generate([12] * 40, params, placed_at=1.0)
    assert engine.step()
    assert engine.batch.scheduler.running[0].gen is earlier
    fifo = ReferenceEngine(tiny_model, config, metrics=KvMetrics())  # without placements
    first = fifo.generate([11] * 40, params)
    fifo.generate([12] * 40, params)
    assert fifo.step()
    assert fifo.batch.scheduler.running[0].gen is first
    while engine.step() or fifo.step():
        pass
    assert later.output_ids and earlier.output_ids


def test_the_front_door_sends_when_it_placed_the_request(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What goes on the wire to the worker (observed at the front door's HTTP client)."""
    seen: list[str | None] = []
    send = httpx.AsyncClient.send

    async def observed(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> Any:
        if request.url.path.endswith("/completions"):
            seen.append(request.headers.get(PLACED_AT_HEADER))
        return await send(self, request, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "send", observed)
    with tiny_fleet(tiny_model, worker_id="placement:1", limits=ServeLimits(max_tokens=8)) as tiny:
        body = {"model": "tiny", "prompt": "placed", "max_tokens": 2, "temperature": 0.0}
        before = time.time()
        answer = tiny.front.post("/v1/completions", json=body)
        after = time.time()
    assert answer.status_code == 200
    assert len(seen) == 1
    placed = parse_placed_at(seen[0])
    assert placed is not None and before <= placed <= after


def test_a_worker_hands_the_placement_to_its_engine(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.serve.app import create_app

    metrics = KvMetrics()
    engine = ReferenceEngine(tiny_model, EngineConfig(pool_blocks=64), metrics=metrics)
    handed: list[float | None] = []
    generate = engine.generate

    def observed(*args: Any, **kwargs: Any) -> Any:
        handed.append(kwargs.get("placed_at"))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", observed)
    app = create_app(engine, model_name="tiny", metrics=metrics, limits=ServeLimits(max_tokens=8))
    body = {"model": "tiny", "prompt": "placed", "max_tokens": 1, "temperature": 0.0}
    with serving(app) as worker:
        for value in ("12.500000", None, "nan"):
            headers = {} if value is None else {PLACED_AT_HEADER: value}
            assert worker.post("/v1/completions", json=body, headers=headers).status_code == 200
    assert handed == [12.5, None, None]  # a bad one costs only its place
