"""Exactness for hits served from every tier, and the engine's tier failure paths (tiny model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.store.config import RolloutConfig, TierConfig, WritePolicy
from kvstrata.tiers.base import TierError
from kvstrata.tiers.disk import DiskTier
from tier_helpers import worker_tiers

B = 16
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def make(loaded: LoadedModel, tmp_path: Path, **tier_kw: object) -> ReferenceEngine:
    block = 2 * 2 * 2 * B * 16 * 4  # tiny: 2 layers, K+V, 2 heads, 16 tokens, head dim 16, fp32
    options = worker_tiers(
        host_bytes=tier_kw.pop("host_blocks", 256) * block,  # type: ignore[operator]
        disk_dir=tmp_path / "disk",
        disk_bytes=1024 * block,
        durable_disk=False,
        **tier_kw,  # type: ignore[arg-type]
    )
    return build_engine(loaded, EngineConfig(block_size=B, pool_blocks=64), options)


@pytest.fixture()
def engine(tiny_model: LoadedModel, tmp_path: Path) -> Iterator[ReferenceEngine]:
    e = make(tiny_model, tmp_path)
    yield e
    e.close()


def exact_from(engine: ReferenceEngine, prompt: list[int]) -> dict[str, int]:
    fresh = engine.generate(prompt, GREEDY, use_cache=False, keep_logits=True).run()
    cached = engine.generate(prompt, GREEDY, keep_logits=True).run()
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(fresh.step_logits, cached.step_logits, strict=True)
    )
    assert diff <= 1e-4
    assert cached.output_ids == fresh.output_ids
    # Full blocks at least; the tail too when a cached block continues the prompt.
    assert cached.record.matched_tokens >= (len(prompt) - 1) // B * B
    return cached.record.matched_by_tier


def test_hit_from_host_is_exact(engine: ReferenceEngine) -> None:
    prompt = tokens(150, seed=1)
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    engine.pool.clear()
    assert engine.pool.blocks_used == 0
    assert exact_from(engine, prompt) == {"host": 144}
    assert engine.metrics.value("kvstrata_matched_tokens_total", {"tier": "host"}) == 144


def test_hit_from_disk_is_exact(engine: ReferenceEngine) -> None:
    prompt = tokens(150, seed=2)
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    assert engine.bridge is not None
    store = engine.bridge.store
    store.flush()  # write-back host → disk
    store.set_enabled("host", False)
    engine.pool.clear()
    assert exact_from(engine, prompt) == {"disk": 144}


def test_mixed_device_host_disk_hit_is_exact(engine: ReferenceEngine) -> None:
    prompt = tokens(200, seed=3)
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    assert engine.bridge is not None
    store = engine.bridge.store
    store.flush()
    keys = engine.block_keys(prompt)
    engine.pool.clear()  # demotes nothing new: the host tier was written through
    # device for blocks 0..3 (below), host for 4..7, disk only for 8..11
    for key in reversed(keys[8:12]):
        assert store.levels[0].tier.remove(key)
    engine.generate(prompt[: 4 * B + 1], SamplingParams(max_tokens=1)).run()  # device: 0..3
    by_tier = exact_from(engine, prompt)
    assert by_tier["device"] == 4 * B and by_tier["host"] == 4 * B and by_tier["disk"] == 4 * B


def test_corrupt_disk_object_is_recomputed_and_counted(engine: ReferenceEngine) -> None:
    prompt = tokens(100, seed=4)
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    assert engine.bridge is not None
    store = engine.bridge.store
    store.flush()
    store.set_enabled("host", False)
    engine.pool.clear()
    disk = store.levels[1].tier
    assert isinstance(disk, DiskTier)
    key = engine.block_keys(prompt)[3]
    path = disk.path_of(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    fresh = engine.generate(prompt, GREEDY, use_cache=False).run()
    cached = engine.generate(prompt, GREEDY).run()
    assert cached.record.matched_tokens == 3 * B  # stops at the corrupt block, recomputes the rest
    assert cached.output_ids == fresh.output_ids
    assert (
        store.metrics.value(
            "kvstrata_tier_invalidated_total", {"tier": "disk", "reason": "digest_mismatch"}
        )
        == 1
    )
    unloaded = {"reason": "digest_mismatch"}  # the planned blocks from the corrupt one on
    want = (len(prompt) - 1) // B - 3
    assert store.metrics.value("kvstrata_promotion_unloaded_blocks_total", unloaded) == want


def test_break_even_threshold_recomputes(tiny_model: LoadedModel, tmp_path: Path) -> None:
    host = TierConfig("host", rollout=RolloutConfig(min_reusable_tokens=10_000))
    engine = make(tiny_model, tmp_path, host=host)
    prompt = tokens(100, seed=5)
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    engine.pool.clear()
    result = engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    assert result.record.matched_tokens == 0
    assert engine.bridge is not None
    metrics = engine.bridge.store.metrics
    assert metrics.value("kvstrata_breakeven_recompute_total", {"reason": "below_min_tokens"}) == 1
    engine.close()


def test_fetch_slower_than_recompute_recomputes(engine: ReferenceEngine) -> None:
    prompt = tokens(100, seed=6)
    engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    engine.pool.clear()
    assert engine.bridge is not None
    engine.bridge.store.levels[0].fetch_s_per_byte = 1.0  # as if the tier were absurdly slow
    result = engine.generate(prompt, SamplingParams(max_tokens=1)).run()
    assert result.record.matched_tokens == 0
    assert (
        engine.bridge.store.metrics.value(
            "kvstrata_breakeven_recompute_total", {"reason": "fetch_slower"}
        )
        == 1
    )


def test_selective_host_keeps_only_reused_blocks(tiny_model: LoadedModel, tmp_path: Path) -> None:
    host = TierConfig("host", write_policy=WritePolicy.SELECTIVE, selective_min_uses=2)
    engine = make(tiny_model, tmp_path, host=host)
    once, twice = tokens(64, seed=7), tokens(64, seed=8)
    engine.generate(once, SamplingParams(max_tokens=1)).run()
    engine.generate(twice, SamplingParams(max_tokens=1)).run()
    engine.generate(twice, SamplingParams(max_tokens=1)).run()
    engine.pool.clear()  # demotion: only the reused prompt's blocks are worth a host slot
    assert engine.bridge is not None
    host_tier = engine.bridge.store.levels[0].tier
    assert host_tier.contains(engine.block_keys(twice)[0])
    assert not host_tier.contains(engine.block_keys(once)[0])
    assert exact_from(engine, twice) == {"host": 63}
    engine.close()


def test_other_tenant_gets_nothing_from_lower_tiers(engine: ReferenceEngine) -> None:
    prompt = tokens(80, seed=9)
    engine.generate(prompt, SamplingParams(max_tokens=1), tenant="alice").run()
    engine.pool.clear()
    bob = engine.generate(prompt, SamplingParams(max_tokens=1), tenant="bob").run()
    assert bob.record.matched_tokens == 0
    alice = engine.generate(prompt, SamplingParams(max_tokens=1), tenant="alice").run()
    assert alice.record.matched_by_tier == {"host": 79}


@pytest.mark.parametrize("host_policy", [WritePolicy.WRITE_BACK, WritePolicy.SELECTIVE])
def test_close_demotes_the_device_pool_and_drains_write_back(
    tiny_model: LoadedModel, tmp_path: Path, host_policy: WritePolicy
) -> None:
    """Blocks only in the device pool at close (the host level copies on eviction) reach the
    disk tier (write-back below the host) before the tiers close."""
    host = TierConfig("host", host_policy, selective_min_uses=1)
    first = make(tiny_model, tmp_path, host=host)
    prompt = tokens(120, seed=12)
    first.generate(prompt, SamplingParams(max_tokens=1)).run()
    assert first.bridge is not None
    assert first.bridge.store.levels[1].tier.object_count == 0  # nothing below the pool yet
    first.close()
    second = make(tiny_model, tmp_path, host=host)
    assert exact_from(second, prompt) == {"disk": 112}
    second.close()


def test_disk_tier_survives_an_engine_restart(tiny_model: LoadedModel, tmp_path: Path) -> None:
    first = make(tiny_model, tmp_path)
    prompt = tokens(120, seed=10)
    reference = first.generate(prompt, GREEDY, use_cache=False).run().output_ids
    first.generate(prompt, SamplingParams(max_tokens=1)).run()
    first.close()  # drains write-back to disk
    second = make(tiny_model, tmp_path)
    result = second.generate(prompt, GREEDY).run()
    assert result.record.matched_by_tier == {"disk": 112}
    assert result.output_ids == reference
    second.close()


def test_a_failing_store_lookup_fails_its_request_and_the_engine_goes_on(
    engine: ReferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission's store lookup raising (a medium failing in a way its tier did not absorb)
    answers that request with the error — it is not lost between the queues — and the
    queue-depth bookkeeping stays exact."""
    prompt = tokens(150, seed=5)

    def failing(seq: object) -> dict[str, int]:
        raise TierError("the medium is gone")

    monkeypatch.setattr(engine.batch, "_lookup", failing)
    with pytest.raises(TierError, match="medium is gone"):
        engine.generate(prompt, SamplingParams(max_tokens=2)).run()
    monkeypatch.undo()
    assert engine._queued == 0 and len(engine.batch.scheduler) == 0
    assert engine.generate(prompt, SamplingParams(max_tokens=2)).run().output_ids
    assert engine._queued == 0


