"""``bench.foreign_load``: what processes outside a benchmark used while it ran, from the real
``/proc`` with real busy processes (one of ours, one that is not)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstrata.bench.foreign_load import (
    ForeignLoad,
    _descendants,
    _label,
    _read,
    _steal_ticks,
    own_cpu,
    own_cpu_use,
)

BUSY = (  # busy until {s} s of its own CPU (however loaded the box), or 30 s of wall time
    "import ctypes, time\n"
    "ctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)\n"  # PR_SET_NAME: /proc's comm
    "t = time.time()\n"
    "while time.process_time() < {s} and time.time() - t < 30: pass\n"
)


def _orphan_burner(seconds: float, name: str) -> int:
    """A busy Python process that is not our descendant: started in the background by a
    shell that exits at once, so it is reparented away from this process. Its pid."""
    script = BUSY.format(s=seconds, name=name)
    shell = ["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!', sys.executable, script]
    return int(subprocess.run(shell, check=True, capture_output=True, text=True).stdout)


def _gone(pid: int, timeout_s: float) -> bool:
    """``pid`` exited (a zombie its reaper has not collected yet counts as gone)."""

    def running() -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] != "Z"

    deadline = time.monotonic() + timeout_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running()


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_a_foreign_busy_process_is_counted_and_our_own_child_is_not() -> None:
    with ForeignLoad(interval_s=0.1) as load:
        foreign = _orphan_burner(1.0, "kvs-foreign")
        ours = subprocess.Popen([sys.executable, "-c", BUSY.format(s=1.0, name="kvs-ours")])
        time.sleep(1.5)
        ours.wait(timeout=40)
        assert _gone(foreign, 40)  # it burnt its 1 s of CPU, however long that took
    figures = load.figures()
    top = {row["command"]: row["cpu_s"] for row in figures["top"]}
    assert top.get("kvs-foreign", 0.0) >= 0.5, figures
    assert figures["foreign_cpu_s"] >= top["kvs-foreign"]
    assert 0 < figures["foreign_share"] <= 1 and figures["wall_s"] >= 1.5
    assert figures["steal_s"] >= 0 and 0 <= figures["steal_share"] <= 1
    assert "kvs-ours" not in top, figures  # our child burnt as long: not foreign


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_our_own_processes_cpu_is_split_by_kvstrata_subcommand() -> None:
    """A child whose command line reads like a fleet worker's (``… kvstrata.cli.main serve …
    --worker-id w7``) is labelled ``serve w7``, and its CPU counted from the first snapshot."""
    before = own_cpu()
    started = time.perf_counter()
    burn = (  # busy until 0.3 s of its own CPU, then says so and idles: however loaded the box
        "import sys, time\nwhile time.process_time() < 0.3: pass\n"
        "print('burnt', flush=True)\ntime.sleep(5)\n"
    )
    argv = [sys.executable, "-c", burn, "kvstrata.cli.main", "serve", "--worker-id", "w7"]
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None and worker.stdout.readline() == "burnt\n"
    during = own_cpu()  # the worker still runs: a live process's ticks
    worker.kill()
    worker.wait(timeout=10)
    use = own_cpu_use(before, during, time.perf_counter() - started)
    assert 0.25 <= use["processes"]["serve w7"]["cpu_s"] <= 2.0, use
    assert "this process" in use["processes"] and use["cpus"] >= 1
    assert 0 < use["processes"]["serve w7"]["share"] <= 1
    assert own_cpu_use(during, during, 1.0)["processes"]["serve w7"]["cpu_s"] == 0


def test_labels_name_the_kvstrata_subcommand_and_worker(tmp_path: Path) -> None:
    argvs = {
        10: ["python", "-m", "kvstrata.cli.main", "serve", "--port", "1", "--worker-id", "w0"],
        11: ["/venv/bin/kvstrata", "serve", "--worker-id=w3"],
        12: ["/venv/bin/kvstrata", "up", "--workers", "2"],
        13: ["/usr/bin/valkey-server", "--port", "7"],
        14: ["python", "-m", "kvstrata.cli.main"],  # no subcommand: named by its program
    }
    for pid, argv in argvs.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    labels = [_label(tmp_path, pid, root=1) for pid in argvs]
    assert labels == ["serve w0", "serve w3", "up", "valkey-server", "python"]
    assert _label(tmp_path, 1, root=1) == "this process"
    assert _label(tmp_path, 99, root=1) == "?"  # gone meanwhile


def test_stat_lines_are_parsed_whatever_the_command_holds(tmp_path: Path) -> None:
    """The command sits in parentheses and may hold spaces and ``)``; what follows is split."""
    fields = ["S", "1", "0", "0", "0", "0", "0", "0", "0", "0", "0", "7", "5"] + ["0"] * 6
    for pid, comm in ((10, "sh"), (11, "a b) c"), (12, "x")):
        ppid = "10" if pid == 11 else "1"
        line = f"{pid} ({comm}) {' '.join([fields[0], ppid, *fields[2:], '123'])}\n"
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(line)
    (tmp_path / "13").mkdir()  # unreadable / malformed entries are skipped
    (tmp_path / "13" / "stat").write_text("13 (broken)\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text("cpu  10 0 5 100 1 0 2 37 0 0\ncpu0 5 0 2 50 0 0 1 20 0 0\n")
    assert _steal_ticks(tmp_path) == 37  # the 8th figure: steal
    assert _steal_ticks(tmp_path / "missing") == 0
    table = _read(tmp_path)
    assert table[11] == (10, "a b) c", 12, 123) and table[10][2] == 12
    assert set(table) == {10, 11, 12}
    assert _descendants(table, 10) == {10, 11}


def test_without_proc_every_figure_is_none(tmp_path: Path) -> None:
    with ForeignLoad(proc=tmp_path / "missing") as load:
        pass
    figures = load.figures()
    assert figures["foreign_cpu_s"] is None and figures["foreign_share"] is None
