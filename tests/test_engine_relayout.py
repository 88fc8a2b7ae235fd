"""Stored objects written under one layout, read under another (engine.relayout, tiny model).

A "restart with another block size" is a real one: the first engine closes (its disk tier's
lock released), the second opens the same directory with another block size and the first's
layout among its ``read_layouts``. Layouts no reference engine writes (TP shards, another axis
order, another dtype) are stored by a writer made here: canonical blocks exported from a
pool, sharded/reordered/cast, and put under that writer's own fingerprint and keys.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.relayout import (
    Alternate,
    StoredRelayout,
    layout_label,
    layout_representation,
    pool_layout,
)
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.transfer_io import export_prefix
from kvstrata.identity import DEFAULT_TENANT, chain_keys
from kvstrata.runtime.blocks import BlockInfo, block_tokens
from kvstrata.runtime.config import WorkerConfig, remote_tier
from kvstrata.runtime.read_layouts import ReadLayout
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.remote_client import RemoteConfig
from kvstrata.transfer.convert import shard_blocks
from tier_helpers import worker_tiers

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT_LEN = 150


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def engine_on(
    loaded: LoadedModel, disk: Path, block_size: int, *reads: ReadLayout
) -> ReferenceEngine:
    options = worker_tiers(
        disk_dir=disk,
        disk_bytes=64 << 20,
        disk=TierConfig("disk", WritePolicy.WRITE_THROUGH),
        durable_disk=False,
    )
    config = EngineConfig(block_size=block_size, pool_blocks=64, read_layouts=reads)
    return build_engine(loaded, config, options)


def relayout_of(engine: ReferenceEngine) -> StoredRelayout:
    assert engine.batch.relayout is not None
    return engine.batch.relayout


def converted_blocks(engine: ReferenceEngine, source: str) -> float:
    labels = {"from_layout": source, "to_layout": layout_label(pool_layout(engine.pool.config))}
    return engine.metrics.value("kvstrata_relayout_blocks_total", labels)


def refused(engine: ReferenceEngine, source: str, reason: str) -> float:
    labels = {"from_layout": source, "reason": reason}
    return engine.metrics.value("kvstrata_relayout_refused_total", labels)


def assert_exact(engine: ReferenceEngine, prompt: list[int]) -> dict[str, int]:
    """The cached run (through whatever the store holds) equals a fresh one; its hits."""
    fresh = engine.generate(prompt, GREEDY, use_cache=False, keep_logits=True).run()
    cached = engine.generate(prompt, GREEDY, keep_logits=True).run()
    assert cached.output_ids == fresh.output_ids
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(fresh.step_logits, cached.step_logits, strict=True)
    )
    assert diff <= 1e-4
    return cached.record.matched_by_tier


def restart(
    loaded: LoadedModel, disk: Path, prompt: list[int], first: int, second: int
) -> ReferenceEngine:
    writer = engine_on(loaded, disk, first)
    writer.generate(prompt, SamplingParams(max_tokens=1)).run()
    writer.close()
    return engine_on(loaded, disk, second, ReadLayout(block_size=first))


def test_restart_16_to_32_hits_through_conversion(tiny_model: LoadedModel, tmp_path: Path) -> None:
    prompt = tokens(PROMPT_LEN, seed=1)
    engine = restart(tiny_model, tmp_path / "disk", prompt, 16, 32)
    try:
        source = relayout_of(engine).alternates[0].label
        assert source == "b16/LKHTD/tp1/float32"
        # 149 tokens before the last one: 4 blocks of 32, read as 8 stored blocks of 16.
        assert assert_exact(engine, prompt) == {"disk": 128}
        assert converted_blocks(engine, source) == 4
        # Written through in the engine's own layout: after the pool is dropped they hit as
        # its own keys, with no second conversion.
        engine.pool.clear()
        assert assert_exact(engine, prompt) == {"disk": 128}
        assert converted_blocks(engine, source) == 4
    finally:
        engine.close()


def test_restart_32_to_16_hits_through_conversion(tiny_model: LoadedModel, tmp_path: Path) -> None:
    prompt = tokens(PROMPT_LEN, seed=2)
    engine = restart(tiny_model, tmp_path / "disk", prompt, 32, 16)
    try:
        source = relayout_of(engine).alternates[0].label
        # Four stored blocks of 32 become eight of 16; the ninth own block is recomputed.
        assert assert_exact(engine, prompt) == {"disk": 128}
        assert converted_blocks(engine, source) == 8
        assert (
            engine.metrics.value(
                "kvstrata_relayout_tokens_total",
                {"from_layout": source, "to_layout": "b16/LKHTD/tp1/float32"},
            )
            == 128
        )
    finally:
        engine.close()


def test_corrupt_stored_object_is_recomputed_and_counted(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    prompt = tokens(PROMPT_LEN, seed=3)
    disk = tmp_path / "disk"
    writer = engine_on(tiny_model, disk, 16)
    writer.generate(prompt, SamplingParams(max_tokens=1)).run()
    key = writer.block_keys(prompt)[5]
    writer.close()
    engine = engine_on(tiny_model, disk, 32, ReadLayout(block_size=16))
    try:
        assert engine.bridge is not None
        tier = engine.bridge.store.levels[0].tier
        assert isinstance(tier, DiskTier)
        path = tier.path_of(key)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
        source = relayout_of(engine).alternates[0].label
        # Stored blocks 0-4 verify (80 tokens: two own blocks, 16 tokens left over), 5 fails.
        assert assert_exact(engine, prompt) == {"disk": 64}
        assert converted_blocks(engine, source) == 2
        assert refused(engine, source, "digest_mismatch") == 1
    finally:
        engine.close()


def put_as_writer(
    engine: ReferenceEngine, alt: Alternate, prompt: list[int], canonical: torch.Tensor
) -> None:
    """Store ``canonical`` blocks ``[n, L, 2, H, B, D]`` the way ``alt``'s writer would."""
    relayout = relayout_of(engine)
    layout = alt.layout
    blocks = canonical.to(getattr(torch, layout.dtype))
    shards = shard_blocks(blocks, layout)
    size = layout.block_size
    for rank, digest in alt.digests.items():
        keys = chain_keys(relayout._root(digest, DEFAULT_TENANT), prompt, size)
        for i in range(shards[rank].shape[0]):
            payload = shards[rank][i].contiguous().view(torch.uint8).numpy().reshape(-1)
            info = BlockInfo(DEFAULT_TENANT, i * size, block_tokens(prompt, i, size))
            parent = keys[i - 1] if i else None
            assert alt.bridges[rank].put(keys[i], parent, info, memoryview(payload.data))


