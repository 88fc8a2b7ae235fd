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
