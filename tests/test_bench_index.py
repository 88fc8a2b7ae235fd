"""``kvstrata bench index``: runs end to end at small sizes and reports every figure."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from typing import Any

import pytest

from kvstrata.bench.index import FINGERPRINT, IndexBenchConfig, run_index_bench
from kvstrata.bench.index_peers import NaiveIndex, SetIndex
from kvstrata.cli.main import main
from kvstrata.errors import InvalidInput
from kvstrata.events.schema import BlockStored, KVEventBatch
from kvstrata.index.core import GlobalIndex

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
        "peer_set_events_blocks_per_s",
        "peer_set_lookup_p50_ms",
        "peer_set_lookup_p99_ms",
        "peer_set_lookup_with_hash_p50_ms",
        "peer_set_lookup_with_hash_p99_ms",
        "peer_set_lookup_speedup_p99",
        "peer_set_with_hash_speedup_p99",
        "lookup_with_hash_vs_peer_set_p99",
        "peer_set_apply_speedup",
    ):
        assert result[name] > 0, name
    assert result["lookup_p99_ms"] >= result["lookup_p50_ms"]
    assert result["peer_set_lookup_with_hash_p99_ms"] >= result["peer_set_lookup_p99_ms"]
    assert result["lookup_with_hash_vs_peer_set_p99"] == pytest.approx(
        result["lookup_with_hash_p99_ms"] / result["peer_set_lookup_with_hash_p99_ms"]
    )
    _check_memory_figures(result)
    assert result["blocks_per_event"] > 1 and result["events"] >= result["batches"] > 0
    # The two looked-up documents sit on four workers each at full, 3/4, 1/2 and 1/4 depth.
    assert result["matched_blocks"] == [64, 48, 32, 16, 0, 0, 0, 0]
    assert result["peer_agrees"] is True
    # Figures are medians over rounds of alternating lookups, each p99 with its rounds' spread.
    assert result["rounds"] == IndexBenchConfig().rounds >= 5
    for name, figure in (
        ("both", "lookup_with_hash_p99_ms"),
        ("set_both", "peer_set_lookup_with_hash_p99_ms"),
    ):
        low, high = result["p99_spread_ms"][name]
        assert low <= result[figure] <= high, name
    assert result["lookup_with_hash_vs_peer_set_p99_min"] > 0
    assert (
        result["lookup_with_hash_vs_peer_set_p99_min"]
        <= result["lookup_with_hash_vs_peer_set_p99_max"]
    )
    # Live rounds: events between lookups leave a backlog the next lookup syncs.
    assert result["live_batches"] == 4 and result["live_backlog_median"] > 0
    assert result["live_lookup_with_hash_p99_ms"] > 0
    assert result["peer_set_live_lookup_with_hash_p99_ms"] > 0
    assert (
        result["live_lookup_with_hash_vs_peer_set_p99_min"]
        <= result["live_lookup_with_hash_vs_peer_set_p99"]
        <= result["live_lookup_with_hash_vs_peer_set_p99_max"]
    )


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _check_memory_figures(result: dict[str, Any], peak_rss_mib: float | None = None) -> None:
    """``bytes_per_block`` is ``rss_mb`` spread over the indexed placements, and the RSS the
    fill added cannot exceed the process's peak RSS. (In a process that has already freed
    memory the allocator reuses it and the figure can read 0: positivity needs a fresh one.)"""
    assert result["bytes_per_block"] * result["index_blocks"] == pytest.approx(
        result["rss_mb"] * 2**20
    )
    assert 0 <= result["rss_mb"] <= (_peak_rss_mib() if peak_rss_mib is None else peak_rss_mib)


_FRESH_PROCESS = """
import json, resource, sys
from kvstrata.bench.index import IndexBenchConfig, run_index_bench
config = IndexBenchConfig(blocks=3000, workers=8, request_tokens=1024, repeats=5,
                          naive=False, peer_set=False)
