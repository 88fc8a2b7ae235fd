"""The simulated router knows no more than a live one (``kvstrata.sim.view``); ``--oracle``."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstrata.cli.main import main
from kvstrata.costs import PrefillModel
from kvstrata.router.model import RouteDecision, RouteRequest, WorkerLoad
from kvstrata.sim.cluster import SimConfig, Simulation, simulate
from kvstrata.sim.profiles import gpu_a100_8b
from kvstrata.sim.report import summarize
from kvstrata.sim.trace import SimRequest, prepare
from kvstrata.sim.view import RouterView, ServiceNoise, prior_prefill, scaled_prefill
from kvstrata.workloads.synthetic import generate, preset, write_trace

SHAPES = [(128, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (512, 1024), (1024, 1536)]
"""(new, cached) prompt shapes inside the synthetic chat trace's range (the fit is not
expected to extrapolate its attention term far beyond what it observed)."""


def _requests(rate_scale: float = 6.0, duration_s: float = 150.0) -> list[SimRequest]:
    config = replace(preset("chat", 1), duration_s=duration_s, conversation_rate_per_s=1.0)
    return prepare(generate(config), rate_scale=rate_scale)


def _config(**kwargs: object) -> SimConfig:
    profile = gpu_a100_8b().with_capacities(256, 1024)
    return SimConfig(profile=profile, workers=3, **kwargs)  # type: ignore[arg-type]


def _error(model: PrefillModel, truth: PrefillModel) -> float:
    """Mean relative error of ``model`` against ``truth`` over typical prompt shapes."""
    return statistics.fmean(abs(model.seconds(n, c) / truth.seconds(n, c) - 1.0) for n, c in SHAPES)


class _Recording(Simulation):
    """Records, at every arrival, the router's queue estimate beside the simulator's truth."""

    pairs: list[tuple[float, float]]

    def _arrive(self, request: SimRequest) -> None:
        if not hasattr(self, "pairs"):
            self.pairs = []
        for n, worker in enumerate(self.workers):
            truth: WorkerLoad = worker.load(self.now)
            if self.view is not None:
                believed = self.view.load(n, truth, self.now).queued_s
            else:
                believed = truth.queued_s
            self.pairs.append((believed, truth.queued_s))
        super()._arrive(request)


def test_router_estimates_differ_from_truth_with_noise() -> None:
    requests = _requests()
    live = _Recording(requests, "kvstrata", _config(service_noise=0.2))
    live.run()
    busy = [(b, t) for b, t in live.pairs if t > 0]
    assert busy, "the trace never queued: the test would prove nothing"
    wrong = [abs(b - t) for b, t in busy if abs(b - t) > 1e-3 * max(t, 1e-3)]
    assert len(wrong) > len(busy) // 2
    oracle = _Recording(requests, "kvstrata", _config(oracle=True))
    oracle.run()
    assert all(b == t for b, t in oracle.pairs)


def _compute_only(**kwargs: object) -> SimConfig:
    """``_config`` without host fetches or decode interference: a worker's start → first
    token is then its prefill alone."""
    config = _config(**kwargs)
    cost = replace(config.profile.cost, decode_interference_s=0.0, prefill_chunk_tokens=0)
    return replace(config, profile=replace(config.profile, cost=cost).with_capacities(None, 0))


def test_the_fit_starts_from_a_wrong_prior_and_converges_toward_the_truth() -> None:
    truth = _config().profile.cost.prefill
    prior = prior_prefill(truth)
    assert _error(prior, truth) > 0.1

    def errors(duration_s: float) -> tuple[list[float], list[float]]:
        sim = Simulation(
            _requests(duration_s=duration_s), "round-robin", _compute_only(service_noise=0.1)
        )
        sim.run()
        assert sim.view is not None
        # Each worker's truth includes its persistent slowdown: that is what it must learn.
        own = [scaled_prefill(truth, factor) for factor in sim.noise.worker_factor]
        fitted = [_error(sim.view.fit(n).model(), own[n]) for n in range(3)]
        return fitted, [_error(prior, own[n]) for n in range(3)]

    early, _ = errors(20.0)
    late, prior_errors = errors(400.0)
    assert all(fit < prior / 2 for fit, prior in zip(late, prior_errors, strict=True))
    assert max(late) < 0.06
    assert sum(late) < sum(early)
    exact = Simulation(_requests(duration_s=60.0), "round-robin", _compute_only(service_noise=0.0))
    exact.run()
    assert exact.view is not None
    assert _error(exact.view.fit(0).model(), truth) < 1e-6  # noiseless timings pin the model


def test_the_router_refits_from_a_prefills_own_compute_as_a_live_engine_reports() -> None:
    """The live engine reports a request's own share of its steps (``serve.timing``): no host
    fetch (done at admission) and not the decode steps shared with it. The simulated router
    learns the same figure, so with host fetches and decodes beside the prefills it learns
    what it learns without them: the noiseless truth. (Until the engine reported its share,
    the router learned admission → first token and the simulator did the same: stop 35.)"""
    requests = _requests(duration_s=60.0)
    loaded = Simulation(requests, "round-robin", _config(service_noise=0.0))
    loaded.run()
    assert loaded.view is not None
    assert any(job.prefill_s > 1.01 * job.compute_s for job in loaded.jobs)  # they were slowed
    truth = _config().profile.cost.prefill
    assert _error(loaded.view.fit(0).model(), truth) < 1e-6


def test_the_router_is_not_handed_the_true_profile() -> None:
    """Fails if the non-oracle router prices with the simulator's own cost model."""
    config = _config(service_noise=0.0)
    truth = config.profile.cost
    sim = Simulation(_requests(duration_s=30.0), "kvstrata", config)
    assert sim.view is not None
    for n in range(config.workers):
        assert sim.view.profile(f"w{n}").prefill != truth.prefill
    handed: list[tuple[float, float]] = []
    route = sim.router.route

    def spy(request: RouteRequest, loads: Sequence[WorkerLoad], **kwargs: Any) -> RouteDecision:
        truths = [worker.load(sim.now).queued_s for worker in sim.workers]
        handed.extend(zip([load.queued_s for load in loads], truths, strict=True))
        return route(request, loads, **kwargs)

    sim.router.route = spy  # type: ignore[method-assign]
    result = sim.run()
    # The loads the policy read are the router's estimates, not the simulator's queues.
    assert any(abs(seen - true) > 1e-6 for seen, true in handed if true > 0)
    # The first request meets an idle cluster: with the truth its prediction would be exact.
    assert result.predicted_ttft_s[0] != pytest.approx(result.ttft_s[0], rel=1e-6)
    oracle = simulate(_requests(duration_s=30.0), "kvstrata", _config(oracle=True))
    assert oracle.predicted_ttft_s[0] == pytest.approx(oracle.ttft_s[0], rel=1e-9)


