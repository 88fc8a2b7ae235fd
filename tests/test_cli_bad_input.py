"""Bad command-line input gets ``kvstrata: error: …`` and exit status 2, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.cli.main import main


def test_a_keys_file_in_a_missing_directory_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "keys.toml"
    assert main(["keys", "add", "--file", str(missing), "--tenant", "acme"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstrata: error:") and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--prompts", "p.jsonl", "--block-size", "0"],
        ["verify", "--prompts", "p.jsonl", "--pool-blocks", "-1"],
        ["delete", "--url", "http://127.0.0.1:1", "--tenant", "t", "--older-than", "9" * 400 + "d"],
    ],
)
def test_out_of_range_numbers_are_refused_by_the_parser(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify --block-size 0`` divided by zero; an ``--older-than`` past float range
    reached the JSON encoder as inf."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
