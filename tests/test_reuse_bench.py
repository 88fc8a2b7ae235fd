"""``kvstrata bench reuse``: trace reader, cache bookkeeping, reuse statistics and the CLI.

Small scripted traces with hand-computed answers, property tests against naive models, and
one slow check against the figures independently measured on the Mooncake trace.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.bench.reuse import (
    FenwickTree,
    LRUCache,
    Percentiles,
    UnboundedCache,
    analyse_reuse,
    nearest_rank_percentile,
    replay_hit_tokens,
    stack_distances,
    top_reuse_share,
)
from kvstrata.cli.main import main
from kvstrata.errors import InvalidInput, TraceFormatError
from kvstrata.workloads.mooncake import BLOCK_TOKENS, TraceBlockId, TraceRequest, read_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
MOONCAKE_TRACE = REPO_ROOT / ".." / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def _line(timestamp: int, input_length: int, hash_ids: Sequence[int], output: int = 10) -> str:
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output,
            "hash_ids": list(hash_ids),
        }
    )


def _write(tmp_path: Path, lines: Sequence[str], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# r0 misses; r1 hits blocks 1,2; r2 hits block 1; r3 fully matches its partial last block
# (600 tokens, not 1024); r4 holds block 2 but not block 5, and caches are prefix-closed.
SCRIPTED = [
    _line(0, 1024, [1, 2]),
    _line(1000, 1100, [1, 2, 3]),
    _line(2500, 1000, [1, 4]),
    _line(4000, 600, [1, 4]),
    _line(10000, 1024, [5, 2]),
]
SCRIPTED_TOTAL = 1024 + 1100 + 1000 + 600 + 1024
SCRIPTED_INFINITE_HIT = 1024 + 512 + 600


@pytest.fixture
def scripted(tmp_path: Path) -> list[TraceRequest]:
    return read_trace(_write(tmp_path, SCRIPTED))


# --- trace reader -------------------------------------------------------------------------


def test_read_trace_parses_typed_requests(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(5, 513, [7, 8], output=3), "", _line(6, 512, [7])])
    requests = read_trace(path)
    assert requests == [
        TraceRequest(5, 513, 3, (TraceBlockId(7), TraceBlockId(8))),
        TraceRequest(6, 512, 10, (TraceBlockId(7),)),
    ]
    assert requests[0].timestamp_s == 0.005
    assert BLOCK_TOKENS == 512


def test_prefix_tokens_counts_partial_last_block() -> None:
    request = TraceRequest(0, 1100, 1, (TraceBlockId(1), TraceBlockId(2), TraceBlockId(3)))
    assert [request.prefix_tokens(k) for k in range(4)] == [0, 512, 1024, 1100]
    with pytest.raises(InvalidInput):
        request.prefix_tokens(4)


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"timestamp": 1, "input_length": ', "bad JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            '{"timestamp": 1, "input_length": 10, "hash_ids": [1]}',
            "missing field(s): output_length",
        ),
        (_line(1, 10, [1]).replace('"input_length": 10', '"input_length": "10"'), "input_length"),
        (_line(1, 10, [1]).replace('"timestamp": 1', '"timestamp": true'), "timestamp"),
        (_line(1, 10, [1]).replace('"timestamp": 1', '"timestamp": 1.5'), "timestamp"),
        (_line(1, 10, [1]).replace('"output_length": 10', '"output_length": -1'), "0.."),
        (_line(10**400, 10, [1]), "timestamp: expected 0.."),  # was an OverflowError later
        (_line(1, 1000, [7, 7]), "hash_ids[1] repeats hash_ids[0]"),  # crashed the simulator
        (_line(1, 0, []), "at least one prompt token"),
        (_line(1, 10, [1]).replace("[1]", '"1"'), "hash_ids: expected a list"),
        (_line(1, 10, [1]).replace("[1]", "[1.0]"), "hash_ids[0]"),
        (_line(1, 1025, [1, 2]), "len(hash_ids) = 2"),
        (_line(1, 512, [1, 2]), "len(hash_ids) = 2"),
        (_line(1, 0, [1]), "len(hash_ids) = 1"),
    ],
)
def test_malformed_line_names_file_line_and_problem(
    tmp_path: Path, bad_line: str, problem: str
) -> None:
    path = _write(tmp_path, [_line(0, 10, [1]), "", bad_line, _line(2, 10, [1])])
    with pytest.raises(TraceFormatError) as excinfo:
        read_trace(path)
    message = str(excinfo.value)
    assert f"{path}:3:" in message
    assert problem in message


def test_missing_trace_file_is_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")


# --- cache bookkeeping --------------------------------------------------------------------


def test_lru_cache_evicts_least_recently_used() -> None:
    cache: LRUCache[str] = LRUCache(2)
    assert cache.touch("a") is None
    assert cache.touch("b") is None
    assert cache.touch("a") is None
    assert cache.touch("c") == "b"
    assert list(cache) == ["a", "c"]
    assert cache.matched_prefix(["a", "c", "b"]) == 2
    assert cache.matched_prefix(["b", "a"]) == 0
    assert list(cache) == ["a", "c"], "lookups must not change recency"
    assert cache.discard("a") and not cache.discard("a")
    assert len(cache) == 1 and "c" in cache


def test_lru_cache_of_zero_capacity_holds_nothing() -> None:
    cache: LRUCache[int] = LRUCache(0)
    assert cache.touch(1) == 1
    assert len(cache) == 0
    with pytest.raises(InvalidInput):
        LRUCache(-1)


@given(st.integers(0, 6), st.lists(st.integers(0, 9), max_size=200))
def test_lru_cache_matches_naive_list_model(capacity: int, keys: list[int]) -> None:
    cache: LRUCache[int] = LRUCache(capacity)
    model: list[int] = []
    for key in keys:
        expected_evicted = None
        if key in model:
            model.remove(key)
        elif len(model) == capacity:
            expected_evicted = model.pop(0) if model else key
        if capacity:
            model.append(key)
        assert cache.touch(key) == expected_evicted
        assert list(cache) == model


# --- stack distances ------------------------------------------------------------------------


def _naive_stack_distances(keys: Sequence[int]) -> list[int | None]:
    result: list[int | None] = []
    for position, key in enumerate(keys):
        previous = max((i for i in range(position) if keys[i] == key), default=None)
        result.append(None if previous is None else len(set(keys[previous + 1 : position])))
    return result


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ("ABA", [None, None, 1]),
        ("AA", [None, 0]),
        ("ABBA", [None, None, 0, 1]),
        ("ABCBA", [None, None, None, 1, 2]),
        ("ABCABC", [None, None, None, 2, 2, 2]),
        ("", []),
    ],
)
def test_stack_distances_scripted(keys: str, expected: list[int | None]) -> None:
    assert stack_distances(keys) == expected


@given(st.lists(st.integers(0, 12), max_size=150))
def test_stack_distances_match_naive_reference(keys: list[int]) -> None:
    assert stack_distances(keys) == _naive_stack_distances(keys)


@given(st.integers(0, 8), st.lists(st.integers(0, 12), max_size=150))
def test_lru_holds_a_key_iff_its_stack_distance_is_below_capacity(
    capacity: int, keys: list[int]
) -> None:
    """Mattson's inclusion property ties the Fenwick distances to the LRU bookkeeping."""
    cache: LRUCache[int] = LRUCache(capacity)
    for key, distance in zip(keys, stack_distances(keys), strict=True):
        assert (key in cache) == (distance is not None and distance < capacity)
        cache.touch(key)


