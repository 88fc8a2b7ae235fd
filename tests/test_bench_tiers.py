"""``kvstrata bench tiers``: the CLI runs end to end and reports positive rates (no thresholds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.main import main


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
    for field in ("read_gbps", "raw_read_gbps", "raw_readinto_gbps", "ratio", "get_gbps"):
        assert result["disk"][field] > 0
    assert result["disk"]["verify"] is True
    for tier in ("host", "disk"):
        for field in ("get_gbps_verified", "get_gbps_unverified", "verify_cost_ratio"):
            assert result[tier][field] > 0
            assert all(entry[tier][field] > 0 for entry in result["sizes"])
    assert [s["size_bytes"] for s in result["sizes"]] == [65536, 131072]
    for entry in result["sizes"]:
        assert entry["host"]["ratio"] > 0 and entry["disk"]["ratio"] > 0
    assert list(tmp_path.iterdir()) == []  # the bench cleans up its files


def test_bench_tiers_table_and_cold(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["bench", "tiers", "--sizes", "0.0625", "--objects", "2", "--repeat", "1", "--cold"]
    assert main([*argv, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "raw_read_gbps" in out and "memcpy_gbps" in out and "verify_cost_ratio" in out


def test_bench_tiers_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--sizes", "one", "--json"]) == 2
    assert main(["bench", "tiers", "--sizes", "0", "--json"]) == 2
    assert "error" in capsys.readouterr().err
