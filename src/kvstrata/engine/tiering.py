"""The reference engine's side of the store: its device pool's tensors ↔ the runtime bridge.

Everything that is not about torch tensors (metas, write policies, the break-even test,
verified loads) is ``kvstrata.runtime.bridge.StoreBridge``; this adapter only moves bytes
between the pool's ``[L, 2, H, B, D]`` block views and the memoryviews the bridge takes:

- it is a pool listener: when the pool evicts a block the store wants, its bytes are staged
  and demoted (the store's first level decides whether to keep it);
- ``write_through`` copies freshly committed blocks when the first level is write-through;
- ``promote`` loads the longest worthwhile prefix beyond the device hit into the pool;
- ``prefetch`` (when the store has a shared level below a local one and the engine asks for
  it) hands a queued request's prefix to a ``store.prefetch.Prefetcher``, which copies what
  only the shared level holds into the local one on its own thread. The pool is the step
  thread's, so the prefetch thread asks this bridge's mirror of the pool's committed keys
  (kept by the listener calls, under a lock of its own) what the pool holds.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.identity import BlockKey
from kvstrata.objects import Representation
from kvstrata.runtime.blocks import BlockInfo, EvictedBlock, ResidentBlock, block_tokens
from kvstrata.runtime.bridge import LoadOutcome, RecomputeEstimate, StoreBridge
from kvstrata.store.levels import Located, RequestScope
from kvstrata.store.prefetch import Prefetcher, can_prefetch
from kvstrata.store.tiered import TieredStore

BLOCK_LAYOUT = "kvstrata.block.v1[L,2,H,B,D]"


@dataclass
class Promotion:
    block_ids: list[int]
    tokens_by_tier: dict[str, int]


class PoolBridge:
    """Listens to the pool (subscribe it first, so demotion runs before event listeners)."""

    def __init__(
        self,
        store: TieredStore,
        pool: PagedKVPool,
        *,
        model_id: str,
        recompute_estimate: RecomputeEstimate,
        prefetch: bool = True,
    ) -> None:
        """``prefetch``: prefetch queued requests' prefixes from a shared level (only when the
        store has one below a local level; started by ``start_prefetch``)."""
        self.pool = pool
        c = pool.config
        self.shape = (c.num_layers, 2, c.num_kv_heads, c.block_size, c.head_dim)
        representation = Representation(
            dtype=str(c.dtype).removeprefix("torch."),
            layout=BLOCK_LAYOUT,
            block_size=c.block_size,
            shape=self.shape,
        )
        self.bridge = StoreBridge(
            store,
            representation=representation,
            block_bytes=c.bytes_per_block,
            model_id=model_id,
            recompute_estimate=recompute_estimate,
        )
        self._staging = torch.empty(self.shape, dtype=c.dtype)
        self._resident_lock = threading.Lock()
        self._resident: set[BlockKey] = set()  # the pool's committed keys (prefetch only)
        self.prefetcher: Prefetcher | None = None
        if prefetch and can_prefetch(store):
            self.prefetcher = Prefetcher(store, skip=self._pool_holds)

    @property
    def store(self) -> TieredStore:
        return self.bridge.store

    def _staged(self, block_id: int) -> memoryview:
        self._staging.copy_(self.pool.block_view(block_id))
        return memoryview(self._staging.view(torch.uint8).numpy().reshape(-1).data)

    # ---- PoolListener -----------------------------------------------------------------------
    def block_committed(self, block: ResidentBlock) -> None:
        """Commits are written through by ``write_through`` (it knows the block ids)."""
        if self.prefetcher is not None:
            with self._resident_lock:
                self._resident.add(block.key)

    def block_evicted(self, block: EvictedBlock) -> None:
        if self.prefetcher is not None:
            with self._resident_lock:
                self._resident.discard(block.key)
        if self.bridge.wants_demotion(block):
            self.bridge.demote(block, self._staged(block.block_id))

    # ---- device → store ---------------------------------------------------------------------
    def write_through(
        self,
        block_ids: Sequence[int],
        keys: Sequence[BlockKey],
        first: int,
        tenant: str,
        token_ids: Sequence[int] | None = None,
        *,
        request_id: str | None = None,
    ) -> None:
        """Copy freshly committed blocks ``keys[first:first+len(block_ids)]`` into the store
        (``token_ids``: the sequence the keys were chained from, recorded in each meta;
        ``request_id``: the request that computed them, for a canary level's share)."""
        if not self.bridge.wants_write_through():
            return
        size = self.pool.config.block_size
        for offset, block_id in enumerate(block_ids):
            i = first + offset
            parent = keys[i - 1] if i > 0 else None
            info = BlockInfo(tenant, i * size, block_tokens(token_ids, i, size))
            self.bridge.put(keys[i], parent, info, self._staged(block_id), request_id=request_id)

    # ---- prefetch (submitted from any thread, run on the prefetcher's) -----------------------
    def _pool_holds(self, key: BlockKey) -> bool:
        with self._resident_lock:
            return key in self._resident

    def start_prefetch(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.start()

    def stop_prefetch(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

    def prefetch(
        self, request_id: str, keys: Callable[[], Sequence[BlockKey]], scope: RequestScope
    ) -> bool:
        """Start fetching a queued request's prefix (``keys``, computed on the prefetch
        thread) into the store's local level; False when nothing was queued."""
        if self.prefetcher is None:
            return False
        return self.prefetcher.submit(request_id, keys, scope)

    def prefetch_done(self, request_id: str) -> None:
        """The request was admitted (or left the queue): stop prefetching for it."""
        if self.prefetcher is not None:
            self.prefetcher.cancel(request_id)

    # ---- store → device ---------------------------------------------------------------------
    def hold(self, keys: Sequence[BlockKey], scope: RequestScope) -> list[Located]:
        """Hold what the store's local levels have of ``keys`` against eviction until
        ``release`` (``TieredStore.hold_prefix``): an admission's promotions load them."""
        return self.store.hold_prefix(keys, scope)

    def release(self, held: Sequence[Located]) -> None:
        self.store.release(held)

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
        located = self.bridge.plan_promotion(keys, first, scope)
        size = self.pool.config.block_size
        dtype = self.pool.config.dtype
        unloaded = ""  # why the plan ended early
        try:
            for offset, loc in enumerate(located):
                i = first + offset
                parent = keys[i - 1] if i > 0 else None
                tokens = block_tokens(token_ids, i, size)
                info = BlockInfo(scope.tenant, i * size, tokens, created_at=loc.meta.created_at)
                block_id = self.pool.allocate(loc.key, parent, info)
                if block_id is None:
                    unloaded = "pool_full"
                    break

                def write(payload: memoryview, block_id: int = block_id) -> None:
                    with warnings.catch_warnings():  # read-only buffer: we only read from it
                        warnings.simplefilter("ignore", UserWarning)
                        source = torch.frombuffer(payload, dtype=dtype)
                    self.pool.write_block(block_id, source.view(self.shape))

                try:
                    outcome = self.bridge.load_verified(loc, scope.tenant, write)
                except BaseException:
                    self.pool.abort(block_id)
                    raise
                if outcome is not LoadOutcome.LOADED:
                    self.pool.abort(block_id)
                    unloaded = outcome.value
                    break
                self.pool.commit(block_id)
                self.pool.acquire([block_id])
                result.block_ids.append(block_id)
                name = self.store.levels[loc.level].name
                result.tokens_by_tier[name] = result.tokens_by_tier.get(name, 0) + size
        except BaseException:
            self.pool.release(result.block_ids)  # the caller never learns of them
            raise
        finally:
            if located:
                self.bridge.finish_promotion(located)
        if unloaded:
            short = len(located) - len(result.block_ids)
            self.store.metrics.promotion_unloaded.labels(reason=unloaded).inc(short)
        return result