def test_fenwick_tree_prefix_sums() -> None:
    tree = FenwickTree(5)
    for index, value in enumerate([3, 0, -1, 4, 2]):
        tree.add(index, value)
    assert [tree.prefix_sum(end) for end in range(6)] == [0, 3, 3, 2, 6, 8]
    assert len(tree) == 5


def test_nearest_rank_percentiles() -> None:
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert nearest_rank_percentile(values, 50) == 5
    assert nearest_rank_percentile(values, 90) == 9
    assert nearest_rank_percentile(values, 99) == 10
    assert nearest_rank_percentile([7], 1) == 7
    assert nearest_rank_percentile([], 50) is None
    assert Percentiles.of([]) == Percentiles(None, None, None)


def test_top_reuse_share_takes_ceil_of_one_percent() -> None:
    assert top_reuse_share([3, 2, 0, 1, 0]) == 0.5
    assert top_reuse_share([0] * 5) == 0.0
    # 101 blocks: the top ceil(1.01) = 2 blocks.
    assert top_reuse_share([10, 5, *([1] * 99)]) == 15 / 114


# --- whole-trace replay ---------------------------------------------------------------------


def test_infinite_cache_hits_longest_seen_prefix(scripted: list[TraceRequest]) -> None:
    assert replay_hit_tokens(scripted, UnboundedCache()) == SCRIPTED_INFINITE_HIT


def test_lru_replay_touches_blocks_in_request_order(scripted: list[TraceRequest]) -> None:
    # Capacity 2: r1 hits [1, 2] (1024) and leaves {2, 3}; r2 misses block 1 and leaves
    # {1, 4}; r3 matches fully (600). Touching r1 in reverse order would keep block 1 and
    # give r2 a hit of 512 instead.
    assert replay_hit_tokens(scripted, LRUCache(2)) == 1024 + 600
    assert replay_hit_tokens(scripted, LRUCache(0)) == 0
    assert replay_hit_tokens(scripted, LRUCache(100)) == SCRIPTED_INFINITE_HIT


