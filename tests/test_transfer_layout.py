"""``transfer.layout``: TP head resharding (GQA groups, replication), plans, refusals, and a
numpy reference interpreter that runs every plan and compares with the target's own blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.transfer.layout import (
    CANONICAL_ORDER,
    ConversionPlan,
    HeadSource,
    KVLayout,
    Refusal,
    RefuseReason,
    StepKind,
    plan_conversion,
)


def layout(heads: int, tp: int = 1, rank: int = 0, **changes: object) -> KVLayout:
    base = KVLayout(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=4,
        block_size=8,
        dtype="float32",
        tp_size=tp,
        tp_rank=rank,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def plan(source: KVLayout, target: KVLayout) -> ConversionPlan:
    result = plan_conversion(source, target)
    assert isinstance(result, ConversionPlan), result
    return result


def heads(source: KVLayout, target: KVLayout) -> tuple[HeadSource, ...]:
    steps = [s for s in plan(source, target).steps if s.kind is StepKind.RESHARD_HEADS]
    assert len(steps) == 1
    return steps[0].heads


def test_tp2_to_tp1_gathers_both_ranks() -> None:
    assert heads(layout(4, 2), layout(4)) == (HeadSource(0, 0, 0, 2), HeadSource(1, 0, 2, 2))
    assert plan(layout(4, 2), layout(4)).source_ranks == (0, 1)


def test_tp1_to_tp2_slices_one_rank() -> None:
    assert heads(layout(4), layout(4, 2, 0)) == (HeadSource(0, 0, 0, 2),)
    assert heads(layout(4), layout(4, 2, 1)) == (HeadSource(0, 2, 0, 2),)


@pytest.mark.parametrize(
    ("kv_heads", "target_rank", "expected"),
    [
        (8, 0, (HeadSource(0, 0, 0, 2), HeadSource(1, 0, 2, 2))),  # GQA groups of 2 per rank
        (8, 1, (HeadSource(2, 0, 0, 2), HeadSource(3, 0, 2, 2))),
        (4, 0, (HeadSource(0, 0, 0, 1), HeadSource(1, 0, 1, 1))),  # one KV head per rank
        (4, 1, (HeadSource(2, 0, 0, 1), HeadSource(3, 0, 1, 1))),
    ],
)
def test_tp4_to_tp2_respects_gqa_groups(
    kv_heads: int, target_rank: int, expected: tuple[HeadSource, ...]
) -> None:
    assert heads(layout(kv_heads, 4), layout(kv_heads, 2, target_rank)) == expected


def test_smollm2_three_heads_over_tp3() -> None:
    assert heads(layout(3, 3), layout(3)) == tuple(HeadSource(r, 0, r, 1) for r in range(3))
    assert heads(layout(3), layout(3, 3, 2)) == (HeadSource(0, 2, 0, 1),)
    refused = plan_conversion(layout(3, 3), layout(3, 2))
    assert isinstance(refused, Refusal) and refused.reason is RefuseReason.HEADS_NOT_DIVISIBLE


def test_replication_when_tp_exceeds_kv_heads() -> None:
    assert [layout(2, 4, r).local_heads() for r in range(4)] == [range(0, 1)] * 2 + [
        range(1, 2)
    ] * 2
    assert heads(layout(2, 4), layout(2)) == (HeadSource(0, 0, 0, 1), HeadSource(2, 0, 1, 1))
    assert plan(layout(2, 4), layout(2)).source_ranks == (0, 2)
    assert heads(layout(3, 6), layout(3)) == tuple(HeadSource(2 * h, 0, h, 1) for h in range(3))
    assert heads(layout(3), layout(3, 6, 5)) == (HeadSource(0, 2, 0, 1),)
    assert heads(layout(3, 3), layout(3, 6, 3)) == (HeadSource(1, 0, 0, 1),)


def test_steps_run_in_the_canonical_order_and_a_cast_is_lossy() -> None:
    source = layout(4, 2, order="HTDKL", block_size=16)
    target = layout(4, 1, order="TDHKL", dtype="bfloat16")
    kinds = [s.kind for s in plan(source, target).steps]
    assert kinds == [
        StepKind.REORDER,
        StepKind.RESHARD_HEADS,
        StepKind.REBLOCK,
        StepKind.CAST,
        StepKind.REORDER,
    ]
    assert not plan(source, target).lossless
    assert plan(source, dataclasses.replace(target, dtype="float32")).lossless


def test_identity_plans() -> None:
    assert plan(layout(4), layout(4)).identity
    odd = layout(4, order="TDHKL")
    assert plan(odd, odd).identity  # to canonical and straight back
    assert plan(layout(4, 2, 1), layout(4, 2, 1)).source_ranks == (1,)


def test_another_rank_of_the_same_tp_size_is_never_an_identity() -> None:
    """Rank 1 of TP 2 holds heads 2-3, rank 0 heads 0-1: taken byte for byte, they would be
    the wrong heads. The plan reshards, and names the rank that holds the target's heads."""
    other = plan(layout(4, 2, 1), layout(4, 2, 0))
    assert not other.identity and other.source_ranks == (0,)
    assert heads(layout(4, 2, 1), layout(4, 2, 0)) == (HeadSource(0, 0, 0, 2),)