result = run_index_bench(config).to_dict()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
json.dump({"result": result, "peak_rss_mib": peak}, sys.stdout)
"""


def test_bench_index_memory_figure_in_a_fresh_process() -> None:
    """The first fill in a process grows its RSS (about 15 MiB at this size): at least the
    8-byte hash of every distinct block it now holds, at most the process's peak RSS."""
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    result = out["result"]
    assert result["index_entries"] >= 3000
    assert result["rss_mb"] * 2**20 >= 8 * result["index_entries"]
    assert result["bytes_per_block"] >= 8 * result["index_entries"] / result["index_blocks"]
    _check_memory_figures(result, out["peak_rss_mib"])


def test_bench_index_table_without_peer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", *SMALL, "--no-naive", "--no-peer-set"]) == 0
    out = capsys.readouterr().out
    assert "lookup p99" in out and "apply BlockStored" in out


def test_bench_index_table_with_peers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "set peer" in out and "answers agree: True" in out


def test_bench_index_is_deterministic_in_what_it_builds() -> None:
    config = IndexBenchConfig(
        blocks=2000, workers=4, request_tokens=512, repeats=2, naive=False, peer_set=False
    )
    first, second = run_index_bench(config), run_index_bench(config)
    assert (first.index_blocks, first.index_entries, first.batches, first.events) == (
        second.index_blocks,
        second.index_entries,
        second.batches,
        second.events,
    )
    assert first.peer_agrees is None and "naive_lookup_p99_ms" not in first.to_dict()
    assert "peer_set_lookup_p99_ms" not in first.to_dict()


@pytest.mark.parametrize(
    "args",
    [["--request-tokens", "8"], ["--workers", "0"], ["--repeats", "0"], ["--rounds", "0"]],
)
def test_bench_index_rejects_bad_sizes(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", "--blocks", "10", *args, "--json"]) == 2
    assert "error" in capsys.readouterr().err


def test_defaults_are_the_issues_target() -> None:
    """≥ 1M indexed blocks, 16 workers, a 128k-token request, ≥ 5 rounds."""
    config = IndexBenchConfig()
    assert config.blocks >= 1_000_000 and config.workers == 16
    assert config.request_tokens == 131_072 and config.rounds >= 5


def test_config_check() -> None:
    with pytest.raises(InvalidInput):
        IndexBenchConfig(step_tokens=4).check()


def _stored(hashes: list[int], tokens: list[int], medium: str, parent: int | None = None) -> Any:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_peers_answer_like_the_index_on_tiers_and_partial_prefixes() -> None:
    """Hand-built: a worker holding the request on device and host (device wins), one holding
    a host-only prefix continued on device, one holding nothing but an unrelated block."""
    index = GlobalIndex(FINGERPRINT, 4, clock=lambda: 0.0)
    naive, by_set = NaiveIndex(index), SetIndex(index, width=3)
    tokens = list(range(16))  # four blocks
    batches = {
        "a": [_stored([1, 2, 3, 4], tokens, "GPU"), _stored([1, 2], tokens[:8], "CPU")],
        "b": [_stored([5], tokens[:4], "CPU"), _stored([6, 7], tokens[4:12], "GPU", parent=5)],
        "c": [_stored([8], [99, 98, 97, 96], "GPU")],
    }
    for worker, events in batches.items():
        for apply in (index.apply_batch, naive.apply_batch, by_set.apply_batch):
            apply(worker, KVEventBatch(ts=1.0, events=events))
    expected = {"a": (4, [4, 0, 0, 0]), "b": (3, [2, 1, 0, 0]), "c": (0, [0, 0, 0, 0])}
    hashes = by_set.hashes(tokens)
    assert hashes == index.request_hashes(None, tokens).tolist()
    found = index.match(hashes)
    assert {w: (m.blocks, list(m.tier_blocks)) for w, m in found.items()} == expected
    assert naive.match(hashes) == expected
    assert by_set.match(hashes) == expected
    assert by_set.match(hashes[:2]) == {
        "a": (2, [2, 0, 0, 0]),
        "b": (2, [1, 1, 0, 0]),
        **{"c": (0, [0, 0, 0, 0])},
    }
    with pytest.raises(ValueError):
        by_set.apply_batch("d", KVEventBatch(ts=2.0, events=batches["c"]))
