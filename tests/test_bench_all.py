"""``kvstrata bench all`` / ``bench render``: the plan runs real benchmark subprocesses, the
page shows their own tables, and a missing or failed figure stays visible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.bench.results_page import method_line, render_page
from kvstrata.cli.bench_all import PLAN, Entry, merge_bundles, run_entry, select
from kvstrata.errors import InvalidInput


def _bundle() -> dict[str, object]:
    return {
        "meta": {"date": "2026-12-01", "commit": "abc1234", "cores": 2},
        "benches": [
            {
                "name": "toy",
                "command": "kvstrata bench toy --json",
                "about": "A toy against its peer.",
                "status": "ok",
                "seconds": 1.0,
                "record": {
                    "title": "toy: ours vs peer",
                    "columns": ["figure", "ours", "peer"],
                    "rows": [["p99 | ms", "1.5", "2"]],
                    "result": {"repeats": 5, "p99_ms": {"median": 1.5, "lo": 1.2, "hi": 1.9}},
                },
                "plots": ["img/toy.png"],
            },
            {
                "name": "gone",
                "command": "kvstrata bench gone",
                "status": "skipped",
                "reason": "no vLLM venv",
                "seconds": None,
            },
            {"name": "broke", "command": "x", "status": "failed", "reason": "Traceback: boom"},
        ],
    }


def test_page_shows_tables_meta_method_plots_and_missing_figures() -> None:
    page = render_page(_bundle())
    assert "| commit | abc1234 |" in page
    assert "| p99 \\| ms | 1.5 | 2 |" in page  # a pipe in a cell cannot break the table
    assert "**toy: ours vs peer**" in page
    assert "repetitions: 5" in page and "`p99_ms.hi`" in page
    assert "![toy](img/toy.png)" in page
    assert "| gone | skipped: no vLLM venv | - | - | - |" in page
    assert "**Not measured** (failed): Traceback: boom" in page
    assert "| never | not run in this bundle |" in render_page(_bundle(), plan=["toy", "never"])
    assert "not run in this bundle" not in page


def test_method_line_says_when_nothing_is_reported() -> None:
    assert method_line({"x": 1}) == "*repetitions: not reported; spread: not reported.*"
    # look-alikes are not spread figures: "_lookup", "tokens_max"
    assert "spread: not reported" in method_line({"lookup_p99_ms": 1, "prompt_tokens_max": 9})
    line = method_line({"method": "deterministic", "ratio_max": 2, "p99": {"lo": 1}})
    assert line.startswith("*deterministic; repetitions: not reported; spread fields: ")
    assert "`p99.lo`" in line and "`ratio_max`" in line


def test_select_by_name_and_unknown_names_are_refused() -> None:
    assert [e.name for e in select(PLAN, "hash,index", None)] == ["hash", "index"]
    assert "hash" not in [e.name for e in select(PLAN, None, "hash")]
    with pytest.raises(InvalidInput, match="unknown benchmark"):
        select(PLAN, "nope", None)


def test_missing_prerequisite_is_skipped_with_its_reason(tmp_path: Path) -> None:
    entry = Entry("x", ("bench", "hash"), "x", needs=(str(tmp_path / "absent.jsonl"),))
    out = run_entry(entry, quick=False, plots=tmp_path, vllm_ok=True)
    assert out["status"] == "skipped" and "absent.jsonl" in out["reason"]
    out = run_entry(
        Entry("v", ("bench", "vllm"), "v", needs_vllm=True),
        quick=False,
        plots=tmp_path,
        vllm_ok=False,
    )
    assert out["status"] == "skipped" and "vLLM" in out["reason"]


def test_a_failing_benchmark_is_recorded_as_failed(tmp_path: Path) -> None:
    entry = Entry("bad", ("bench", "hash", "--tokens", "-5", "--json"), "bad")
    out = run_entry(entry, quick=False, plots=tmp_path, vllm_ok=True)
    assert out["status"] == "failed" and out["reason"]


def test_bench_all_then_render_end_to_end(tmp_path: Path) -> None:
    plots = tmp_path / "img"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstrata.cli.main",
            "bench",
            "all",
            "--quick",
            "--only",
            "hash",
            "--plots",
            str(plots),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    bundle = json.loads(done.stdout)
    (hash_run,) = bundle["benches"]
    assert hash_run["status"] == "ok", hash_run
    result = hash_run["record"]["result"]
    assert result["baseline_tokens_per_s"] > 0
    bundle_path = tmp_path / "bundle.json"
    bundle_path.write_text(done.stdout)
    page_path = tmp_path / "results.md"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstrata.cli.main",
            "bench",
            "render",
            str(bundle_path),
            "--out",
            str(page_path),
        ],
        check=True,
        timeout=60,
    )
    page = page_path.read_text()
    assert "## hash" in page and hash_run["record"]["title"] in page
    assert bundle["meta"]["commit"] in page


def test_bundles_merge_later_runs_replace_earlier_ones() -> None:
    first = {
        "meta": {"cores": 2, "date": "d1"},
        "benches": [{"name": "index", "v": 1}, {"name": "zz"}, {"name": "hash"}],
    }
    second = {"meta": {"cores": 4, "date": "d2"}, "benches": [{"name": "index", "v": 2}]}
    merged = merge_bundles([first, second])
    assert merged["meta"] == {"cores": 4}
    names = [(b["name"], b.get("v")) for b in merged["benches"]]
    assert names == [("hash", None), ("index", 2), ("zz", None)]  # plan order, unknown last
    # "later" is by the runs' dates, not the files' order: the page cannot depend on it
    assert merge_bundles([second, first]) == merged


def test_merged_benchmarks_keep_the_cpu_of_their_own_run() -> None:
    amd = {"meta": {"cpu": "AMD EPYC"}, "benches": [{"name": "eviction-chat"}, {"name": "hash"}]}
    xeon = {"meta": {"cpu": "Intel Xeon"}, "benches": [{"name": "hash"}]}
    merged = merge_bundles([amd, xeon])
    assert {b["name"]: b["cpu"] for b in merged["benches"]} == {
        "hash": "Intel Xeon",
        "eviction-chat": "AMD EPYC",
    }
    page = render_page(merged)
    assert "| eviction-chat | ok |" not in page  # no status given: shown as "?"
    assert "| AMD EPYC |" in page and "| Intel Xeon |" in page
