"""``kvstrata bench hash``: the CLI runs end to end and reports positive throughputs."""

from __future__ import annotations

import json

import pytest

from kvstrata.cli.main import main


def test_bench_hash_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["bench", "hash", "--tokens", "512", "--block-size", "16", "--repeat", "2", "--json"]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["tokens"] == 512
    assert result["block_size"] == 16
    for field in ("key_tokens_per_s", "router_tokens_per_s", "baseline_tokens_per_s", "ratio"):
        assert result[field] > 0


def test_bench_hash_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "hash", "--tokens", "64", "--block-size", "4", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "router" in out and "baseline" in out


def test_bench_hash_rejects_too_few_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "hash", "--tokens", "3", "--block-size", "16", "--json"]) == 2
    assert "error" in capsys.readouterr().err
