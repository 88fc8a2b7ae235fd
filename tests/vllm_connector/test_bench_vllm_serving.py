"""``kvstrata bench vllm-serving`` plumbing that needs no vLLM: workload sizes, the client's and
server's argument lists, request order, metrics parsing, the JSON summary and the table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstrata.bench.vllm_serving import (
    ServingWorkload,
    client_argv,
    client_figures,
    kv_bytes_per_token,
    kvstrata_transfer,
    parse_metrics,
    round_robin,
    server_argv,
    summarize,
)
from kvstrata.cli import bench_vllm
from kvstrata.errors import InvalidInput

SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
}


def test_smollm2_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(SMOLLM2) == 30 * 2 * 3 * 64 * 2 == 23_040
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    assert kv_bytes_per_token(no_head_dim) == 23_040


def test_default_workload_overflows_vllm_cache_four_times() -> None:
    w = ServingWorkload()
    assert w.working_set_tokens == w.num_prefixes * w.prefix_len + w.num_requests * (
        w.suffix_len + w.output_len
    )
    assert w.working_set_ratio >= 4
    assert w.kv_cache_tokens >= w.max_model_len
    assert w.max_model_len % 32 == 0
    assert w.requests_per_prefix >= 3  # each prefix recurs


def test_workload_rejects_a_cache_smaller_than_one_request() -> None:
    with pytest.raises(InvalidInput):
        ServingWorkload(prefix_len=2048, kv_cache_blocks=8)
    with pytest.raises(InvalidInput):
        ServingWorkload(request_rate=0)


def test_round_robin_cycles_through_prefix_groups() -> None:
    grouped = [f"p{g}s{i}" for g in range(3) for i in range(2)]
    assert round_robin(grouped, 3) == ["p0s0", "p1s0", "p2s0", "p0s1", "p1s1", "p2s1"]
    assert round_robin([1, 2, 3, 4, 5], 2) == [1, 3, 2, 4, 5]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_client_and_server_arguments() -> None:
    w = ServingWorkload(num_prefixes=5, requests_per_prefix=3, kv_cache_blocks=40)
    client = client_argv(w, model="/m", port=1234)
    assert _flag(client, "--dataset-name") == "prefix_repetition"
    assert _flag(client, "--num-prompts") == "15"
    assert _flag(client, "--prefix-repetition-num-prefixes") == "5"
    assert _flag(client, "--port") == "1234"
    assert "--disable-shuffle" in client  # order comes from round_robin
    plain = server_argv(w, model="/m", port=1234, bytes_per_token=100, transfer=None)
    assert "--kv-transfer-config" not in plain
    assert _flag(plain, "--kv-cache-memory-bytes") == str(40 * 32 * 100)
    assert _flag(plain, "--num-gpu-blocks-override") == "40"
    assert "--enable-prefix-caching" in plain
    transfer = kvstrata_transfer(Path("/t"), host_gib=1, disk_gib=2)
    ours = server_argv(w, model="/m", port=1, bytes_per_token=100, transfer=transfer)
    config = json.loads(_flag(ours, "--kv-transfer-config"))
    assert config["kv_connector"] == "KvstrataConnector"
    assert config["kv_connector_module_path"] == "kvstrata.connectors.vllm"
    assert config["kv_role"] == "kv_both"
    extra = config["kv_connector_extra_config"]
    assert extra["host_gib"] == 1 and extra["disk_gib"] == 2 and extra["disk_dir"]


def test_parse_metrics_sums_engines_and_splits_sources() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_total x",
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 20.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 64.0',
            'vllm:external_prefix_cache_hits_total{engine="0"} 64.0',
            'vllm:request_prefill_time_seconds_sum{engine="0"} 3.0',
            'vllm:request_prefill_time_seconds_count{engine="0"} 4.0',
            "unrelated_metric 5",
        ]
    )
    got = parse_metrics(text)
    assert got["prompt_tokens"] == 120
    assert got["prompt_tokens_external_kv_transfer"] == 64
    assert got["external_hit_tokens"] == 64
    assert got["prefill_seconds_sum"] == 3 and got["prefill_count"] == 4


def _client_result(ttft_p50: float, ttft_p99: float, rps: float) -> dict[str, float]:
    return {
        "median_ttft_ms": ttft_p50,
        "p99_ttft_ms": ttft_p99,
        "request_throughput": rps,
        "output_throughput": rps * 16,
        "completed": 32,
    }


def test_summary_ratios_and_table() -> None:
    w = ServingWorkload()
    runs = {
        "plain": client_figures(_client_result(900.0, 3000.0, 0.4)),
        "kvstrata": client_figures(_client_result(300.0, 1500.0, 0.5)),
    }
    data = summarize(w, 23_040, runs)
    assert data["ttft_p50_ratio"] == pytest.approx(3.0)
    assert data["ttft_p99_ratio"] == pytest.approx(2.0)
    assert data["throughput_ratio"] == pytest.approx(1.25)
    assert data["working_set_tokens"] == w.working_set_tokens
    assert data["kv_cache_tokens"] == w.kv_cache_tokens
    assert data["working_set_ratio"] == pytest.approx(w.working_set_ratio)
    json.dumps(data)  # --json prints it as one object
    rows = bench_vllm.serving_rows(data)
    assert rows[0][0] == "TTFT p50 (ms)" and rows[0][3] == data["ttft_p50_ratio"]


def test_cli_parses_the_serving_subcommand() -> None:
    parser = argparse.ArgumentParser()
    bench_vllm.register(parser.add_subparsers())
    args = parser.parse_args(
        ["vllm-serving", "--num-prefixes", "6", "--request-rate", "0.25", "--json"]
    )
    assert args.func is bench_vllm.run_serving and args.json
    w = bench_vllm.workload_from_args(args)
    assert w.num_prefixes == 6 and w.request_rate == 0.25
    assert w.prefix_len == ServingWorkload().prefix_len
