"""``kvstrata bench prefill``: timed points on the real (tiny) engine, and the fit of them."""

from __future__ import annotations

import argparse
import json

import pytest

from kvstrata.bench.decode import pool_blocks_for, run_decode_curve
from kvstrata.bench.prefill import PrefillCurve, run_prefill_curve
from kvstrata.cli.bench_prefill import _points
from kvstrata.cli.main import main
from kvstrata.costs import fit
from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.errors import InvalidInput


def test_points_parse_fresh_and_after_a_hit() -> None:
    assert _points("16, 2032+16,512") == ((16, 0), (16, 2032), (512, 0))
    with pytest.raises(argparse.ArgumentTypeError, match="CACHED\\+NEW"):
        _points("16,x+3")


def test_each_point_is_timed_with_exactly_its_hit(tiny_model: LoadedModel) -> None:
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=16, pool_blocks=32))
    try:
        points = ((16, 0), (48, 0), (16, 32), (16, 64), (32, 16))
        curve = run_prefill_curve(engine, points, model="tiny", repeats=2)
        with pytest.raises(InvalidInput, match="multiple of 16"):
            run_prefill_curve(engine, ((16, 8),), model="tiny", repeats=1)
    finally:
        engine.close()
    # a stored prefix longer than a later point's would have raised (matched != cached)
    assert [(n, c) for n, c, _ in curve.samples] == list(points)
    assert all(s > 0 for *_, s in curve.samples)
    assert curve.fitted == fit(curve.samples, name="tiny-measured")
    assert curve.stat == "min" and all(len(t) == 2 for *_, t in curve.timings)
    assert [s for *_, s in curve.samples] == [min(t) for *_, t in curve.timings]


def test_a_curve_keeps_every_timing_and_its_statistic() -> None:
    """``--stat median`` pins the typical forward, ``min`` the best (module docstring)."""
    timings = ((16, 0, (0.3, 0.1, 0.2)), (64, 0, (0.5, 0.4, 0.9)), (16, 64, (0.2, 0.3, 0.25)))
    low = PrefillCurve("m", 3, "min", timings, "m-measured")
    typical = PrefillCurve("m", 3, "median", timings, "m-measured")
    assert [s for *_, s in low.samples] == [0.1, 0.4, 0.2]
    assert [s for *_, s in typical.samples] == [0.2, 0.5, 0.25]
    assert typical.fitted == fit(typical.samples, name="m-measured")
    data = typical.to_dict()
    assert data["stat"] == "median" and data["samples"][1]["timings"] == [0.5, 0.4, 0.9]
    assert data["samples"][1]["seconds"] == 0.5
    with pytest.raises(InvalidInput, match="stat must be one of"):
        PrefillCurve("m", 3, "p90", timings, "m-measured")


def test_cli_prints_the_samples_and_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "prefill", "--model", "tiny", "--repeat", "1", "--points",
                 "16,32,16+16", "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert [s["cached_tokens"] for s in data["samples"]] == [0, 0, 16]
    assert set(data["fit"]) == {"overhead_s", "per_token_s", "per_token_ctx_s", "spread"}
    assert main(["bench", "prefill", "--model", "tiny", "--repeat", "3", "--stat", "median",
                 "--points", "16,32,16+16", "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["stat"] == "median" and all(len(s["timings"]) == 3 for s in data["samples"])
    assert all(s["seconds"] == sorted(s["timings"])[1] for s in data["samples"])


@pytest.mark.slow
def test_served_points_time_a_real_fleet_and_check_each_hit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--served``: a real ``kvstrata up`` fleet of the tiny model; every cached point hit
    exactly its prefix through the front door (``time_points`` raises otherwise)."""
    assert main(["bench", "prefill", "--served", "--model", "tiny", "--workers", "1",
                 "--repeat", "2", "--points", "16,48,32+16,64+32", "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "tiny-served"
    samples = [(s["new_tokens"], s["cached_tokens"]) for s in data["samples"]]
    assert samples == [(16, 0), (48, 0), (16, 32), (32, 64)]
    assert all(s["seconds"] > 0 for s in data["samples"])
    assert data["fit"]["spread"] >= 0


def test_decode_curve_times_only_steps_that_decode_the_whole_batch(
    tiny_model: LoadedModel,
) -> None:
    """Each batch size's samples are steps that computed one token for each of its ``b``
    sequences (never a prefill step, nor a step of a batch still filling or draining): as
    many as the tokens decoded after the first; the fit is the least-squares line."""
    blocks = pool_blocks_for((1, 3), 40, 5, 16, 512)
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=16, pool_blocks=blocks))
    try:
        curve = run_decode_curve(engine, (1, 3), context=40, steps=5)
        with pytest.raises(InvalidInput, match="fewer than"):
            run_decode_curve(engine, (1, 64), context=40, steps=5)
    finally:
        engine.close()
    assert [b for b, _ in curve.timings] == [1, 3]
    # 1 + 5 + 2 tokens each (one prefill step of 40 or 120 tokens): 7 decode steps of the batch
    assert all(len(t) == 7 for _, t in curve.timings)
    (_, s1), (_, s3) = curve.samples
    assert s1 == min(curve.timings[0][1]) and curve.per_sequence_s == pytest.approx((s3 - s1) / 2)
    assert curve.base_s == pytest.approx(s1 - curve.per_sequence_s)
    data = curve.to_dict()
    assert data["fit"]["decode_step_base_s"] == curve.base_s
    assert [s["batch"] for s in data["samples"]] == [1, 3]


def test_cli_decode_adds_the_curve_and_refuses_bad_batches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "prefill", "--model", "tiny", "--repeat", "1", "--points", "16,32,64"]
    assert main([*argv, "--decode", "1,2", "--decode-context", "24", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["batch"] for s in data["decode"]["samples"]] == [1, 2]
    assert data["decode"]["context_tokens"] == 24
    for bad in (["--decode", "2,2"], ["--decode", "0,1"], ["--decode", "1,2", "--served"]):
        assert main([*argv, *bad]) != 0
        assert "kvstrata:" in capsys.readouterr().err
