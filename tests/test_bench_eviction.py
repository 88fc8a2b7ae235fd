"""``kvstrata bench eviction`` and the synthetic trace generator.

Small synthetic traces for the CLI and its invariants (LRU equals ``bench reuse``'s LRU
bookkeeping, Belady bounds the online policies, the infinite cache bounds everything); one
slow replay of the real Mooncake trace.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstrata.bench.eviction import (
    POLICY_NAMES,
    SimulatedTrace,
    goals_met,
    replay,
    run_eviction_bench,
)
from kvstrata.bench.reuse import LRUCache, analyse_reuse, replay_hit_tokens
from kvstrata.cli.main import main
from kvstrata.costs import DEFAULT_PREFILL_MODEL, per_token
from kvstrata.store.deployed import PEER_PARAMETERS
from kvstrata.store.policies import LRUPolicy
from kvstrata.workloads.mooncake import BLOCK_TOKENS, TraceRequest, read_trace
from kvstrata.workloads.synthetic import generate, preset, write_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / ".." / "shared" / "data"
MOONCAKE_TRACE = DATA_DIR / "mooncake" / "conversation_trace.jsonl"


def _small(name: str = "chat", seed: int = 0, duration_s: float = 600.0) -> list[TraceRequest]:
    return generate(replace(preset(name, seed), duration_s=duration_s))


def _tail_first_lru(requests: list[TraceRequest], capacity: int) -> int:
    """``bench reuse``'s LRUCache, each request touched tail first (see store/policies.py)."""
    cache: LRUCache[Any] = LRUCache(capacity)
    hit_tokens = 0
    for request in requests:
        hit_tokens += request.prefix_tokens(cache.matched_prefix(request.hash_ids))
        for block in reversed(request.hash_ids):
            cache.touch(block)
    return hit_tokens


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", "eviction", *args, "--json", "--quiet"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_cli_reports_every_policy_and_matches_the_reuse_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = _small()
    path = tmp_path / "chat.jsonl"
    write_trace(path, requests)
    result = _run_cli(capsys, "--trace", str(path), "--capacities", "100,300,25%")

    distinct = len({block for request in requests for block in request.hash_ids})
    capacities = [100, 300, distinct // 4]
    assert result["capacities"] == capacities
    assert result["distinct_blocks"] == distinct
    assert result["requests"] == len(requests)
    assert result["cost_model"] == "smollm2-cpu"
    saved = result["saved_tokens"]
    assert set(saved) == set(POLICY_NAMES)
    assert {"lru", "s3fifo", "arc", "gdsf", "tinylfu", "kvstrata", "belady"} <= set(saved)
    assert all(len(values) == 3 for values in saved.values())
    assert set(result["saved_prefill_s"]) == set(saved)

    report = analyse_reuse(requests, capacities)
    assert result["total_tokens"] == report.total_tokens
    assert result["infinite_saved_tokens"] == report.infinite_hit_tokens
    for index, capacity in enumerate(capacities):
        lru = saved["lru"][index]
        assert lru == _tail_first_lru(requests, capacity)
        assert lru == pytest.approx(report.lru[index].hit_tokens, rel=0.02)
        assert saved["belady"][index] >= lru
        # Belady minimises block misses, not tokens (a partial last block weighs less): no
        # theorem, but on this trace (small, no ties) it bounds every online policy
        for name in saved:
            assert saved["belady"][index] >= saved[name][index], name
        assert max(saved[name][index] for name in saved) <= result["infinite_saved_tokens"]
        assert result["kvstrata_vs_lru"][index] == pytest.approx(saved["kvstrata"][index] / lru)
        assert result["kvstrata_vs_belady"][index] == pytest.approx(
            saved["kvstrata"][index] / saved["belady"][index]
        )


@pytest.mark.parametrize(("name", "seed"), [("chat", 1), ("docs", 0), ("docs", 2)])
def test_leaf_first_lru_equals_tail_first_lru_cache(name: str, seed: int) -> None:
    requests = _small(name, seed)
    trace = SimulatedTrace.build(requests, DEFAULT_PREFILL_MODEL)
    for capacity in (50, 200, 1000):
        saved = replay(trace, LRUPolicy(), capacity).saved_tokens
        assert saved == _tail_first_lru(requests, capacity)
        assert saved >= replay_hit_tokens(requests, LRUCache(capacity)) * 0.9


def test_synthetic_cli_half_split_and_policy_subset(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--synthetic", "chat", "--seed", "3", "--capacities", "10%", "--policies", "lru")
    whole = _run_cli(capsys, *args)
    first = _run_cli(capsys, *args, "--half", "first")
    second = _run_cli(capsys, *args, "--half", "second")
    assert first["requests"] + second["requests"] == whole["requests"]
    assert first["requests"] > 0 and second["requests"] > 0
    assert set(whole["saved_tokens"]) == {"lru"}
    assert "kvstrata_vs_lru" not in whole
    assert whole["trace"] == "synthetic:chat:seed=3"


def test_cli_skip_takes_a_later_window(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--synthetic", "chat", "--seed", "3", "--capacities", "10%", "--policies", "lru")
    first = _run_cli(capsys, *args, "--requests", "150")
    window = _run_cli(capsys, *args, "--skip", "100", "--requests", "50")
    assert first["requests"] == 150 and window["requests"] == 50
    assert "from request 100" in window["trace"] and "first 50" in window["trace"]


def test_bench_rejects_unknown_policies(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("fifo", "gdsf:0", "arc:1", "lru-tuned"):
        code = main(["bench", "eviction", "--synthetic", "chat", "--policies", bad, "--quiet"])
        assert code == 2, bad
        error = capsys.readouterr().err
        assert "unknown policies" in error or f"{bad!r}: gdsf's beta must be > 0" in error


def test_cli_runs_peers_at_any_point_and_reports_kvstrata_against_the_best(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``NAME:VALUE`` and ``NAME-tuned`` run the peer at that point; ``kvstrata_vs_best_peer``
    divides by the best of every peer in the run (here the same GDSF at three points)."""
    policies = "gdsf,gdsf-tuned,gdsf:4,s3fifo:0.3,kvstrata"
    args = ("--synthetic", "docs", "--requests", "300", "--capacities", "5%,15%")
    result = _run_cli(capsys, *args, "--policies", policies)
    assert result["peer_parameters"] == {
        "gdsf": {"beta": 1.0},
        "gdsf-tuned": {"beta": PEER_PARAMETERS["gdsf"].tuned},
        "gdsf:4": {"beta": 4.0},
        "s3fifo:0.3": {"small_fraction": 0.3},
    }
    versus = result["kvstrata_vs_best_peer"]
    assert versus["peers"] == ["gdsf", "gdsf-tuned", "gdsf:4", "s3fifo:0.3"]
    for field in ("saved_prefill_s", "saved_tokens"):
        values = result[field]
        for index, ratio in enumerate(versus[field]):
            best = max(values[name][index] for name in versus["peers"])
            assert ratio == pytest.approx(values["kvstrata"][index] / best)
    assert result["saved_prefill_s"]["gdsf:4"] != result["saved_prefill_s"]["gdsf"]


def test_zero_capacity_saves_nothing() -> None:
    report = run_eviction_bench(_small(duration_s=120.0), [0])
    assert report["saved_tokens"] == {name: [0] for name in POLICY_NAMES}
    assert report["kvstrata_vs_lru"] == [None]


# ---- the synthetic generator -----------------------------------------------------------------
def test_synthetic_traces_are_deterministic_and_well_formed() -> None:
    first = _small("docs", 7)
    assert first == _small("docs", 7)
    assert first != _small("docs", 8)
    assert [r.timestamp_ms for r in first] == sorted(r.timestamp_ms for r in first)
    parent: dict[int, int | None] = {}
    for request in first:
        assert len(request.hash_ids) == -(-request.input_length // BLOCK_TOKENS)
        previous: int | None = None
        for block in request.hash_ids:
            # chained ids: an id always follows the same parent id
            assert parent.setdefault(block, previous) == previous
            previous = block


def test_next_turn_reuses_the_previous_turns_full_blocks() -> None:
    requests = _small("chat", 0)
    earlier_full_prefixes: set[tuple[Any, ...]] = set()
    continued = 0
    for request in requests:
        full = request.input_length // BLOCK_TOKENS
        continued += any(
            request.hash_ids[:cut] in earlier_full_prefixes
            for cut in range(2, len(request.hash_ids))
        )
        earlier_full_prefixes.add(tuple(request.hash_ids[:full]))
    assert continued > len(requests) // 10
    shared_root = {request.hash_ids[0] for request in requests if request.hash_ids}
    assert len(shared_root) <= preset("chat").system_prompts


def test_azure_arrivals_drive_the_azure_preset(tmp_path: Path) -> None:
    csv_path = tmp_path / "azure.csv"
    csv_path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:00:{second:02d}.0000000,700,50\n" for second in range(40)),
        encoding="utf-8",
    )
    config = replace(preset("azure-conv"), azure_csv=str(csv_path), azure_stride=2)
    requests = generate(config)
    starts = {r.timestamp_ms for r in requests}
    assert starts >= {second * 1000 for second in range(0, 40, 2)}
    assert all(r.output_length >= 1 for r in requests)


# ---- the real trace ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE_TRACE.is_file(), reason="Mooncake trace not present")
def test_mooncake_lru_matches_reuse_bench_and_kvstrata_beats_it() -> None:
    """LRU reproduces ``bench reuse`` (21.5% at 10k, 37.1% at 100k blocks); with a cost model
    that values every prompt token alike, kvstrata saves at least as many tokens as LRU."""
    requests = read_trace(MOONCAKE_TRACE)
    reference = analyse_reuse(requests, (10_000, 100_000))
    lru = run_eviction_bench(requests, [10_000, 100_000], cost_model=per_token(), policies=("lru",))
    total = lru["total_tokens"]
    for index, entry in enumerate(reference.lru):
        assert lru["saved_tokens"]["lru"][index] / total == pytest.approx(entry.hit_rate, abs=1e-3)
    # kvstrata (the adaptive policy: four candidates and their shadow tiers) at the small
    # capacity only, where policies differ; it is the slow half of this test
    report = run_eviction_bench(
        requests, [10_000], cost_model=per_token(), policies=("lru", "kvstrata")
    )
    assert report["kvstrata_vs_lru"][0] >= 1.0


def test_windows_replay_each_window_as_its_own_run(capsys: pytest.CaptureFixture[str]) -> None:
    """``--windows`` equals one ``--skip`` run per window, and counts the windows meeting both
    goals by the same rule (``goals_met``)."""
    args = ("--synthetic", "chat", "--seed", "2", "--capacities", "5%,20%")
    policies = ("--policies", "s3fifo,gdsf-tuned,kvstrata", "--requests", "120")
    result = _run_cli(capsys, *args, *policies, "--skip", "50", "--windows", "2")
    assert [window["skip"] for window in result["windows"]] == [50, 170]
    for window in result["windows"]:
        alone = _run_cli(capsys, *args, *policies, "--skip", str(window["skip"]))
        assert window["kvstrata_vs_best_peer"] == alone["kvstrata_vs_best_peer"]
        assert window["capacities"] == alone["capacities"]
        assert window["goals_met"] == goals_met(alone["kvstrata_vs_best_peer"])
    assert result["windows_meeting_goals"] == sum(w["goals_met"] for w in result["windows"])
    worst = min(r for w in result["windows"] for r in w["kvstrata_vs_best_peer"]["saved_tokens"])
    assert result["worst_vs_best_peer"]["saved_tokens"] == worst
    assert result["peer_parameters"] == {
        "s3fifo": {"small_fraction": 0.1},
        "gdsf-tuned": {"beta": PEER_PARAMETERS["gdsf"].tuned},
    }


def test_windows_need_a_window_size_and_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "eviction", "--synthetic", "chat", "--quiet", "--windows", "2"]
    assert main(base) == 2  # no --requests
    assert "--windows needs --requests" in capsys.readouterr().err
    assert main([*base, "--requests", "50", "--policies", "lru,s3fifo"]) == 2
    assert "name both" in capsys.readouterr().err
    assert main([*base[:-1], "0"]) == 2
    assert "--windows must be >= 1" in capsys.readouterr().err
