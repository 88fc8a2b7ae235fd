"""The router's estimate of a worker's queued prefill seconds (``router.queue``): one rule
for the live fleet and the simulated router."""

from __future__ import annotations

import pytest

from kvstrata.fleet.vllm_workers import router_fingerprint
from kvstrata.fleet.worker_info import WorkerInfo
from kvstrata.fleet.workers import WorkerState, default_profile
from kvstrata.router.queue import Queued, queued_seconds


def test_the_head_loses_what_it_ran_and_predictions_follow_the_fit() -> None:
    queue = [Queued(2.0, 1.0, 1.0), Queued(3.0, 1.0, 2.0), Queued(0.7, 0.0, 5.0)]
    # head 2.0 less 0.5 run; the second re-priced ×2; the third never priced: kept
    assert queued_seconds(queue, 0.5) == pytest.approx(1.5 + 6.0 + 0.7)
    assert queued_seconds(queue, 9.0) == pytest.approx(0.0 + 6.0 + 0.7)  # never below 0
    assert queued_seconds(queue, -1.0) == pytest.approx(2.0 + 6.0 + 0.7)
    assert queued_seconds([], 3.0) == 0.0


def _state() -> WorkerState:
    info = WorkerInfo(
        "w0", "http://h", 1, "m", router_fingerprint("m", 16), 16, "tcp://h:1", None, 0
    )  # fmt: skip
    return WorkerState(info, default_profile(16))


def test_a_live_worker_ages_its_head_from_the_last_first_token() -> None:
    state = _state()
    state.begin("a", 256, 0, 1.0, 4, now=0.0)
    state.begin("b", 256, 0, 2.0, 4, now=0.1)
    assert state.load(0.1).queued_s == pytest.approx(0.9 + 2.0)  # a has run 0.1 s
    state.first_token("a", 1.0, alone=False)
    decoding = 4 * state.decode_step_s  # a's expected output, one decode step each
    # b could start at a's first token: at 1.5 it has run 0.5 of its 2.0 s
    assert state.load(1.5).queued_s == pytest.approx(1.5 + decoding)
    assert state.load(None).queued_s == pytest.approx(2.0 + decoding)  # not aged


def test_a_live_worker_reprices_its_queue_when_its_fit_moves() -> None:
    state = _state()
    prior = state.prefill_model()
    state.begin("q", 256, 0, prior.seconds(256, 0), 4, now=0.0)
    for i in range(12):  # reports of a worker exactly twice as slow as the prior
        tokens = 32 * (i + 1)
        state.observe_prefill(f"r{i}", tokens, 0, 2 * prior.seconds(tokens, 0))
    assert state.prefill_model().seconds(256, 0) == pytest.approx(2 * prior.seconds(256, 0))
    assert state.load(None).queued_s == pytest.approx(2 * prior.seconds(256, 0))
