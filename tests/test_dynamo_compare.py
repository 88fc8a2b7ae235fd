"""The dynamo-mocker profile and the cross-check against Dynamo's own trace replay."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstrata.sim.cluster import SimConfig
from kvstrata.sim.dynamo_compare import PAIRS, DynamoRun, compare, dynamo_unavailable
from kvstrata.sim.profiles import ChunkedPolynomialPrefill, dynamo_mocker, profile
from kvstrata.workloads.mooncake import TraceBlockId, TraceRequest, read_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mooncake"
CONVERSATION = TRACE / "conversation_trace.jsonl"


def _poly_ms(tokens: int) -> float:
    """Dynamo's polynomial prefill of one iteration (aisimulate perf_model.rs), in ms."""
    return 4.209989e-07 * tokens**2 + 1.518344e-02 * tokens + 1.650142e01


def test_mocker_prefill_is_the_polynomial_per_8192_token_iteration() -> None:
    model = dynamo_mocker().cost.prefill
    assert isinstance(model, ChunkedPolynomialPrefill)
    assert model.seconds(12_000) * 1000 == pytest.approx(_poly_ms(8192) + _poly_ms(3808))
    assert model.seconds(8192) * 1000 == pytest.approx(_poly_ms(8192))
    assert model.seconds(524, 11_776) * 1000 == pytest.approx(_poly_ms(524))
    # The cached prefix is free, as in the mocker; marginal drops one iteration overhead.
    assert model.seconds(3000, 0) == model.seconds(3000, 50_000)
    assert model.marginal_s(3000) == pytest.approx(model.seconds(3000) - model.overhead_s)
    assert model.marginal_s(0) == 0.0


def test_mocker_profile_pool_and_registration() -> None:
    mocker = profile("dynamo-mocker")
    assert mocker.device_blocks * 512 == 16_384 * 64
    assert mocker.host_blocks == 0
    assert mocker.cost.prefill_chunk_tokens == 8192


def _requests(count: int) -> list[TraceRequest]:
    out = []
    for i in range(count):
        conversation = i % 5
        turn = i // 5
        blocks = 2 + turn
        hashes = [1000 * conversation + b for b in range(blocks)]
        out.append(
            TraceRequest(
                timestamp_ms=i * 400,
                input_length=blocks * 512 + 100,
                output_length=20,
                hash_ids=tuple(TraceBlockId(h) for h in [*hashes, 10_000 + i]),
            )
        )
    return out


def _fake_runner(figures: dict[str, DynamoRun]) -> Callable[..., DynamoRun]:
    def run(_trace: Path, *, workers: int, mode: str, speedup: float) -> DynamoRun:
        assert workers == 4 and speedup == 1.0
        return figures[mode]

    return run


def test_compare_shape_ratios_and_goal_with_a_stand_in_for_dynamo(tmp_path: Path) -> None:
    requests = _requests(60)
    config = SimConfig(profile=dynamo_mocker(), workers=4)
    first = compare(
        tmp_path / "t.jsonl",
        requests,
        config,
        runner=_fake_runner(
            {mode: DynamoRun(mode, 0.05, 0.08, 0.1, 0.3, 60, 0.0) for mode in PAIRS.values()}
        ),
    )
    ours = first["kvstrata_sim"]
    assert set(ours) == {"dynamo", "round-robin", "kvstrata"}
    # A stand-in reporting exactly our figures meets the goal; one 2x off does not.
    exact = {
        mode: DynamoRun(
            mode,
            ours[name]["ttft_p50_s"],
            ours[name]["ttft_p90_s"],
            ours[name]["ttft_p99_s"],
            ours[name]["reuse_ratio"],
            60,
            0.0,
        )
        for name, mode in PAIRS.items()
    }
    same = compare(tmp_path / "t.jsonl", requests, config, runner=_fake_runner(exact))
    assert same["goal_met"] is True
    assert all(pair["ttft_p99_s_ratio"] == 1.0 for pair in same["pairs"].values())
    off = {
        mode: DynamoRun(mode, r.ttft_p50_s * 2, r.ttft_p90_s, r.ttft_p99_s, r.reuse_ratio, 60, 0)
        for mode, r in exact.items()
    }
    worse = compare(tmp_path / "t.jsonl", requests, config, runner=_fake_runner(off))
    assert worse["goal_met"] is False
    assert all(pair["ttft_p50_s_ratio"] == 0.5 for pair in worse["pairs"].values())
    json.dumps(worse)


def test_against_dynamos_own_replay_on_a_slice(tmp_path: Path) -> None:
    reason = dynamo_unavailable()
    if reason is not None:
        print(f"skipping the Dynamo cross-check: {reason}", file=sys.stderr)
        pytest.skip(reason)
    if not CONVERSATION.exists():
        print(f"skipping the Dynamo cross-check: no {CONVERSATION}", file=sys.stderr)
        pytest.skip(f"no {CONVERSATION}")
    rows = [json.loads(line) for line in CONVERSATION.open(encoding="utf-8")][:200]
    sliced = tmp_path / "slice.jsonl"
    sliced.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    report = compare(
        sliced,
        read_trace(sliced),
        SimConfig(profile=dynamo_mocker(), workers=4),
        policies=("dynamo", "round-robin"),
    )
    assert report["requests"] == 200
    for mode in PAIRS.values():
        figures = report["dynamo"][mode]
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
        assert 0 <= figures["reuse_ratio"] < 1
    for pair in report["pairs"].values():
        for key in ("ttft_p50_s_ratio", "ttft_p99_s_ratio", "reuse_ratio_ratio"):
            assert pair[key] is not None and math.isfinite(pair[key])
    # Round robin places requests the same way in both: equal reuse checks block accounting
    # (full blocks, the last prompt token computed, reuse counted at first admission).
    assert abs(report["pairs"]["round-robin"]["reuse_ratio_ratio"] - 1.0) <= 0.05