def test_analyse_reuse_scripted(scripted: list[TraceRequest]) -> None:
    report = analyse_reuse(scripted, capacities=[2, 100])
    assert report.requests == 5
    assert report.total_tokens == SCRIPTED_TOTAL
    assert report.infinite_hit_rate == SCRIPTED_INFINITE_HIT / SCRIPTED_TOTAL
    assert [(e.capacity_blocks, e.hit_tokens) for e in report.lru] == [
        (2, 1624),
        (100, SCRIPTED_INFINITE_HIT),
    ]
    # Block stream 1,2 | 1,2,3 | 1,4 | 1,4 | 5,2: reuse distances 1,1,2,1,1,4.
    assert report.block_accesses == 11
    assert report.reuses == 6
    assert report.distinct_blocks == 5
    assert report.reuse_distance_blocks == Percentiles(1, 4, 4)
    # Time distances 1.0, 1.0, 1.5, 1.5, 1.5, 9.0 seconds.
    assert report.reuse_distance_s == Percentiles(1.5, 9.0, 9.0)
    # Reuse counts 3,2,0,1,0: the top ceil(5/100) = 1 block takes 3 of 6 reuses.
    assert report.top1pct_reuse_share == 0.5


def test_analyse_reuse_of_empty_trace() -> None:
    report = analyse_reuse([])
    assert report.infinite_hit_rate == 0.0
    assert report.reuses == 0
    assert report.reuse_distance_blocks == Percentiles(None, None, None)
    json.dumps(report.to_dict())


# --- CLI ----------------------------------------------------------------------------------


def test_cli_json_prints_one_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, SCRIPTED)
    assert main(["bench", "reuse", "--trace", str(path), "--capacities", "2,100", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    result = json.loads(out)
    assert result["trace"] == str(path)
    assert result["requests"] == 5
    assert result["total_tokens"] == SCRIPTED_TOTAL
    assert result["lru"] == [
        {"capacity_blocks": 2, "hit_tokens": 1624, "hit_rate": 1624 / SCRIPTED_TOTAL},
        {
            "capacity_blocks": 100,
            "hit_tokens": SCRIPTED_INFINITE_HIT,
            "hit_rate": SCRIPTED_INFINITE_HIT / SCRIPTED_TOTAL,
        },
    ]
    assert result["reuse_distance_blocks"] == {"p50": 1, "p90": 4, "p99": 4}
    assert result["reuse_distance_s"] == {"p50": 1.5, "p90": 9.0, "p99": 9.0}
    assert result["top1pct_reuse_share"] == 0.5
    assert result["reuses"] == 6
    assert result["distinct_blocks"] == 5


def test_cli_default_capacities_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, SCRIPTED)
    assert main(["bench", "reuse", "--trace", str(path), "--json"]) == 0
    capacities = [e["capacity_blocks"] for e in json.loads(capsys.readouterr().out)["lru"]]
    assert capacities == [10_000, 100_000]
    assert main(["bench", "reuse", "--trace", str(path)]) == 0
    assert "infinite cache hit rate" in capsys.readouterr().out


def test_cli_malformed_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, [_line(0, 10, [1]), "{oops"])
    assert main(["bench", "reuse", "--trace", str(path), "--json"]) == 2
    assert f"{path}:2: bad JSON" in capsys.readouterr().err


@pytest.mark.parametrize("capacities", ["", "a,1", "10,-1"])
def test_cli_rejects_bad_capacities(tmp_path: Path, capacities: str) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "reuse", "--trace", "x", "--capacities", capacities])


# --- the real trace -------------------------------------------------------------------------


@pytest.mark.slow
def test_mooncake_conversation_trace_matches_independent_measurement() -> None:
    if not MOONCAKE_TRACE.is_file():
        pytest.skip(f"Mooncake trace not found at {MOONCAKE_TRACE} (see shared/data/README.md)")
    report = analyse_reuse(read_trace(MOONCAKE_TRACE), capacities=[10_000, 100_000])
    assert report.requests == 12_031
    assert report.infinite_hit_rate == pytest.approx(0.374, abs=0.005)
    lru = {entry.capacity_blocks: entry.hit_rate for entry in report.lru}
    assert lru[10_000] == pytest.approx(0.215, abs=0.01)
    assert lru[100_000] == pytest.approx(0.371, abs=0.01)
    assert report.reused_access_share == pytest.approx(0.366, abs=0.002)
