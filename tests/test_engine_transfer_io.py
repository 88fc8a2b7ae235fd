"""The engine's prefix export/import (engine.transfer_io) on the real tiny model (fast)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.transfer_io import export_prefix, import_prefix, pool_layout
from kvstrata.errors import ConversionError
from kvstrata.transfer.convert import convert_blocks, shard_blocks
from kvstrata.transfer.layout import ConversionPlan, plan_conversion

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


@pytest.fixture()
def sender(tiny_model: LoadedModel) -> ReferenceEngine:
    return ReferenceEngine(tiny_model, EngineConfig(block_size=16, pool_blocks=64))


@pytest.fixture()
def receiver(tiny_model: LoadedModel) -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=32, pool_blocks=64))
    engine.start_loop()  # import from this thread goes through engine.call to the loop
    yield engine
    engine.stop_loop()


def to_receiver(
    sender: ReferenceEngine, receiver: ReferenceEngine, prompt: list[int]
) -> torch.Tensor:
    exported = export_prefix(sender, prompt, "default")
    source = replace(exported.layout, tp_size=2)  # the tiny model has 2 KV heads
    plan = plan_conversion(source, pool_layout(receiver.pool.config))
    assert isinstance(plan, ConversionPlan)
    return convert_blocks(plan, shard_blocks(exported.blocks, source)).blocks


def test_exported_prefix_decodes_exactly_on_another_layout(
    sender: ReferenceEngine, receiver: ReferenceEngine
) -> None:
    prompt = tokens(100, seed=3)
    sender.generate(prompt, SamplingParams(max_tokens=1)).run()
    exported = export_prefix(sender, prompt, "default")
    c = sender.pool.config
    assert exported.blocks.shape == (6, c.num_layers, 2, c.num_kv_heads, 16, c.head_dim)
    first = sender.pool.lookup_prefix(exported.keys)[0]
    assert torch.equal(exported.blocks[0], sender.pool.block_view(first))
    assert exported.keys == sender.block_keys(prompt)[:6]
    blocks = to_receiver(sender, receiver, prompt)
    assert blocks.shape[0] == 3
    result = import_prefix(receiver, prompt, "default", blocks)
    assert (result.imported, result.present, result.complete) == (3, 0, True)
    fresh = receiver.generate(prompt, GREEDY, use_cache=False, keep_logits=True).run()
    hit = receiver.generate(prompt, GREEDY, keep_logits=True).run()
    assert hit.record.matched_tokens == 96
    assert hit.output_ids == fresh.output_ids
    diff = max(
        float((a - b).abs().max()) for a, b in zip(fresh.step_logits, hit.step_logits, strict=True)
    )
    assert diff <= 1e-4
    assert export_prefix(receiver, prompt, "other-tenant").blocks.shape[0] == 0


def test_imported_blocks_are_under_the_receivers_own_keys(
    sender: ReferenceEngine, receiver: ReferenceEngine
) -> None:
    prompt = tokens(70, seed=4)
    sender.generate(prompt, SamplingParams(max_tokens=1)).run()
    blocks = to_receiver(sender, receiver, prompt)
    import_prefix(receiver, prompt, "tenant-b", blocks)
    own = receiver.block_keys(prompt, "tenant-b")
    assert len(receiver.pool.lookup_prefix(own)) == 2
    assert receiver.pool.lookup_prefix(sender.block_keys(prompt)) == []
    assert receiver.pool.lookup_prefix(receiver.block_keys(prompt, "default")) == []


def test_a_failed_write_aborts_every_block(
    sender: ReferenceEngine, receiver: ReferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokens(100, seed=5)
    sender.generate(prompt, SamplingParams(max_tokens=1)).run()
    blocks = to_receiver(sender, receiver, prompt)
    real = receiver.pool.write_block
    calls: list[int] = []

    def failing(block_id: int, data: torch.Tensor) -> None:
        calls.append(block_id)
        if len(calls) == 3:
            raise RuntimeError("device write failed")
        real(block_id, data)

    monkeypatch.setattr(receiver.pool, "write_block", failing)
    with pytest.raises(ConversionError, match="device write failed"):
        import_prefix(receiver, prompt, "default", blocks)
    assert receiver.pool.blocks_free == receiver.pool.config.num_blocks
    assert receiver.pool.blocks_available == receiver.pool.config.num_blocks
    assert receiver.pool.lookup_prefix(receiver.block_keys(prompt)) == []


def test_a_full_pool_commits_the_prefix_that_fit(
    sender: ReferenceEngine, tiny_model: LoadedModel
) -> None:
    small = ReferenceEngine(tiny_model, EngineConfig(block_size=32, pool_blocks=2))
    prompt = tokens(100, seed=6)
    sender.generate(prompt, SamplingParams(max_tokens=1)).run()
    blocks = to_receiver(sender, small, prompt)
    result = import_prefix(small, prompt, "default", blocks)
    assert (result.imported, result.complete) == (2, False)
    assert len(small.pool.lookup_prefix(small.block_keys(prompt))) == 2


def test_blocks_of_another_layout_are_refused(
    sender: ReferenceEngine, receiver: ReferenceEngine
) -> None:
    prompt = tokens(100, seed=7)
    sender.generate(prompt, SamplingParams(max_tokens=1)).run()
    exported = export_prefix(sender, prompt, "default")
    with pytest.raises(ConversionError, match="not this pool"):
        import_prefix(receiver, prompt, "default", exported.blocks)  # block size 16, not 32
    blocks = to_receiver(sender, receiver, prompt)
    with pytest.raises(ConversionError, match="bfloat16"):
        import_prefix(receiver, prompt, "default", blocks.to(torch.bfloat16))
    with pytest.raises(ConversionError, match="exceed"):
        import_prefix(receiver, prompt[:64], "default", blocks)
    assert receiver.pool.blocks_free == receiver.pool.config.num_blocks
