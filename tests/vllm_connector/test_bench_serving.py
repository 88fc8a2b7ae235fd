"""``kvstrata bench serving`` without servers: the KV budget both sides get, the commands and the
client's arguments, the run order, and the report's arithmetic (medians, spread, ratios, goals,
output agreement)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.bench.serving import (
    KvBudget,
    ServingSettings,
    client_argv,
    kvstrata_command,
    report,
    run_order,
    vllm_command,
)
from kvstrata.bench.serving_report import (
    RunRecord,
    equal_outputs,
    goal_met,
    ratio,
    run_figures,
    run_texts,
    saturating_rate,
    spread,
    summarize,
)
from kvstrata.cli import bench_serving, serve_cmd
from kvstrata.engine.kv_pool import PoolConfig
from kvstrata.errors import InvalidInput

SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ---- the KV budget and the commands -----------------------------------------------------------
def test_kv_budget_is_whole_fp32_blocks_like_the_engine_pool() -> None:
    kv = KvBudget.for_model(SMOLLM2, ServingSettings())
    engine = PoolConfig(1, 32, 30, 3, 64, dtype=torch.float32)
    assert kv.bytes_per_block == engine.bytes_per_block == 30 * 2 * 3 * 64 * 4 * 32
    assert kv.blocks == (1 << 30) // kv.bytes_per_block == 728
    assert kv.bytes == 728 * 1_474_560
    assert int(kv.pool_gib * (1 << 30)) == kv.bytes  # exact through the float flag
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    assert KvBudget.for_model(no_head_dim, ServingSettings()) == kv
    with pytest.raises(InvalidInput):
        KvBudget.for_model(SMOLLM2, ServingSettings(kv_gib=0.001))  # not one request


def test_kvstrata_serve_parses_its_command_to_the_same_bytes_and_no_tiers() -> None:
    settings = ServingSettings()
    kv = KvBudget.for_model(SMOLLM2, settings)
    argv = kvstrata_command("py", settings, kv, model_dir="/m", port=4321)
    assert argv[:4] == ["py", "-m", "kvstrata.cli.main", "serve"]
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    args = parser.parse_args(argv[3:])
    config = serve_cmd.worker_config(args)
    assert config.pool_bytes == kv.bytes
    assert config.pool_bytes // kv.bytes_per_block == kv.blocks  # serve's pool_blocks_for
    assert config.block_size == 32
    assert config.tiers == ()
    assert config.served_model_name == settings.served_model_name
    assert args.host == "127.0.0.1" and args.port == 4321


def test_vllm_command_is_fp32_with_the_same_kv_bytes() -> None:
    settings = ServingSettings()
    kv = KvBudget.for_model(SMOLLM2, settings)
    argv = vllm_command("vpy", settings, kv, model_dir="/m", port=1)
    assert argv[:3] == ["vpy", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--kv-cache-memory-bytes") == str(kv.bytes)
    assert _flag(argv, "--num-gpu-blocks-override") == str(kv.blocks)
    assert _flag(argv, "--block-size") == "32"
    assert _flag(argv, "--served-model-name") == settings.served_model_name
    assert "--enable-prefix-caching" in argv
    assert int(_flag(argv, "--max-model-len")) >= 1024 + 64 + 16


def test_client_argv_is_the_same_workload_for_both_sides() -> None:
    settings = ServingSettings()
    a = client_argv(settings, model_dir="/m", port=1, request_rate=math.inf)
    b = client_argv(settings, model_dir="/m", port=2, request_rate=math.inf)
    assert [x for x in a if x != "1"] == [x for x in b if x != "2"]
    assert _flag(a, "--dataset-name") == "prefix_repetition"
    assert _flag(a, "--prefix-repetition-prefix-len") == "1024"
    assert _flag(a, "--prefix-repetition-suffix-len") == "64"
    assert _flag(a, "--prefix-repetition-num-prefixes") == "4"
    assert _flag(a, "--prefix-repetition-output-len") == "16"
    assert _flag(a, "--num-prompts") == "40"
    assert _flag(a, "--request-rate") == "inf"
    assert _flag(a, "--endpoint") == "/v1/completions"
    assert _flag(a, "--temperature") == "0"
    assert _flag(a, "--ready-check-timeout-sec") == "0"
    assert {"--ignore-eos", "--save-detailed"} <= set(a)
    assert "--save-result" not in a  # texts come back in memory, no file


def test_settings_reject_bad_sizes() -> None:
    with pytest.raises(InvalidInput):
        ServingSettings(block_size=16)  # vLLM on CPU: multiples of 32
    with pytest.raises(InvalidInput):
        ServingSettings(num_prompts=3, num_prefixes=4)
    with pytest.raises(InvalidInput):
        ServingSettings(repeats=0)
    with pytest.raises(InvalidInput):
        ServingSettings(output_len=1)  # no TPOT


def test_run_order_alternates_kvstrata_first_on_odd_repeats() -> None:
    assert [run_order(r) for r in (1, 2, 3, 4)] == [
        ("kvstrata", "vllm"),
        ("vllm", "kvstrata"),
        ("kvstrata", "vllm"),
        ("vllm", "kvstrata"),
    ]


# ---- arithmetic --------------------------------------------------------------------------------
def test_spread_ratio_and_goals() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3, 1, 2]}
    assert spread([4.0, None, 2.0])["median"] == 3.0
    assert spread([None])["median"] is None
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert goal_met(0.8, ">=", 0.8) and not goal_met(0.79, ">=", 0.8)
    assert goal_met(1.0, "<=", 1.0) and not goal_met(1.01, "<=", 1.0)
    assert not goal_met(None, "<=", 1.0)


def test_equal_outputs_counts_failures_as_unequal() -> None:
    assert equal_outputs(["a", "b", None], ["a", "c", None]) == (1, 3)
    with pytest.raises(InvalidInput):
        equal_outputs(["a"], ["a", "b"])


def test_client_result_fields() -> None:
    result = {
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
        "median_tpot_ms": 5.0,
        "request_throughput": 2.0,
        "generated_texts": ["x", "", "z"],
        "errors": ["", "boom", ""],
    }
    figures = run_figures(result)
    assert figures["ttft_p50_ms"] == 10.0 and figures["ttft_p99_ms"] == 20.0
    assert figures["tpot_p50_ms"] == 5.0 and figures["request_throughput"] == 2.0
    assert run_texts(result) == ["x", None, "z"]


def _record(phase: str, repeat: int, side: str, rps: float, ttft: float, **kw: Any) -> RunRecord:
    figures = {
        "request_throughput": rps,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": 2 * ttft,
        "tpot_p50_ms": kw.get("tpot", 10.0),
        "failed": 0,
    }
    texts: list[str | None] = kw.get("texts", ["a", "b"])
    rate = math.inf if phase == "saturating" else 1.0
    return RunRecord(phase, repeat, side, rate, figures, texts)


def _runs() -> list[RunRecord]:
    """vLLM: 4, 5, 6 req/s saturated; kvstrata: 2, 6, 3. Half phase: TTFT 100 vs 50/60/70."""
    runs = []
    for repeat, (ours, theirs) in enumerate([(2.0, 4.0), (6.0, 5.0), (3.0, 6.0)], start=1):
        runs.append(_record("saturating", repeat, "kvstrata", ours, 500.0))
        runs.append(_record("saturating", repeat, "vllm", theirs, 400.0))
    for repeat, theirs in enumerate([50.0, 60.0, 70.0], start=1):
        texts = ["a", "x"] if repeat == 1 else ["a", "b"]
        runs.append(_record("half", repeat, "kvstrata", 1.0, 100.0, tpot=20.0, texts=texts))
        runs.append(_record("half", repeat, "vllm", 1.0, theirs, tpot=10.0))
    return runs


def test_summary_ratios_of_medians_with_per_repeat_spread() -> None:
    runs = _runs()
    assert saturating_rate(runs) == 5.0
    data = summarize(runs, repeats=3)
    assert data["throughput_ratio"] == pytest.approx(3.0 / 5.0)  # median 3 ÷ median 5
    spread_ = data["ratio_spread"]["throughput_ratio"]
    assert spread_["values"] == pytest.approx([0.5, 1.2, 0.5])
    assert (spread_["min"], spread_["max"]) == pytest.approx((0.5, 1.2))
    assert data["ttft_p50_ratio"] == pytest.approx(100.0 / 60.0)
    assert data["ttft_p99_ratio"] == pytest.approx(200.0 / 120.0)
    assert data["tpot_ratio"] == pytest.approx(2.0)
    assert data["vllm"]["saturating"]["request_throughput"] == {
        "median": 5.0,
        "min": 4.0,
        "max": 6.0,
        "values": [4.0, 5.0, 6.0],
    }
    assert data["kvstrata"]["half"]["ttft_p50_ms"]["median"] == 100.0
    goals = data["goals"]
    assert goals["throughput_ratio"]["met"] is False  # 0.6 < 0.8
    assert goals["ttft_p50_ratio"]["met"] is False  # 1.67 > 1.0
    assert goals["tpot_ratio"]["met"] is False  # 2.0 > 1.5
    assert data["goals_met"] is False
    assert "ttft_p99_ratio" not in goals  # reported, no goal
    # 6 pairs of 2 requests; one differs
    assert (data["outputs_equal"], data["outputs_compared"]) == (11, 12)
    assert data["outputs_equal_share"] == pytest.approx(11 / 12)
    assert data["repeats"] == 3


def test_goals_met_when_kvstrata_keeps_up() -> None:
    runs = [
        _record("saturating", 1, "kvstrata", 4.0, 100.0),
        _record("saturating", 1, "vllm", 4.5, 100.0),
        _record("half", 1, "kvstrata", 2.0, 90.0, tpot=14.0),
        _record("half", 1, "vllm", 2.0, 100.0, tpot=10.0),
    ]
    data = summarize(runs, repeats=1)
    assert all(goal["met"] for goal in data["goals"].values())
    assert data["goals_met"] is True


def test_saturating_rate_needs_vllm_throughput() -> None:
    with pytest.raises(InvalidInput):
        saturating_rate([_record("saturating", 1, "kvstrata", 3.0, 1.0)])


def test_report_is_strict_json_and_renders_a_table() -> None:
    runs = _runs()
    settings = ServingSettings()
    kv = KvBudget.for_model(SMOLLM2, settings)
    pythons = {"kvstrata": Path("/main/python"), "vllm": Path("/vllm/python")}
    data = report(runs, settings, kv, model_dir=Path("/m"), pythons=pythons, wall_s=12.34)
    assert data["runs"][0]["request_rate"] == "inf" and "texts" not in data["runs"][0]
    assert data["rates"]["saturating_req_s"] == 5.0
    assert data["rates"]["half_req_s"] == 1.0  # what the half-phase runs were offered
    assert data["kv_bytes"]["kvstrata"] == data["kv_bytes"]["vllm"] == kv.bytes
    assert data["repeats"] == 3 and data["wall_s"] == 12.3
    json.dumps(data, allow_nan=False)  # --json prints it as one strict JSON object
    rows = bench_serving.rows(data)
    assert rows[0][0].startswith("throughput_ratio")
    assert "NOT met" in rows[0][4]
    assert any(row[0] == "outputs_equal_share" for row in rows)


def test_cli_defaults_are_the_reference_workload() -> None:
    parser = argparse.ArgumentParser()
    bench_serving.register(parser.add_subparsers())
    args = parser.parse_args(["serving", "--json"])
    assert args.func is bench_serving.run and args.json
    assert bench_serving.settings_from_args(args) == ServingSettings()
    args = parser.parse_args(["serving", "--num-prompts", "8", "--prefix-len", "256"])
    settings = bench_serving.settings_from_args(args)
    assert (settings.num_prompts, settings.prefix_len, settings.repeats) == (8, 256, 3)
