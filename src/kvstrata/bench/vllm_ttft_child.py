"""One vLLM process of ``kvstrata bench vllm``, driven line by line over stdin/stdout.

Run with the vLLM venv's python: ``python -m kvstrata.bench.vllm_ttft_child SPEC.json``. The
spec names the model, the prompt length and the KV transfer config (``null``: vLLM with no KV
connector at all). The process builds one ``LLM`` (SmolLM2 bf16, block 32, eager, prefix
caching on), runs a warm-up generation, prints ``READY`` and then answers one command per line
(JSON ``{"op": ..., "ids": [...]}``), each with one result line, both prefixed by ``MARK`` so
that vLLM's own log lines on stdout are skipped:

- ``fresh``: vLLM's prefix cache is reset, the prompt runs (timed);
- ``store``: the same, then the connector's write-back queue is drained
  (``KvstrataConnector.drain_write_back`` on the worker, when the connector has one; the
  ExampleConnector writes synchronously) and the prefix cache is reset again — so the next
  ``hit`` finds the prompt only in the connector's storage, with nothing left to write;
- ``hit``: the prompt runs (timed), then the prefix cache is reset;
- ``quit``.

A timed run is one ``LLM.generate`` call with ``max_tokens=1`` and greedy sampling: its wall
time (scheduling, prefill of what is not reused, one sampled token), the token and vLLM's
``num_cached_tokens`` are returned.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

MARK = "KVSTRATA-BENCH "


def _drain(worker: Any) -> bool:
    """Runs on the vLLM worker (``collective_rpc``): drain the connector's write-back."""
    from vllm.distributed.kv_transfer import (  # type: ignore[import-not-found]
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return False
    drain = getattr(get_kv_transfer_group(), "drain_write_back", None)
    if drain is None:
        return False
    drain()
    return True


def serve(spec: dict[str, Any]) -> None:
    import random

    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.config import KVTransferConfig  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    transfer = spec.get("transfer")
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec["tokens"] + 64,
        enforce_eager=True,
        block_size=32,
        enable_prefix_caching=True,
        kv_transfer_config=(
            KVTransferConfig(kv_role="kv_both", **transfer) if transfer is not None else None
        ),
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def timed(ids: list[int]) -> dict[str, Any]:
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "token": int(out.outputs[0].token_ids[0]),
            "cached": int(out.num_cached_tokens or 0),
        }

    rng = random.Random(99)
    # warm-up at the timed length (kernels, allocator): every side's first timed forward of
    # that length was otherwise the fresh side's (the connectors' untimed store ran one)
    timed([rng.randrange(1000, 40000) for _ in range(spec["tokens"])])
    llm.reset_prefix_cache()
    _reply({"op": "ready"})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op in ("fresh", "store"):
            llm.reset_prefix_cache()
        result = timed(command["ids"])
        if op == "store":
            started = time.perf_counter()
            drained = llm.collective_rpc(_drain)
            result["drain_s"] = time.perf_counter() - started
            result["drained"] = all(drained)
        llm.reset_prefix_cache()
        _reply({"op": op, **result})


def _reply(body: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(body) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    serve(json.loads(Path(sys.argv[1]).read_text()))
