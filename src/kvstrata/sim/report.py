"""Running several policies, searching the rate, and turning runs into the reported figures.

Figures per policy (all in simulated time):

* ``ttft_p50_s`` / ``ttft_p99_s`` — arrival → first token;
* ``throughput_tok_s`` — (prompt + generated tokens) / (first arrival → last completion);
* ``hit_rate`` — prompt tokens served from any cache tier / prompt tokens;
* ``utilisation`` — mean over workers of each worker's scarcer resource over first → last
  arrival: the larger of its prefill-busy fraction (``prefill_utilisation``) and the mean
  share of its device KV pool held by running requests (``kv_occupancy``), and the output
  tokens asked of it per second ÷ the most it can decode per second (``decode_demand``;
  decode-heavy traces saturate decode long before prefill compute: without this term the
  rate search drove them into a growing backlog); ``load_imbalance`` = max / mean over
  workers of the larger of their prefill-busy share and KV occupancy;
* ``ttft_prediction_mae_s`` — the router's predicted TTFT vs the simulated one.

``best_baseline`` is the non-kvstrata policy with the lowest ``ttft_p99_s``. The goal
(issue 4) is ``kvstrata_p99_vs_best_baseline ≤ 0.8`` and
``kvstrata_hit_rate_vs_infinite ≥ 0.9``.

Rate search (``search_rate_scale``): utilisation is close to proportional to the rate scale
(the work per request barely changes; the span shrinks), so the search iterates
``scale ← scale · target / utilisation(best baseline)`` from the trace's natural rate, with
every baseline run at each step (the best one can change with the rate), and stops within
``tolerance`` of the target or after ``iterations`` steps.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Final

import numpy as np

from kvstrata.errors import InvalidInput
from kvstrata.router import POLICIES
from kvstrata.sim.cluster import RunResult, SimConfig, simulate
from kvstrata.sim.trace import SimRequest, infinite_cache_hit_rate, prepare
from kvstrata.workloads.mooncake import TraceRequest

KVSTRATA: Final = "kvstrata"
GOAL_P99_RATIO: Final = 0.8
GOAL_HIT_RATIO: Final = 0.9


def parse_policies(text: str) -> list[str]:
    if text.strip() == "all":
        return list(POLICIES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise InvalidInput(
            f"unknown policies {unknown}; expected 'all' or some of {list(POLICIES)}"
        )
    return names


def _run_one(args: tuple[Sequence[SimRequest], str, SimConfig]) -> RunResult:
    requests, policy, config = args
    return simulate(requests, policy, config)


def run_policies(
    requests: Sequence[SimRequest],
    policies: Sequence[str],
    config: SimConfig,
    *,
    jobs: int = 1,
    on_done: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, RunResult]:
    """Each policy over the same requests; ``jobs > 1`` runs policies in parallel processes."""
    results: dict[str, RunResult] = {}
    if jobs <= 1 or len(policies) <= 1:
        for policy in policies:
            results[policy] = simulate(requests, policy, config, progress)
            if on_done is not None:
                on_done(policy)
        return results
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(jobs, len(policies)), mp_context=context) as pool:
        futures = {policy: pool.submit(_run_one, (requests, policy, config)) for policy in policies}
        for policy, future in futures.items():
            results[policy] = future.result()
            if on_done is not None:
                on_done(policy)
    return results


def summarize(result: RunResult) -> dict[str, Any]:
    ttft = np.asarray(result.ttft_s, dtype=np.float64)
    predicted = np.asarray(result.predicted_ttft_s, dtype=np.float64)
    span = max(result.window_end_s - result.first_arrival_s, 1e-9)
    prefill_busy = np.asarray(result.busy_s, dtype=np.float64) / span
    kv = np.asarray(result.kv_occupancy, dtype=np.float64)
    # A worker is as busy as its scarcer resource: prefill compute or KV memory for decodes.
    per_worker = np.maximum(prefill_busy, kv) if len(kv) == len(prefill_busy) else prefill_busy
    # ... or decode throughput: demand beyond it is a backlog no placement can drain in time.
    # (Decode demand is the cluster's average, so imbalance is measured without it.)
    busy = np.maximum(per_worker, result.decode_demand)
    placed_mean = float(per_worker.mean()) if len(per_worker) else 0.0
    mean_util = float(busy.mean()) if len(busy) else 0.0
    makespan = max(result.last_done_s - result.first_arrival_s, 1e-9)
    return {
        "ttft_p50_s": _r(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_p90_s": _r(np.percentile(ttft, 90)) if len(ttft) else None,
        "ttft_p99_s": _r(np.percentile(ttft, 99)) if len(ttft) else None,
        "ttft_mean_s": _r(ttft.mean()) if len(ttft) else None,
        "throughput_tok_s": _r((result.prompt_tokens + result.output_tokens) / makespan),
        "hit_rate": _r(result.hit_tokens / result.prompt_tokens) if result.prompt_tokens else 0.0,
        "utilisation": _r(mean_util),
        "prefill_utilisation": _r(float(prefill_busy.mean())) if len(prefill_busy) else 0.0,
        "kv_occupancy": _r(float(kv.mean())) if len(kv) else 0.0,
        "decode_demand": _r(result.decode_demand),
        "load_imbalance": (_r(float(per_worker.max()) / placed_mean) if placed_mean > 0 else None),
        "ttft_prediction_mae_s": (
            _r(np.abs(predicted - ttft).mean())
            if len(predicted) == len(ttft) and len(ttft)
            else None
        ),
        "device_evictions": result.device_evictions,
        "host_evictions": result.host_evictions,
    }


def _r(value: float | np.floating[Any]) -> float:
    return round(float(value), 4)


def best_baseline(summaries: dict[str, dict[str, Any]]) -> str | None:
    baselines = [name for name in summaries if name != KVSTRATA]
    if not baselines:
        return None
    return min(baselines, key=lambda name: summaries[name]["ttft_p99_s"])


def compare(summaries: dict[str, dict[str, Any]], infinite_hit_rate: float) -> dict[str, Any]:
    """The goal figures: kvstrata vs the best baseline and vs the infinite-cache bound."""
    best = best_baseline(summaries)
    out: dict[str, Any] = {
        "best_baseline": best,
        "kvstrata_p99_vs_best_baseline": None,
        "kvstrata_hit_rate_vs_infinite": None,
        "goal_met": False,
    }
    mine = summaries.get(KVSTRATA)
    if mine is None:
        return out
    if infinite_hit_rate > 0:
        out["kvstrata_hit_rate_vs_infinite"] = _r(mine["hit_rate"] / infinite_hit_rate)
    if best is not None and summaries[best]["ttft_p99_s"]:
        out["kvstrata_p99_vs_best_baseline"] = _r(
            mine["ttft_p99_s"] / summaries[best]["ttft_p99_s"]
        )
    p99_ratio = out["kvstrata_p99_vs_best_baseline"]
    hit_ratio = out["kvstrata_hit_rate_vs_infinite"]
    out["goal_met"] = bool(
        p99_ratio is not None
        and hit_ratio is not None
        and p99_ratio <= GOAL_P99_RATIO
        and hit_ratio >= GOAL_HIT_RATIO
    )
    return out


def search_rate_scale(
    trace: Sequence[TraceRequest],
    config: SimConfig,
    *,
    target: float,
    baselines: Sequence[str],
    start: float = 1.0,
    iterations: int = 6,
    tolerance: float = 0.02,
    jobs: int = 1,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[float, list[dict[str, Any]]]:
    """The rate scale at which the best baseline's mean utilisation is ``target`` (±tol)."""
    if not 0.0 < target < 1.0:
        raise InvalidInput(f"target utilisation must be in (0, 1), got {target}")
    if not baselines:
        raise InvalidInput("the rate search needs at least one baseline policy")
    scale = start
    history: list[dict[str, Any]] = []
    best_scale, best_gap = scale, float("inf")
    for _ in range(iterations):
        requests = prepare(trace, scale)
        summaries = {
            name: summarize(result)
            for name, result in run_policies(requests, baselines, config, jobs=jobs).items()
        }
        best = best_baseline(summaries)
        assert best is not None
        utilisation = summaries[best]["utilisation"]
        step = {"rate_scale": round(scale, 4), "best_baseline": best, "utilisation": utilisation}
        history.append(step)
        if on_step is not None:
            on_step(step)
        gap = abs(utilisation - target)
        if gap < best_gap:
            best_scale, best_gap = scale, gap
        if gap <= tolerance or utilisation <= 0:
            break
        # Damped near saturation: utilisation cannot exceed 1, so never jump by more than 2×.
        scale *= min(2.0, max(0.5, target / utilisation))
    return best_scale, history


