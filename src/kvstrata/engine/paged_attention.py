"""Attention over the paged KV pool for a packed batch of sequences (one forward per step).

The engine runs transformers' own model code with one change: the attention function.
``PAGED_ATTENTION`` is registered with transformers' ``AttentionInterface``; a forward packs
every scheduled sequence's new tokens into one row (``input_ids [1, T]``, explicit
``position_ids``) and passes a ``BatchLayout`` as the ``kvstrata_batch`` keyword, which
transformers hands through to the attention call of every layer. There, per layer:

1. the new tokens' K and V (after rotary embedding) are written into the pool at their slots
   (``slot = block_table[pos // B] * B + pos % B``), one ``index_copy_`` for the whole batch;
2. each sequence attends over its own context: its blocks are gathered from the pool (one
   ``index_select``; none when the sequence has no past) and torch's
   ``scaled_dot_product_attention`` runs with a causal mask aligned to the context's end.

Layer listeners (``BatchLayout.layer_listeners``, for prefill-for-transfer requests): right
after layer ``l`` has written this step's K/V, each ``(listener, block_ids)`` pair is called as
``listener(l, block_ids)`` with the pool blocks that sequence wrote this step, in layer order,
so a sender can ship layer ``l``'s blocks while layers ``l+1…`` compute. A listener runs on the
step thread in the middle of the forward and must only enqueue (on CUDA the writes are queued
on the current stream: read them in stream order, e.g. ``non_blocking`` copies and an event).
With no listener the loop is over an empty tuple: nothing else is paid.

Without a ``kvstrata_batch`` argument the function is transformers' SDPA, so the model stays
usable for plain forwards (a fresh-prefill reference). The per-sequence computation is the
same SDPA call a request running alone makes, on the same
K/V values, so batching changes no attention result; only the packed GEMMs of the linear layers
see other sequences' rows, which leaves each row's values equal up to float summation order.

Why not transformers' continuous batching (``generate_batch`` / ``ContinuousBatchingManager``
with ``PagedAttentionCache``): it owns its own scheduler, block allocator and cache, with no
chained content keys, tiers or tenant namespaces; the pool here is the device tier of a
storage hierarchy and must stay the one owner of its blocks. See docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PAGED_ATTENTION = "kvstrata_paged"
BATCH_KWARG = "kvstrata_batch"

LayerListener = Callable[[int, tuple[int, ...]], None]
"""``on_layer(layer, block_ids)``: layer ``layer`` has written its K/V into ``block_ids``,
the blocks this step filled, in order. A block is named in the step that completes it, never
while a later step still has rows of it to write (a chunk that ends mid-block names that block
in the next step), except the sequence's partial last block, named by the step that computes
its last token: what a listener copies when a block is named is that block's final content."""


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a packed step."""

    start: int  # first row of this sequence in the packed batch
    length: int  # new tokens computed this step
    context: int  # tokens attended to (past + new)
    blocks: torch.Tensor  # pool block ids covering ``context`` tokens (long)
    mask: torch.Tensor | None = None  # ``causal_mask(length, context)`` when both exceed 1

    @classmethod
    def make(cls, start: int, length: int, context: int, blocks: torch.Tensor) -> SeqSlice:
        """The slice, with its mask built once for every layer of the step."""
        needs_mask = 1 < length < context
        mask = causal_mask(length, context, blocks.device) if needs_mask else None
        return cls(start, length, context, blocks, mask)


@dataclass(frozen=True)
class DecodeBatch:
    """Every sequence of the step that computes one token, attended to in one batch.

    Cascade layout: sequences are grouped by their first block; the blocks every table of a
    group starts with (``groups[i][1]``, full blocks of every context) are gathered once for
    the group, and each sequence's remaining blocks (``own``, padded to the longest) in one
    gather for the batch. Decoding requests that share a cached prefix read it once per layer,
    not once per request. ``rows`` are ordered group by group.
    """

    rows: torch.Tensor  # [S] packed row of each sequence's token (long)
    groups: tuple[tuple[int, torch.Tensor], ...]  # (sequences, shared block ids) per group
    own: torch.Tensor  # [S * w] the rest of each table, padded to w blocks (long)
    own_valid: torch.Tensor  # [1, S, 1, w * B] bool: an own position inside the context

    @classmethod
    def make(
        cls,
        rows: list[int],
        tables: list[list[int]],
        contexts: list[int],
        block_size: int,
        device: torch.device | str,
    ) -> DecodeBatch:
        by_first: dict[int, list[int]] = {}
        for i, table in enumerate(tables):
            by_first.setdefault(table[0], []).append(i)
        order: list[int] = []
        groups: list[tuple[int, torch.Tensor]] = []
        rests: list[list[int]] = []
        own_len: list[int] = []
        for members in by_first.values():
            # shared: full blocks of every member's context; each keeps one own block at least
            full = min(min(contexts[i] // block_size, len(tables[i]) - 1) for i in members)
            first = tables[members[0]]
            shared = 0
            while shared < full and all(tables[i][shared] == first[shared] for i in members):
                shared += 1
            groups.append((len(members), torch.tensor(first[:shared], dtype=torch.long)))
            for i in members:
                order.append(i)
                rests.append(tables[i][shared:])
                own_len.append(contexts[i] - shared * block_size)
        width = max(len(rest) for rest in rests)
        padded = [rest + [rest[-1]] * (width - len(rest)) for rest in rests]
        valid = torch.arange(width * block_size).unsqueeze(0) < torch.tensor(own_len).unsqueeze(1)
        return cls(
            rows=torch.tensor([rows[i] for i in order], dtype=torch.long, device=device),
            groups=tuple((n, blocks.to(device)) for n, blocks in groups),
            own=torch.tensor(padded, dtype=torch.long, device=device).reshape(-1),
            own_valid=valid.view(1, len(order), 1, -1).to(device),
        )


@dataclass(frozen=True)
class BatchLayout:
    kv: torch.Tensor  # the pool's ``[L, 2, H, N, B, D]`` tensor
    slots: torch.Tensor  # [T] flat pool slot of every new token (long)
    seqs: tuple[SeqSlice, ...]  # sequences computing more than one token
    decode: DecodeBatch | None = None
    layer_listeners: tuple[tuple[LayerListener, tuple[int, ...]], ...] = ()


def causal_mask(length: int, context: int, device: torch.device) -> torch.Tensor:
    """Row i (new token at position context - length + i) sees keys 0..context - length + i."""
    rows = torch.arange(length, device=device).unsqueeze(1) + (context - length)
    return torch.arange(context, device=device).unsqueeze(0) <= rows


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query ``[1, Hq, T, D]``, key/value ``[1, Hkv, T, D]`` → ``[1, T, Hq, D]``."""
    layout: BatchLayout | None = kwargs.pop(BATCH_KWARG, None)
    if layout is None:  # a plain forward of the same model (no pool): transformers' SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    pool = layout.kv[layer]  # [2, H, N, B, D]
    _, heads, blocks, block_size, head_dim = pool.shape
    flat = pool.view(2, heads, blocks * block_size, head_dim)
    flat[0].index_copy_(1, layout.slots, key[0].to(pool.dtype))
    flat[1].index_copy_(1, layout.slots, value[0].to(pool.dtype))
    for listener, block_ids in layout.layer_listeners:
        listener(layer, block_ids)
    out = torch.empty(
        (1, query.shape[2], query.shape[1], query.shape[3]), dtype=query.dtype, device=query.device
    )
    if layout.decode is not None:
        out[0, layout.decode.rows] = _decode_attention(pool, query, layout.decode, scaling)
    for seq in layout.seqs:
        rows = slice(seq.start, seq.start + seq.length)
        q = query[:, :, rows]
        if seq.context == seq.length:  # no past: attend to this step's own keys
            k, v = key[:, :, rows], value[:, :, rows]
            mask = None
            causal = seq.length > 1
        else:
            picked = pool.index_select(2, seq.blocks)  # [2, H, n, B, D]
            both = picked.view(2, 1, heads, -1, head_dim)[:, :, :, : seq.context]
            k, v = both[0].to(query.dtype), both[1].to(query.dtype)
            causal = False
            mask = seq.mask
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True
        )
        out[0, rows] = attended[0].transpose(0, 1)
    return out, None


