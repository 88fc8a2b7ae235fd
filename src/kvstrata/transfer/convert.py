"""Executing a ``ConversionPlan`` on torch tensors (the bytes side of ``transfer.layout``).

``convert_blocks(plan, sources)`` takes, for every source TP rank the plan needs
(``plan.source_ranks``), a tensor ``[n, *plan.source.rank(r).block_shape()]``: ``n`` blocks of
that rank, consecutive in the sequence (block ``i`` of every rank holds the same tokens). It
returns ``Converted``: ``[m, *plan.target.block_shape()]`` for the plan's one target rank, and
how many trailing tokens did not fill a target block (they are dropped: the receiver computes
them, or the caller passes them again with the next run of blocks).

The steps run in the plan's order, on a ``[n, …]`` batch axis in front of the block axes:

- reorder: a permutation of the block axes;
- reshard: the target rank's heads sliced out of the source ranks and concatenated along ``H``
  as the plan's ``HeadSource`` pieces say (a replicated head is read from its first holder);
- reblock: the blocks concatenated along ``T`` and split into target blocks (any sizes: tokens
  run over block boundaries);
- cast: ``.to(dtype)`` — the only step that changes values (``plan.lossless`` is False).

Reorder, reshard and reblock only move values, so a lossless plan is bit-exact. The result may
share memory with an input when no step copies (an identity plan). ``shard_blocks`` splits
canonical full blocks (``LKHTD``, every head and layer) into one layout's TP shards — what a
TP sender holds, and the tests' way to make one.

Inputs are checked against the plan before any step runs; a mismatch raises
``ConversionError``, never a torch error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstrata.errors import ConversionError
from kvstrata.transfer.layout import (
    CANONICAL_ORDER,
    ConversionPlan,
    ConversionStep,
    KVLayout,
    StepKind,
)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout's dtype name."""
    dtype = TORCH_DTYPES.get(name)
    if dtype is None:
        raise ConversionError(f"dtype {name!r} has no torch equivalent here")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The layout dtype name of a torch dtype (``torch.float32`` → ``"float32"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise ConversionError(f"dtype {dtype} is not a KV dtype kvstrata converts")
    return name


@dataclass(frozen=True)
class Converted:
    """The target rank's blocks and the tokens left over (fewer than one target block)."""

    blocks: torch.Tensor  # [m, *plan.target.block_shape()]
    remainder_tokens: int

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])


def _permutation(current: str, wanted: str) -> list[int]:
    """Dims (batch axis first) that turn a ``[n, *current]`` tensor into ``[n, *wanted]``."""
    return [0, *(1 + current.index(axis) for axis in wanted)]


def _check_source(plan: ConversionPlan, rank: int, tensor: torch.Tensor) -> int:
    layout = plan.source.rank(rank)
    expected = layout.block_shape()
    if not isinstance(tensor, torch.Tensor):
        raise ConversionError(f"source rank {rank}: expected a tensor, got {type(tensor)}")
    if tensor.dim() != len(expected) + 1 or tuple(tensor.shape[1:]) != expected:
        raise ConversionError(
            f"source rank {rank}: shape {tuple(tensor.shape)} is not "
            f"[n, {', '.join(map(str, expected))}] ({layout.order})"
        )
    if tensor.dtype != torch_dtype(plan.source.dtype):
        raise ConversionError(
            f"source rank {rank}: dtype {tensor.dtype} but the layout says {plan.source.dtype}"
        )
    return int(tensor.shape[0])


def _validate(plan: ConversionPlan, sources: Mapping[int, torch.Tensor]) -> int:
    """The common block count ``n`` of the sources the plan needs (raises on any mismatch)."""
    if plan.source.problem() is not None or plan.target.problem() is not None:
        raise ConversionError("the plan holds an invalid layout")
    missing = [rank for rank in plan.source_ranks if rank not in sources]
    if missing:
        raise ConversionError(f"source ranks {missing} are missing (have {sorted(sources)})")
    counts = {rank: _check_source(plan, rank, sources[rank]) for rank in plan.source_ranks}
    if len(set(counts.values())) > 1:
        raise ConversionError(f"source ranks hold different block counts: {counts}")
    return next(iter(counts.values()))


