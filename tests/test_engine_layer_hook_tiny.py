"""The layer listener on the tiny model (fast suite): order per step and final contents."""

from __future__ import annotations

import pytest
import torch

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.runtime.scheduler import SchedulerConfig

B = 16


@pytest.mark.parametrize("length", [17, 100])
def test_listener_order_and_contents_on_the_tiny_model(
    tiny_model: LoadedModel, length: int
) -> None:
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)
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
    steps = -(-length // 32)
    assert [layer for layer, _ in calls] == list(range(layers)) * steps
    assert {b for _, ids in calls for b in ids} == set(result.block_ids)
    for layer in range(layers):
        for i, block in enumerate(result.block_ids):
            filled = min(length - i * B, B)
            final = engine.pool.kv[layer, :, :, block, :filled]
            assert torch.equal(seen[(layer, block)][:, :, :filled], final)
    handle.release()
    assert engine.pool.blocks_available == 64
