"""CPU that processes outside a benchmark used while it ran: a live benchmark's evidence that
it had the machine to itself.

A live calibration on a 2-core machine pins one fleet worker to each core; anything else that
runs meanwhile (a type checker, a test run, another benchmark) steals from them and inflates
every TTFT it measures, and nothing in a TTFT says so. :class:`ForeignLoad` watches ``/proc``
while the benchmark runs and reports what the processes that are not the benchmark's own
used, so a run that shared its machine can be told from one where the machine itself was
slower.

- **Ours**: this process and its descendants (by parent pid, read at every sample), so a
  fleet this process started counts as ours, however many sessions or process groups it
  opens. Everything else is foreign, kernel threads included.
- **Sampling**: every ``interval_s``, the CPU ticks (user + system, all threads) of every
  process in ``/proc/<pid>/stat``. A process's ticks count from the sample that first saw it
  (from 0 when it started during the watch), so a foreign process alive for one sample or
  more is counted; one that starts and exits between two samples is missed, and so is the
  last interval of one that exits: the figure is a lower bound.
- **Figures** (:meth:`ForeignLoad.figures`): ``foreign_cpu_s``, ``wall_s``, ``cpus``,
  ``foreign_share`` = foreign CPU seconds ÷ (wall seconds × CPUs), and ``top``: the three
  foreign commands that used the most.
- **Steal** (``steal_s``, ``steal_share``): the time this virtual machine's CPUs were ready
  to run and the hypervisor ran something else (``/proc/stat``'s ``steal``), a neighbour
  outside the machine that no process list shows. 0 where the hypervisor does not report it.

Linux only (``/proc``); elsewhere every figure is None.

**Our own processes** (:func:`own_cpu`, :func:`own_cpu_use`): the same ticks for this process
and its descendants, each labelled by its kvstrata subcommand (``serve w0``, ``up``; this
process is ``this process``), snapshotted around a window of interest (``bench calibrate``:
one replay). On a 2-core machine whose two workers own a core each, whatever the front door,
the router and the load generator use in that window comes out of the workers' cores, and
neither the fleet's probes (one request at a time) nor the simulator see it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any, Final

PROC: Final = Path("/proc")
BUSY_SHARE: Final = 0.05
"""Above this foreign share a live figure is flagged: other work took more than 5 % of the
machine while it was measured."""


def _read(proc: Path) -> dict[int, tuple[int, str, int, int]]:
    """``pid → (ppid, command, cpu ticks, start time)`` of every readable process."""
    out: dict[int, tuple[int, str, int, int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        head, _, rest = raw.rpartition(")")  # the command may hold spaces and parentheses
        fields = rest.split()
        try:  # after the command: state ppid … utime(14) stime(15) … starttime(22)
            ppid, ticks, start = int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])
        except (IndexError, ValueError):
            continue
        out[int(entry.name)] = (ppid, head.partition("(")[2], ticks, start)
    return out


def _steal_ticks(proc: Path) -> int:
    """All CPUs' steal ticks so far (the 8th figure of ``/proc/stat``'s ``cpu`` line; 0
    when absent or unreadable)."""
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else 0
    except (OSError, ValueError, IndexError):
        return 0


def _descendants(table: dict[int, tuple[int, str, int, int]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    ours, stack = {root}, [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in ours:
                ours.add(child)
                stack.append(child)
    return ours


class ForeignLoad:
    """A context that watches foreign CPU use while it is open (module docstring)."""

    def __init__(self, interval_s: float = 1.0, proc: Path = PROC) -> None:
        self.interval_s = interval_s
        self._proc = proc
        self._root = os.getpid()
        self._seen: dict[tuple[int, int], int] = {}  # (pid, start) → ticks at last sample
        self._foreign: dict[tuple[int, int], tuple[str, int]] = {}  # → (command, ticks used)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-load", daemon=True)
        self._started = self._ended = 0.0
        self._available = proc.is_dir()
        self._steal = [0, 0]  # /proc/stat's steal ticks at the start and at the end

    def __enter__(self) -> ForeignLoad:
        self._started = time.monotonic()
        if self._available:
            self._steal[0] = _steal_ticks(self._proc)
            self._sample(first=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self._sample(first=False)
            self._steal[1] = _steal_ticks(self._proc)
        self._ended = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(first=False)

    def _sample(self, *, first: bool) -> None:
        table = _read(self._proc)
        ours = _descendants(table, self._root)
        for pid, (_, command, ticks, start) in table.items():
            key = (pid, start)
            before = self._seen.get(key, ticks if first else 0)
            self._seen[key] = ticks
            if pid in ours or ticks <= before:
                continue
            name, used = self._foreign.get(key, (command, 0))
            self._foreign[key] = (name, used + ticks - before)

    def figures(self) -> dict[str, Any]:
        """The figures of the watch (module docstring); call after it closed."""
        wall = max(self._ended - self._started, 1e-9)
        cpus = os.cpu_count() or 1
        if not self._available:
            return {"foreign_cpu_s": None, "wall_s": wall, "cpus": cpus, "foreign_share": None}
        tick = os.sysconf("SC_CLK_TCK")
        by_command: dict[str, int] = {}
        for command, used in self._foreign.values():
            by_command[command] = by_command.get(command, 0) + used
        foreign_s = sum(by_command.values()) / tick
        steal_s = max(0, self._steal[1] - self._steal[0]) / tick
        top = sorted(by_command.items(), key=lambda kv: -kv[1])[:3]
        return {
            "foreign_cpu_s": round(foreign_s, 2),
            "wall_s": round(wall, 2),
            "cpus": cpus,
            "foreign_share": round(foreign_s / (wall * cpus), 4),
            "steal_s": round(steal_s, 2),
            "steal_share": round(steal_s / (wall * cpus), 4),
            "top": [{"command": c, "cpu_s": round(t / tick, 2)} for c, t in top],
        }


def _label(proc: Path, pid: int, root: int) -> str:
    """A process's kvstrata subcommand and worker id (``serve w0``), from its command line."""
    if pid == root:
        return "this process"
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "?"
    argv = raw.removesuffix("\0").split("\0")  # each argument ends with a NUL
    for i, arg in enumerate(argv[:-1]):
        if arg == "kvstrata.cli.main" or Path(arg).name == "kvstrata":  # -m, or the script
            rest = argv[i + 2 :]
            worker = [b for a, b in itertools.pairwise(rest) if a == "--worker-id"]
            worker += [a.partition("=")[2] for a in rest if a.startswith("--worker-id=")]
            return " ".join([argv[i + 1], *worker[:1]])
    return Path(argv[0]).name if argv and argv[0] else "?"


