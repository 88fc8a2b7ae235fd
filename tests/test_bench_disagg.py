"""``kvstrata bench disagg``: the ``--quick`` entry's JSON shape from two real tiny workers,
and the pure inputs it (and the front door) price ``choose()`` with."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from kvstrata.bench.disagg import calibration_lengths
from kvstrata.bench.servers import counter_totals
from kvstrata.cli.bench_all import PLAN
from kvstrata.costs import OnlinePrefillFit
from kvstrata.router.costs import CostProfile
from kvstrata.router.disagg import choose
from kvstrata.router.disagg_inputs import (
    InterferenceEstimate,
    Link,
    OverheadEstimate,
    disagg_cost,
    kv_bytes_per_token,
)
from kvstrata.transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


def test_kv_bytes_per_token_is_one_block_over_its_tokens() -> None:
    assert kv_bytes_per_token(LAYOUT) == 2 * 2 * 2 * 16 * 4  # layers, K/V, heads, dim, fp32


def _cost(active: int, interference: float, prompt: int = 2048) -> str:
    profile = InterferenceEstimate(512, interference).apply(CostProfile())
    cost = disagg_cost(
        prompt_tokens=prompt,
        decode_cached_tokens=0,
        prefill_cached_tokens=0,
        decode_queue_s=0.0,
        prefill_queue_s=0.0,
        active_decodes=active,
        decode_profile=profile,
        prefill_profile=CostProfile(),
        layout=LAYOUT,
        link=Link(bytes_per_s=1e9),
        decode_step_s=0.01,
    )
    assert cost.kv_bytes_per_token == kv_bytes_per_token(LAYOUT) and cost.num_layers == 2
    return choose(cost).path


def test_learned_interference_moves_a_long_prompt_to_disagg_and_a_short_one_stays() -> None:
    assert _cost(active=0, interference=0.0) == "local"
    assert _cost(active=4, interference=0.5) == "disagg"
    assert _cost(active=0, interference=0.5, prompt=8) == "local"


def test_interference_estimate_learns_per_running_decode_and_ignores_alone_runs() -> None:
    estimate = InterferenceEstimate(chunk_tokens=512)
    estimate.observe(1.0, 0.2, 1024, 0)  # nothing ran alongside: says nothing
    assert estimate.samples == 0 and estimate.value_s == 0.0
    estimate.observe(1.0, 0.2, 1024, 4)  # 0.8 s over 2 steps x 4 decodes
    assert estimate.value_s == pytest.approx(0.1)
    estimate.observe(0.1, 0.2, 100, 2)  # faster than alone: clipped at 0, smoothed
    assert 0.0 < estimate.value_s < 0.1
    assert estimate.apply(CostProfile()).interference_s(1024, 2) == pytest.approx(
        2 * 2 * estimate.value_s
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_entry_prints_one_json_object_with_the_named_figures() -> None:
    entry = next(e for e in PLAN if e.name == "disagg")
    assert entry.quick is not None and "--json" in entry.quick
    argv = list(entry.quick)
    # smaller still than --quick (one length) to keep the test short; same code path
    argv[argv.index("--lengths") + 1] = "64"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", *argv],
        capture_output=True, text=True, timeout=280, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    shapes = [(p["prompt_tokens"], p["load"], p["queued_tokens"]) for p in result["points"]]
    assert shapes == [(64, 0, 0), (64, 2, 0), (64, 0, 256)]
    assert result["queued"] == [256]
    assert result["shared_compute"] is True  # two unpinned processes on this machine
    decode = result["decode_worker"]
    assert set(decode) == {"promotion_unloaded_blocks", "breakeven_recompute", "evictions"}
    assert sum(decode["promotion_unloaded_blocks"].values()) == 0  # no plan was cut short
    # The calibration fits the decode worker's own cost model (4 lengths: it leaves its prior),
    # and for this tiny model recomputing 63 tokens and fetching them cost about the same: a
    # point's transfer either became a whole hit, or the worker's break-even test chose to
    # recompute (counted). Nothing in between. (A break-even that wrongly refused every fetch
    # would pass here: test_engine_tiers checks that test on its own.)
    fetch_slower = decode["breakeven_recompute"].get("fetch_slower", 0)
    recomputed = sum(point["decode_hit_tokens"] == 0 for point in result["points"])
    assert recomputed <= fetch_slower
    for point in result["points"]:
        assert point["chosen"] in {"local", "disagg"} and point["best"] in {"local", "disagg"}
        assert point["ttft_local_s"] > 0 and point["ttft_disagg_s"] > 0
        best = "disagg" if point["ttft_disagg_s"] < point["ttft_local_s"] else "local"
        assert point["best"] == best
        assert point["decode_hit_tokens"] in {63, 0}  # the transfer landed as a hit, or see above
    assert 0.0 <= result["choice_accuracy"] <= 1.0
    assert result["transfers_sent"] == result["transfers"] == 3 * 3
    assert result["transfer_gbps"] > 0 and result["raw_socket_gbps"] > 0
    probes = result["link_probes"]
    assert len(probes) == 3 and all(p["bytes"] > 0 for p in probes)
    for probe in probes:
        assert math.isclose(probe["ratio"], probe["transfer_gbps"] / probe["raw_socket_gbps"])
    assert result["transfer_vs_raw"] == sorted(p["ratio"] for p in probes)[1]
    assert result["transfer_gbps"] == sorted(p["transfer_gbps"] for p in probes)[1]
    assert result["prefill_send_gbps"] > 0
    assert 0.0 <= result["overlap"] <= 1.0
    assert result["link_source"] == "measured"


def test_calibration_pads_the_swept_lengths_until_the_online_fit_leaves_its_prior() -> None:
    assert calibration_lengths([2048, 256]) == [64, 128, 256, 2048]
    assert calibration_lengths([64]) == [8, 16, 32, 64]
    assert calibration_lengths([512, 1024, 2048, 4096, 256]) == [256, 512, 1024, 2048, 4096]
    assert calibration_lengths([3]) == [1, 3]  # nothing below one token
    prior = CostProfile().prefill
    fit = OnlinePrefillFit(prior)
    for length in calibration_lengths([256, 2048]) * 2:  # what _calibrate feeds each worker
        fit.observe(length, 0, 0.01 + 2e-4 * length + 1e-8 * length * length / 2)
    assert fit.model() != replace(prior, spread=fit.model().spread)
    assert fit.model().seconds(2048, 0) == pytest.approx(0.01 + 2e-4 * 2048 + 1e-8 * 2048**2 / 2)


def test_overhead_estimate_learns_the_unpriced_gap_clipped_at_zero() -> None:
    estimate = OverheadEstimate()
    estimate.observe(0.09, 0.03)
    assert estimate.value_s == pytest.approx(0.06) and estimate.samples == 1
    estimate.observe(0.01, 0.03)  # faster than predicted: a gap of 0, smoothed
    assert estimate.value_s == pytest.approx(0.03)
    estimate.observe(float("nan"), 0.03)
    assert estimate.samples == 2


def test_counter_totals_sums_a_family_by_its_labels() -> None:
    page = (
        "# HELP kvstrata_tier_evictions_total Objects evicted\n"
        "# TYPE kvstrata_tier_evictions_total counter\n"
        'kvstrata_tier_evictions_total{outcome="dropped",tier="host"} 3.0\n'
        'kvstrata_tier_evictions_total{outcome="dropped",tier="host2"} 1.0\n'
        'kvstrata_tier_evictions_total{outcome="demoted",tier="host"} 2.0\n'
        'kvstrata_tier_evictions_created{outcome="demoted",tier="host"} 1.7e9\n'
        'kvstrata_tier_hits_total{tier="host"} 9.0\n'
    )
    by_both = counter_totals(page, "kvstrata_tier_evictions", ("tier", "outcome"))
    assert by_both == {"host/dropped": 3.0, "host2/dropped": 1.0, "host/demoted": 2.0}
    assert counter_totals(page, "kvstrata_tier_evictions", ("outcome",)) == {
        "dropped": 4.0,
        "demoted": 2.0,
    }
    assert counter_totals(page, "kvstrata_absent", ("tier",)) == {}
