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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PAGED_ATTENTION = "kvstrata_paged"
BATCH_KWARG = "kvstrata_batch"


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
class BatchLayout:
    kv: torch.Tensor  # the pool's ``[L, 2, H, N, B, D]`` tensor
    slots: torch.Tensor  # [T] flat pool slot of every new token (long)
    seqs: tuple[SeqSlice, ...]


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
    out = torch.empty(
        (1, query.shape[2], query.shape[1], query.shape[3]), dtype=query.dtype, device=query.device
    )
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


AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Route every attention layer of ``model`` through ``paged_attention_forward``."""
    config: Any = model.config
    config._attn_implementation = PAGED_ATTENTION
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if sub_config is not None and sub_config is not config:
            sub_config._attn_implementation = PAGED_ATTENTION
