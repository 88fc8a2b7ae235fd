"""Pure parts of ``kvstrata bench vllm-fleet``: counters from vLLM's ``/metrics``, hit rate,
goals, policy order, output comparison and the router's ``--worker`` argument."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstrata.bench.vllm_fleet_report import (
    FleetRun,
    counter_delta,
    goals,
    hit_rate,
    mismatches,
    run_order,
    server_counters,
    summarize,
)
from kvstrata.errors import InvalidInput
from kvstrata.fleet.vllm_bench import FleetWorkload, worker_arg
from kvstrata.fleet.vllm_workers import VllmWorker

METRICS = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
"""


def test_counters_sum_label_sets_and_default_to_zero() -> None:
    got = server_counters(METRICS)
    assert got == {
        "prompt_tokens": 1000.0,
        "prefix_cache_hit_tokens": 600.0,
        "external_hit_tokens": 96.0,
        "requests": 9.0,
        "preemptions": 0.0,
    }
    assert server_counters("")["requests"] == 0.0


def test_hit_rate_is_device_plus_external_hits_over_prompt_tokens_of_all_servers() -> None:
    before = server_counters(METRICS)
    after = dict(before, prompt_tokens=1500.0, prefix_cache_hit_tokens=800.0, requests=10.0)
    delta = counter_delta(before, after)
    assert delta["prompt_tokens"] == 500 and delta["requests"] == 1
    other = {"prompt_tokens": 500.0, "prefix_cache_hit_tokens": 0.0, "external_hit_tokens": 250.0}
    assert hit_rate([delta, other]) == pytest.approx((200 + 250) / 1000)
    assert hit_rate([{"prompt_tokens": 0.0}]) is None


def _medians(**p50: float | None) -> dict[str, dict[str, float | None]]:
    return {name.replace("_", "-"): {"ttft_p50_ms": v, "ttft_p99_ms": v} for name, v in p50.items()}


def test_goals_against_round_robin_and_the_best_other_policy() -> None:
    met = goals(_medians(kvstrata=70.0, round_robin=100.0, llm_d=75.0, dynamo=90.0))
    assert met["ttft_p50_ms_vs_round_robin"]["met"] is True
    assert met["ttft_p50_ms_vs_round_robin"]["ratio"] == pytest.approx(0.7)
    assert met["ttft_p99_ms_vs_best_other"]["peer"] == "llm-d"
    assert met["ttft_p99_ms_vs_best_other"]["met"] is True
    missed = goals(_medians(kvstrata=85.0, round_robin=100.0, llm_d=80.0, dynamo=90.0))
    assert missed["ttft_p50_ms_vs_round_robin"]["met"] is False  # 0.85 > 0.8
    assert missed["ttft_p50_ms_vs_best_other"]["met"] is False  # 85 > llm-d's 80
    assert missed["ttft_p50_ms_vs_best_other"]["peer_ms"] == 80.0
    absent = goals(_medians(kvstrata=None, round_robin=100.0))
    assert not any(g["met"] for g in absent.values())  # a missing figure never meets a goal
    no_rr = goals(_medians(kvstrata=50.0, llm_d=80.0))
    assert no_rr["ttft_p50_ms_vs_round_robin"]["met"] is False


def test_run_order_rotates_and_balances_positions() -> None:
    policies = ("a", "b", "c", "d")
    orders = [run_order(policies, r) for r in range(1, 5)]
    assert orders[0] == ["a", "b", "c", "d"] and orders[1] == ["d", "c", "b", "a"]
    assert orders[2] == ["b", "c", "d", "a"] and orders[3] == ["a", "d", "c", "b"]
    for first, second in (orders[:2], orders[2:]):
        positions = {p: first.index(p) + second.index(p) for p in policies}
        assert set(positions.values()) == {3}  # the same mean position for every policy
    assert {o[0] for o in orders} == {"a", "d", "b"}


def _run(policy: str, repeat: int, ttft: float, texts: list[str | None]) -> FleetRun:
    client: dict[str, Any] = {
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": 2 * ttft,
        "tpot_p50_ms": 30.0,
        "request_throughput": 1.0 / ttft,
        "failed": 0,
    }
    servers = {
        "v0": {"prompt_tokens": 100.0, "prefix_cache_hit_tokens": ttft, "requests": 2.0},
        "v1": {"prompt_tokens": 100.0, "external_hit_tokens": 10.0, "requests": 1.0},
    }
    return FleetRun(policy, repeat, 0, client, servers, texts)


