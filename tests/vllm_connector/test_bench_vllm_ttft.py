"""``kvstrata bench vllm`` plumbing that needs no vLLM: alternation, spread, the summary and the
table (the end-to-end run is ``tests_vllm/test_bench_vllm.py``)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvstrata.bench.vllm_ttft import spread, summarize, table_rows, timed_order
from kvstrata.cli import bench_vllm
from kvstrata.errors import InvalidInput


def _record(i: int, fresh: float, hit: float, peer: float, *, token: int = 7) -> dict[str, Any]:
    return {
        "order": timed_order(i),
        "fresh_s": fresh,
        "kvstrata_s": hit,
        "example_connector_s": peer,
        "store_kvstrata_s": fresh * 1.1,
        "store_example_s": fresh * 1.5,
        "drain_kvstrata_s": 0.01,
        "drained_kvstrata": True,
        "cached_fresh": 0,
        "cached_kvstrata": 224 + 32 * (i % 2),
        "cached_example_connector": 224,
        "token_fresh": 7,
        "token_kvstrata": token,
        "token_example_connector": 7,
        "same_token_kvstrata": token == 7,
        "same_token_example_connector": True,
    }


def test_order_alternates_fresh_first_then_hits_first() -> None:
    assert timed_order(0) == ["fresh", "kvstrata", "example"]
    assert timed_order(1) == ["example", "kvstrata", "fresh"]
    assert timed_order(2) == timed_order(0)


def test_spread_is_min_quartiles_max() -> None:
    assert spread([3.0, 1.0, 2.0, 5.0, 4.0]) == {
        "min": 1.0,
        "q1": 2.0,
        "median": 3.0,
        "q3": 4.0,
        "max": 5.0,
    }
    assert spread([2.0])["q1"] == spread([2.0])["max"] == 2.0
    with pytest.raises(InvalidInput):
        spread([])


def test_summary_medians_paired_ratios_and_token_check() -> None:
    runs = [
        _record(0, 1.0, 0.2, 0.5),
        _record(1, 1.2, 0.3, 0.6),
        _record(2, 3.0, 0.25, 0.4),  # a noisy fresh run: the median ignores it
        _record(3, 1.1, 0.2, 0.5),
        _record(4, 0.9, 0.2, 0.5, token=8),
    ]
    result = summarize(256, runs)
    assert result.repetitions == 5
    assert result.ttft_fresh_s == 1.1 and result.ttft_kvstrata_s == 0.2
    assert result.speedup_vs_fresh == pytest.approx(1.1 / 0.2)
    assert result.spread["speedup_vs_fresh"]["max"] == pytest.approx(3.0 / 0.25)
    assert result.spread["speedup_vs_fresh"]["min"] == pytest.approx(1.2 / 0.3)
    assert result.samples["fresh"] == [1.0, 1.2, 3.0, 1.1, 0.9]
    assert result.cached_tokens_kvstrata == 224
    assert result.same_token_kvstrata is False and result.same_token_example_connector is True
    data = result.to_dict()
    assert data["runs"][1]["order"][0] == "example"
    labels = [row[0] for row in table_rows(data)]
    assert "TTFT fresh, no connector (s)" in labels and "same_token_kvstrata" in labels
    assert all(row[-1] == 5 for row in table_rows(data))


def test_cli_repeats_defaults_to_five_and_keeps_repeat_alias() -> None:
    parser = argparse.ArgumentParser()
    bench_vllm.register(parser.add_subparsers())
    assert parser.parse_args(["vllm"]).repeats == 5
    assert parser.parse_args(["vllm", "--repeat", "3"]).repeats == 3
