"""``kvstrata verify`` and ``kvstrata bench ttft`` end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.main import main


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_verify_reports_exact_reuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 4}),
            json.dumps(
                {"messages": [{"role": "user", "content": "Capital of France?"}], "tenant": "acme"}
            ),
            "",
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be terse."},
                        {"role": "user", "content": "Name three colours."},
                    ]
                }
            ),
        ],
    )
    code = main(["verify", "--prompts", str(prompts), "--model", "tiny", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["line"] for r in out["results"]] == [1, 2, 4]
    assert out["results"][1]["tenant"] == "acme"
    for result in out["results"]:
        assert result["greedy_equal"] is True
        assert result["max_abs_logit_diff"] <= 1e-4
        n = result["prompt_tokens"]
        assert result["matched_tokens"] == (n - 1 if n >= 16 else 0)
    summary = out["summary"]
    assert summary["prompts"] == 3 and summary["all_exact"] is True
    assert summary["min_matched_tokens"] == min(r["matched_tokens"] for r in out["results"])
    assert list(out)[-1] == "summary"


def test_verify_with_concurrency_compares_batched_runs_with_runs_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        json.dumps({"prompt": f"Story {i}: " + "once upon a time " * (2 + 3 * i)}) for i in range(5)
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", lines)
    args = ["verify", "--prompts", str(prompts), "--model", "tiny", "--json", "--concurrency", "3"]
    code = main(args)
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["concurrency"] == 3
    assert out["summary"]["prompts"] == 5 and out["summary"]["all_exact"] is True
    for result in out["results"]:
        n = result["prompt_tokens"]
        assert result["matched_tokens"] == (n - 1 if n >= 16 else 0)
        assert result["max_abs_logit_diff"] <= 1e-4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"prompt": 3}', "'prompt' must be a non-empty string"),
        ('{"prompt": "a", "messages": []}', "exactly one of"),
        ('{"messages": [{"role": "user"}]}', "messages[0] needs string"),
        ('{"prompt": "a", "tenant": ""}', "'tenant' must be"),
    ],
)
def test_verify_names_the_malformed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    prompts = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), line])
    code = main(["verify", "--prompts", str(prompts), "--model", "tiny", "--json"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{prompts}:2:" in err and message in err


def test_bench_ttft_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "ttft", "--model", "tiny", "--tokens", "256", "--repeat", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["prompt_tokens"] == 256 and out["matched_tokens"] == 255
    assert out["ttft_fresh_s"] > 0 and out["ttft_hit_s"] > 0
    assert out["speedup"] == pytest.approx(out["ttft_fresh_s"] / out["ttft_hit_s"])
    assert out["greedy_equal"] is True and out["max_abs_logit_diff"] <= 1e-4
