"""Worker processes for ``kvstrata up``: start, wait until ready, watch, restart, stop.

Each worker is a real ``kvstrata serve`` child process with its own engine, device pool,
host tier and event publisher (and, with ``remote_url``, a remote tier all of them share), on
a port chosen here. Its ZMQ endpoints take random ports; the router learns them from
``/kv/info``. A worker that dies is noticed twice over: by this supervisor (the process
exited) and by the router's health loop (it stops answering); with ``restart=True`` it is
started again on the same port, as a new incarnation (new epoch).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstrata.errors import KvstrataError
from kvstrata.runtime.processes import die_with_parent

_log = logging.getLogger(__name__)

CRASH_LOOP_S = 30.0
"""A worker that exits sooner than this after its start is restarted after a backoff."""
MAX_BACKOFF_S = 60.0


def _longer(backoff_s: float) -> float:
    return min(MAX_BACKOFF_S, 2 * backoff_s or 0.5)


@dataclass
class WorkerSpec:
    """How to start one worker: its ``--config`` file plus overrides (None: the file's value);
    ``extra_args`` go to ``kvstrata serve`` unchanged."""

    worker_id: str
    port: int
    model: str = "tiny"
    host: str = "127.0.0.1"
    pool_gib: float | None = 0.25
    host_gib: float | None = 0.5
    config: Path | None = None
    disk_dir: Path | None = None
    remote_url: str | None = None  # a remote tier every worker of the fleet shares
    remote_password_file: Path | None = None
    remote_gib: float | None = None
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    """A key that may read ``/kv/info`` (the fleet key), to see that the worker is ready."""
    cpus: frozenset[int] | None = None
    """The CPUs the worker may run on (``sched_setaffinity`` before it starts; None: all)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        overrides: list[str] = []
        for flag, value in (
            ("--config", self.config),
            ("--pool-gib", self.pool_gib),
            ("--host-gib", self.host_gib),
            ("--disk-dir", self.disk_dir),
            ("--remote-url", self.remote_url),
            ("--remote-gib", self.remote_gib),
            ("--remote-password-file", self.remote_password_file),
        ):
            if value is not None:
                overrides += [flag, str(value)]
        return [
            sys.executable,
            "-m",
            "kvstrata.cli.main",
            "serve",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *overrides,
            "--worker-id",
            self.worker_id,
            "--events-endpoint",
            f"tcp://{self.host}:*",
            "--replay-endpoint",
            f"tcp://{self.host}:*",
            "--log-level",
            "warning",
            *self.extra_args,
        ]


class WorkerStartError(KvstrataError):
    """A worker exited before it answered: ``up`` prints this instead of a traceback."""


class WorkerProcess:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.started_at = 0.0
        self.backoff_s = 0.0  # before the next restart (grows while it keeps dying young)
        self.exited_at = 0.0
        self.exit_reported = False

    def start(self) -> None:
        # Without a log file the worker's stderr is ours: a worker that cannot start says why
        # where the user looks (its stdout, the access log, is dropped).
        log = open(self.spec.log_path, "ab") if self.spec.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            self.spec.command(),
            stdout=log,
            stderr=subprocess.STDOUT if self.spec.log_path else None,
            env=env,
            preexec_fn=self._in_child,
        )
        self.starts += 1
        self.started_at = time.monotonic()
        self.exit_reported = False

    def _in_child(self) -> None:
        """``preexec_fn``: pin to the spec's CPUs, die with this process."""
        if self.spec.cpus is not None:
            os.sched_setaffinity(0, self.spec.cpus)
        die_with_parent()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/kv/info`` answers; raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        headers = (
            {} if self.spec.api_key is None else {"Authorization": f"Bearer {self.spec.api_key}"}
        )
        with httpx.Client(timeout=2.0, headers=headers) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    code = None if self.process is None else self.process.returncode
                    where = (
                        f"its log: {self.spec.log_path}"
                        if self.spec.log_path
                        else "its error is printed above"
                    )
                    raise WorkerStartError(
                        f"worker {self.spec.worker_id} exited with {code} at start-up ({where})"
                    )
                try:
                    if client.get(f"{self.spec.url}/kv/info").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"worker {self.spec.worker_id} not ready after {timeout_s} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.alive():
            self.process.send_signal(sig)
            self.process.wait(timeout=30)

    def terminate(self) -> None:
        if self.process is not None and self.alive():
            self.process.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or not self.alive():
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


class Supervisor:
    """Starts N workers (in parallel), then restarts any that exits while ``restart`` is on."""

    def __init__(self, specs: list[WorkerSpec], *, restart: bool = False) -> None:
        self.workers = [WorkerProcess(spec) for spec in specs]
        self.restart = restart
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [w.spec.url for w in self.workers]

    def start(self, ready_timeout_s: float = 300.0) -> None:
        for worker in self.workers:
            worker.start()
        for worker in self.workers:
            worker.wait_ready(ready_timeout_s)
        self._thread = threading.Thread(target=self._watch, name="kvstrata-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Until ``stop``: report each exit once, and restart (``restart``) after a backoff
        that doubles, up to ``MAX_BACKOFF_S``, while a worker keeps dying within
        ``CRASH_LOOP_S`` of its start. Nothing may end this thread early: the workers it
        restarted are its children, and Linux SIGTERMs them when it exits (PDEATHSIG)."""
        while not self._stop.wait(0.5):
            for worker in self.workers:
                if worker.alive() or self._stop.is_set():
                    continue
                now = time.monotonic()
                if not worker.exit_reported:
                    code = None if worker.process is None else worker.process.returncode
                    _log.warning("worker %s exited (%s)", worker.spec.worker_id, code)
                    worker.exit_reported = True
                    young = now - worker.started_at < CRASH_LOOP_S
                    worker.backoff_s = _longer(worker.backoff_s) if young else 0.0
                    worker.exited_at = now
                if not self.restart or now < worker.exited_at + worker.backoff_s:
                    continue
                try:
                    worker.start()
                except Exception:  # a log directory gone, no fork: try again after the backoff
                    _log.exception("restarting worker %s failed", worker.spec.worker_id)
                    worker.backoff_s, worker.exited_at = _longer(worker.backoff_s), now

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for worker in self.workers:  # all at once: each drains in parallel
            worker.terminate()
        for worker in self.workers:
            worker.stop()