def exported(tiny_model: LoadedModel, prompt: list[int]) -> torch.Tensor:
    writer = ReferenceEngine(tiny_model, EngineConfig(block_size=16, pool_blocks=64))
    writer.generate(prompt, SamplingParams(max_tokens=1)).run()
    return export_prefix(writer, prompt).blocks


def test_tp_sharded_reordered_writer_is_read_exactly(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    prompt = tokens(PROMPT_LEN, seed=4)
    canonical = exported(tiny_model, prompt)
    read = ReadLayout(block_size=16, order="HTLKD", tp_size=2)  # the tiny model: 2 KV heads
    engine = engine_on(tiny_model, tmp_path / "disk", 32, read)
    try:
        (alt,) = relayout_of(engine).alternates
        assert sorted(alt.digests) == [0, 1] and len(set(alt.digests.values())) == 2
        put_as_writer(engine, alt, prompt, canonical)
        assert assert_exact(engine, prompt) == {"disk": 128}
        assert converted_blocks(engine, alt.label) == 4
    finally:
        engine.close()


def test_lossy_alternate_is_refused_and_counted(tiny_model: LoadedModel, tmp_path: Path) -> None:
    prompt = tokens(PROMPT_LEN, seed=5)
    canonical = exported(tiny_model, prompt)
    engine = engine_on(
        tiny_model, tmp_path / "disk", 32, ReadLayout(block_size=16, dtype="bfloat16")
    )
    try:
        (alt,) = relayout_of(engine).alternates
        assert not alt.plan.lossless
        put_as_writer(engine, alt, prompt, canonical)
        assert assert_exact(engine, prompt) == {}  # never an exact hit: recomputed
        assert refused(engine, alt.label, "lossy_not_allowed") == 1
        assert converted_blocks(engine, alt.label) == 0
    finally:
        engine.close()


def test_own_layout_representation_is_the_pool_bridges(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    engine = engine_on(tiny_model, tmp_path / "disk", 32)
    try:
        assert engine.bridge is not None and engine.batch.relayout is None  # none by default
        own = pool_layout(engine.pool.config)
        assert layout_representation(own) == engine.bridge.bridge.representation
        shard = layout_representation(replace(own, tp_size=2, tp_rank=1))
        assert shard.shape == (2, 2, 1, 32, 16) and shard.tp_rank == 1
    finally:
        engine.close()


@pytest.mark.slow
def test_smollm2_restart_block16_to_block32_is_exact(
    smollm2_model: LoadedModel, tmp_path: Path
) -> None:
    prompt = tokens(120, seed=14)  # 7 stored blocks of 16 → 3 own blocks of 32, 23 recomputed
    engine = restart(smollm2_model, tmp_path / "disk", prompt, 16, 32)
    try:
        source = relayout_of(engine).alternates[0].label
        assert assert_exact(engine, prompt) == {"disk": 96}
        assert converted_blocks(engine, source) == 3
    finally:
        engine.close()


def test_remote_tier_of_another_block_size_is_read(
    tiny_model: LoadedModel, remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Workers of two block sizes share one remote tier: the block-32 one reads the block-16
    one's objects, and stores its own beside them."""
    prompt = tokens(PROMPT_LEN, seed=6)

    def worker(block_size: int, *reads: ReadLayout) -> ReferenceEngine:
        remote = RemoteConfig(url=remote_server.url, namespace=remote_namespace)
        options = WorkerConfig(tiers=(remote_tier(remote, 64 << 20),))
        config = EngineConfig(block_size=block_size, pool_blocks=64, read_layouts=reads)
        return build_engine(tiny_model, config, options)

    writer = worker(16)
    reader = worker(32, ReadLayout(block_size=16))
    try:
        writer.generate(prompt, SamplingParams(max_tokens=1)).run()
        source = relayout_of(reader).alternates[0].label
        assert assert_exact(reader, prompt) == {"remote": 128}
        assert converted_blocks(reader, source) == 4
        assert reader.bridge is not None
        own_keys = reader.block_keys(prompt)[:4]
        assert all(reader.bridge.bridge.holds(key) for key in own_keys)
    finally:
        reader.close()
        writer.close()
