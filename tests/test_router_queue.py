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


def test_prompts_that_fit_in_one_step_share_its_fixed_cost() -> None:
    """The engine packs waiting prompts into one step of ``step_tokens`` and pays the fixed
    cost once (stop 39's diagnosis: short prompts late in a burst were predicted up to 4×
    too long, one fixed cost each)."""
    queue = [
        Queued(1.0, 0.0, 0.0, 400, 0.1),
        Queued(0.5, 0.0, 0.0, 100, 0.1),  # 500 ≤ 512: shares the head's step
        Queued(0.5, 0.0, 0.0, 100, 0.1),  # 600 > 512: starts the next step
        Queued(0.3, 0.0, 0.0, 50, 0.1),  # packs behind it
    ]
    assert queued_seconds(queue, 0.0) == pytest.approx(2.3)  # no budget: one step each
    assert queued_seconds(queue, 0.0, 512) == pytest.approx(1.4 + 0.7)
    assert queued_seconds(queue, 0.2, 512) == pytest.approx(1.2 + 0.7)  # the head pack aged
    long_head = [Queued(2.0, 0.0, 0.0, 600, 0.1), Queued(0.5, 0.0, 0.0, 10, 0.1)]
    assert queued_seconds(long_head, 0.0, 512) == pytest.approx(2.5)  # a longer step runs alone
    unknown = [Queued(1.0, 0.0, 0.0, 100, 0.1), Queued(0.5, 0.0, 0.0, 0, 0.1)]
    assert queued_seconds(unknown, 0.0, 512) == pytest.approx(1.5)  # unknown size: no pack
    cheap = [Queued(1.0, 0.0, 0.0, 100, 0.1), Queued(0.05, 0.0, 0.0, 10, 0.1)]
    assert queued_seconds(cheap, 0.0, 512) == pytest.approx(1.0)  # never below nothing
    unknown_head = [Queued(1.0, 0.0, 0.0, 0, 0.1), Queued(0.5, 0.0, 0.0, 100, 0.1)]
    assert queued_seconds(unknown_head, 0.0, 512) == pytest.approx(1.5)  # nothing fits beside


def test_a_step_that_has_begun_takes_no_newcomer() -> None:
    """Review finding: a request placed while the head's step ran was packed into it."""
    queue = [
        Queued(1.0, 0.0, 0.0, 100, 0.1, placed_s=0.0),
        Queued(0.5, 0.0, 0.0, 100, 0.1, placed_s=2.0),  # placed after the head started (1.0)
        Queued(0.5, 0.0, 0.0, 100, 0.1, placed_s=2.1),  # packs with the one ahead of it
    ]
    assert queued_seconds(queue, 0.0, 512, head_since_s=1.0) == pytest.approx(1.0 + 0.9)
    assert queued_seconds(queue, 0.0, 512, head_since_s=3.0) == pytest.approx(1.8)


def test_a_live_worker_packs_short_queued_prompts() -> None:
    state = _state()
    fixed = state.prefill_fit.model().overhead_s  # the engine's step, not the serving around it
    assert fixed > 0
    state.begin("a", 200, 0, 1.0, None, now=0.0)  # running from 0.0: nothing joins its step
    state.begin("b", 200, 0, 1.0, None, now=0.1)
    state.begin("c", 200, 0, 1.0, None, now=0.2)  # packs with b: 400 tokens
    state.begin("d", 200, 0, 1.0, None, now=0.3)  # 600: the next step
    assert state.load(None).queued_s == pytest.approx(1.0 + (2.0 - fixed) + 1.0)
    state.first_token("a", 0.5, alone=False)  # b's step starts: c joins it, d does not
    decoding = state.mean_output_tokens * state.decode_step_s
    assert state.load(None).queued_s == pytest.approx((2.0 - fixed) + 1.0 + decoding)


def _state(step_tokens: int | None = None) -> WorkerState:
    info = WorkerInfo(
        "w0", "http://h", 1, "m", router_fingerprint("m", 16), 16, "tcp://h:1", None, 0,
        step_tokens=step_tokens,
    )  # fmt: skip
    return WorkerState(info, default_profile(16))


def test_a_live_worker_packs_by_its_own_step_budget() -> None:
    """A worker that reports its step budget (``/kv/info`` ``step_tokens``) is packed by it;
    one that does not, by the reference engine's default (512)."""
    queued = {}
    for budget in (None, 256, 2048):
        state = _state(budget)
        state.begin("a", 200, 0, 1.0, None, now=0.0)  # running: nothing joins its step
        for name in "bcd":
            state.begin(name, 200, 0, 1.0, None, now=0.1)
        queued[budget] = state.load(None).queued_s
        assert state.interference.chunk_tokens == (budget or 512)
    fixed = _state().prefill_fit.model().overhead_s
    assert queued[256] == pytest.approx(4.0)  # 400 > 256: one step each
    assert queued[None] == pytest.approx(4.0 - fixed)  # b and c share a step, d runs alone
    assert queued[2048] == pytest.approx(4.0 - 2 * fixed)  # b, c and d share one


def test_a_live_worker_ages_its_head_from_the_last_first_token() -> None:
    state = _state()
    state.begin("a", 300, 0, 1.0, 4, now=0.0)  # 600 tokens: too many for one engine step
    state.begin("b", 300, 0, 2.0, 4, now=0.1)
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
