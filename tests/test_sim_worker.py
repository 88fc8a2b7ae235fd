"""One simulated worker's cache accounting (``kvstrata.sim.worker``).

Review findings: a prefill that could not get KV room emptied the device cache before
giving up; the index was told the host tier held blocks it had no room for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
