"""Two vLLM processes share one remote tier (a real valkey-server), and nothing else.

Process 1 (its connector has only the remote tier: no host, no disk) generates for a prompt.
Process 2, another vLLM process with the same remote url and namespace, generates the same
prompt: its own prefix cache is empty and it has no local tier, so every cached token comes
from what process 1 wrote to the server — with the same greedy output. In process 2 too, the
paired tenant check: another ``cache_salt`` gets no external hit, then hits its own blocks
(written to the remote tier by process 2 itself) after vLLM's prefix cache is reset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import BLOCK, generations, run_driver
from kvstrata.runtime.valkey_server import ValkeyServer

pytestmark = pytest.mark.timeout(600)


def _reusable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_second_vllm_process_reuses_the_first_ones_prefix_from_the_remote_tier(
    tmp_path: Path,
    smol: Path,
    prompt_ids: list[int],
    remote_server: ValkeyServer,
    remote_namespace: str,
) -> None:
    def connector(name: str) -> dict[str, Any]:
        return {
            "remote_url": remote_server.url,
            "remote_gib": 1,
            "remote_namespace": remote_namespace,
            "stats_path": str(tmp_path / f"stats-{name}.json"),
        }

    def stats(name: str) -> dict[str, Any]:
        return dict(json.loads((tmp_path / f"stats-{name}.json").read_text()))

    reusable = _reusable(prompt_ids)
    first = run_driver(
        tmp_path,
        {
            "model": str(smol),
            "connector": connector("first"),
            "steps": [{"op": "generate", "prompt": prompt_ids}],
        },
    )
    (fresh,) = generations(first)
    assert fresh["num_cached_tokens"] == 0
    assert fresh["tokens"] and fresh["text"].strip(), fresh
    written = stats("first")
    assert list(written["tiers"]) == ["remote"]
    assert written["blocks_saved"] >= reusable // BLOCK
    assert written["tokens_loaded"] == 0

    second = run_driver(
        tmp_path,
        {
            "model": str(smol),
            "connector": connector("second"),
            "steps": [
                {"op": "generate", "prompt": prompt_ids},
                {"op": "generate", "prompt": prompt_ids, "salt": "tenant-b"},
                {"op": "reset"},
                {"op": "generate", "prompt": prompt_ids, "salt": "tenant-b"},
            ],
        },
    )
    (start_1,) = [r for r in first if r["op"] == "start"]
    (start_2,) = [r for r in second if r["op"] == "start"]
    assert start_1["pid"] != start_2["pid"]
    shared, other_tenant, other_again = generations(second)
    # A fresh process without local tiers: its hit is process 1's KV, from the server.
    assert shared["num_cached_tokens"] == reusable
    assert shared["tokens"] == fresh["tokens"]
    assert other_tenant["num_cached_tokens"] == 0  # tenant-b sees nothing of the default tenant
    assert other_tenant["tokens"] == fresh["tokens"]
    assert other_again["num_cached_tokens"] == reusable  # its own blocks, via the remote tier
    assert other_again["tokens"] == fresh["tokens"]
    read = stats("second")
    assert read["tokens_loaded"] == 2 * reusable
    assert read["load_errors"] == 0 and read["load_digest_mismatch"] == 0
    remote = read["tiers"]["remote"]
    assert remote["loads"] == 2 * reusable // BLOCK
    # Each request's prefix came in one pipelined read-ahead batch, all of it used.
    assert remote["read_ahead_bytes"] == 2 * reusable // BLOCK * read["block_bytes"]
    assert remote["read_ahead_unused_bytes"] == 0
