"""``kvstrata sim --loads … --repeats R``: median and range, the goal, sweeps, disjoint data."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.cli import sim_repeat
from kvstrata.cli.main import main
from kvstrata.cli.output import RECORD_ENV
from kvstrata.router import POLICIES
from kvstrata.router.dynamo_policy import DynamoWeights
from kvstrata.router.policies import LlmdScorerPolicy, LlmdWeights
from kvstrata.router.specs import format_spec, parse_spec
from kvstrata.sim import experiment
from kvstrata.sim.cluster import SimConfig
from kvstrata.sim.experiment import (
    Interval,
    goal_met,
    interval,
    p99_goal_under_floor,
    paired,
    run_experiment,
    split_windows,
    sweep_points,
)
from kvstrata.sim.profiles import gpu_a100_8b
from kvstrata.sim.report import GOAL_P99_RATIO, RunResult
from kvstrata.sim.trace import SimRequest
from kvstrata.workloads.mooncake import TraceRequest
from kvstrata.workloads.synthetic import generate, preset, write_trace

FIGURES = ("ttft_p99_s", "ttft_p50_s", "hit_rate")


def _chat(seed: int, duration_s: float = 90.0) -> list[TraceRequest]:
    return generate(replace(preset("chat", seed), duration_s=duration_s))


def _config() -> SimConfig:
    return SimConfig(profile=gpu_a100_8b().with_capacities(128, 512), workers=2)


@given(st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=40))
def test_interval_is_the_median_and_the_range(values: list[float]) -> None:
    span = interval(values)
    assert span.lo <= span.median <= span.hi
    assert span.lo == round(min(values), 4) and span.hi == round(max(values), 4)


def test_interval_of_five_repeats_is_their_min_median_and_max() -> None:
    """Labelled and computed as the range of the repeats: the interpolated 5th-95th
    percentiles of five values were called a 90% interval but hold a new repeat ~60% of
    the time."""
    span = interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (span.lo, span.median, span.hi) == (1.0, 3.0, 5.0)


def test_goal_on_hand_made_numbers() -> None:
    p99 = Interval(median=7.0, lo=6.0, hi=8.0)
    assert goal_met(
        p99, best_baseline_p99_median=10.0, kvstrata_hit_rate_median=0.27, infinite_hit_rate=0.30
    )
    # The interval's upper end, not the median, must clear 0.8x the best baseline.
    assert not goal_met(p99, 9.9, 0.27, 0.30)
    # A fast kvstrata that gives up hit rate misses the goal too.
    assert not goal_met(p99, 10.0, 0.26, 0.30)


def test_goal_under_the_floor_on_hand_made_numbers() -> None:
    # Mooncake at 0.5 load (2026-12-02): floor p99 16.4 [22.0] s, best baseline median 18.06 s.
    floor = Interval(median=16.4, lo=14.0, hi=22.0)
    assert p99_goal_under_floor(floor, 18.06)  # 0.8 x 18.06 = 14.4 < 22.0
    assert not p99_goal_under_floor(floor, 27.5)  # 0.8 x 27.5 = 22.0: reachable, just


def test_paired_ratios_are_taken_repeat_by_repeat() -> None:
    """Paired, not ratio of medians: kvstrata's worst repeat may be the baseline's worst too."""
    mine, theirs = [10.0, 30.0, 12.0], [20.0, 25.0, 10.0]
    span = paired(mine, theirs)
    assert span == Interval(median=1.2, lo=0.5, hi=1.2)
    assert interval(mine).hi / interval(theirs).median > span.hi  # the goal's form is stricter
    assert paired(mine, [1.0, 0.0, 1.0]) is None  # no ratio to a zero
    assert paired(mine, theirs[:2]) is None and paired([], []) is None


def test_paired_figures_take_each_repeats_own_winner_and_floor() -> None:
    p99 = {
        "kvstrata": [9.0, 12.0, 10.0],
        "dynamo": [10.0, 10.0, 10.0],  # best by median
        "llm-d": [12.0, 8.0, 20.0],  # wins the second repeat
    }
    values = {name: {"ttft_p99_s": series} for name, series in p99.items()}
    figures = experiment._paired_figures(values, "dynamo", ["dynamo", "llm-d"], [6.0, 8.0, 5.0])
    assert figures["p99_vs_best"] == {"median": 1.0, "lo": 0.9, "hi": 1.2}
    assert figures["p99_vs_repeat_best"] == {"median": 1.0, "lo": 0.9, "hi": 1.5}
    assert figures["kvstrata_p99_vs_floor"] == {"median": 1.5, "lo": 1.5, "hi": 2.0}
    assert figures["best_p99_vs_floor"] == {"median": 1.6667, "lo": 1.25, "hi": 2.0}
    assert (
        experiment._paired_figures(values, "dynamo", ["dynamo"], [0.0, 1.0, 1.0])[
            "kvstrata_p99_vs_floor"
        ]
        is None
    )  # no ratio to a zero floor


def test_every_sweep_starts_at_the_published_defaults() -> None:
    assert LlmdWeights() == LlmdWeights(prefix=3.0, kv_utilisation=2.0, queue=2.0)
    assert DynamoWeights().prefill_load_scale == 1.0
    for name in POLICIES:
        points = sweep_points(name)
        assert points[0] == format_spec(name, POLICIES.defaults(name))
        assert len(points) == len(set(points)) <= 6
        for spec in points:
            assert parse_spec(spec)[0] == name and spec in POLICIES
    assert len(sweep_points("llm-d")) > 1 and len(sweep_points("kvstrata")) > 1
    built = POLICIES["llm-d:prefix=6.0"](lambda _w: gpu_a100_8b().cost)
    assert isinstance(built, LlmdScorerPolicy) and built.weights.prefix == 6.0
    assert built.weights.queue == 2.0  # unnamed parameters keep their defaults
    assert "llm-d:nonsense=1" not in POLICIES and "llm-d:prefix" not in POLICIES
    assert list(POLICIES)[:2] == ["kvstrata", "round-robin"]


def test_windows_are_disjoint_equal_and_cover_the_trace() -> None:
    trace = [TraceRequest(ms, 600, 4, (ms,)) for ms in range(0, 60_000, 700)]
    windows = split_windows(trace, 6)
    assert sum(len(w) for w in windows) == len(trace)
    for k, window in enumerate(windows):
        assert all(k * 59_500 / 6 <= r.timestamp_ms for r in window)
        assert all(r.timestamp_ms < (k + 1) * 59_500 / 6 or k == 5 for r in window)
    for before, after in itertools.pairwise(windows):
        assert before[-1].timestamp_ms < after[0].timestamp_ms
    assert [len(w) for w in split_windows(trace, 6, limit=3)] == [3] * 6


def _signature(requests: Sequence[SimRequest]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    return tuple((r.prompt_tokens, r.hashes) for r in requests)


def test_tuning_data_never_appear_in_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = sorted(_chat(3, duration_s=240.0), key=lambda r: r.timestamp_ms)
    tuning, *evaluation = split_windows(trace, 3)
    tuned_on: list[int] = []
    evaluated: list[tuple[int, Any]] = []
    real_search, real_run = experiment.search_rate_scale, experiment.run_policies

    def search(data: Sequence[TraceRequest], *args: Any, **kwargs: Any) -> Any:
        tuned_on.append(id(data))
        return real_search(data, *args, **kwargs)

    def run(
        requests: Sequence[SimRequest], policies: Sequence[str], config: SimConfig, **kw: Any
    ) -> dict[str, RunResult]:
        evaluated.append((config.seed, _signature(requests)))
        return real_run(requests, policies, config, **kw)

    monkeypatch.setattr(experiment, "search_rate_scale", search)
    monkeypatch.setattr(experiment, "run_policies", run)
    report = run_experiment(
        tuning, evaluation, ["kvstrata", "round-robin"], _config(), [0.5], jobs=1
    )
    scale = report["loads"][0]["rate_scale"]
    assert tuned_on == [id(tuning)]
    prepared = {
        seed: _signature(experiment.prepare(data, scale))
        for seed, data in enumerate([tuning, *evaluation])
    }
    assert [seed for seed, _ in evaluated] == [0, 1, 2]  # one tuning sweep, then each repeat
    for seed, signature in evaluated:
        assert signature == prepared[seed]
    tuning_ids = {(r.timestamp_ms, r.hash_ids) for r in tuning}
    assert not any((r.timestamp_ms, r.hash_ids) in tuning_ids for w in evaluation for r in w)


def _check_schema(report: dict[str, Any], loads: list[float], repeats: int) -> None:
    assert report["repeats"] == repeats
    assert [load["utilisation"] for load in report["loads"]] == loads
    for load in report["loads"]:
        assert set(load["policies"]) == {"kvstrata", "round-robin", "dynamo", "llm-d"}
        for figures in load["policies"].values():
            for name in FIGURES:
                span = figures[name]
                assert span["lo"] <= span["median"] <= span["hi"]
        best = load["best_baseline"]
        assert best != "kvstrata"
        assert all(
            load["policies"][best]["ttft_p99_s"]["median"] <= f["ttft_p99_s"]["median"]
            for name, f in load["policies"].items()
            if name != "kvstrata"
        )
        assert 0.0 < load["infinite_cache_hit_rate"] < 1.0
        floor = load["ttft_p99_floor_s"]
        assert 0.0 < floor["lo"] <= floor["median"] <= floor["hi"]
        best_p99 = load["policies"][best]["ttft_p99_s"]["median"]
        assert load["p99_goal_under_floor"] == (floor["hi"] > GOAL_P99_RATIO * best_p99)
        pairs = load["paired"]
        # Each repeat's own winner is at most the best-by-median baseline on that repeat.
        for end in ("lo", "median", "hi"):
            assert pairs["p99_vs_repeat_best"][end] >= pairs["p99_vs_best"][end]
        assert min(pairs[n]["lo"] for n in ("kvstrata_p99_vs_floor", "best_p99_vs_floor")) > 0
        mine = load["policies"]["kvstrata"]
        assert load["goal_met"] == goal_met(
            Interval(**mine["ttft_p99_s"]),
            load["policies"][best]["ttft_p99_s"]["median"],
            mine["hit_rate"]["median"],
            load["infinite_cache_hit_rate"],
        )
        for name, record in load["tuning"].items():
            assert record["sweep"][0]["params"] == POLICIES.defaults(name)
            assert record["chosen"] in sweep_points(name)
            chosen = min(s["ttft_p99_s"] for s in record["sweep"])
            assert (
                chosen == record["sweep"][sweep_points(name).index(record["chosen"])]["ttft_p99_s"]
            )
        assert load["rate_search"]


BASE = ["--workers", "2", "--device-blocks", "128", "--host-blocks", "512", "--jobs", "1"]
BASE += ["--policies", "kvstrata,round-robin,dynamo,llm-d", "--json", "--quiet"]


def test_cli_synthetic_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--synthetic", "chat", "--limit", "60", "--loads", "0.5,0.8"]
    assert main([*argv, "--repeats", "5", *BASE]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    _check_schema(report, [0.5, 0.8], 5)
    assert report["source"]["tuning_seed"] == 0 and report["source"]["seeds"] == [1, 2, 3, 4, 5]
    assert report["interval"].startswith("median and range (min-max) of the repeats")
    # 60 requests a repeat: its p99 is one of the largest values, and the CLI says so.
    assert "p99 TTFT of the smallest repeat rests on 60 TTFT samples" in err


def test_cli_trace_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "chat.jsonl"
    write_trace(trace, _chat(1, duration_s=180.0))
    assert main(["sim", "--trace", str(trace), "--repeats", "5", "--loads", "0.6", *BASE]) == 0
    report = json.loads(capsys.readouterr().out)
    _check_schema(report, [0.6], 5)
    windows = [report["source"]["tuning_window_s"], *report["source"]["windows_s"]]
    assert all(a[1] < b[0] for a, b in itertools.pairwise(windows))


@pytest.mark.parametrize("repeats", ["1", "4"])
def test_cli_needs_five_repeats_with_loads(
    repeats: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--synthetic", "chat", "--limit", "20", "--loads", "0.5"]
    assert main([*argv, "--repeats", repeats, *BASE]) == 2
    assert "--repeats must be >= 5" in capsys.readouterr().err


def test_cli_table_says_the_figures_are_median_and_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The human table (and its bench record) names what ``[lo, hi]`` is: min and max."""
    span = {"median": 2.0, "lo": 1.0, "hi": 3.0}
    load = {
        "utilisation": 0.5,
        "best_baseline": "round-robin",
        "goal_met": False,
        "p99_goal_under_floor": False,
        "paired": {"p99_vs_best": {"median": 0.9, "lo": 0.85, "hi": 1.1}},
        "policies": {"round-robin": dict.fromkeys(FIGURES, span)},
        "tuning": {"round-robin": {"params": {}}},
    }
    canned = {"repeats": 5, "loads": [load]}
    monkeypatch.setattr(sim_repeat, "run_experiment", lambda *_a, **_k: canned)
    record = tmp_path / "record.json"
    monkeypatch.setenv(RECORD_ENV, str(record))
    argv = ["sim", "--synthetic", "chat", "--limit", "200", "--loads", "0.5"]
    assert main([*argv, "--workers", "2", "--policies", "round-robin", "--quiet"]) == 0
    table = json.loads(record.read_text())
    assert "median [min, max] of the repeats" in table["title"]
    assert "kvstrata p99 ÷ best's, paired 0.9 [0.85, 1.1]" in table["title"]
    assert "TTFT p99 s [min, max]" in table["columns"]
    assert table["rows"][0][3] == "2 [1, 3]"
    assert "warning" not in capsys.readouterr().err  # 200 requests a repeat: enough for a p99


def test_cli_single_run_warns_when_a_p99_rests_on_few_samples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sim", "--synthetic", "chat", "--limit", "30", "--workers", "2", "--jobs", "1"]
    assert main([*argv, "--policies", "round-robin", "--json", "--quiet"]) == 0
    assert "p99 TTFT of this run rests on 30 TTFT samples (< 100)" in capsys.readouterr().err
