"""The reference engine's step thread: one step at a time, and what runs between steps.

``StepLoop`` is the base of :class:`~kvstrata.engine.engine.ReferenceEngine` that owns its
threading: the inbox of submitted sequences, the cancels, the calls run between two steps
(``call``), the queue bound's counter, and the loop thread (``start_loop``/``stop_loop``) that
runs ``step`` in a server; without a loop, the caller iterating a generation drives ``step``.
``_wake`` guards the inbox, cancels, calls and the queue bound; ``_step_lock`` is held by the
step thread. The state is set by ``ReferenceEngine.__init__`` (declared here), and
``ReferenceEngine.generate`` is the one other writer of the inbox, under ``_wake``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from kvstrata.engine.batch import BatchRunner
from kvstrata.engine.generation import Generation
from kvstrata.engine.sequence import Sequence as Seq
from kvstrata.engine.threads import step_thread_kernels
from kvstrata.engine.tiering import PoolBridge
from kvstrata.errors import RequestCancelled
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.telemetry import KvMetrics

logger = logging.getLogger("kvstrata.engine")
T = TypeVar("T")
_IDLE_POLL_S = 0.005
"""How long the loop waits after a step found nothing admissible (blocks pinned outside the
batch) before it tries again, unless an arrival, cancel or call wakes it first."""


class StepLoop:
    """The step thread's machinery over the engine's batch; a base of ``ReferenceEngine`` only."""

    metrics: KvMetrics
    bridge: PoolBridge | None
    batch: BatchRunner
    events: KVEventEmitter | None
    _step_lock: threading.RLock
    _wake: threading.Condition
    _inbox: list[Seq]
    _cancels: list[Generation]
    _calls: list[tuple[Callable[[], Any], Future[Any]]]
    _queued: int
    _stepping: bool
    _loop: threading.Thread | None
    _stopping: bool

    def _flush_events(self) -> None:
        """Publish this step's KV events as one batch (on the engine thread, as ZMQ needs)."""
        if self.events is not None:
            self.events.flush()

    def cancel(self, generation: Generation) -> None:
        """Free ``generation`` at the next step (``Generation.close`` calls this)."""
        with self._wake:
            self._cancels.append(generation)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the step thread between two steps (now, when no loop runs)."""
        future: Future[T] = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
            # A stopping loop may have drained its calls for the last time already: run it
            # here, after the loop's last step (or on the loop thread itself: the lock is
            # reentrant), rather than queue it where nothing will ever run it.
            inline = self._loop is None or self._stopping
        if inline:
            with self._step_lock:
                self._run_calls()
        return future

    @property
    def loop_running(self) -> bool:
        return self._loop is not None

    def start_loop(self) -> None:
        """Run steps on a thread of the engine's own until ``stop_loop`` (a server)."""
        if self._loop is not None:
            return
        self._stopping = False
        if self.bridge is not None:
            self.bridge.start_prefetch()
        self._loop = threading.Thread(target=self._run_loop, name="kvstrata-engine", daemon=True)
        self._loop.start()

    def stop_loop(self) -> None:
        """Cancel every queued and running request and stop the loop thread."""
        loop = self._loop
        if loop is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        loop.join()
        self._loop = None
        if self.bridge is not None:
            self.bridge.stop_prefetch()

    def _run_loop(self) -> None:
        step_thread_kernels()
        while True:
            with self._wake:
                while (
                    not self._stopping
                    and not self._inbox
                    and not self._cancels
                    and not self._calls
                    and not len(self.batch)
                ):
                    self._wake.wait(0.5)
                if self._stopping:
                    break
            try:
                if not self.step():  # waiting requests, none admissible (blocks pinned)
                    with self._wake:
                        if not (self._inbox or self._cancels or self._calls or self._stopping):
                            self._wake.wait(_IDLE_POLL_S)
            except Exception:  # the failing step's requests got the error; keep serving
                logger.exception("engine step failed")
        with self._step_lock:
            self._abort_all(RequestCancelled("the engine stopped"))
            self._run_calls()

    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        with self._step_lock, torch.inference_mode():
            with self._wake:
                self._stepping = True
            try:
                self._run_calls()
                self._take_inbox()
                try:
                    return self.batch.run_step()
                finally:
                    self._flush_events()
            finally:
                with self._wake:
                    self._stepping = False

    def _run_calls(self) -> None:
        with self._wake:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

    def _take_inbox(self) -> None:
        with self._wake:
            arrivals, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for seq in arrivals:
            self.batch.add(seq)
        for generation in cancels:
            self.batch.cancel(generation)

    def _dequeued(self) -> None:
        with self._wake:
            self._queued -= 1
            self.metrics.queue_depth.set(self._queued)

    def _abort_all(self, error: BaseException) -> None:
        self._take_inbox()
        self.batch.abort_all(error)