def test_oracle_is_deterministic_and_ignores_service_noise() -> None:
    requests = _requests(duration_s=60.0)
    plain = summarize(simulate(requests, "kvstrata", _config(oracle=True)))
    noisy = summarize(simulate(requests, "kvstrata", _config(oracle=True, service_noise=0.5)))
    assert plain == noisy
    assert _config(oracle=True).effective_service_noise == 0.0
    # The noiseless executed time of a lone prefill is the model's.
    one = simulate(requests[:1], "round-robin", _config(oracle=True))
    request = requests[0]
    assert one.ttft_s[0] == pytest.approx(
        _config().profile.cost.prefill.seconds(request.prompt_tokens, 0), rel=1e-9
    )


def test_service_noise_is_seeded_lognormal_with_a_per_worker_slowdown() -> None:
    noise = ServiceNoise(4, 0.1, seed=0)
    draws = [noise.factor(0, index) for index in range(2000)]
    again = ServiceNoise(4, 0.1, seed=0)
    assert draws == [again.factor(0, index) for index in range(2000)]
    assert 0.05 < statistics.pstdev(draws) < 0.2
    assert len(set(noise.worker_factor)) == 4
    assert ServiceNoise(4, 0.0, seed=0).factor(1, 5) == 1.0
    requests = _requests(duration_s=40.0)
    quiet = simulate(requests, "round-robin", _config(service_noise=0.0))
    loud = simulate(requests, "round-robin", _config(service_noise=0.1))
    assert quiet.prefill_s != loud.prefill_s


@pytest.mark.parametrize(
    ("flags", "oracle", "noise"),
    [([], False, 0.1), (["--service-noise", "0.25"], False, 0.25), (["--oracle"], True, 0.0)],
)
def test_cli_says_which_information_model_ran(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    oracle: bool,
    noise: float,
) -> None:
    trace = tmp_path / "chat.jsonl"
    config = replace(preset("chat", 1), duration_s=30.0, conversation_rate_per_s=1.0)
    write_trace(trace, generate(config))
    args = ["sim", "--trace", str(trace), "--workers", "2", "--policies", "round-robin"]
    assert main([*args, "--device-blocks", "256", "--json", "--quiet", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["oracle"] is oracle
    assert report["service_noise"] == noise


def test_queued_predictions_are_repriced_as_the_fit_learns() -> None:
    """A queue filled while the router priced with its prior corrects itself once the fit
    learns the worker is slower, before any of those queued requests comes back."""
    cost = _config().profile.cost
    view = RouterView(cost, 1)
    prior = view.fit(0).model()
    queued = [(4096, 0), (1024, 2048)]
    for new, cached in queued:
        view.sent(0, prior.seconds(new, cached), 0.0, new, cached)
    view.sent(0, 0.5, 0.0)  # no tokens given: kept as predicted
    assert view.queued_s(0, 0.0) == pytest.approx(sum(prior.seconds(n, c) for n, c in queued) + 0.5)
    slower = scaled_prefill(cost.prefill, 2.0)
    for new, cached in SHAPES * 2:  # timings of other requests (the fit alone sees them)
        view.fit(0).observe(new, cached, slower.seconds(new, cached))
    learnt = view.fit(0).model()
    assert learnt.name == "online"
    want = sum(learnt.seconds(n, c) for n, c in queued) + 0.5
    assert view.queued_s(0, 0.0) == pytest.approx(want)
    assert view.queued_s(0, 0.0) > 1.5 * (sum(prior.seconds(n, c) for n, c in queued))
