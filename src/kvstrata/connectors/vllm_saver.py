"""The vLLM connector's background saver: block saves leave vLLM's step.

``wait_for_save`` only hands the step's new full blocks to ``BackgroundSaver.submit`` (a few
dict and deque operations); one saver thread gathers their bytes out of vLLM's KV tensors and
puts them into the store (digest, host copy, disk or remote write) while vLLM runs its next
steps. Contracts:

- **Pinned, not copied.** vLLM never rewrites a full block while a request references it, so
  the saver reads vLLM's tensors directly. A request's blocks stay referenced until its saves
  are done: the scheduler side returns ``delay_free_blocks=True`` from ``request_finished``
  for every request it planned saves for, and the worker reports the request in
  ``finished_sending`` (``take_finished``) only once vLLM has said it finished *and* no job of
  it is queued or running. Preempted requests lose their blocks at once, so their jobs are
  finished synchronously first (``drain_requests``, from ``handle_preemptions``).
- **Bounded.** At most ``max_blocks`` blocks wait; a job beyond that is not saved (counted in
  ``dropped_blocks``): a lost save costs only future reuse, never correctness, and the step
  never waits for the saver.
- **Failures lose nothing but reuse**: a put that fails is logged and counted by ``save``.
- **In one process** (vLLM's engine core runs scheduler and worker together:
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler side finds the saver through
  ``local_saver`` and ``release_now`` finishes what is left of that request's saves (usually
  nothing: they ran during its decode) so its blocks are freed at once; only a saver in another
  process goes through ``delay_free_blocks`` and ``get_finished`` (an offline ``LLM`` does not
  step after its last request, so a delayed free would wait for the next request).
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
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstrata.connectors.vllm_plan import RequestSave

logger = logging.getLogger("kvstrata.connectors.vllm")

SaveFn = Callable[[RequestSave], None]


def unpin_current_thread() -> None:
    """Let the calling thread run on any CPU of the machine (Linux: affinity is per thread;
    the kernel keeps it inside the process's cpuset)."""
    setter = getattr(os, "sched_setaffinity", None)
    if setter is not None:
        with contextlib.suppress(OSError):
            setter(0, range(os.cpu_count() or 1))


_LOCAL: dict[str, BackgroundSaver] = {}
_LOCAL_LOCK = threading.Lock()


def register_saver(engine_id: str, saver: BackgroundSaver | None) -> None:
    with _LOCAL_LOCK:
        if saver is None:
            _LOCAL.pop(engine_id, None)
        else:
            _LOCAL[engine_id] = saver


def local_saver(engine_id: str) -> BackgroundSaver | None:
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


@dataclass(frozen=True)
class SaveJob:
    request: RequestSave

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
        self._tracked: set[str] = set()  # requests with saves planned, not yet reported
        self._finished: set[str] = set()  # vLLM says finished; reported once pending is 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dropped_blocks = 0
        self.jobs_done = 0
        self.failed_jobs = 0
        self.released = 0  # requests whose blocks were let go (take_finished or release_now)
        # Released in place: a plan built before vLLM finished the request (async scheduling)
        # may still name its blocks, which vLLM has freed: such saves are refused.
        self._gone: deque[str] = deque(maxlen=4096)

    def start(self) -> BackgroundSaver:
        self._thread = threading.Thread(target=self._run, name="kvstrata-saver", daemon=True)
        self._thread.start()
        return self

    # ---- step thread ------------------------------------------------------------------------
    def submit(self, requests: Iterable[RequestSave]) -> None:
        """Queue the step's saves (never blocks on the saver). Beyond ``max_blocks`` queued, a
        request's first blocks that fit are queued (a prefix of its chain is reusable) and the
        rest dropped (counted; only reuse is lost)."""
        with self._lock:
            for request in requests:
                if request.req_id in self._gone:
                    self.dropped_blocks += len(request.blocks)
                    continue
                self._tracked.add(request.req_id)
                if not request.blocks:
                    continue
                room = self.max_blocks - self._queued_blocks
                if room <= 0:
                    self.dropped_blocks += len(request.blocks)
                    continue
                if len(request.blocks) > room:  # the chain's first blocks: still a prefix
                    self.dropped_blocks += len(request.blocks) - room
                    request = RequestSave(request.req_id, request.tenant, request.blocks[:room])
                job = SaveJob(request)
                self._queue.append(job)
                self._queued_blocks += job.blocks
                self._pending[request.req_id] = self._pending.get(request.req_id, 0) + 1
            self._wake.notify()

    def take_finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests vLLM finished whose saves are all done (each reported once)."""
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._tracked)
            done = {r for r in self._finished if not self._pending.get(r)}
            self._finished -= done
            self._tracked -= done
            self.released += len(done)
        return done

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

    def release_now(self, req_id: str) -> None:
        """Finish the request's saves here and forget it (never reported by ``get_finished``):
        the caller frees its blocks itself."""
        self.drain_requests([req_id])
        with self._lock:
            self._tracked.discard(req_id)
            self._finished.discard(req_id)
            self._gone.append(req_id)
            self.released += 1

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
                left = self._pending.get(req_id, 1) - 1
                if left > 0:
                    self._pending[req_id] = left
                else:
                    self._pending.pop(req_id, None)
                self.jobs_done += 1
                self._wake.notify_all()
