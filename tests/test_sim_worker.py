"""One simulated worker's cache accounting (``kvstrata.sim.worker``).

Review findings: a prefill that could not get KV room emptied the device cache before
giving up; the index was told the host tier held blocks it had no room for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvstrata.index.core import Medium
from kvstrata.sim.cluster import _eviction_policy, build_metas
from kvstrata.sim.profiles import gpu_a100_8b
from kvstrata.sim.trace import SimRequest
from kvstrata.sim.worker import Job, SimWorker

Report = tuple[str, bool, list[int], float]


def _worker(
    requests: Sequence[SimRequest], device_blocks: int, host_blocks: int
) -> tuple[SimWorker, Any, list[Report]]:
    profile = gpu_a100_8b().with_capacities(device_blocks, host_blocks)
    built = build_metas(requests, profile)
    reports: list[Report] = []

    def report(_worker_id: str, ids: list[int], medium: Medium, stored: bool, now: float) -> None:
        reports.append((medium.name, stored, sorted(ids), now))

    worker = SimWorker(
        "w0",
        profile,
        device_policy=_eviction_policy("lru", profile, device=True, seed=0),
        host_policy=_eviction_policy("lru", profile, device=False, seed=0),
        metas=built.metas,
        block_ids=built.block_ids(),
        report=report,
    )
    return worker, built, reports


def _job(request: SimRequest, built: Any) -> Job:
    return Job(request, tuple(built.keys[h] for h in request.hashes), 0.1, request.prompt_tokens)


def _run_prefill(worker: SimWorker, job: Job, now: float) -> float:
    worker.enqueue(job)
    end = worker.try_start(now)
    assert end is not None
    worker.finish_prefill(end)
    return end


def test_a_prefill_that_cannot_start_evicts_nothing() -> None:
    a = SimRequest(0, 0.0, 10 * 512, 1, tuple(range(100, 110)))  # leaves 10 cached blocks
    long = SimRequest(1, 0.0, 2 * 512, 8 * 512, (200, 201))  # 2 pinned + 8 private, decoding
    c = SimRequest(2, 0.0, 12 * 512, 1, tuple(range(300, 312)))  # needs 13 blocks
    worker, built, reports = _worker([a, long, c], device_blocks=20, host_blocks=0)
    now = _run_prefill(worker, _job(a, built), 0.0)
    now = _run_prefill(worker, _job(long, built), now)
    assert (len(worker.device), len(worker.pins), worker.private_blocks) == (12, 2, 8)
    reports.clear()
    worker.enqueue(_job(c, built))
    assert worker.try_start(now) is None and worker.blocked
    # 12 cached + 8 private + 13 needed − 20 = 13 to evict, only 10 evictable: it waits
    # without touching the cache.
    evictions = [r for r in reports if not r[1]]
    assert evictions == []
    assert len(worker.device) == 12 and worker.device_evictions == 0
    assert all(built.keys[h] in worker.device for h in a.hashes)
    # Once the long decode ends, C starts and evicts exactly what it needs: 12 + 13 − 20.
    done = worker.next_decode_s(now)
    assert done is not None
    assert [j.request.index for j in worker.finish_decodes(done)] == [1]
    assert worker.try_start(done) is not None
    assert worker.device_evictions == 5
    assert sum(len(ids) for _m, stored, ids, _t in reports if not stored) == 5


def test_the_index_hears_only_of_host_blocks_the_host_took() -> None:
    a = SimRequest(0, 0.0, 6 * 512 + 100, 1, tuple(range(10, 16)))
    worker, built, reports = _worker([a], device_blocks=64, host_blocks=3)
    _run_prefill(worker, _job(a, built), 0.0)
    ids = built.block_ids()
    held = sorted(ids[key] for key in worker.host)
    assert len(held) == 3
    host_stores = [r[2] for r in reports if r[0] == Medium.HOST.name and r[1]]
    assert host_stores == [held]
    device_stores = [r[2] for r in reports if r[0] == Medium.DEVICE.name and r[1]]
    assert device_stores == [sorted(ids[built.keys[h]] for h in a.hashes)]


def test_prompts_that_fit_in_one_step_start_together_and_pay_one_fixed_cost() -> None:
    """The engine packs waiting prompts into one step's token budget (``runtime.scheduler``):
    the simulated worker does too, instead of one prompt per step."""
    a = SimRequest(0, 0.0, 1024, 1, (1, 2))
    b = SimRequest(1, 0.0, 512, 1, (3,))  # 1,536 ≤ 2,048: shares a's step
    c = SimRequest(2, 0.0, 1024, 1, (4, 5))  # 2,560 > 2,048: the next step
    worker, built, _ = _worker([a, b, c], device_blocks=64, host_blocks=0)
    assert worker.cost.prefill_chunk_tokens == 2048
    for request in (a, b, c):
        worker.enqueue(_job(request, built))
    model = worker.cost.prefill
    end = worker.try_start(0.0)
    assert end == pytest.approx(model.seconds(1024, 0) + model.seconds(512, 0) - model.overhead_s)
    assert [job.request.index for job in worker.running] == [0, 1]
    assert worker.load(0.0).queued_requests == 3  # two in prefill, one waiting
    first = worker.finish_prefill(end)
    assert [(job.request.index, job.leads) for job in first] == [(0, True), (1, False)]
    assert first[0].ttft_s == first[1].ttft_s == end
    # Each reports what it would have taken alone (what the engine's split reports).
    assert [job.compute_s for job in first] == [model.seconds(1024, 0), model.seconds(512, 0)]
    second = worker.try_start(end)
    assert second == pytest.approx(end + model.seconds(1024, 0))


def test_a_prompt_continuing_blocks_the_batch_computes_waits_for_them() -> None:
    """As the engine's ``Admission.DEFER``: it hits them after the step, not beside it."""
    a = SimRequest(0, 0.0, 512, 1, (1,))
    b = SimRequest(1, 0.0, 612, 1, (1,))
    worker, built, _ = _worker([a, b], device_blocks=64, host_blocks=0)
    worker.enqueue(_job(a, built))
    worker.enqueue(_job(b, built))
    end = worker.try_start(0.0)
    assert end is not None and [job.request.index for job in worker.running] == [0]
    worker.finish_prefill(end)
    assert worker.try_start(end) is not None
    assert worker.running[0].hit_tokens == 512