def test_a_promotion_under_pressure_keeps_its_blocks_and_the_tails_donor(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    """Both the pool and the host tier full: each promoted block evicts a pool block, which is
    demoted into the host tier, whose LRU victim would be the prompt's own unread blocks —
    the tail's donor first (block 7 of an 8-block prompt), then the plan's tail. Held for the
    whole lookup, the prompt is found whole and the room comes from the demoted blocks."""
    block = 2 * 2 * 2 * B * 16 * 4
    options = worker_tiers(
        host_bytes=12 * block, host=TierConfig("host", WritePolicy.WRITE_BACK), policy="lru"
    )
    engine = build_engine(tiny_model, EngineConfig(block_size=B, pool_blocks=16), options)
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0)
        prompt = tokens(8 * B, seed=21)
        engine.generate(prompt, one).run()
        engine.pool.clear()  # demoted: the host tier holds the prompt's 8 blocks
        for seed in (22, 23):  # two other prompts fill the pool (nothing of them in the host)
            engine.generate(tokens(8 * B, seed=seed), one).run()
        assert engine.bridge is not None
        metrics = engine.bridge.store.metrics
        dropped = {"tier": "host", "outcome": "dropped"}
        before = metrics.value("kvstrata_tier_evictions_total", dropped)
        cached = engine.generate(prompt, GREEDY).run()
        assert cached.record.matched_tokens == len(prompt) - 1  # 7 blocks and the donor's 15
        fresh = engine.generate(prompt, GREEDY, use_cache=False).run()
        assert cached.output_ids == fresh.output_ids
        after = metrics.value("kvstrata_tier_evictions_total", dropped)
        assert after > before  # the host tier was full: the demotions evicted something else
    finally:
        engine.close()
