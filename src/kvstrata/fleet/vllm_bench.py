"""``kvstrata bench vllm-fleet``: routing policies in front of two real vLLM servers (issue 13.4).

Needs vLLM (``make vllm-venv``); the CLI re-runs itself with that venv's python. For every
repetition and every routing policy (``kvstrata``, ``round-robin``, ``llm-d``, ``dynamo``: the
names ``kvstrata router --policy`` accepts), one run:

1. two **fresh** vLLM OpenAI servers, exactly as ``kvstrata up --engine vllm`` starts them
   (``fleet/vllm_servers.py``: SmolLM2 bf16, block 32, prefix caching, vLLM's KV events, the
   kvstrata connector with a host tier, ``OMP_NUM_THREADS=1``), with a small device KV cache
   (``--num-gpu-blocks-override``). Fresh servers are the fairness rule: every policy starts
   from empty device caches, empty host tiers and an empty index. (A reset would need
   ``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``, and the kvstrata connector has no
   ``reset_cache`` for its host tier; a restart is the only complete reset.) Each server gets
   one short warm-up request (shorter than a block: nothing of the workload is cached);
2. a fresh front door, ``python -m kvstrata.cli.main router --engine vllm --policy P``, in
   its own process (what users run), attached to both servers' event streams; the run starts
   once it reports both workers healthy;
3. ``vllm.benchmarks.serve`` (its parser and ``main``, as ``bench vllm-serving``) through the
   front door, streaming completions at temperature 0, ``--save-detailed`` for the texts. Its
   ``/tokenize`` alignment is replaced by the identity (the front door has no ``/tokenize``;
   client, router and servers tokenize with the same files);
4. each server's ``/metrics`` just before and after the client: hit rate and per-server
   requests (``vllm_fleet_report``); then the router and both servers are stopped.

Workload: vLLM's ``prefix_repetition`` dataset in its own (seeded, shuffled) order with Poisson
arrivals: ``num_prefixes`` shared random prefixes, each followed by different suffixes — the
shape of many users sharing system prompts or documents. It is vLLM's own, works offline
(random tokens, no download) and is the same prompts in the same order for every policy (same
seed). Multi-turn/ShareGPT-style datasets need downloads, and vLLM's multi-turn client
(``benchmarks/multi_turn``) is not ``vllm.benchmarks.serve``. Sized so the prefixes fill both
servers' device caches together (``working_set_ratio`` ≈ 1 per server pair): a policy that
keeps each prefix on one server hits on device, one that spreads them pays extra prefills
(or host-tier loads).

Policy order rotates across repetitions (``vllm_fleet_report.run_order``); medians and spread
per policy. Server and router start-up is outside every figure (``start_s`` per run).
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstrata.bench.servers import (
    free_port,
    http,
    prefix_repetition_argv,
    run_serve_client,
    running_server,
    server_env,
    sigterm_unwinds,
)
from kvstrata.bench.serving_report import run_figures, run_texts
from kvstrata.bench.vllm_fleet_report import (
    POLICY_NAMES,
    FleetRun,
    counter_delta,
    run_order,
    server_counters,
    summarize,
)
from kvstrata.errors import InvalidInput
from kvstrata.fleet.vllm_servers import DEFAULT_BLOCK_SIZE, VllmServer, VllmServerSpec
from kvstrata.fleet.vllm_workers import VLLM_STEP_TOKENS, VllmWorker
from kvstrata.runtime.processes import source_root, with_source_first

WARM_PROMPT = "Hello, warm-up."
SERVERS = 2


@dataclass(frozen=True)
class FleetWorkload:
    num_prefixes: int = 6
    prefix_len: int = 512
    suffix_len: int = 32
    output_len: int = 16
    num_prompts: int = 24
    request_rate: float = 0.8
    kv_cache_blocks: int = 48  # 6 × 512 prefix tokens = both servers' 2 × 48 × 32 together
    host_gib: float = 0.25  # `kvstrata up --engine vllm`'s default
    repeats: int = 2
    seed: int = 0
    policies: tuple[str, ...] = POLICY_NAMES
    multiprocess: bool = False
    """``VllmServerSpec.multiprocess`` (as ``tests_vllm/test_vllm_fleet.py`` starts them)."""
    dtype: str = "bfloat16"
    """``VllmServerSpec.dtype``."""

    def __post_init__(self) -> None:
        if self.num_prefixes < 1 or self.num_prompts < self.num_prefixes:
            raise InvalidInput("need num_prefixes ≥ 1 and num_prompts ≥ num_prefixes")
        if self.prefix_len < DEFAULT_BLOCK_SIZE or self.suffix_len < 1 or self.output_len < 2:
            raise InvalidInput(f"prefix_len ≥ {DEFAULT_BLOCK_SIZE}, suffix ≥ 1, output ≥ 2")
        if self.request_rate <= 0 or self.repeats < 1 or self.host_gib < 0:
            raise InvalidInput("request_rate > 0, repeats ≥ 1, host_gib ≥ 0")
        if len(self.policies) < 2 or len(set(self.policies)) != len(self.policies):
            raise InvalidInput("need at least two distinct policies")
        if self.kv_cache_blocks * DEFAULT_BLOCK_SIZE < self.max_model_len:
            raise InvalidInput(
                f"{self.kv_cache_blocks} blocks cannot hold one request ({self.max_model_len})"
            )

    @property
    def max_model_len(self) -> int:
        need = self.prefix_len + self.suffix_len + self.output_len + 64  # re-tokenize slack
        return math.ceil(need / DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE

    @property
    def working_set_ratio(self) -> float:
        """Prefix tokens ÷ the two servers' device KV tokens together."""
        return (self.num_prefixes * self.prefix_len) / (
            SERVERS * self.kv_cache_blocks * DEFAULT_BLOCK_SIZE
        )


