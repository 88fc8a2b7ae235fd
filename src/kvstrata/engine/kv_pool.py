"""The paged KV pool: the device tier of the reference engine.

Layout: one tensor ``kv[L, 2, H, N, B, D]`` (layers, K/V, KV heads, blocks, block size, head
dim) on CUDA when available, else on the CPU. Heads outside blocks let a request's blocks be
gathered with one ``index_select`` straight into the ``[H, tokens, D]`` shape attention wants.

Bookkeeping (pure Python, no I/O):
- a block is PENDING after ``allocate`` (invisible to lookup, not evictable) and becomes
  visible on ``commit``; ``abort`` frees it, so a failed write leaves nothing behind;
- a running sequence computes into SCRATCH blocks (``allocate_scratch``: no key yet, private,
  never evicted); once a scratch block is full, ``publish`` gives it its key and commits it
  (the caller keeps its reference), or ``free_scratch`` drops it;
- committed blocks are found by their chained ``BlockKey``; ``acquire`` / ``release`` count
  readers, and a referenced block is never evicted;
- eviction takes the least recently used *leaf* (no cached children, no readers), so a
  block is never evicted before its descendants and the pool stays prefix-closed;
- listeners (given at construction or with ``subscribe``; ``kvstrata.runtime.blocks.
  PoolListener``) hear every commit and every eviction, in subscription order, while an
  evicted block's bytes are still in place: demotion into the store and KV events are both
  listeners. With none the pool pays nothing. ``committed_blocks`` lists what is resident,
  parents first;
- ``delete(keys)`` (a deletion request) removes committed blocks and all their descendants:
  listeners hear each one as evicted with reason ``DELETED`` (no demotion keeps it); a free
  block is freed at once, one a running sequence reads is UNPUBLISHED — out of the index, so
  no request can match it or build on it — and freed when its last reader releases it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from kvstrata.errors import PoolStateError
from kvstrata.identity import BlockKey
from kvstrata.runtime.blocks import DELETED, EVICTED, EvictedBlock, PoolListener, ResidentBlock
from kvstrata.telemetry import KvMetrics


@dataclass(frozen=True)
class PoolConfig:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elem


class BlockState(Enum):
    FREE = 0
    PENDING = 1
    COMMITTED = 2
    SCRATCH = 3
    UNPUBLISHED = 4  # deleted while read: invisible, freed at the last release


@dataclass(frozen=True)
class PoolDeletion:
    """What ``PagedKVPool.delete`` did: blocks freed now, blocks freed at their release."""

    removed: list[BlockKey]
    held: list[BlockKey]


@dataclass
class _Block:
    state: BlockState = BlockState.FREE
    key: BlockKey | None = None
    parent: int | None = None  # block id of the parent block when it is cached here
    children: int = 0
    refs: int = 0
    last_used: int = 0
    uses: int = 0  # commits + acquires: the evidence a selective lower tier asks for
    info: object = None  # the owner's per-block data (tenant, position), opaque here


class PagedKVPool:
    """Fixed-size pool of KV blocks addressed by chained block keys."""

    def __init__(
        self,
        config: PoolConfig,
        metrics: KvMetrics | None = None,
        listeners: Sequence[PoolListener] = (),
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._listeners: list[PoolListener] = list(listeners)
        shape = (
            config.num_layers,
            2,
            config.num_kv_heads,
            config.num_blocks,
            config.block_size,
            config.head_dim,
        )
        self.kv = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self._blocks = [_Block() for _ in range(config.num_blocks)]
        self._free = list(range(config.num_blocks - 1, -1, -1))
        self._by_key: dict[BlockKey, int] = {}
        self._pending: dict[BlockKey, int] = {}
        self._evictable: list[tuple[int, int]] = []  # heap of (last_used, block id), lazy
        self._children: dict[int, set[int]] = {}  # committed parent id → committed child ids
        self._held = 0  # committed blocks with readers
        self._scratch = 0
        self._clock = 0
        self.evictions = 0
        self._publish()

    def subscribe(self, listener: PoolListener) -> None:
        """Hear every later commit and eviction (after the listeners already subscribed)."""
        self._listeners.append(listener)

    # ---- lookup and readers -------------------------------------------------------------
    def lookup_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """Block ids of the longest prefix of ``keys`` whose blocks are all committed here."""
        found: list[int] = []
        for key in keys:
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def contains(self, key: BlockKey) -> bool:
        return key in self._by_key

    def acquire(self, block_ids: Sequence[int]) -> None:
        self._clock += 1
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.state is not BlockState.COMMITTED:
                raise PoolStateError(f"acquire of block {block_id} in state {block.state.name}")
            if block.refs == 0:
                self._held += 1
            block.refs += 1
            block.uses += 1
            block.last_used = self._clock

    def release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.refs <= 0:
                raise PoolStateError(f"release of unreferenced block {block_id}")
            block.refs -= 1
            if block.refs == 0:
                self._held -= 1
                if block.state is BlockState.UNPUBLISHED:
                    self._free_block(block_id)
                    self._publish()
                    continue
            self._maybe_evictable(block_id)

    # ---- writes -------------------------------------------------------------------------
    def allocate(
        self, key: BlockKey, parent_key: BlockKey | None, info: object = None
    ) -> int | None:
        """Reserve a PENDING block for ``key``; None when no block is free or evictable.

        ``parent_key`` must be cached here, committed or pending (None for the first block of
        a chain): the pool never holds a block whose parent it lacks. Children are committed
        after their parents.
        """
        if key in self._by_key or key in self._pending:
            raise PoolStateError("allocate of a key that is already cached")
        parent_id = None
        if parent_key is not None:
            parent_id = self._by_key.get(parent_key, self._pending.get(parent_key))
            if parent_id is None:
                raise PoolStateError("allocate of a block whose parent is not cached")
        if not self._free and not self._evict_one(protect=parent_id):
            return None
        block_id = self._free.pop()
        self._blocks[block_id] = _Block(
            state=BlockState.PENDING, key=key, parent=parent_id, uses=1, info=info
        )
        if parent_id is not None:
            self._blocks[parent_id].children += 1
        self._pending[key] = block_id
        return block_id

    def commit(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.state is not BlockState.PENDING or block.key is None:
            raise PoolStateError(f"commit of block {block_id} in state {block.state.name}")
        if (
            block.parent is not None
            and self._blocks[block.parent].state is not BlockState.COMMITTED
        ):
            raise PoolStateError("commit of a block before its parent")
        del self._pending[block.key]
        self._committed(block_id)

    def _committed(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.key is not None
        block.state = BlockState.COMMITTED
        self._clock += 1
        block.last_used = self._clock
        self._by_key[block.key] = block_id
        if block.parent is not None:
            self._children.setdefault(block.parent, set()).add(block_id)
        self._maybe_evictable(block_id)
        self._publish()
        if self._listeners:
            resident = self._resident(block)
            for listener in self._listeners:
                listener.block_committed(resident)

    # ---- scratch blocks of running sequences --------------------------------------------
    def allocate_scratch(self) -> int | None:
        """A private block for a running sequence's KV (evicts an unreferenced leaf when the
        pool is full); None when every block is in use."""
        if not self._free and not self._evict_one(protect=None):
            return None
        block_id = self._free.pop()
        self._blocks[block_id] = _Block(state=BlockState.SCRATCH)
        self._scratch += 1
        self._publish()
        return block_id

    def publish(
        self, block_id: int, key: BlockKey, parent_key: BlockKey | None, info: object = None
    ) -> bool:
        """Commit a filled scratch block under ``key``; the caller keeps one reference.

        False (the block stays scratch) when ``key`` is cached already or ``parent_key`` is
        not committed here: the pool stays prefix-closed and holds each key once.
        """
        block = self._blocks[block_id]
        if block.state is not BlockState.SCRATCH:
            raise PoolStateError(f"publish of block {block_id} in state {block.state.name}")
        if key in self._by_key or key in self._pending:
            return False
        parent_id = None
        if parent_key is not None:
            parent_id = self._by_key.get(parent_key)
            if parent_id is None:
                return False
            self._blocks[parent_id].children += 1
        self._scratch -= 1
        self._held += 1
        block.key, block.parent, block.info = key, parent_id, info
        block.refs, block.uses = 1, 1
        self._committed(block_id)
        return True

    def free_scratch(self, block_id: int) -> None:
        if self._blocks[block_id].state is not BlockState.SCRATCH:
            raise PoolStateError(f"free_scratch of block {block_id} that is not scratch")
        self._scratch -= 1
        self._free_block(block_id)
        self._publish()

    def copy_block(self, source: int, target: int) -> None:
        """Copy a block's KV into a scratch block (copy-on-write of a shared tail block)."""
        if self._blocks[target].state is not BlockState.SCRATCH:
            raise PoolStateError("copy into a block that is not scratch")
        self.kv[:, :, :, target].copy_(self.kv[:, :, :, source])

    def children(self, parent_key: BlockKey) -> list[tuple[int, object]]:
        """(block id, info) of the committed blocks whose parent is ``parent_key``."""
        parent_id = self._by_key.get(parent_key)
        if parent_id is None:
            return []
        return [(child, self._blocks[child].info) for child in self._children.get(parent_id, ())]

    def delete(self, keys: Sequence[BlockKey]) -> PoolDeletion:
        """Remove the committed blocks of ``keys`` and all their descendants (see the module
        docstring); children go before their parents, so the pool stays prefix-closed."""
        order: list[int] = []  # post-order: every block after its descendants
        seen: set[int] = set()
        for key in keys:
            start = self._by_key.get(key)
            if start is None or start in seen:
                continue
            stack = [(start, False)]
            while stack:
                block_id, expanded = stack.pop()
                if expanded:
                    order.append(block_id)
                    continue
                if block_id in seen:
                    continue
                seen.add(block_id)
                stack.append((block_id, True))
                stack.extend((child, False) for child in self._children.get(block_id, ()))
        for block_id in order:
            block = self._blocks[block_id]
            if block.children != len(self._children.get(block_id, ())):
                raise PoolStateError("delete of a block whose child is still pending")
        result = PoolDeletion(removed=[], held=[])
        for block_id in order:
            block = self._blocks[block_id]
            assert block.key is not None
            (result.held if block.refs else result.removed).append(block.key)
            self._unlink(block_id, DELETED)
            if block.refs:
                block.state, block.parent, block.children = BlockState.UNPUBLISHED, None, 0
            else:
                self._free_block(block_id)
        self._publish()
        return result

    def block_id(self, key: BlockKey) -> int | None:
        return self._by_key.get(key)

    @property
    def blocks_available(self) -> int:
        """Blocks a new sequence could get: free ones and committed ones nobody reads."""
        return self.config.num_blocks - self._held - self._scratch - len(self._pending)

    def abort(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.state is not BlockState.PENDING:
            raise PoolStateError(f"abort of block {block_id} in state {block.state.name}")
        if block.children:
            raise PoolStateError("abort of a pending block that has children")
        assert block.key is not None
        del self._pending[block.key]
        if block.parent is not None:
            self._blocks[block.parent].children -= 1
            self._maybe_evictable(block.parent)
        self._free_block(block_id)
        self._publish()

    def block_view(self, block_id: int) -> torch.Tensor:
        """One block's KV as a strided ``[L, 2, H, B, D]`` view (copy it to store it)."""
        return self.kv[:, :, :, block_id]

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Fill a PENDING block from a ``[L, 2, H, B, D]`` tensor (e.g. loaded from a tier)."""
        if self._blocks[block_id].state is not BlockState.PENDING:
            raise PoolStateError("write to a block that is not PENDING")
        self.kv[:, :, :, block_id].copy_(data)

    # ---- statistics ---------------------------------------------------------------------
    @property
    def blocks_used(self) -> int:
        return self.config.num_blocks - len(self._free)

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    def clear(self) -> None:
        """Drop every unreferenced committed block (leaf first), one eviction at a time, so
        demotion and listeners see each block go (blocks held by readers stay)."""
        while self._evict_one(protect=None):
            pass

    def committed_blocks(self) -> list[ResidentBlock]:
        """Every committed block, each after its parent (ordered by depth in its chain)."""
        depth: dict[int, int] = {}
        for start in self._by_key.values():
            path: list[int] = []
            block_id: int | None = start
            while block_id is not None and block_id not in depth:
                path.append(block_id)
                block_id = self._blocks[block_id].parent
            base = -1 if block_id is None else depth[block_id]
            for offset, walked in enumerate(reversed(path), start=1):
                depth[walked] = base + offset
        ids = sorted(self._by_key.values(), key=lambda block_id: (depth[block_id], block_id))
        return [self._resident(self._blocks[block_id]) for block_id in ids]

    # ---- internals ----------------------------------------------------------------------
    @staticmethod
    def _is_evictable(block: _Block) -> bool:
        return block.state is BlockState.COMMITTED and block.refs == 0 and block.children == 0

    def _maybe_evictable(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if self._is_evictable(block):
            heapq.heappush(self._evictable, (block.last_used, block_id))
            if len(self._evictable) > 2 * len(self._blocks) + 16:
                self._compact_evictable()

    def _compact_evictable(self) -> None:
        """Drop the heap's stale entries (a block released again pushes a new one; only an
        eviction pops them): a pool that rarely fills would keep ~2 per request for good."""
        self._evictable = [
            (block.last_used, block_id)
            for block_id, block in enumerate(self._blocks)
            if self._is_evictable(block)
        ]
        heapq.heapify(self._evictable)

    def _evict_one(self, protect: int | None) -> bool:
        deferred: list[tuple[int, int]] = []
        evicted = False
        try:
            while self._evictable:
                last_used, block_id = heapq.heappop(self._evictable)
                block = self._blocks[block_id]
                stale = (
                    block.state is not BlockState.COMMITTED
                    or block.refs
                    or block.children
                    or block.last_used != last_used
                )
                if stale:
                    continue
                if block_id == protect:
                    deferred.append((last_used, block_id))
                    continue
                self._evict(block_id)
                evicted = True
                break
        finally:
            for item in deferred:
                heapq.heappush(self._evictable, item)
            self._publish()
        return evicted

    def _evict(self, block_id: int) -> None:
        self._unlink(block_id, EVICTED)
        self._free_block(block_id)
        self.evictions += 1
        if self.metrics is not None:
            self.metrics.pool_evictions.inc()

    def _unlink(self, block_id: int, reason: str) -> None:
        """Announce a committed block's removal and take it out of the index and its
        parent's children (the caller frees or unpublishes it)."""
        block = self._blocks[block_id]
        assert block.key is not None
        if self._listeners:
            parent_key = self._blocks[block.parent].key if block.parent is not None else None
            evicted = EvictedBlock(block_id, block.key, parent_key, block.uses, block.info, reason)
            # Listeners must not raise (demotion is best effort and counts its own failures).
            for listener in self._listeners:
                listener.block_evicted(evicted)
        del self._by_key[block.key]
        parent_id = block.parent
        self._children.pop(block_id, None)
        if parent_id is not None:
            siblings = self._children.get(parent_id)
            if siblings is not None:
                siblings.discard(block_id)
                if not siblings:
                    del self._children[parent_id]
            self._blocks[parent_id].children -= 1
            self._maybe_evictable(parent_id)

    def _resident(self, block: _Block) -> ResidentBlock:
        assert block.key is not None
        parent_key = self._blocks[block.parent].key if block.parent is not None else None
        return ResidentBlock(block.key, parent_key, block.info)

    def _free_block(self, block_id: int) -> None:
        self._blocks[block_id] = _Block()
        self._free.append(block_id)

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.pool_blocks_used.set(self.blocks_used)
            self.metrics.pool_blocks_free.set(self.blocks_free)