def _decode_attention(
    pool: torch.Tensor, query: torch.Tensor, decode: DecodeBatch, scaling: float | None
) -> torch.Tensor:
    """One-token queries of S sequences over their contexts → ``[S, Hq, D]``.

    Softmax attention in two parts merged exactly (the log-sum-exp identity): each group's
    shared blocks against all of the group's queries at once (one matmul with
    members × group-size rows), and every sequence's own blocks (padded, masked to -inf) in
    one batched matmul. Work is in ``[H, S, ...]`` order, the gathered layout.
    """
    heads, head_dim = pool.shape[1], pool.shape[4]
    count = decode.rows.numel()
    q_heads = query.shape[1]
    group = q_heads // heads
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query[0, :, decode.rows].view(heads, group, count, head_dim).transpose(1, 2)
    q = q * scale  # [H, S, g, D]
    own = pool.index_select(2, decode.own).view(2, heads, count, -1, head_dim).to(q.dtype)
    own_scores = torch.matmul(q, own[0].transpose(-1, -2))  # [H, S, g, T_own]
    own_scores = own_scores.masked_fill(~decode.own_valid, float("-inf"))
    top = own_scores.amax(-1, keepdim=True)
    tops, sums, outs = [], [], []
    start = 0
    for members, blocks in decode.groups:
        rows = slice(start, start + members)
        start += members
        if blocks.numel() == 0:
            tops.append(torch.full_like(top[:, rows], float("-inf")))
            sums.append(torch.zeros_like(top[:, rows]))
            outs.append(torch.zeros_like(q[:, rows]))
            continue
        kv = pool.index_select(2, blocks).view(2, heads, -1, head_dim).to(q.dtype)
        flat = q[:, rows].reshape(heads, members * group, head_dim)
        scores = torch.matmul(flat, kv[0].transpose(-1, -2)).view(heads, members, group, -1)
        peak = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - peak)
        tops.append(peak)
        sums.append(weights.sum(-1, keepdim=True))
        out = torch.matmul(weights.view(heads, members * group, -1), kv[1])
        outs.append(out.view(heads, members, group, head_dim))
    shared_top, shared_sum, shared_out = torch.cat(tops, 1), torch.cat(sums, 1), torch.cat(outs, 1)
    top = torch.maximum(top, shared_top)
    own_w = torch.exp(own_scores - top)
    rescale = torch.exp(shared_top - top)  # 0 where a group shares nothing
    total = shared_sum * rescale + own_w.sum(-1, keepdim=True)
    attended = (shared_out * rescale + torch.matmul(own_w, own[1])) / total
    return attended.permute(1, 0, 2, 3).reshape(count, q_heads, head_dim)


AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Route every attention layer of ``model`` through ``paged_attention_forward``."""
    config: Any = model.config
    config._attn_implementation = PAGED_ATTENTION
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and sub_config is not config:
            sub_config._attn_implementation = PAGED_ATTENTION