@pytest.mark.parametrize(
    ("source", "target", "reason"),
    [
        (layout(4), layout(8), RefuseReason.SHAPE_MISMATCH),
        (layout(4), layout(4, num_layers=3), RefuseReason.SHAPE_MISMATCH),
        (layout(4), layout(4, head_dim=8), RefuseReason.SHAPE_MISMATCH),
        (layout(4), layout(4, codec_id="kivi"), RefuseReason.CODEC_UNSUPPORTED),
        (layout(4), layout(4, codec_version=2), RefuseReason.CODEC_UNSUPPORTED),
        (layout(4), layout(4, pp_size=2), RefuseReason.PIPELINE_MISMATCH),
        (layout(4, num_layers=3, pp_size=2), layout(4), RefuseReason.PIPELINE_MISMATCH),
        (layout(4, order="LKHTX"), layout(4), RefuseReason.ORDER_UNKNOWN),
        (layout(4, order="LKHT"), layout(4), RefuseReason.ORDER_UNKNOWN),
        (layout(4), layout(4, dtype="int8"), RefuseReason.DTYPE_UNSUPPORTED),
        (layout(6, 4), layout(6), RefuseReason.HEADS_NOT_DIVISIBLE),
        (layout(3), layout(3, 4), RefuseReason.HEADS_NOT_DIVISIBLE),
        (layout(4, 2, 2), layout(4), RefuseReason.INVALID_LAYOUT),
        (layout(4), layout(4, block_size=0), RefuseReason.INVALID_LAYOUT),
        (layout(4, tp=0), layout(4), RefuseReason.INVALID_LAYOUT),
    ],
)
def test_refusals(source: KVLayout, target: KVLayout, reason: RefuseReason) -> None:
    refused = plan_conversion(source, target)
    assert isinstance(refused, Refusal) and refused.reason is reason


def test_block_shape_and_bytes() -> None:
    smol = KVLayout(30, 3, 64, 16, "bfloat16", order="HTKLD", tp_size=3, tp_rank=1)
    assert smol.block_shape() == (1, 16, 2, 30, 64)
    assert smol.block_bytes() == 1 * 16 * 2 * 30 * 64 * 2


# --- a reference interpreter: runs a plan on numpy arrays --------------------------------------

TOKENS = 32


def _to(order_from: str, order_to: str, array: np.ndarray) -> np.ndarray:
    return np.transpose(array, [order_from.index(axis) for axis in order_to])


def _blocks(kv: np.ndarray, lay: KVLayout) -> list[np.ndarray]:
    """The rank's blocks of a canonical ``[L, 2, H, T, D]`` KV, in the layout's own order."""
    held = kv[:, :, list(lay.local_heads())]
    size = lay.block_size
    return [
        _to(CANONICAL_ORDER, lay.order, held[:, :, :, i : i + size]) for i in range(0, TOKENS, size)
    ]


def _run(conversion: ConversionPlan, inputs: dict[int, list[np.ndarray]]) -> list[np.ndarray]:
    source, target = conversion.source, conversion.target
    runs = {
        rank: np.concatenate(blocks, axis=source.order.index("T"))
        for rank, blocks in inputs.items()
    }
    order, size = source.order, source.block_size
    current = runs[conversion.source_ranks[0]]
    for step in conversion.steps:
        if step.kind is StepKind.REORDER:
            assert step.source_order == order
            runs = {rank: _to(order, step.target_order, run) for rank, run in runs.items()}
            current, order = _to(order, step.target_order, current), step.target_order
        elif step.kind is StepKind.RESHARD_HEADS:
            assert order == CANONICAL_ORDER
            pieces = sorted(step.heads, key=lambda h: h.target_start)
            current = np.concatenate(
                [
                    runs[h.source_rank][:, :, h.source_start : h.source_start + h.count]
                    for h in pieces
                ],
                axis=2,
            )
        elif step.kind is StepKind.REBLOCK:
            assert step.source_block_size == size
            size = step.target_block_size
        else:
            assert (step.source_dtype, step.target_dtype) == (source.dtype, target.dtype)
    assert (order, size) == (target.order, target.block_size)
    axis = order.index("T")
    return list(np.split(current, TOKENS // size, axis=axis))


def _tp(heads_: int) -> st.SearchStrategy[int]:
    return st.sampled_from(
        [t for t in (1, 2, 3, 4, 6, 8, 12) if (t <= heads_ and heads_ % t == 0) or t % heads_ == 0]
    )


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[KVLayout, KVLayout]:
    kv_heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    made = []
    for _ in range(2):
        tp = draw(_tp(kv_heads))
        made.append(
            layout(
                kv_heads,
                tp,
                draw(st.integers(0, tp - 1)),
                block_size=draw(st.sampled_from([4, 8, 16, 32])),
                order=draw(st.permutations(CANONICAL_ORDER).map("".join)),
                dtype=draw(st.sampled_from(["float32", "bfloat16"])),
            )
        )
    return made[0], made[1]


@given(layout_pairs())
@settings(max_examples=200, deadline=None)
def test_every_plan_reproduces_the_targets_own_blocks(pair: tuple[KVLayout, KVLayout]) -> None:
    source, target = pair
    kv = np.arange(2 * 2 * source.num_kv_heads * TOKENS * 4, dtype=np.float64).reshape(
        2, 2, source.num_kv_heads, TOKENS, 4
    )
    conversion = plan(source, target)
    inputs = {rank: _blocks(kv, source.rank(rank)) for rank in conversion.source_ranks}
    produced = _run(conversion, inputs)
    expected = _blocks(kv, target)
    assert len(produced) == len(expected)
    for got, want in zip(produced, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert conversion.lossless == (source.dtype == target.dtype)
