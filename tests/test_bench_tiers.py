"""``kvstrata bench tiers``: the CLI runs end to end and reports positive rates (no thresholds).

The remote section runs on a real Valkey server: one the bench starts itself, or the session's
server named with ``--remote-url`` (then nothing of the bench's may be left on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.main import main
from kvstrata.runtime.valkey_server import ValkeyServer

REMOTE_RATES = ("get_gbps", "raw_get_gbps", "put_gbps", "raw_set_gbps")
DISK_FIELDS = (
    "read_gbps", "raw_read_gbps", "raw_readinto_gbps", "get_gbps", "ratio", "ratio_vs_os_read",
    "cold_read_gbps", "cold_raw_readinto_gbps", "cold_ratio",
)  # fmt: skip
READ_AHEAD_RATES = ("read_ahead_gbps", "raw_sequential_get_gbps", "raw_pipelined_get_gbps")


def _check_remote(section: dict[str, object]) -> None:
    read_ahead = section["read_ahead"]
    assert isinstance(read_ahead, dict)
    for table, rates, ratios in (
        (section, REMOTE_RATES, ("ratio", "put_ratio")),
        (read_ahead, READ_AHEAD_RATES, ("read_ahead_ratio", "read_ahead_vs_raw_pipeline")),
    ):
        for field in (*rates, *ratios):
            value = table[field]
            assert isinstance(value, float) and value > 0, field
            low, high = table[f"{field}_spread"]
            assert 0 < low <= high, field
        for field in rates:
            low, high = table[f"{field}_spread"]
            assert low <= table[field] <= high  # the median lies within its rounds


def test_bench_tiers_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        [
            "bench", "tiers", "--sizes", "0.0625,0.125", "--objects", "3", "--repeat", "2",
            "--dir", str(tmp_path), "--json",
        ]
    )  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    for field in ("get_gbps", "put_gbps", "memcpy_gbps", "ratio"):
        assert result["host"][field] > 0
    for entry in (result, *result["sizes"]):
        disk = entry["disk"]
        for field in DISK_FIELDS:
            assert isinstance(disk[field], float) and disk[field] > 0, field
        assert disk["ratio"] == pytest.approx(disk["read_gbps"] / disk["raw_readinto_gbps"])
        assert disk["ratio_vs_os_read"] == pytest.approx(disk["read_gbps"] / disk["raw_read_gbps"])
        assert disk["cold_ratio"] == pytest.approx(
            disk["cold_read_gbps"] / disk["cold_raw_readinto_gbps"]
        )
        low, high = disk["cold_ratio_spread"]
        assert 0 < low <= high
        low, high = disk["ratio_spread"]  # the warm rounds' paired ratios, best and median
        assert 0 < low <= disk["ratio_median"] <= high
    assert set(result["peers"]) >= {"disk.ratio", "disk.cold_ratio", "disk.ratio_vs_os_read"}
    assert result["disk"]["verify"] is True
    for tier in ("host", "disk"):
        for field in ("get_gbps_verified", "get_gbps_unverified", "verify_cost_ratio"):
            assert result[tier][field] > 0
            assert all(entry[tier][field] > 0 for entry in result["sizes"])
    assert [s["size_bytes"] for s in result["sizes"]] == [65536, 131072]
    for entry in result["sizes"]:
        assert entry["host"]["ratio"] > 0 and entry["disk"]["ratio"] > 0
        _check_remote(entry["remote"])
    _check_remote(result["remote"])
    remote = result["remote"]
    assert remote["verify"] is True and remote["server"] == "started by the bench"
    assert remote["batch_objects"] == 3
    assert list(tmp_path.iterdir()) == []  # the bench cleans up its files


def test_bench_tiers_remote_on_a_given_server_leaves_nothing_behind(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, remote_server: ValkeyServer
) -> None:
    argv = ["bench", "tiers", "--sizes", "0.0625", "--objects", "4", "--repeat", "2"]
    with remote_server.connection() as conn:
        before = set(conn.scan_iter(match="*bench-tiers-*"))
        assert (
            main([*argv, "--dir", str(tmp_path), "--remote-url", remote_server.url, "--json"]) == 0
        )
        left = set(conn.scan_iter(match="*bench-tiers-*"))
    result = json.loads(capsys.readouterr().out)
    assert result["remote"]["server"] == "given"
    _check_remote(result["remote"])
    assert left == before == set()


def test_bench_tiers_without_remote(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["bench", "tiers", "--sizes", "0.0625", "--objects", "2", "--repeat", "1"]
    assert main([*argv, "--dir", str(tmp_path), "--no-remote", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "remote" not in result and all("remote" not in s for s in result["sizes"])


def test_bench_tiers_table_and_cold(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["bench", "tiers", "--sizes", "0.0625", "--objects", "2", "--repeat", "1", "--cold"]
    assert main([*argv, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "raw_read_gbps" in out and "memcpy_gbps" in out and "verify_cost_ratio" in out
    assert "raw_get_gbps" in out and "read_ahead.read_ahead_ratio" in out
    assert "cold_ratio" in out and "preallocated buffer, pages dropped" in out


def test_bench_tiers_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--sizes", "one", "--json"]) == 2
    assert main(["bench", "tiers", "--sizes", "0", "--json"]) == 2
    assert "error" in capsys.readouterr().err
