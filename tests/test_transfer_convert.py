"""Executing conversion plans (transfer.convert) and the engine's prefix export/import."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.transfer_io import export_prefix, import_prefix, pool_layout
from kvstrata.errors import ConversionError
from kvstrata.transfer.convert import convert_blocks, shard_blocks, torch_dtype
from kvstrata.transfer.layout import (
    CANONICAL_ORDER,
    ConversionPlan,
    KVLayout,
    Refusal,
    RefuseReason,
    plan_conversion,
)

ORDERS = ["LKHTD", "LKTHD", "KLHTD", "TLKHD", "DHTKL"]


def plan(source: KVLayout, target: KVLayout) -> ConversionPlan:
    result = plan_conversion(source, target)
    assert isinstance(result, ConversionPlan), result
    return result


def naive_reblock(blocks: torch.Tensor, size: int) -> torch.Tensor:
    """Canonical ``[n, L, 2, H, B, D]`` → ``[m, L, 2, H, size, D]`` token by token."""
    n, layers, pair, heads, block, dim = blocks.shape
    tokens = [blocks[i, :, :, :, t] for i in range(n) for t in range(block)]
    m = len(tokens) // size
    out = torch.empty((m, layers, pair, heads, size, dim), dtype=blocks.dtype)
    for j in range(m):
        for t in range(size):
            out[j, :, :, :, t] = tokens[j * size + t]
    return out


def tp_sizes(heads: int) -> list[int]:
    return [
        t for t in range(1, 9) if (t <= heads and heads % t == 0) or (t > heads and t % heads == 0)
    ]


@st.composite
def round_trips(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, torch.Tensor]:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    sizes = tp_sizes(heads)
    base = KVLayout(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=heads,
        head_dim=draw(st.integers(1, 4)),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16])),
        dtype="float32",
    )
    source = replace(
        base, tp_size=draw(st.sampled_from(sizes)), order=draw(st.sampled_from(ORDERS))
    )
    target = replace(
        base,
        tp_size=draw(st.sampled_from(sizes)),
        order=draw(st.sampled_from(ORDERS)),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32, 48])),
    )
    n = draw(st.integers(0, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    shape = (n, base.num_layers, 2, heads, base.block_size, base.head_dim)
    blocks = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return source, target, blocks


def to_target(
    source: KVLayout, target: KVLayout, blocks: torch.Tensor
) -> tuple[dict[int, torch.Tensor], int]:
    shards = shard_blocks(blocks, source)
    out = {r: convert_blocks(plan(source, target.rank(r)), shards) for r in range(target.tp_size)}
    remainders = {c.remainder_tokens for c in out.values()}
    assert len(remainders) == 1
    return {r: c.blocks for r, c in out.items()}, remainders.pop()


@settings(max_examples=120, deadline=None)
@given(round_trips())
def test_lossless_round_trip_is_bit_exact(case: tuple[KVLayout, KVLayout, torch.Tensor]) -> None:
    source, target, blocks = case
    target_shards, remainder = to_target(source, target, blocks)
    tokens = blocks.shape[0] * source.block_size
    assert remainder == tokens % target.block_size
    # direct oracle: what the target ranks hold is the naive reblock, sharded by the target
    expected = shard_blocks(naive_reblock(blocks, target.block_size), target)
    for rank, shard in target_shards.items():
        assert torch.equal(shard, expected[rank])
    # and back: the target's blocks converted to the source's layout give the source back
    back_layout = replace(source, tp_size=1, tp_rank=0, order=CANONICAL_ORDER)
    back = convert_blocks(plan(target, back_layout), target_shards)
    kept = back.num_blocks
    assert kept == (tokens - remainder) // source.block_size
    assert torch.equal(back.blocks, blocks[:kept])


@pytest.mark.parametrize(
    ("heads", "tps", "sizes"),
    [
        (4, (1, 2, 1), (16, 16, 16)),
        (8, (4, 2, 4), (16, 32, 16)),
        (4, (2, 4, 2), (16, 48, 16)),  # 48: a kernel block size
        (2, (4, 1, 8), (16, 32, 16)),  # TP above the KV heads: replication
        (3, (3, 1, 3), (32, 16, 48)),
    ],
)
def test_named_chains_are_bit_exact(
    heads: int, tps: tuple[int, ...], sizes: tuple[int, ...]
) -> None:
    base = KVLayout(
        num_layers=2, num_kv_heads=heads, head_dim=4, block_size=sizes[0], dtype="float32"
    )
    blocks = torch.randn(
        (6, 2, 2, heads, sizes[0], 4), generator=torch.Generator().manual_seed(heads)
    )
    layouts = [
        replace(base, tp_size=t, block_size=b, order=o)
        for t, b, o in zip(tps, sizes, ORDERS, strict=False)
    ]
    shards = shard_blocks(blocks, layouts[0])
    for source, target in itertools.pairwise(layouts):
        shards = {
            r: convert_blocks(plan(source, target.rank(r)), shards).blocks
            for r in range(target.tp_size)
        }
    final = convert_blocks(plan(layouts[-1], base), shards)
    tokens = 6 * sizes[0]
    for size in sizes[1:]:
        tokens = tokens // size * size  # each reblock leaves its trailing partial block out
    assert final.num_blocks == tokens // sizes[0]
    assert torch.equal(final.blocks, blocks[: final.num_blocks])


def test_replicated_target_ranks_share_a_head() -> None:
    base = KVLayout(num_layers=1, num_kv_heads=2, head_dim=2, block_size=4, dtype="float32")
    blocks = torch.randn((3, 1, 2, 2, 4, 2))
    target = replace(base, tp_size=4)
    shards, _ = to_target(base, target, blocks)
    assert torch.equal(shards[0], shards[1]) and torch.equal(shards[2], shards[3])
    assert not torch.equal(shards[1], shards[2])
    assert torch.equal(shards[3][:, :, :, 0], blocks[:, :, :, 1])


def test_cast_is_marked_lossy_and_a_bf16_round_trip_is_not_exact() -> None:
    base = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    half = replace(base, dtype="bfloat16")
    down, up = plan(base, half), plan(half, base)
    assert not down.lossless and not up.lossless
    assert plan(base, replace(base, block_size=32, tp_size=2)).lossless
    blocks = torch.randn((3, 2, 2, 2, 16, 8), generator=torch.Generator().manual_seed(1))
    narrowed = convert_blocks(down, {0: blocks})
    assert narrowed.blocks.dtype == torch.bfloat16
    restored = convert_blocks(up, {0: narrowed.blocks}).blocks
    assert restored.dtype == torch.float32
    assert not torch.equal(restored, blocks)
    assert float((restored - blocks).abs().max()) < 0.05 * float(blocks.abs().max())


def test_identity_plan_returns_the_blocks() -> None:
    base = KVLayout(
        num_layers=1, num_kv_heads=2, head_dim=2, block_size=4, dtype="float16", order="TLKHD"
    )
    same = plan(base, base)
    assert same.identity
    blocks = torch.randn((2, *base.block_shape())).to(torch.float16)
    out = convert_blocks(same, {0: blocks})
    assert torch.equal(out.blocks, blocks) and out.remainder_tokens == 0


def test_mismatched_inputs_raise_conversion_errors() -> None:
    base = KVLayout(num_layers=2, num_kv_heads=4, head_dim=4, block_size=8, dtype="float32")
    two = replace(base, tp_size=2)
    merge = plan(two, base)
    good = shard_blocks(torch.randn((2, 2, 2, 4, 8, 4)), two)
    convert_blocks(merge, good)
    with pytest.raises(ConversionError, match="missing"):
        convert_blocks(merge, {0: good[0]})
    with pytest.raises(ConversionError, match="shape"):
        convert_blocks(merge, {0: good[0], 1: good[1][:, :1]})
    with pytest.raises(ConversionError, match="block counts"):
        convert_blocks(merge, {0: good[0], 1: good[1][:1]})
    with pytest.raises(ConversionError, match="dtype"):
        convert_blocks(merge, {0: good[0], 1: good[1].to(torch.float16)})
    with pytest.raises(ConversionError, match="shape"):
        convert_blocks(merge, {0: good[0], 1: good[1][0]})
    with pytest.raises(ConversionError):
        convert_blocks(merge, {0: good[0], 1: "not a tensor"})  # type: ignore[dict-item]
    with pytest.raises(ConversionError, match="not \\[n"):
        shard_blocks(torch.randn((2, 2, 2, 3, 8, 4)), two)
    with pytest.raises(ConversionError, match="bfloat16"):
        shard_blocks(torch.randn((2, 2, 2, 4, 8, 4)).to(torch.bfloat16), two)
    with pytest.raises(ConversionError, match="invalid layout"):
        shard_blocks(torch.randn((2, 2, 2, 4, 8, 4)), replace(base, tp_size=3))
    with pytest.raises(ConversionError):
        torch_dtype("int8")


# ---- SmolLM2: prefill on one layout, decode on another ----------------------------------------
PROMPT_TOKENS = 120  # 7 blocks of 16; 3 blocks of 32 and 16 tokens the receiver computes


@pytest.mark.slow
def test_smollm2_prefill_tp3_block16_decode_block32_is_exact(smollm2_model: LoadedModel) -> None:
    rng = np.random.default_rng(14)
    prompt = [int(t) for t in rng.integers(100, 49000, size=PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sender = ReferenceEngine(smollm2_model, EngineConfig(block_size=16, pool_blocks=16))
    sender.generate(prompt, SamplingParams(max_tokens=1)).run()
    exported = export_prefix(sender, prompt, "default")
    assert exported.blocks.shape[0] == PROMPT_TOKENS // 16 == len(exported.keys)
    source = replace(exported.layout, tp_size=3)  # SmolLM2 has 3 KV heads: TP 3 shards them
    refused = plan_conversion(replace(exported.layout, tp_size=2), exported.layout)
    assert isinstance(refused, Refusal) and refused.reason is RefuseReason.HEADS_NOT_DIVISIBLE
    shards = shard_blocks(exported.blocks, source)
    assert all(shard.shape[3] == 1 for shard in shards.values())

    receiver = ReferenceEngine(smollm2_model, EngineConfig(block_size=32, pool_blocks=16))
    target = pool_layout(receiver.pool.config)
    conversion = plan(source, target)
    assert conversion.lossless and not conversion.identity
    converted = convert_blocks(conversion, shards)
    assert (converted.num_blocks, converted.remainder_tokens) == (3, 16)
    result = import_prefix(receiver, prompt, "default", converted.blocks)
    assert (result.imported, result.present, result.complete) == (3, 0, True)
    decoded = receiver.generate(prompt, params, keep_logits=True).run()
    assert decoded.record.matched_tokens == 96

    fresh = ReferenceEngine(smollm2_model, EngineConfig(block_size=32, pool_blocks=16))
    plain = fresh.generate(prompt, params, keep_logits=True).run()
    assert plain.record.matched_tokens == 0
    assert decoded.output_ids == plain.output_ids
    assert float((decoded.step_logits[0] - plain.step_logits[0]).abs().max()) <= 1e-4
    again = import_prefix(receiver, prompt, "default", converted.blocks)
    assert (again.imported, again.present) == (0, 3)