def own_cpu(proc: Path = PROC) -> dict[tuple[int, int], tuple[str, int]]:
    """``(pid, start) → (label, CPU ticks so far)`` of this process and its descendants."""
    if not proc.is_dir():
        return {}
    root = os.getpid()
    table = _read(proc)
    return {
        (pid, table[pid][3]): (_label(proc, pid, root), table[pid][2])
        for pid in _descendants(table, root)
        if pid in table
    }


def own_cpu_use(
    before: dict[tuple[int, int], tuple[str, int]],
    after: dict[tuple[int, int], tuple[str, int]],
    wall_s: float,
) -> dict[str, Any]:
    """CPU seconds per label between two :func:`own_cpu` snapshots (a process first seen in
    ``after`` counts from 0), each also as a share of the machine over ``wall_s``."""
    tick = os.sysconf("SC_CLK_TCK")
    cpus = os.cpu_count() or 1
    used: dict[str, int] = {}
    for key, (label, ticks) in after.items():
        used[label] = used.get(label, 0) + max(0, ticks - before.get(key, (label, 0))[1])
    capacity = max(wall_s, 1e-9) * cpus
    return {
        "wall_s": round(wall_s, 2),
        "cpus": cpus,
        "processes": {
            label: {"cpu_s": round(t / tick, 2), "share": round(t / tick / capacity, 4)}
            for label, t in sorted(used.items(), key=lambda kv: -kv[1])
        },
    }
