"""What the simulated router reads: never a request's true future output; common noise.

Review findings: the router's ``active_kv_blocks`` / ``kv_utilisation`` counted every running
request's *true* output length from its prefill start, ``RouteRequest.expected_output_tokens``
was the truth, ``queued_prefill_tokens`` dropped at a prefill start no router can see, and
the per-job service noise came from one stream in prefill-start order (so two policies gave
the same request different noise).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from kvstrata.index.core import PrefixMatch
from kvstrata.router.model import RouteDecision, RouteRequest, RoutingPolicy, WorkerLoad
from kvstrata.sim.cluster import SimConfig, Simulation, _eviction_policy, build_metas
from kvstrata.sim.profiles import BLOCK_TOKENS, gpu_a100_8b
from kvstrata.sim.trace import SimRequest
from kvstrata.sim.view import ServiceNoise
from kvstrata.sim.worker import Job, SimWorker

PRIOR_OUTPUT = 64
"""The live fleet's expected output before any request ended (``WorkerState`` default)."""


class _Recorder:
    """Wraps the policy the router holds; records what each decision was shown."""

    def __init__(self, inner: RoutingPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[tuple[RouteRequest, list[WorkerLoad]]] = []

    def choose(
        self,
        request: RouteRequest,
        matches: Mapping[str, PrefixMatch],
        loads: Sequence[WorkerLoad],
    ) -> RouteDecision:
        self.seen.append((request, list(loads)))
        return self.inner.choose(request, matches, loads)

    def __getattr__(self, name: str) -> Any:  # lifecycle hooks (dynamo) go to the policy
        return getattr(self.inner, name)


def _record(
    requests: Sequence[SimRequest], policy: str, config: SimConfig
) -> tuple[Simulation, _Recorder]:
    sim = Simulation(requests, policy, config)
    recorder = _Recorder(sim.router.policy)
    sim.router.policy = recorder
    sim.run()
    return sim, recorder


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("policy", ["llm-d", "kvstrata", "least-loaded"])
def test_router_never_sees_a_requests_true_output_length(policy: str, oracle: bool) -> None:
    """Two runs that differ only in A's output length (200 vs 300,000 tokens) show the router
    the very same figures when B arrives: A has produced a few dozen tokens by then."""
    config = SimConfig(profile=gpu_a100_8b(), workers=2, seed=0, oracle=oracle)
    seen = []
    for output in (200, 300_000):
        a = SimRequest(0, 0.0, 4096, output, tuple(range(8)))
        b = SimRequest(1, 1.0, 9216, 10, tuple(range(8)) + tuple(range(100, 110)))
        sim, recorder = _record([a, b], policy, config)
        assert sim.jobs[0].start_s + sim.jobs[0].prefill_s < 1.0 < sim.jobs[0].done_s
        seen.append(recorder.seen)
    short, long = seen
    assert len(short) == len(long) == 2
    assert short[1][1] == long[1][1]  # B's decision: every worker's load figures
    for (request_short, loads_short), (request_long, loads_long) in zip(short, long, strict=True):
        assert loads_short == loads_long
        assert request_short.expected_output_tokens == request_long.expected_output_tokens == 0
    # A is counted as the live fleet counts it: prompt + the prior mean output.
    held = max(short[1][1], key=lambda load: load.active_kv_blocks)
    assert held.active_kv_blocks == (4096 + PRIOR_OUTPUT) // BLOCK_TOKENS


def _worker(requests: Sequence[SimRequest], device_blocks: int = 64) -> tuple[SimWorker, Any]:
    profile = gpu_a100_8b().with_capacities(device_blocks, 0)
    built = build_metas(requests, profile)
    worker = SimWorker(
        "w0",
        profile,
        device_policy=_eviction_policy("lru", profile, device=True, seed=0),
        host_policy=_eviction_policy("lru", profile, device=False, seed=0),
        metas=built.metas,
        block_ids=built.block_ids(),
        report=lambda *_args: None,
    )
    return worker, built


def _job(request: SimRequest, built: Any) -> Job:
    keys = tuple(built.keys[h] for h in request.hashes)
    return Job(request, keys, 0.1, request.prompt_tokens)


def test_kv_figure_is_prompt_plus_the_running_mean_of_finished_outputs() -> None:
    a = SimRequest(0, 0.0, 1024, 300, (1, 2))
    b = SimRequest(1, 0.0, 900, 5, ())
    worker, built = _worker([a, b])
    worker.enqueue(_job(a, built))
    # Sent, not started: already counted (the live fleet counts from the send).
    assert worker.load(0.0).active_kv_blocks == (1024 + PRIOR_OUTPUT) // BLOCK_TOKENS
    end = worker.try_start(0.0)
    assert end is not None
    worker.finish_prefill(end)
    assert (
        worker.load(end).active_kv_blocks == (1024 + PRIOR_OUTPUT) // BLOCK_TOKENS
    )  # not 1024 + 300
    done = worker.next_decode_s(end)
    assert done is not None
    assert [job.request.index for job in worker.finish_decodes(done)] == [0]
    assert worker.load(done).active_kv_blocks == 0
    assert worker.mean_output_tokens == 300.0  # A's output, known once A ended
    worker.enqueue(_job(b, built))
    load = worker.load(done)
    assert load.active_kv_blocks == (900 + 300) // BLOCK_TOKENS
    assert load.kv_utilisation == pytest.approx(load.active_kv_blocks / 64)


def test_queued_prefill_tokens_count_a_running_prefill_until_its_first_token() -> None:
    """A router cannot see a prefill start: A's predicted new tokens stay queued until A's
    first token comes back (the live fleet's ``queued_prefill_tokens``)."""
    a = SimRequest(0, 0.0, 8192, 2, ())
    b = SimRequest(1, 0.01, 1024, 2, ())
    sim, recorder = _record([a, b], "round-robin", SimConfig(profile=gpu_a100_8b(), workers=1))
    assert sim.jobs[0].start_s == 0.0 and sim.jobs[0].prefill_s > 0.01  # A runs at B's arrival
    (load,) = recorder.seen[1][1]
    assert load.queued_requests == 1
    assert load.queued_prefill_tokens == 8192


def test_a_requests_noise_draw_depends_on_seed_and_request_only() -> None:
    noise, again = ServiceNoise(4, 0.1, seed=3), ServiceNoise(4, 0.1, seed=3)
    forward = [noise.factor(i % 4, i) for i in range(50)]
    backward = [again.factor(i % 4, i) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert noise.job_factor(7) == again.job_factor(7) != ServiceNoise(4, 0.1, 4).job_factor(7)
    assert noise.factor(2, 7) == noise.worker_factor[2] * noise.job_factor(7)


def _unshared(
    count: int, *, rate: float, prompts: tuple[int, int], output: int, seed: int
) -> list[SimRequest]:
    """``count`` Poisson arrivals at ``rate`` per second, prompts of random lengths in the
    ``prompts`` range sharing no block, ``output`` tokens each."""
    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        prompt = rng.randint(*prompts)
        hashes = tuple(rng.randrange(10**9) for _ in range(prompt // BLOCK_TOKENS))
        requests.append(SimRequest(i, t, prompt, output, hashes))
    return requests


def test_every_policy_gives_a_request_the_same_per_job_noise() -> None:
    """Common random numbers: with no cache hits, no decodes and no host tier a prefill's
    compute is model(prompt) × worker factor × job factor (packed or not: each prompt's own
    part); the job factor must not depend on the policy."""
    profile = gpu_a100_8b().with_capacities(None, 0)
    requests = _unshared(200, rate=20.0, prompts=(600, 8000), output=1, seed=1)
    config = SimConfig(profile=profile, workers=4, seed=3)
    per_policy = {}
    for policy in ("round-robin", "least-loaded", "kvstrata"):
        sim = Simulation(requests, policy, config)
        sim.run()
        per_policy[policy] = [
            job.compute_s
            / profile.cost.prefill.seconds(job.request.prompt_tokens, 0)
            / sim.noise.worker_factor[job.worker]
            for job in sorted(sim.jobs, key=lambda job: job.request.index)
        ]
    first, *others = per_policy.values()
    assert len(set(first)) > 100  # real noise
    for factors in others:
        assert factors == pytest.approx(first, rel=1e-9)


def test_the_prior_output_is_the_live_fleets() -> None:
    from kvstrata.fleet.workers import WorkerState
    from kvstrata.sim.worker import PRIOR_OUTPUT_TOKENS

    assert WorkerState.__dataclass_fields__["mean_output_tokens"].default == PRIOR_OUTPUT_TOKENS
    assert int(PRIOR_OUTPUT_TOKENS) == PRIOR_OUTPUT


def test_the_router_learns_a_prefills_own_compute_not_the_decode_steps_beside_it() -> None:
    """The live engine reports a request's share of its steps (``serve.timing``): its own
    compute, without the decode steps interleaved with its chunks. The simulated router
    learns the same figure, not the whole start → first token time."""
    profile = gpu_a100_8b().with_capacities(None, 0)
    requests = _unshared(120, rate=8.0, prompts=(600, 6000), output=300, seed=5)  # decodes run
    sim = Simulation(requests, "round-robin", SimConfig(profile=profile, workers=2, seed=3))
    assert sim.view is not None
    learned: list[float] = []
    first_token = sim.view.first_token

    def spy(worker: int, new: int, cached: int, measured_s: float, now: float) -> None:
        learned.append(measured_s)
        first_token(worker, new, cached, measured_s, now)

    sim.view.first_token = spy  # type: ignore[method-assign]
    sim.run()
    model = profile.cost.prefill
    for job in sim.jobs:
        new = job.request.prompt_tokens - job.hit_tokens
        factor = sim.noise.factor(job.worker, job.request.index)
        assert job.compute_s == pytest.approx(model.seconds(new, job.hit_tokens) * factor)
    assert sorted(learned) == sorted(job.compute_s for job in sim.jobs)
    slowed = [job for job in sim.jobs if job.prefill_s > 1.01 * job.compute_s]
    assert len(slowed) > 20  # decodes really ran beside these prefills
