"""``kvstrata bench index``: runs end to end at small sizes and reports every figure."""

from __future__ import annotations

import json

import pytest

from kvstrata.bench.index import IndexBenchConfig, run_index_bench
from kvstrata.cli.main import main
from kvstrata.errors import InvalidInput

SMALL = ["--blocks", "3000", "--workers", "8", "--request-tokens", "1024", "--repeats", "5"]


def test_bench_index_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", *SMALL, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["workers"] == 8 and result["request_tokens"] == 1024
    assert result["request_blocks"] == 64
    assert result["index_entries"] >= 3000
    assert result["index_blocks"] >= result["index_entries"]
    for name in (
        "events_blocks_per_s",
        "hash_ms",
        "blake3_hash_ms",
        "lookup_p50_ms",
        "lookup_p99_ms",
        "lookup_with_hash_p50_ms",
        "lookup_with_hash_p99_ms",
        "naive_events_blocks_per_s",
        "naive_lookup_p50_ms",
        "naive_lookup_p99_ms",
        "lookup_speedup_p99",
        "apply_speedup",
        "apply_s",
    ):
        assert result[name] > 0, name
    assert result["lookup_p99_ms"] >= result["lookup_p50_ms"]
    assert result["rss_mb"] >= 0 and result["bytes_per_block"] >= 0
    assert result["blocks_per_event"] > 1 and result["events"] >= result["batches"] > 0
    # The two looked-up documents sit on four workers each at full, 3/4, 1/2 and 1/4 depth.
    assert result["matched_blocks"] == [64, 48, 32, 16, 0, 0, 0, 0]
    assert result["peer_agrees"] is True


def test_bench_index_table_without_peer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", *SMALL, "--no-naive"]) == 0
    out = capsys.readouterr().out
    assert "lookup p99" in out and "apply BlockStored" in out


def test_bench_index_is_deterministic_in_what_it_builds() -> None:
    config = IndexBenchConfig(blocks=2000, workers=4, request_tokens=512, repeats=2, naive=False)
    first, second = run_index_bench(config), run_index_bench(config)
    assert (first.index_blocks, first.index_entries, first.batches, first.events) == (
        second.index_blocks,
        second.index_entries,
        second.batches,
        second.events,
    )
    assert first.peer_agrees is None and "naive_lookup_p99_ms" not in first.to_dict()


@pytest.mark.parametrize(
    "args", [["--request-tokens", "8"], ["--workers", "0"], ["--repeats", "0"]]
)
def test_bench_index_rejects_bad_sizes(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", "--blocks", "10", *args, "--json"]) == 2
    assert "error" in capsys.readouterr().err


def test_config_check() -> None:
    with pytest.raises(InvalidInput):
        IndexBenchConfig(step_tokens=4).check()
