"""The engine's side of the tiered store: demotion, write-through, promotion, break-even.

- Every pool block carries ``BlockInfo`` (tenant, first token position, its tokens). The tokens
  travel into every stored object's meta so that KV events from any tier can carry them (a
  fleet index hashes tokens itself); they are freed with the block. When the pool evicts
  a block, ``demote`` copies it into the store (the store's first level decides whether to
  keep it: a selective level wants ``selective_min_uses`` uses first).
- With a write-through first level, ``write_through`` copies blocks as soon as they commit.
- ``promote`` loads the longest prefix the store holds beyond the device hit into the pool —
  unless the break-even test says recomputing is cheaper: fewer reusable tokens than the
  tier's ``min_reusable_tokens``, or a fetch estimated (from measured tier throughput) to take
  longer than recomputing those tokens (cost model).
- A loaded object must carry exactly this engine's representation; anything else is
  incompatible and recomputed (invariant 7), and counted.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstrata.engine.kv_pool import EvictedBlock, PagedKVPool
from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.store.config import WritePolicy
from kvstrata.store.levels import Located, RequestScope
from kvstrata.store.tiered import TieredStore
from kvstrata.telemetry import KvMetrics

RecomputeEstimate = Callable[[int, int], float]
"""Seconds to prefill ``n`` tokens at context offset ``c`` on this engine."""

BLOCK_LAYOUT = "kvstrata.block.v1[L,2,H,B,D]"
logger = logging.getLogger("kvstrata.engine")


@dataclass(frozen=True)
class BlockInfo:
    tenant: str
    position: int
    tokens: tuple[int, ...] | None = None


def block_tokens(token_ids: Sequence[int] | None, index: int, size: int) -> tuple[int, ...] | None:
    """Tokens of full block ``index`` of ``token_ids`` (None when the caller has none)."""
    if token_ids is None:
        return None
    tokens = tuple(int(t) for t in token_ids[index * size : (index + 1) * size])
    return tokens if len(tokens) == size else None


@dataclass
class Promotion:
    block_ids: list[int]
    tokens_by_tier: dict[str, int]


class StoreBridge:
    def __init__(
        self,
        store: TieredStore,
        pool: PagedKVPool,
        *,
        model_id: str,
        metrics: KvMetrics,
        recompute_estimate: RecomputeEstimate,
    ) -> None:
        self.store = store
        self.pool = pool
        self.model_id = model_id
        self.metrics = metrics
        self.recompute_estimate = recompute_estimate
        c = pool.config
        self.shape = (c.num_layers, 2, c.num_kv_heads, c.block_size, c.head_dim)
        self.representation = Representation(
            dtype=str(c.dtype).removeprefix("torch."),
            layout=BLOCK_LAYOUT,
            block_size=c.block_size,
            shape=self.shape,
        )
        self.block_bytes = c.bytes_per_block
        self._staging = torch.empty(self.shape, dtype=c.dtype)
        pool.on_evict = self.demote

    # ---- device → store ---------------------------------------------------------------------
    def _put(
        self,
        block_id: int,
        key: BlockKey,
        parent: BlockKey | None,
        info: BlockInfo,
        uses: int = 1,
    ) -> None:
        self._staging.copy_(self.pool.block_view(block_id))
        payload = self._staging.view(torch.uint8).numpy().reshape(-1)
        meta = KVObjectMeta(
            key=key,
            parent=parent,
            tenant=info.tenant,
            representation=self.representation,
            size=self.block_bytes,
            digest=payload_digest(payload.data),
            created_at=time.time(),
            position=info.position,
            recompute_s=self.recompute_estimate(self.pool.config.block_size, info.position),
            model=self.model_id,
            tokens=info.tokens,
        )

        def fill(buffer: memoryview) -> None:
            buffer[:] = payload.data

        scope = RequestScope(tenant=info.tenant, model=self.model_id)
        self.store.put(meta, fill, scope, uses=uses)

    def demote(self, evicted: EvictedBlock) -> None:
        """The pool is evicting a block: keep it in the store unless it is there already or,
        for a selective first level, has not been used often enough to be worth it."""
        if not isinstance(evicted.info, BlockInfo) or not self.store.levels:
            return
        top = self.store.levels[0]
        if top.tier.contains(evicted.key):
            return
        if (
            top.config.write_policy is WritePolicy.SELECTIVE
            and evicted.uses < top.config.selective_min_uses
        ):
            self.store.metrics.evictions.labels(tier="device", outcome="dropped_low_value").inc()
            return
        try:
            self._put(evicted.block_id, evicted.key, evicted.parent_key, evicted.info, evicted.uses)
        except KvstrataError:
            # Demotion is best effort: the block is dropped, the pool must still free it.
            logger.exception("demotion of an evicted device block failed")
            self.store.metrics.evictions.labels(tier="device", outcome="demotion_failed").inc()
            return
        self.store.metrics.evictions.labels(tier="device", outcome="demoted").inc()

    def write_through(
        self,
        block_ids: Sequence[int],
        keys: Sequence[BlockKey],
        first: int,
        tenant: str,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Copy freshly committed blocks ``keys[first:first+len(block_ids)]`` into the store
        (``token_ids``: the sequence the keys were chained from, recorded in each meta)."""
        if not self.store.levels:
            return
        top = self.store.levels[0]
        if top.config.write_policy is not WritePolicy.WRITE_THROUGH:
            return
        size = self.pool.config.block_size
        for offset, block_id in enumerate(block_ids):
            i = first + offset
            parent = keys[i - 1] if i > 0 else None
            info = BlockInfo(tenant, i * size, block_tokens(token_ids, i, size))
            self._put(block_id, keys[i], parent, info)

    # ---- store → device ---------------------------------------------------------------------
    def promote(
        self,
        keys: Sequence[BlockKey],
        first: int,
        scope: RequestScope,
        token_ids: Sequence[int] | None = None,
    ) -> Promotion:
        """Load blocks ``keys[first:]`` from the store into the pool (committed, acquired);
        ``token_ids`` (the prompt the keys came from) become the pool blocks' tokens."""
        result = Promotion(block_ids=[], tokens_by_tier={})
        located = self.store.lookup(keys[first:], scope)
        if not located:
            return result
        size = self.pool.config.block_size
        tokens = len(located) * size
        min_tokens = max(
            self.store.levels[loc.level].config.rollout.min_reusable_tokens for loc in located
        )
        if tokens < min_tokens:
            self.store.metrics.recompute_decisions.labels(reason="below_min_tokens").inc()
            return result
        fetch_s = self.store.estimated_fetch_s(located)
        recompute_s = self.recompute_estimate(tokens, first * size)
        if fetch_s > recompute_s:
            self.store.metrics.recompute_decisions.labels(reason="fetch_slower").inc()
            return result
        try:
            for offset, loc in enumerate(located):
                i = first + offset
                parent = keys[i - 1] if i > 0 else None
                info = BlockInfo(scope.tenant, i * size, block_tokens(token_ids, i, size))
                block_id = self.pool.allocate(loc.key, parent, info)
                if block_id is None:
                    break
                try:
                    loaded = self._load_into(block_id, loc, scope.tenant)
                except BaseException:
                    self.pool.abort(block_id)
                    raise
                if not loaded:
                    self.pool.abort(block_id)
                    break
                self.pool.commit(block_id)
                self.pool.acquire([block_id])
                result.block_ids.append(block_id)
                name = self.store.levels[loc.level].name
                result.tokens_by_tier[name] = result.tokens_by_tier.get(name, 0) + size
        except BaseException:
            self.pool.release(result.block_ids)  # the caller never learns of them
            raise
        return result

    def _load_into(self, block_id: int, loc: Located, tenant: str) -> bool:
        with self.store.load(loc, tenant) as lease:
            if lease is None:
                return False
            if (
                lease.meta.representation != self.representation
                or lease.meta.size != self.block_bytes
            ):
                name = self.store.levels[loc.level].name
                self.store.metrics.invalid.labels(tier=name, reason="incompatible").inc()
                return False
            with warnings.catch_warnings():  # read-only buffer: we only read from it
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(lease.buffer, dtype=self.pool.config.dtype)
            self.pool.write_block(block_id, source.view(self.shape))
        return True
