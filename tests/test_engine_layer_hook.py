"""The layer-wise prefill hook and prefill-only requests (issue 14, item 3) on SmolLM2.

``on_layer(layer, block_ids)`` fires once per layer per step, in layer order, after that
layer wrote the step's K/V; what it sees for layer ``l`` is what the pool finally holds for
layer ``l``; a prefill-only request keeps its blocks pinned until released; a request with no
listener is unaffected (its logits equal a fresh prefill's and another engine's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import RequestCancelled
from kvstrata.runtime.scheduler import SchedulerConfig

pytestmark = (
    pytest.mark.slow
)  # the real SmolLM2 (the tiny model's case is in test_engine_layer_hook_tiny)

B = 16
CHUNK = 64


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


@pytest.fixture()
def engine(smollm2_model: LoadedModel) -> ReferenceEngine:
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=CHUNK)
    return ReferenceEngine(
        smollm2_model, EngineConfig(block_size=B, pool_blocks=128, scheduler=scheduler)
    )


class Recorder:
    """Copies of what each layer wrote, as a sender would ship them."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.kv = engine.pool.kv
        self.calls: list[tuple[int, tuple[int, ...]]] = []
        self.seen: dict[tuple[int, int], torch.Tensor] = {}  # (layer, block) → [2, H, B, D]

    def __call__(self, layer: int, block_ids: tuple[int, ...]) -> None:
        self.calls.append((layer, block_ids))
        for block in block_ids:
            self.seen[(layer, block)] = self.kv[layer, :, :, block].clone()


def test_listener_fires_per_layer_per_step_in_order_and_sees_final_contents(
    engine: ReferenceEngine,
) -> None:
    layers = engine.pool.config.num_layers
    prompt = tokens(150, seed=3)  # 3 steps of 64 tokens: 64, 64, 22
    recorder = Recorder(engine)
    handle = engine.prefill(prompt, on_layer=recorder)
    result = handle.result()
    steps = -(-len(prompt) // CHUNK)
    assert [layer for layer, _ in recorder.calls] == list(range(layers)) * steps
    per_step = [recorder.calls[s * layers][1] for s in range(steps)]
    for s in range(steps):  # every layer of a step names the same blocks
        assert all(ids == per_step[s] for _, ids in recorder.calls[s * layers : (s + 1) * layers])
    written = sorted({b for ids in per_step for b in ids})
    assert written == sorted(result.block_ids)  # nothing was cached: every block was written
    assert len(result.block_ids) == -(-len(prompt) // B)
    assert result.matched_tokens == 0
    assert len(result.keys) == len(prompt) // B
    assert result.committed == len(prompt) // B
    # each block is named once, by the step that completes it, and holds its final content
    for layer in range(layers):
        for block in result.block_ids:
            final = engine.pool.kv[layer, :, :, block]
            seen = recorder.seen[(layer, block)]
            filled = len(prompt) - result.block_ids.index(block) * B
            assert torch.equal(seen[:, :, : min(filled, B)], final[:, :, : min(filled, B)])
    # the first token is the greedy token of a plain request
    plain = engine.generate(prompt, SamplingParams(max_tokens=1), use_cache=False).run()
    assert result.first_token == plain.output_ids[0]
    handle.release()


def test_prefill_pins_its_blocks_until_released(smollm2_model: LoadedModel) -> None:
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=CHUNK)
    config = EngineConfig(block_size=B, pool_blocks=20, scheduler=scheduler)
    engine = ReferenceEngine(smollm2_model, config)
    prompt = tokens(100, seed=5)  # 6 full blocks and a partial one
    handle = engine.prefill(prompt)
    result = handle.result()
    assert result.committed == 6 and len(result.block_ids) == 7
    assert engine.pool.blocks_available == 20 - 7  # 6 referenced, 1 scratch

    def pressure(seed: int) -> None:  # 150-token prompts: 10 blocks each, 13 left free
        for k in range(3):
            engine.generate(tokens(150, seed=seed + k), SamplingParams(max_tokens=1)).run()

    pressure(100)  # the pool evicts, but never a pinned block
    assert [engine.pool.block_id(key) for key in result.keys] == list(
        result.block_ids[: result.committed]
    )
    handle.release()
    handle.release()  # twice is harmless
    assert engine.pool.blocks_available == 20  # nothing is held any more
    pressure(200)  # now the prefill's blocks are the least recently used: they go
    assert any(engine.pool.block_id(key) is None for key in result.keys)


def test_release_before_the_prefill_finished_frees_at_its_end(engine: ReferenceEngine) -> None:
    prompt = tokens(80, seed=6)
    free = engine.pool.blocks_available
    handle = engine.prefill(prompt)
    handle.release()
    with pytest.raises(RequestCancelled):
        handle.result()
    assert engine.pool.blocks_available == free  # published blocks are evictable again


def test_cached_prefix_is_not_named_by_listener_calls(engine: ReferenceEngine) -> None:
    base = tokens(96, seed=7)
    engine.generate(base, SamplingParams(max_tokens=1)).run()
    recorder = Recorder(engine)
    handle = engine.prefill(base + tokens(20, seed=8), on_layer=recorder)
    result = handle.result()
    assert result.matched_tokens == 96
    cached = set(result.block_ids[: 96 // B])
    assert cached.isdisjoint(b for _, ids in recorder.calls for b in ids)
    assert {b for _, ids in recorder.calls for b in ids} == set(result.block_ids[96 // B :])
    handle.release()


def test_a_failing_listener_fails_only_its_request(engine: ReferenceEngine) -> None:
    def broken(layer: int, block_ids: tuple[int, ...]) -> None:
        if layer == 3:
            raise ValueError("sender gone")

    prompt = tokens(40, seed=9)
    other = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    handle = engine.prefill(tokens(40, seed=10), on_layer=broken)
    with pytest.raises(ValueError, match="sender gone"):
        handle.result()
    alone = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0), use_cache=False)
    assert other.run().output_ids == alone.run().output_ids


def test_plain_requests_beside_a_listener_are_unaffected(
    engine: ReferenceEngine, smollm2_model: LoadedModel
) -> None:
    prompt = tokens(120, seed=11)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = ReferenceEngine(smollm2_model, EngineConfig(block_size=B, pool_blocks=64))
    fresh = reference.generate(prompt, greedy, use_cache=False, keep_logits=True).run()
    handle = engine.prefill(tokens(120, seed=12), on_layer=lambda layer, ids: None)
    beside = engine.generate(prompt, greedy, use_cache=False, keep_logits=True)
    handle.result()
    beside.run()
    assert beside.output_ids == fresh.output_ids
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(fresh.step_logits, beside.step_logits, strict=True)
    )
    assert diff <= 1e-4
    handle.release()
