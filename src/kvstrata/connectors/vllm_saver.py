"""The vLLM connector's background saver: block saves leave vLLM's step.

``wait_for_save`` only hands the step's new full blocks to ``BackgroundSaver.submit`` (a few
dict and deque operations); one saver thread gathers their bytes out of vLLM's KV tensors and
puts them into the store (digest, host copy, disk or remote write) while vLLM runs its next
steps. Contracts:

- **Read in place, fenced.** vLLM never rewrites a full block while a request references it,
  so the saver reads vLLM's tensors directly. A finished request's blocks are freed at once
  (``request_finished`` never delays the free); the scheduler side fences the blocks it
  planned to store (``vllm_plan``) and, when vLLM hands one out again, names the request in the
  next plan's ``flush``: ``drain_requests`` (from ``handle_preemptions``, before the forward)
  runs that request's queued jobs on the step thread and waits for its running one. Preempted
  requests lose their blocks at once too, and are drained the same way. ``saved_through``
  tells the scheduler side which plans' saves have all run, so it can lift their fences.
- **Bounded.** At most ``max_blocks`` blocks wait; a job beyond that is not saved (counted in
  ``dropped_blocks``): a lost save costs only future reuse, never correctness, and the step
  never waits for a full queue. It waits for the saver only to flush or drain: whole jobs,
  gather and puts (the gather alone reads vLLM's blocks; splitting the two is left undone).
- **Failures lose nothing but reuse**: a put that fails is logged and counted by ``save``.
- **Off the forward's core.** vLLM's CPU worker pins itself to its OpenMP cores
  (``VLLM_CPU_OMP_THREADS_BIND=auto``: core 0 of this 2-core box, core 1 reserved — with
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, ``runtime.processes.vllm_cpu_env``), and a
  thread inherits its creator's affinity: the saver would share the one compute core with the
  forward and lengthen decode steps (TPOT). Its thread first widens its own affinity to every
  CPU (``unpin_current_thread``), as vLLM's NIXL connector moves its transfers to the reserved
  core (``nixl/base_worker.py``).
- ``start()`` starts the thread; ``close()`` drains the queue, then stops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from kvstrata.connectors.vllm_plan import RequestSave

logger = logging.getLogger("kvstrata.connectors.vllm")

SaveFn = Callable[[RequestSave], None]
K = TypeVar("K")


def unpin_current_thread() -> None:
    """Let the calling thread run on any CPU of the machine (Linux: affinity is per thread;
    the kernel keeps it inside the process's cpuset)."""
    setter = getattr(os, "sched_setaffinity", None)
    if setter is not None:
        with contextlib.suppress(OSError):
            setter(0, range(os.cpu_count() or 1))


@dataclass(frozen=True)
class SaveJob:
    request: RequestSave
    seq: int

    @property
    def blocks(self) -> int:
        return len(self.request.blocks)


class BackgroundSaver:
    def __init__(self, save: SaveFn, *, max_blocks: int) -> None:
        self._save = save
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[SaveJob] = deque()
        self._queued_blocks = 0
        self._pending: dict[str, int] = {}  # req id → jobs queued or running
        self._pending_seqs: dict[int, int] = {}  # plan seq → jobs queued or running
        self._submitted_seq = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dropped_blocks = 0
        self.jobs_done = 0
        self.failed_jobs = 0
        self.flushed = 0  # requests a plan named: a block they read was handed out again
        self.flush_seconds = 0.0  # the steps' time spent on it

    def start(self) -> BackgroundSaver:
        self._thread = threading.Thread(target=self._run, name="kvstrata-saver", daemon=True)
        self._thread.start()
        return self

    # ---- step thread ------------------------------------------------------------------------
    def submit(self, requests: Iterable[RequestSave], *, seq: int) -> None:
        """Queue plan ``seq``'s saves (never blocks on the saver). Beyond ``max_blocks``
        queued, a request's first blocks that fit are queued (a prefix of its chain is
        reusable) and the rest dropped (counted; only reuse is lost)."""
        with self._lock:
            self._submitted_seq = max(self._submitted_seq, seq)
            for request in requests:
                if not request.blocks:
                    continue
                room = self.max_blocks - self._queued_blocks
                if room <= 0:
                    self.dropped_blocks += len(request.blocks)
                    continue
                if len(request.blocks) > room:  # the chain's first blocks: still a prefix
                    self.dropped_blocks += len(request.blocks) - room
                    request = RequestSave(request.req_id, request.tenant, request.blocks[:room])
                job = SaveJob(request, seq)
                self._queue.append(job)
                self._queued_blocks += job.blocks
                self._pending[request.req_id] = self._pending.get(request.req_id, 0) + 1
                self._pending_seqs[seq] = self._pending_seqs.get(seq, 0) + 1
            self._wake.notify()

    def saved_through(self) -> int:
        """The highest plan seq whose saves, and every earlier plan's, have all run."""
        with self._lock:
            if not self._pending_seqs:
                return self._submitted_seq
            return min(self._pending_seqs) - 1

    def flush(self, req_ids: Iterable[str]) -> None:
        """Finish these finished requests' saves before vLLM writes a block they read."""
        wanted = list(req_ids)
        if not wanted:
            return
        started = time.perf_counter()
        self.drain_requests(wanted)
        with self._lock:
            self.flushed += len(wanted)
            self.flush_seconds += time.perf_counter() - started

    def drain_requests(self, req_ids: Iterable[str]) -> None:
        """Run the queued jobs of ``req_ids`` now, on the calling thread, and wait for the one
        the saver may be running (their blocks are about to be reused)."""
        wanted = set(req_ids)
        with self._lock:
            mine = [job for job in self._queue if job.request.req_id in wanted]
            for job in mine:
                self._queue.remove(job)
                self._queued_blocks -= job.blocks
        for job in mine:
            self._run_job(job)
        with self._lock:
            while any(self._pending.get(r) for r in wanted):
                self._wake.wait(0.05)

    @property
    def queued_blocks(self) -> int:
        with self._lock:
            return self._queued_blocks

    def idle(self) -> bool:
        with self._lock:
            return not self._pending

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._wake.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while self._queue:  # never started, or stopped early: drain here
            job = self._queue.popleft()
            self._run_job(job)

    # ---- saver thread -----------------------------------------------------------------------
    def _run(self) -> None:
        unpin_current_thread()
        while True:
            with self._lock:
                self._wake.wait_for(lambda: bool(self._queue) or self._stop)
                if not self._queue:
                    return  # stopping and drained
                job = self._queue.popleft()
                self._queued_blocks -= job.blocks
            self._run_job(job)

    def _run_job(self, job: SaveJob) -> None:
        try:
            self._save(job.request)
        except Exception:  # a save that fails loses only reuse: keep saving
            logger.exception("kvstrata: a background save failed (its blocks are not stored)")
            with self._lock:
                self.failed_jobs += 1
        finally:
            with self._lock:
                req_id = job.request.req_id
                _decrement(self._pending, req_id)
                _decrement(self._pending_seqs, job.seq)
                self.jobs_done += 1
                self._wake.notify_all()


def _decrement(counts: dict[K, int], key: K) -> None:
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