def _reshard(
    step: ConversionStep, plan: ConversionPlan, held: dict[int, torch.Tensor]
) -> torch.Tensor:
    head_axis = 1 + CANONICAL_ORDER.index("H")
    pieces: list[torch.Tensor] = []
    filled = 0
    for piece in step.heads:
        if piece.target_start != filled or piece.source_rank not in held:
            raise ConversionError(f"inconsistent head pieces in the plan: {step.heads}")
        source = held[piece.source_rank]
        stop = piece.source_start + piece.count
        if piece.source_start < 0 or stop > source.shape[head_axis]:
            raise ConversionError(f"head piece {piece} is out of the source rank's heads")
        pieces.append(source.narrow(head_axis, piece.source_start, piece.count))
        filled += piece.count
    if filled != len(plan.target.local_heads()):
        raise ConversionError(f"the plan gives {filled} heads, the target holds another count")
    return torch.cat(pieces, dim=head_axis)


def _reblock(step: ConversionStep, blocks: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[n, L, K, H, Bs, D]`` → ``[m, L, K, H, Bt, D]`` and the tokens left over."""
    n, layers, pair, heads, size, dim = blocks.shape
    if size != step.source_block_size:
        raise ConversionError(f"blocks of {size} tokens, the plan says {step.source_block_size}")
    target = step.target_block_size
    total = n * size
    m, remainder = divmod(total, target)
    tokens = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, pair, heads, total, dim)
    tokens = tokens[:, :, :, : m * target]
    out = tokens.reshape(layers, pair, heads, m, target, dim).permute(3, 0, 1, 2, 4, 5)
    return out, remainder


def convert_blocks(plan: ConversionPlan, sources: Mapping[int, torch.Tensor]) -> Converted:
    """Run ``plan`` on consecutive source blocks (see the module docstring)."""
    _validate(plan, sources)
    order = plan.source.order
    held: dict[int, torch.Tensor] = {rank: sources[rank] for rank in plan.source_ranks}
    remainder = 0
    for step in plan.steps:
        if step.kind is StepKind.REORDER:
            if step.source_order != order or sorted(step.target_order) != sorted(order):
                raise ConversionError(f"reorder {step.source_order}→{step.target_order} at {order}")
            perm = _permutation(order, step.target_order)
            held = {rank: tensor.permute(*perm) for rank, tensor in held.items()}
            order = step.target_order
            continue
        if order != CANONICAL_ORDER:
            raise ConversionError(f"{step.kind.value} needs {CANONICAL_ORDER} blocks, has {order}")
        if step.kind is StepKind.RESHARD_HEADS:
            held = {plan.target.tp_rank: _reshard(step, plan, held)}
            continue
        if len(held) != 1:
            raise ConversionError(f"{step.kind.value} before the ranks were merged")
        ((rank, tensor),) = held.items()
        if step.kind is StepKind.REBLOCK:
            tensor, remainder = _reblock(step, tensor)
        elif step.kind is StepKind.CAST:
            tensor = tensor.to(torch_dtype(step.target_dtype))
        held = {rank: tensor}
    if len(held) != 1 or order != plan.target.order:
        raise ConversionError("the plan does not end in one target rank in the target order")
    (result,) = held.values()
    expected = plan.target.block_shape()
    if tuple(result.shape[1:]) != expected or result.dtype != torch_dtype(plan.target.dtype):
        raise ConversionError(
            f"the plan produced {tuple(result.shape)} {result.dtype}, "
            f"the target layout is [m, {expected}] {plan.target.dtype}"
        )
    return Converted(blocks=result.contiguous(), remainder_tokens=remainder)


def shard_blocks(blocks: torch.Tensor, layout: KVLayout) -> dict[int, torch.Tensor]:
    """Split canonical full blocks ``[n, L, 2, H, B, D]`` (every layer and KV head of the model,
    ``LKHTD``) into ``layout``'s TP shards: ``{rank: [n, *layout.rank(rank).block_shape()]}``
    for its pipeline stage, in its axis order. Values are not changed (no cast)."""
    problem = layout.problem()
    if problem is not None:
        raise ConversionError(f"invalid layout: {problem.detail}")
    full = (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 6 or tuple(blocks.shape[1:]) != full:
        shape = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks)
        raise ConversionError(f"blocks {shape} are not [n, {', '.join(map(str, full))}]")
    if blocks.dtype != torch_dtype(layout.dtype):
        raise ConversionError(f"blocks are {blocks.dtype}, the layout says {layout.dtype}")
    layers = layout.local_layers()
    staged = blocks[:, layers.start : layers.stop]
    perm = _permutation(CANONICAL_ORDER, layout.order)
    shards: dict[int, torch.Tensor] = {}
    for rank in range(layout.tp_size):
        heads = layout.rank(rank).local_heads()
        shard = staged[:, :, :, heads.start : heads.stop]
        shards[rank] = shard.permute(*perm).contiguous()
    return shards
