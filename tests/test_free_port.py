"""``free_port`` picks listening ports where outgoing connections cannot take them first."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvstrata.runtime import processes
from kvstrata.runtime.processes import free_port


def test_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    ephemeral_low = processes._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert processes._LISTEN_LOW <= port < ephemeral_low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def _two_free_ports() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` both bind now."""
    for port in range(20000, 30000, 2):
        if processes._bindable("127.0.0.1", port) and processes._bindable("127.0.0.1", port + 1):
            return port
    raise AssertionError("no two adjacent free ports in 20000-30000")


def test_a_port_in_use_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _two_free_ports()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", taken))
        busy.listen()
        # A range of two ports, one of them busy: every pick is the other one.
        monkeypatch.setattr(processes, "_LISTEN_LOW", taken)
        monkeypatch.setattr(processes, "_ephemeral_low", lambda: taken + 2)
        monkeypatch.setattr(processes, "_MIN_ROOM", 1)
        assert {free_port() for _ in range(50)} == {taken + 1}


def test_without_room_below_the_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("10500\t60999\n")
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", narrow)
    assert processes._ephemeral_low() == 10500
    assert free_port() >= 10500  # no room below: the kernel's own choice
    narrow.write_text("garbage\n")
    assert processes._ephemeral_low() == 32768


def test_a_child_python_runs_this_checkouts_code() -> None:
    """``with_source_first``: the directory of this ``kvstrata`` package leads ``PYTHONPATH``,
    whatever was there before; a child Python started with it imports this very package."""
    import subprocess
    import sys

    import kvstrata

    env = processes.with_source_first({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(":") == [processes.source_root(), "/elsewhere"]
    assert processes.with_source_first({})["PYTHONPATH"] == processes.source_root()
    assert processes.source_root() == str(Path(kvstrata.__file__).resolve().parent.parent)
    # -S: no site-packages, so no editable install either: only PYTHONPATH can find it
    code = "import kvstrata; print(kvstrata.__file__)"
    argv = [sys.executable, "-S", "-c", code]
    child = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd="/")
    assert Path(child.stdout.strip()).resolve() == Path(kvstrata.__file__).resolve()
    bare = subprocess.run(argv, env={}, capture_output=True, text=True, cwd="/")
    assert bare.returncode != 0 and "No module named 'kvstrata'" in bare.stderr
