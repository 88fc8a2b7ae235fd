"""Which thread of a serving process runs torch's multi-threaded kernels: the step thread.

libgomp (torch's OpenMP runtime on Linux) gives every thread that starts a parallel region a
team of worker threads of its own, kept until that thread ends. Once a process holds more
OpenMP threads than CPUs, libgomp stops spinning between parallel regions (its *throttled*
spin count, 100 spins instead of ~300,000: ``libgomp/config/linux/wait.h``), so every
kernel's fork and join goes through futex sleeps and wake-ups. On the 2-core CI machine,
with torch's 2 threads:

- the reference engine prefilled 1,024 tokens of SmolLM2 in 0.93 s on the thread that loaded
  it, but in 1.10 s on its step thread (``start_loop``, how ``kvstrata serve`` runs it): the
  main thread's loading kernels had already started a team;
- vLLM's forward ran ~1.5x slower in a process with kvstrata's connector, because the saver
  thread allocated its staging rows with a torch kernel (``connectors.vllm_worker``).

So a serving process calls :func:`hand_kernels_to_step_thread` before its first torch kernel:
the calling (main) thread's kernels run single-threaded from then on, and the step loop calls
:func:`step_thread_kernels` first thing on its thread, which then gets the team of torch's
configured size. The process owns one team, whichever thread loaded the model.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_step_threads: int | None = None  # torch's thread count when the main thread handed it over


def hand_kernels_to_step_thread() -> None:
    """Keep torch's thread count for the engine's step thread; this thread runs its kernels
    single-threaded (call it before this thread runs any torch kernel: a team once started
    stays)."""
    global _step_threads
    with _lock:
        if _step_threads is None:
            _step_threads = torch.get_num_threads()
    torch.set_num_threads(1)


def step_thread_kernels() -> None:
    """On the step thread: run torch's kernels with the handed-over thread count (nothing to
    do when no thread handed it over: torch's own default applies)."""
    with _lock:
        threads = _step_threads
    if threads is not None:
        torch.set_num_threads(threads)
