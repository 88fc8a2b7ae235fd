"""The reference profile's timings measured now: ``bench calibrate --fresh-profile``.

The pinned ``reference-cpu`` timings (:mod:`kvstrata.costs.profiles`) were measured on some
earlier day, and these machines' speed moves by 10–20 % within an hour (stop 41: three
calibrations in two hours gave 0.85 / 0.77, 0.93 / 0.92 and 0.79 / 0.76 sim ÷ live with the
same pinned profile, while the fleet's own probes met the goal each time). So ``bench
calibrate`` can re-measure them by the pinned profile's own command, just before the live
fleets start (the profile the simulator gets) and again after they stop (how far the machine
moved while the fleets ran)::

    OMP_NUM_THREADS=1 taskset -c 0 kvstrata bench prefill --repeat 3 --points <FRESH_POINTS>

The engine alone, in a process of its own pinned to one core (the lowest this process may
use), with nothing else of the benchmark running (``foreign_load`` says whether anything else
did): out of sample for the replay (no fleet, no request of the trace), so it says whether the
simulator is right given the engine's prefill cost of the day. Only the prefill model is
replaced: the profile's decode terms stay the pinned ones. One OpenMP thread, whatever
``--omp-threads`` the fleet runs with (the pinned profile's setting). ``measured`` (the
fleet's probes) answers the same question from inside the fleet.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Final

from kvstrata.bench.foreign_load import ForeignLoad
from kvstrata.costs import PrefillModel, fit, point_label
from kvstrata.costs.profiles import SMOLLM2_WORKER_TIMINGS
from kvstrata.errors import InvalidInput
from kvstrata.runtime.processes import die_with_parent, with_source_first

FRESH_POINTS: Final = ",".join(point_label(n, c) for n, c, _ in SMOLLM2_WORKER_TIMINGS)
"""The points the pinned timings were measured at (``costs.profiles``)."""
FRESH_REPEATS: Final = 3
_TIMEOUT_S: Final = 1200.0


def pinned_cpu() -> int:
    """The core the measurement is pinned to: the lowest this process may run on (the core
    ``up --pin-cpus`` gives worker w0)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return min(affinity(0)) if affinity is not None else 0


def prefill_command(
    points: str = FRESH_POINTS, repeats: int = FRESH_REPEATS, *, model: str = "smollm2"
) -> list[str]:
    """``kvstrata bench prefill`` as the pinned profile was measured: engine alone, pinned to
    one core by ``taskset`` when it is installed (else not pinned: the record says which)."""
    command = [sys.executable, "-m", "kvstrata.cli.main", "bench", "prefill", "--model", model]
    command += ["--points", points, "--repeat", str(repeats), "--stat", "min", "--json"]
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(pinned_cpu()), *command] if taskset else command


def measure(
    points: str = FRESH_POINTS,
    repeats: int = FRESH_REPEATS,
    *,
    model: str = "smollm2",
    hide: Sequence[str] = (),
) -> dict[str, Any]:
    """Run :func:`prefill_command` now, watched by :class:`ForeignLoad` (whether it had the
    machine to itself): its JSON (``samples``, ``fit``), the command, whether it was pinned,
    its wall seconds and ``foreign_load``. ``hide``: environment variables the child must not
    inherit (a caller's record file). Raises ``InvalidInput`` when the command fails, times
    out or prints no JSON."""
    command = prefill_command(points, repeats, model=model)
    env = with_source_first(dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    for name in hide:
        env.pop(name, None)
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err, ForeignLoad() as watch:
        try:
            done = subprocess.run(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=_TIMEOUT_S,
                preexec_fn=die_with_parent,
            )
        except subprocess.TimeoutExpired:
            raise InvalidInput(f"fresh profile: `{shlex.join(command)}` timed out") from None
        err.seek(0)
        failed = f"fresh profile: `{shlex.join(command)}` exited {done.returncode}: "
        if done.returncode != 0:
            raise InvalidInput(failed + err.read()[-2000:])
    try:
        data: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise InvalidInput(failed + "no JSON on its standard output") from None
    return data | {
        "command": shlex.join(["OMP_NUM_THREADS=1", *command]),
        "pinned": command[0].endswith("taskset"),
        "wall_s": round(time.perf_counter() - started, 1),
        "foreign_load": watch.figures(),
    }


def model_of(data: dict[str, Any], name: str) -> PrefillModel:
    """The prefill model fitted to :func:`measure`'s samples (as the pinned profile is)."""
    samples = [(s["new_tokens"], s["cached_tokens"], s["seconds"]) for s in data["samples"]]
    return fit(samples, name=name)


def drift(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """After ÷ before, point by point (``NEW`` or ``CACHED+NEW``): how much slower (> 1) the
    engine alone ran once the fleets had stopped than before they started."""
    seconds = {(s["new_tokens"], s["cached_tokens"]): s["seconds"] for s in before["samples"]}
    out: dict[str, float] = {}
    for s in after["samples"]:
        key = (s["new_tokens"], s["cached_tokens"])
        if seconds.get(key):
            out[point_label(*key)] = round(s["seconds"] / seconds[key], 4)
    return out
