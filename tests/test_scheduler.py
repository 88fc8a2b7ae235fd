"""The continuous-batching scheduler's rules, on plain objects (no model, no pool)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvstrata.errors import ConfigError
from kvstrata.runtime.scheduler import Admission, Scheduler, SchedulerConfig


@dataclass(eq=False)
class Seq:
    name: str
    pending_tokens: int


def names(work: list[tuple[Seq, int]]) -> list[tuple[str, int]]:
    return [(seq.name, count) for seq, count in work]


def test_decodes_first_then_prefill_chunks_under_the_budget() -> None:
    scheduler: Scheduler[Seq] = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10)
    )
    prefill, d1, d2 = Seq("prefill", 30), Seq("d1", 1), Seq("d2", 1)
    scheduler.running = [prefill, d1, d2]
    assert names(scheduler.plan(lambda s: Admission.ADMIT)) == [
        ("d1", 1),
        ("d2", 1),
        ("prefill", 8),
    ]


def test_waiting_requests_join_while_budget_and_seats_remain() -> None:
    scheduler: Scheduler[Seq] = Scheduler(
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=20)
    )
    scheduler.running = [Seq("d", 1)]
    for name, pending in (("a", 5), ("b", 30), ("c", 4)):
        scheduler.add(Seq(name, pending))
    work = names(scheduler.plan(lambda s: Admission.ADMIT))
    assert work == [("d", 1), ("a", 5), ("b", 14)]  # b's prefill is chunked; c has no seat
    assert [s.name for s in scheduler.waiting] == ["c"]


def test_admission_is_fifo_a_refused_head_blocks_the_rest() -> None:
    scheduler: Scheduler[Seq] = Scheduler(SchedulerConfig())
    big, small = Seq("big", 100), Seq("small", 2)
    scheduler.add(big)
    scheduler.add(small)

    def admit(seq: Seq) -> Admission:
        return Admission.WAIT if seq is big else Admission.ADMIT

    assert scheduler.plan(admit) == []
    assert list(scheduler.waiting) == [big, small]


def test_a_deferred_request_keeps_its_place_and_lets_the_next_go() -> None:
    scheduler: Scheduler[Seq] = Scheduler(SchedulerConfig())
    waits, first, second = Seq("waits", 40), Seq("first", 3), Seq("second", 2)
    for seq in (waits, first, second):
        scheduler.add(seq)

    def admit(seq: Seq) -> Admission:
        return Admission.DEFER if seq is waits else Admission.ADMIT

    assert names(scheduler.plan(admit)) == [("first", 3), ("second", 2)]
    assert list(scheduler.waiting) == [waits]


def test_preempt_last_goes_back_to_the_front_of_the_queue() -> None:
    scheduler: Scheduler[Seq] = Scheduler(SchedulerConfig())
    first, last, queued = Seq("first", 1), Seq("last", 1), Seq("queued", 9)
    scheduler.running = [first, last]
    scheduler.add(queued)
    assert scheduler.preempt_last() is last
    assert scheduler.running == [first] and list(scheduler.waiting) == [last, queued]
    assert len(scheduler) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_seqs": 8, "max_num_batched_tokens": 4},
        {"max_waiting": -1},
    ],
)
def test_bad_configuration_names_the_key(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="scheduler"):
        SchedulerConfig(**kwargs)


def test_an_admit_that_raises_loses_no_sequence() -> None:
    scheduler: Scheduler[Seq] = Scheduler(SchedulerConfig())
    deferred, failing, behind = Seq("deferred", 4), Seq("failing", 4), Seq("behind", 4)
    for seq in (deferred, failing, behind):
        scheduler.add(seq)

    def admit(seq: Seq) -> Admission:
        if seq is deferred:
            return Admission.DEFER
        raise RuntimeError("lookup failed")

    with pytest.raises(RuntimeError):
        scheduler.plan(admit)
    assert [s.name for s in scheduler.waiting] == ["deferred", "failing", "behind"]


def test_a_failed_admission_leaves_the_queue_and_the_rest_go_on() -> None:
    scheduler: Scheduler[Seq] = Scheduler(SchedulerConfig())
    failed, next_one = Seq("failed", 4), Seq("next", 4)
    scheduler.add(failed)
    scheduler.add(next_one)
    work = scheduler.plan(lambda s: Admission.FAILED if s is failed else Admission.ADMIT)
    assert names(work) == [("next", 4)]
    assert list(scheduler) == [next_one]
