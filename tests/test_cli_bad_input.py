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


def test_up_refuses_a_fixed_transfer_port_for_several_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every colocated worker bound the same ``[transfer] port``: the second died with
    EADDRINUSE and ``up`` ended in a bare ``RuntimeError: worker w1 exited with 3``."""
    config = tmp_path / "worker.toml"
    config.write_text('[transfer]\nport = 18950\n\n[[tiers]]\nname = "host"\ngib = 0.01\n')
    argv = ["up", "--model", "tiny", "--workers", "2", "--config", str(config)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "[transfer] port" in err and "Traceback" not in err


def test_a_worker_that_cannot_start_is_named_with_where_its_reason_is() -> None:
    from kvstrata.fleet.supervisor import WorkerProcess, WorkerSpec, WorkerStartError

    spec = WorkerSpec(worker_id="w9", port=1, model="tiny", extra_args=["--no-such-flag"])
    worker = WorkerProcess(spec)
    worker.start()
    try:
        with pytest.raises(WorkerStartError, match="w9 exited with 2 at start-up"):
            worker.wait_ready(60)
    finally:
        worker.terminate()


@pytest.mark.parametrize(
    ("model", "said"),
    [("tiny", "cannot reach worker"), ("/nonexistent/model", "cannot load the tokenizer")],
)
def test_router_with_a_worker_down_or_no_model_is_a_clean_error(
    model: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvstrata router`` raised an httpx or OSError traceback for both."""
    argv = ["router", "--worker", "http://127.0.0.1:1", "--model", model, "--port", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
