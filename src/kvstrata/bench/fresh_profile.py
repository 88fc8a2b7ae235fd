"""The reference profile's timings measured now: ``bench calibrate --fresh-profile``.

The pinned ``reference-cpu`` timings (:mod:`kvstrata.costs.profiles`) were measured on some
earlier day, and these machines' speed moves by 10–20 % within an hour (stop 41: three
calibrations in two hours gave 0.85 / 0.77, 0.93 / 0.92 and 0.79 / 0.76 sim ÷ live with the
same pinned profile, while the fleet's own probes met the goal each time). So ``bench
calibrate`` can re-measure them by the pinned profile's own command, just before the live
fleets start (the profile the simulator gets) and again after they stop (how far the machine
moved while the fleets ran)::

    OMP_NUM_THREADS=1 taskset -c 0 kvstrata bench prefill --repeat 3 --points <FRESH_POINTS>

The engine alone, in a process of its own pinned to one core, with nothing else of the
benchmark running: out of sample for the replay (no fleet, no request of the trace), so it
says whether the simulator is right given the engine's cost of the day. ``measured`` (the
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
from typing import Any, Final

from kvstrata.costs import PrefillModel, fit
from kvstrata.errors import InvalidInput
from kvstrata.runtime.processes import with_source_first

FRESH_POINTS: Final = "16,64,128,256,512,1024,2048,2032+16,1536+512,512+256"
"""The points the pinned timings were measured at (``costs.profiles``)."""
FRESH_REPEATS: Final = 3
PINNED_CPU: Final = 0
_TIMEOUT_S: Final = 1200.0


def prefill_command(
    points: str = FRESH_POINTS, repeats: int = FRESH_REPEATS, *, model: str = "smollm2"
) -> list[str]:
    """``kvstrata bench prefill`` as the pinned profile was measured: engine alone, pinned to
    one core by ``taskset`` when it is installed (else not pinned: the record says which)."""
    command = [sys.executable, "-m", "kvstrata.cli.main", "bench", "prefill", "--model", model]
    command += ["--points", points, "--repeat", str(repeats), "--stat", "min", "--json"]
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(PINNED_CPU), *command] if taskset else command


def measure(
    points: str = FRESH_POINTS, repeats: int = FRESH_REPEATS, *, model: str = "smollm2"
) -> dict[str, Any]:
    """Run :func:`prefill_command` now: its JSON (``samples``, ``fit``), the command, whether
    it was pinned and its wall seconds. Raises ``InvalidInput`` when the command fails."""
    command = prefill_command(points, repeats, model=model)
    env = with_source_first(dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        done = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=_TIMEOUT_S
        )
        if done.returncode != 0:
            err.seek(0)
            raise InvalidInput(
                f"fresh profile: `{shlex.join(command)}` exited {done.returncode}: "
                f"{err.read()[-2000:]}"
            )
    data: dict[str, Any] = json.loads(done.stdout)
    return data | {
        "command": shlex.join(["OMP_NUM_THREADS=1", *command]),
        "pinned": command[0].endswith("taskset"),
        "wall_s": round(time.perf_counter() - started, 1),
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
            label = f"{key[1]}+{key[0]}" if key[1] else str(key[0])
            out[label] = round(s["seconds"] / seconds[key], 4)
    return out