def test_mismatches_compare_every_text_with_the_first_runs() -> None:
    runs = [
        _run("kvstrata", 1, 50.0, ["x", "y"]),
        _run("round-robin", 1, 90.0, ["x", "z"]),
        _run("round-robin", 2, 80.0, [None, "y"]),
        _run("kvstrata", 2, 60.0, ["x", "y"]),
    ]
    got = mismatches(runs)
    assert got["reference"] == {"policy": "kvstrata", "repeat": 1}
    assert got["by_policy"] == {"round-robin": [0, 1], "kvstrata": []}
    assert got["compared"] == 6 and got["mismatched"] == 2


def test_summary_takes_medians_from_the_runs_and_judges_goals() -> None:
    runs = [
        _run("kvstrata", 1, 50.0, ["x"]),
        _run("round-robin", 1, 90.0, ["x"]),
        _run("round-robin", 2, 70.0, ["x"]),
        _run("kvstrata", 2, 60.0, ["x"]),
    ]
    data = summarize(runs)
    ours, rr = data["policies"]["kvstrata"], data["policies"]["round-robin"]
    assert ours["ttft_p50_ms"] == 55.0 and rr["ttft_p50_ms"] == 80.0
    assert ours["ttft_p99_ms"] == 110.0
    assert ours["hit_rate"] == pytest.approx((55.0 + 10.0) / 200)
    assert ours["spread"]["ttft_p50_ms"]["min"] == 50.0
    assert ours["requests_per_server"] == [{"v0": 2.0, "v1": 1.0}] * 2
    assert data["goals"]["ttft_p50_ms_vs_round_robin"]["ratio"] == pytest.approx(55 / 80)
    assert data["goals"]["ttft_p50_ms_vs_round_robin"]["met"] is True
    assert data["goals_met"] is True
    assert len(data["runs"]) == 4 and data["runs"][0]["requests_per_server"]["v0"] == 2.0


def test_worker_arg_round_trips_through_the_routers_parser() -> None:
    worker = VllmWorker(
        worker_id="v1",
        base_url="http://127.0.0.1:8001",
        events_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        lower_events_endpoint="tcp://127.0.0.1:5559",
        lower_replay_endpoint=None,
    )
    assert VllmWorker.parse(worker_arg(worker), 0, 32) == worker
    budget = replace(worker, step_tokens=4096)
    assert VllmWorker.parse(worker_arg(budget), 0, 32) == budget


def test_workload_validation() -> None:
    assert FleetWorkload().max_model_len % 32 == 0
    with pytest.raises(InvalidInput):
        FleetWorkload(policies=("kvstrata",))
    with pytest.raises(InvalidInput):
        FleetWorkload(kv_cache_blocks=8)  # cannot hold one request
    with pytest.raises(InvalidInput):
        FleetWorkload(num_prompts=2, num_prefixes=4)


def test_table_has_one_row_per_policy_and_unknown_policies_fail_early() -> None:
    import argparse

    from kvstrata.cli.bench_vllm_fleet import COLUMNS, fleet_rows, register_fleet

    runs = [_run("kvstrata", 1, 50.0, ["x"]), _run("round-robin", 1, 90.0, ["y"])]
    rows = fleet_rows(summarize(runs))
    assert [r[0] for r in rows] == ["kvstrata", "round-robin"]
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert rows[0][1] == "50" and rows[0][5] == "2/1" and rows[1][6] == 1  # "y" ≠ "x"
    parser = argparse.ArgumentParser()
    register_fleet(parser.add_subparsers())
    args = parser.parse_args(["vllm-fleet", "--policies", "kvstrata,nope"])
    with pytest.raises(InvalidInput, match="nope"):
        args.func(args)


def test_dtype_reaches_every_servers_command(tmp_path: Path) -> None:
    """``--dtype float32`` (for CPUs without AVX-512 BF16) reaches the workload and each
    server's ``--dtype``; bf16 stays the default."""
    import argparse

    from kvstrata.cli.bench_vllm_fleet import register_fleet, workload_from_args
    from kvstrata.fleet.vllm_servers import VllmServerSpec

    parser = argparse.ArgumentParser()
    register_fleet(parser.add_subparsers())
    assert workload_from_args(parser.parse_args(["vllm-fleet"])).dtype == "bfloat16"
    workload = workload_from_args(parser.parse_args(["vllm-fleet", "--dtype", "float32"]))
    assert workload.dtype == "float32"
    spec = VllmServerSpec("v0", tmp_path, Path("python"), tmp_path, dtype=workload.dtype)
    argv = spec.command()
    assert argv[argv.index("--dtype") + 1] == "float32"
