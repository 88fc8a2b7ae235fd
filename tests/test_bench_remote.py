"""The remote benchmarks end to end on real Valkey servers: ``bench ttft --tier remote`` and
``bench eviction --remote-writers`` (real writer processes). Sane fields, no timing thresholds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstrata.cli.main import main
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.workloads.synthetic import generate, preset, write_trace


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def _check_ttft(out: dict[str, Any], tokens: int) -> None:
    assert out["tier"] == "remote" and out["prompt_tokens"] == tokens
    # every block but the last token's comes from the remote tier (the pool was cleared)
    assert out["matched_by_tier"] == {"remote": tokens - 1}
    assert out["matched_tokens"] == tokens - 1
    assert out["ttft_fresh_s"] > 0 and out["ttft_hit_s"] > 0
    assert out["speedup"] == pytest.approx(out["ttft_fresh_s"] / out["ttft_hit_s"])
    assert out["greedy_equal"] is True and out["max_abs_logit_diff"] <= 1e-4


def test_bench_ttft_remote_tiny_on_a_given_server(
    capsys: pytest.CaptureFixture[str], remote_server: ValkeyServer
) -> None:
    argv = ["bench", "ttft", "--model", "tiny", "--tokens", "128", "--repeat", "1"]
    out = _json(capsys, [*argv, "--tier", "remote", "--remote-url", remote_server.url, "--json"])
    _check_ttft(out, 128)
    with remote_server.connection() as conn:
        assert list(conn.scan_iter(match="*bench-ttft-*")) == []  # the bench cleaned up


@pytest.mark.slow
def test_bench_ttft_remote_smollm2(capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2 against a server the bench starts itself (short prompt: seconds, not minutes)."""
    argv = ["bench", "ttft", "--tokens", "256", "--repeat", "1", "--tier", "remote", "--json"]
    _check_ttft(_json(capsys, argv), 256)


def _eviction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *options: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The multi-writer mode on 120 synthetic chat requests, a tier of 20% of their blocks."""
    trace = tmp_path / "chat.jsonl"
    write_trace(trace, generate(replace(preset("chat", 5), duration_s=300.0))[:120])
    argv = ["bench", "eviction", "--trace", str(trace), "--remote-writers", "3"]
    argv += ["--remote-capacity", "20%", "--remote-payload-bytes", "4096", *options]
    result = _json(capsys, [*argv, "--quiet", "--json"])
    report = result["remote_multi_writer"]
    assert report["writers"] == 3 and report["requests"] == result["requests"] == 120
    assert report["capacity_blocks"] == result["distinct_blocks"] // 5
    assert report["ratio"] > 0 and report["token_ratio"] > 0
    for mode in ("value", "lru"):
        summary = report[mode]
        assert summary["requests"] == 120
        assert [w["requests"] for w in summary["per_writer"]] == [40, 40, 40]
        assert 0 <= summary["token_hit_rate"] <= 1 and summary["saved_prefill_s"] > 0
        for run in report["runs"][mode]:
            assert sum(w["requests"] for w in run["per_writer"]) == 120
            assert run["prompt_tokens"] == report["runs"]["value"][0]["prompt_tokens"]
            assert all(0 <= w["token_hit_rate"] <= 1 for w in run["per_writer"])
            assert run["evictions"] > 0  # the tier is small enough that eviction matters
    for run in report["runs"]["value"]:
        # the shared ledger kept the tier within its capacity across all three writers
        assert 0 < run["ledger_objects"] <= report["capacity_blocks"]
        assert run["ledger_used_bytes"] <= report["capacity_blocks"] * 4096
    for run in report["runs"]["lru"]:
        assert run["maxmemory_policy"] == "allkeys-lru" and run["budget_bytes"] > 0
        assert run["maxmemory"] > run["budget_bytes"] + run["client_allowance_bytes"]
    return result, report


def test_bench_eviction_remote_multi_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, report = _eviction(tmp_path, capsys, "--remote-repeat", "2")
    assert report["order"] == ["value", "lru", "lru", "value"]  # alternating, value first
    assert report["lru_budget"] == "used"
    value_memory = [run["data_memory"] for run in report["runs"]["value"]]
    # each LRU run got the data memory of the value run before it
    assert [run["budget_bytes"] for run in report["runs"]["lru"]] == [value_memory[0]] * 2
    low, high = report["value"]["saved_prefill_s_spread"]
    assert low <= report["value"]["saved_prefill_s"] <= high


@pytest.mark.slow
def test_bench_eviction_remote_equal_block_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, report = _eviction(tmp_path, capsys, "--remote-repeat", "1", "--remote-lru-budget", "blocks")
    assert report["lru_budget"] == "blocks" and report["order"] == ["value", "lru"]
    (lru,) = report["runs"]["lru"]
    assert lru["budget_bytes"] < report["runs"]["value"][0]["data_memory"]


def test_bench_eviction_remote_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "eviction", "--synthetic", "chat", "--quiet", "--requests", "10"]
    assert main([*argv, "--remote-writers", "2", "--remote-repeat", "0"]) == 2
    assert main([*argv, "--remote-writers", "2", "--remote-payload-bytes", "8"]) == 2
    assert "error" in capsys.readouterr().err