def simulate_report(
    trace: Sequence[TraceRequest],
    policies: Sequence[str],
    config: SimConfig,
    *,
    rate_scale: float,
    source: str,
    jobs: int = 1,
    on_done: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], dict[str, RunResult]]:
    """The JSON report of every policy at one rate scale (and the raw runs, for plots)."""
    requests = prepare(trace, rate_scale)
    infinite = infinite_cache_hit_rate(requests)
    runs = run_policies(requests, policies, config, jobs=jobs, on_done=on_done, progress=progress)
    summaries = {name: summarize(run) for name, run in runs.items()}
    report: dict[str, Any] = {
        "trace": source,
        "requests": len(requests),
        "workers": config.workers,
        "rate_scale": round(rate_scale, 4),
        "profile": config.profile.name,
        "device_blocks": config.profile.device_blocks,
        "host_blocks": config.profile.host_blocks,
        "eviction": {"device": config.device_eviction, "host": config.host_eviction},
        "index": config.index_mode.value,
        "event_lag_s": config.event_lag_s,
        "estimate_noise": config.estimate_noise,
        "oracle": config.oracle,
        "service_noise": config.effective_service_noise,
        "seed": config.seed,
        "infinite_cache_hit_rate": _r(infinite),
        "policies": summaries,
        **compare(summaries, infinite),
    }
    return report, runs
