"""Moving KV between the paged pool and transformers' attention cache.

``cache_from_blocks`` gathers a request's cached blocks into a ``DynamicCache`` with one copy;
``store_blocks`` writes the new full blocks of a cache into the pool with the two-phase
protocol (allocate → write → commit; abort everything on failure, so a failed write leaves
nothing reusable) and hands them to the store bridge for write-through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import DynamicCache

from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.engine.tiering import PoolBridge
from kvstrata.identity import BlockKey
from kvstrata.runtime.blocks import BlockInfo, block_tokens


def _full_attention_layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer K/V holders (the fingerprint admits full attention only)."""
    return list(cache.layers)


def cache_from_blocks(pool: PagedKVPool, model_config: Any, block_ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model_config)
    if not block_ids:
        return cache
    kv = pool.gather(block_ids)  # [L, 2, H, T, D], one copy
    for layer_idx, layer in enumerate(_full_attention_layers(cache)):
        k = kv[layer_idx, 0].unsqueeze(0)
        v = kv[layer_idx, 1].unsqueeze(0)
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def store_blocks(
    pool: PagedKVPool,
    bridge: PoolBridge | None,
    keys: Sequence[BlockKey],
    cache: DynamicCache,
    first_block: int,
    tenant: str,
    token_ids: Sequence[int] | None = None,
) -> None:
    """Write full blocks ``first_block..`` whose KV is in ``cache`` into the pool.

    ``token_ids`` is the sequence ``keys`` were chained from: each block keeps its own tokens
    (for the store's metas and for KV events).
    """
    block_size = pool.config.block_size
    last_block = min(len(keys), cache.get_seq_length() // block_size)
    start = first_block
    while start < last_block and pool.contains(keys[start]):
        start += 1
    new_ids: list[int] = []
    try:
        for i in range(start, last_block):
            if pool.contains(keys[i]):
                break
            parent = keys[i - 1] if i > 0 else None
            info = BlockInfo(tenant, i * block_size, block_tokens(token_ids, i, block_size))
            block_id = pool.allocate(keys[i], parent, info)
            if block_id is None:
                break
            new_ids.append(block_id)
        if not new_ids:
            return
        lo, hi = start * block_size, (start + len(new_ids)) * block_size
        for layer_idx, layer in enumerate(_full_attention_layers(cache)):
            pool.write_layer(layer_idx, new_ids, layer.keys[0, :, lo:hi], layer.values[0, :, lo:hi])
    except BaseException:
        for block_id in reversed(new_ids):  # nothing half-written stays behind
            pool.abort(block_id)
        raise
    for block_id in new_ids:
        pool.commit(block_id)
    if bridge is not None:
        bridge.write_through(new_ids, keys, start, tenant, token_ids)
