"""The layer listener on the tiny model (fast suite): order per step, each block named once,
and what a block holds when it is named is its final content — also when a chunk ends
mid-block (the block is named by the step that completes it)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.runtime.scheduler import SchedulerConfig

B = 16


@pytest.mark.parametrize(("length", "chunk"), [(17, 32), (100, 32), (100, 24), (40, 24)])
def test_listener_order_and_contents_on_the_tiny_model(
    tiny_model: LoadedModel, length: int, chunk: int
) -> None:
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk)
    engine = ReferenceEngine(
        tiny_model, EngineConfig(block_size=B, pool_blocks=64, scheduler=scheduler)
    )
    layers = engine.pool.config.num_layers
    calls: list[tuple[int, tuple[int, ...]]] = []
    seen: dict[tuple[int, int], torch.Tensor] = {}

    def on_layer(layer: int, block_ids: tuple[int, ...]) -> None:
        calls.append((layer, block_ids))
        for block in block_ids:
            seen[(layer, block)] = engine.pool.kv[layer, :, :, block].clone()

    handle = engine.prefill(list(range(100, 100 + length)), on_layer=on_layer)
    result = handle.result()
    steps = -(-length // chunk)
    assert [layer for layer, _ in calls] == list(range(layers)) * steps
    named = [b for layer, ids in calls if layer == 0 for b in ids]
    assert named == list(result.block_ids)  # each block once, in order
    for layer in range(layers):
        for i, block in enumerate(result.block_ids):
            filled = min(length - i * B, B)
            final = engine.pool.kv[layer, :, :, block, :filled]
            assert torch.equal(seen[(layer, block)][:, :, :filled], final)
    handle.release()
    assert engine.pool.blocks_available == 64
