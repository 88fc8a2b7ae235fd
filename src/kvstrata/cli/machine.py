"""What machine a benchmark runs on: read from ``/proc``, for bundles and for choosing the
measured profile of this CPU."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor, else
    ``unknown``."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Total memory in GiB (``/proc/meminfo``), None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