def client_argv(workload: FleetWorkload, *, model_dir: str, port: int) -> list[str]:
    """The client's arguments (``bench.servers.prefix_repetition_argv``), through the router."""
    w = workload
    return prefix_repetition_argv(
        port=port, model=model_dir, tokenizer=model_dir, endpoint="/v1/completions",
        prefix_len=w.prefix_len, suffix_len=w.suffix_len, num_prefixes=w.num_prefixes,
        output_len=w.output_len, num_prompts=w.num_prompts, request_rate=w.request_rate,
        seed=w.seed,
    )  # fmt: skip


def worker_arg(worker: VllmWorker) -> str:
    """``--worker`` of ``kvstrata router --engine vllm`` (``VllmWorker.parse``'s format)."""
    parts = [worker.base_url, f"events={worker.events_endpoint}"]
    for name, value in (
        ("replay", worker.replay_endpoint),
        ("lower", worker.lower_events_endpoint),
        ("lower_replay", worker.lower_replay_endpoint),
    ):
        if value is not None:
            parts.append(f"{name}={value}")
    if worker.step_tokens != VLLM_STEP_TOKENS:
        parts.append(f"step_tokens={worker.step_tokens}")
    return ",".join([*parts, f"id={worker.worker_id}"])


def router_command(
    policy: str, model_dir: Path, port: int, workers: Sequence[VllmWorker]
) -> list[str]:
    argv = [
        sys.executable, "-m", "kvstrata.cli.main", "router",
        "--engine", "vllm",
        "--policy", policy,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", str(model_dir),
        "--log-level", "warning",
    ]  # fmt: skip
    for worker in workers:
        argv += ["--worker", worker_arg(worker)]
    return argv


async def _no_alignment(
    base_url: str, model_id: str, requests: Any, ssl_context: Any = None
) -> Any:
    return requests


def _wait_attached(base: str, count: int, timeout_s: float = 120.0) -> None:
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = json.loads(http(f"{base}/fleet/workers"))["workers"]
        if sum(bool(w["healthy"]) for w in workers) == count:
            return
        time.sleep(0.2)
    raise InvalidInput(f"front door at {base}: not all {count} vLLM servers healthy")


def _counters(servers: Sequence[VllmServer]) -> dict[str, dict[str, float]]:
    return {
        s.spec.worker_id: server_counters(http(f"{s.spec.url}/metrics").decode()) for s in servers
    }


@contextlib.contextmanager
def _fleet(workload: FleetWorkload, model_dir: Path, run_dir: Path) -> Iterator[list[VllmServer]]:
    src = source_root()
    specs = [
        VllmServerSpec(
            worker_id=f"v{i}",
            model_dir=model_dir,
            python=Path(sys.executable),
            run_dir=run_dir / f"v{i}",
            max_model_len=workload.max_model_len,
            kv_cache_blocks=workload.kv_cache_blocks,
            host_gib=workload.host_gib,
            dtype=workload.dtype,
            pythonpath=src,
            multiprocess=workload.multiprocess,
        )
        for i in range(SERVERS)
    ]
    servers = [VllmServer(spec) for spec in specs]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(600)
        yield servers
    finally:
        for server in servers:
            server.stop()


def run_one(
    workload: FleetWorkload, model_dir: Path, tmp: Path, policy: str, repeat: int, position: int
) -> FleetRun:
    run_dir = tmp / f"{repeat}-{position}-{policy}"
    started = time.perf_counter()
    with _fleet(workload, model_dir, run_dir) as servers:
        for server in servers:  # before the router attaches: nothing of it reaches the index
            warm = {"model": str(model_dir), "prompt": WARM_PROMPT, "max_tokens": 2}
            http(f"{server.spec.url}/v1/completions", warm | {"temperature": 0}, timeout=300)
        port = free_port()
        env = with_source_first(server_env(run_dir))
        command = router_command(policy, model_dir, port, [s.spec.worker() for s in servers])
        with running_server(command, env, run_dir / "router.log", port, name="front door") as base:
            _wait_attached(base, len(servers))
            start_s = time.perf_counter() - started
            before = _counters(servers)
            argv = client_argv(workload, model_dir=str(model_dir), port=port)
            result = run_serve_client(argv, {"_align_prompts_to_server_tokenizer": _no_alignment})
            after = _counters(servers)
    return FleetRun(
        policy=policy,
        repeat=repeat,
        position=position,
        client=run_figures(result),
        servers={w: counter_delta(before[w], after[w]) for w in after},
        texts=run_texts(result),
        start_s=round(start_s, 1),
    )


def run(
    model_dir: Path,
    workload: FleetWorkload,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every repetition × policy (``run_order``), then ``summarize`` plus the settings."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    runs: list[FleetRun] = []
    wall = time.perf_counter()
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="kvstrata-bench-vfleet-") as raw:
        for repeat in range(1, workload.repeats + 1):
            for position, policy in enumerate(run_order(workload.policies, repeat)):
                say(f"bench vllm-fleet: #{repeat} {policy}")
                runs.append(run_one(workload, model_dir, Path(raw), policy, repeat, position))
    wall_s = time.perf_counter() - wall
    return summarize(runs) | {
        "workload": asdict(workload)
        | {
            "max_model_len": workload.max_model_len,
            "working_set_ratio": workload.working_set_ratio,
        },
        "dataset": "prefix_repetition (vLLM), its own seeded order, Poisson arrivals",
        "fairness": "fresh servers, host tiers, index and front door for every run",
        "model": {"dir": str(model_dir), "dtype": workload.dtype},
        "wall_s": round(wall_s, 1),
    }
