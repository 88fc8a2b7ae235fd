"""One OpenMP team per serving process (``kvstrata.engine.threads``): after the main thread
hands torch's kernels to the step thread, its own kernels start no team, and the step
thread's kernels run with torch's original thread count. Run in fresh interpreters: a team,
once started (as pytest's own imports may have), stays for the life of its thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os, sys, threading, torch
from kvstrata.engine.threads import hand_kernels_to_step_thread, step_thread_kernels
torch.set_num_threads(2)
def tasks():
    return len(os.listdir("/proc/self/task"))
if sys.argv[1] == "hand":
    hand_kernels_to_step_thread()
before = tasks()
torch.zeros((8, 1 << 20), dtype=torch.uint8)  # a kernel big enough to run in parallel
main_gained = tasks() - before
seen = {}
def step():
    step_thread_kernels()
    seen["threads"] = torch.get_num_threads()
    start = tasks()
    torch.zeros((8, 1 << 20), dtype=torch.uint8)
    seen["gained"] = tasks() - start
thread = threading.Thread(target=step)
thread.start()
thread.join()
print(json.dumps({"main_gained": main_gained, "main_threads": torch.get_num_threads(), **seen}))
"""


def _run(mode: str) -> dict[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_the_step_thread_owns_the_only_openmp_team() -> None:
    plain = _run("plain")
    if plain["main_gained"] == 0:
        pytest.skip("torch's kernels start no OpenMP team here")
    handed = _run("hand")
    assert handed["main_gained"] == 0 and handed["main_threads"] == 1
    assert handed["threads"] == 2 and handed["gained"] > 0  # the step thread got the team
