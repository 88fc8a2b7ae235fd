"""Child-process helpers shared by the fleet supervisor and the Valkey servers we start."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
"""Loaded here, not in the child: between fork and exec only async-signal-safe work is safe
(an ``import`` there could wait forever on a lock another thread held at the fork)."""


def die_with_parent() -> None:
    """In the child (``preexec_fn``): ask Linux to SIGTERM it if its parent dies, even by
    SIGKILL, so no worker or server outlives the process that started it."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
