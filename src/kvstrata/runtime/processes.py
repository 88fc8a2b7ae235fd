"""Child-process helpers shared by the fleet supervisor and the Valkey servers we start."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
"""Loaded here, not in the child: between fork and exec only async-signal-safe work is safe
(an ``import`` there could wait forever on a lock another thread held at the fork)."""


def die_with_parent() -> None:
    """In the child (``preexec_fn``): ask Linux to SIGTERM it if its parent dies, even by
    SIGKILL, so no worker or server outlives the process that started it."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def split_cpus(count: int, cpus: Sequence[int]) -> list[frozenset[int]]:
    """``count`` disjoint shares of ``cpus`` (in order, contiguous, the first ones one larger
    when they do not divide evenly); with fewer CPUs than shares, share ``i`` is CPU
    ``i mod len(cpus)`` — overlapping, and then reported as shared compute."""
    ordered = sorted(set(cpus))
    if count < 1 or not ordered:
        raise ValueError(f"need count >= 1 and some CPUs: {count}, {ordered}")
    if count > len(ordered):
        return [frozenset({ordered[i % len(ordered)]}) for i in range(count)]
    size, extra = divmod(len(ordered), count)
    shares, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        shares.append(frozenset(ordered[start:end]))
        start = end
    return shares


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
