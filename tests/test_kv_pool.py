"""Scripted scenarios and a property test for the paged KV pool's bookkeeping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.engine.kv_pool import BlockState, PagedKVPool, PoolConfig
from kvstrata.errors import PoolStateError
from kvstrata.identity import BlockKey
from kvstrata.telemetry import KvMetrics


def key(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"\0"))


def make_pool(num_blocks: int = 4, metrics: KvMetrics | None = None) -> PagedKVPool:
    config = PoolConfig(
        num_blocks=num_blocks, block_size=2, num_layers=1, num_kv_heads=1, head_dim=2
    )
    return PagedKVPool(config, metrics)


def store_chain(pool: PagedKVPool, names: list[str]) -> list[int]:
    ids = []
    parent = None
    for name in names:
        block_id = pool.allocate(key(name), parent)
        assert block_id is not None
        pool.commit(block_id)
        ids.append(block_id)
        parent = key(name)
    return ids


def test_pending_block_is_invisible_until_commit_and_abort_leaves_nothing() -> None:
    pool = make_pool()
    block_id = pool.allocate(key("a"), None)
    assert block_id is not None
    assert pool.lookup_prefix([key("a")]) == []
    pool.abort(block_id)
    assert pool.lookup_prefix([key("a")]) == []
    assert pool.blocks_free == 4
    block_id = pool.allocate(key("a"), None)
    assert block_id is not None
    pool.commit(block_id)
    assert pool.lookup_prefix([key("a")]) == [block_id]


def test_lookup_returns_longest_committed_prefix_only() -> None:
    pool = make_pool()
    ids = store_chain(pool, ["a", "b"])
    assert pool.lookup_prefix([key("a"), key("b"), key("c")]) == ids
    assert pool.lookup_prefix([key("x"), key("a")]) == []


def test_child_cannot_be_allocated_without_parent_or_committed_before_it() -> None:
    pool = make_pool()
    with pytest.raises(PoolStateError):
        pool.allocate(key("b"), key("a"))
    parent = pool.allocate(key("a"), None)
    child = pool.allocate(key("b"), key("a"))
    assert parent is not None and child is not None
    with pytest.raises(PoolStateError):
        pool.commit(child)
    pool.commit(parent)
    pool.commit(child)


def test_eviction_is_leaf_first_and_least_recent_first() -> None:
    metrics = KvMetrics()
    pool = make_pool(num_blocks=3, metrics=metrics)
    store_chain(pool, ["a", "b"])  # a <- b
    store_chain(pool, ["c"])
    # Full. The leaves are b (older) and c; a has a child and must survive b.
    assert pool.allocate(key("d"), None) is not None
    assert not pool.contains(key("b"))
    assert pool.contains(key("a")) and pool.contains(key("c"))
    assert metrics.value("kvstrata_pool_evictions_total") == 1


def test_referenced_blocks_are_never_evicted() -> None:
    pool = make_pool(num_blocks=2)
    ids = store_chain(pool, ["a", "b"])
    pool.acquire(ids)
    assert pool.allocate(key("z"), None) is None  # nothing evictable: a has a child, b is held
    pool.release(ids)
    assert pool.allocate(key("z"), None) is not None


def test_illegal_transitions_raise() -> None:
    pool = make_pool()
    (block_id,) = store_chain(pool, ["a"])
    with pytest.raises(PoolStateError):
        pool.commit(block_id)
    with pytest.raises(PoolStateError):
        pool.release([block_id])
    with pytest.raises(PoolStateError):
        pool.allocate(key("a"), None)


def test_scratch_blocks_publish_under_their_key_or_stay_private() -> None:
    pool = make_pool(num_blocks=4)
    a = pool.allocate_scratch()
    assert a is not None
    assert pool.blocks_available == 3 and pool.lookup_prefix([key("a")]) == []
    pool.kv[:, :, :, a] = 7.0
    assert pool.publish(a, key("a"), None, info="A")
    assert pool.lookup_prefix([key("a")]) == [a]
    assert pool.blocks_available == 3  # the publisher still holds it
    b = pool.allocate_scratch()
    assert b is not None
    assert not pool.publish(b, key("a"), None)  # the key is cached already
    assert not pool.publish(b, key("b"), key("missing"))  # the parent is not
    assert pool.publish(b, key("b"), key("a"), info="B")
    assert pool.children(key("a")) == [(b, "B")]
    c = pool.allocate_scratch()
    assert c is not None
    pool.copy_block(a, c)  # copy-on-write of a shared block into private memory
    assert torch.equal(pool.block_view(c), pool.block_view(a))
    pool.free_scratch(c)
    pool.release([a, b])
    assert pool.blocks_available == 4
    with pytest.raises(PoolStateError):
        pool.free_scratch(a)  # committed, not scratch


def test_scratch_blocks_are_never_evicted_and_evict_unreferenced_leaves() -> None:
    pool = make_pool(num_blocks=2)
    a = pool.allocate_scratch()
    assert a is not None and pool.publish(a, key("a"), None)
    pool.release([a])
    s1 = pool.allocate_scratch()
    s2 = pool.allocate_scratch()  # evicts the unreferenced committed block
    assert s1 is not None and s2 is not None
    assert pool.lookup_prefix([key("a")]) == [] and pool.evictions == 1
    assert pool.allocate_scratch() is None  # scratch blocks are never taken back
    assert pool.blocks_available == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=60))
def test_pool_stays_prefix_closed_under_random_operations(ops: list[tuple[int, int]]) -> None:
    """Against a naive model: committed blocks always have committed parents; held ones stay."""
    pool = make_pool(num_blocks=5)
    chains = [[f"{c}{i}" for i in range(6)] for c in "xyz"]
    held: list[int] = []
    for chain_index, depth in ops:
        chain = chains[chain_index]
        prefix = [key(n) for n in chain[: depth + 1]]
        found = pool.lookup_prefix(prefix)
        parent = prefix[len(found) - 1] if found else None
        if len(found) < len(prefix):
            block_id = pool.allocate(prefix[len(found)], parent)
            if block_id is not None:
                pool.commit(block_id)
        if found and depth % 2 == 0:
            pool.acquire(found)
            held.extend(found)
        elif held:
            pool.release(held)
            held = []
        for block_id in held:
            assert pool._blocks[block_id].state is BlockState.COMMITTED
        for block in pool._blocks:
            if block.state is BlockState.COMMITTED and block.parent is not None:
                assert pool._blocks[block.parent].state is BlockState.COMMITTED
        for chain_names in chains:
            ids = pool.lookup_prefix([key(n) for n in chain_names])
            for i, block_id in enumerate(ids[1:], start=1):
                assert pool._blocks[block_id].parent == ids[i - 1]


def test_repeated_hits_do_not_grow_the_eviction_heap_and_lru_order_holds() -> None:
    """Every release of an unreferenced leaf pushes a heap entry, and only an eviction popped
    the stale ones: a pool that rarely fills grew by ~1 per hit for good."""
    pool = make_pool(num_blocks=4)
    a, b = store_chain(pool, ["a"]), store_chain(pool, ["b"])
    for _ in range(1000):
        pool.acquire(b)
        pool.release(b)
    assert len(pool._evictable) <= 2 * 4 + 16
    store_chain(pool, ["c", "d"])
    store_chain(pool, ["e"])  # the pool is full: the least recently used leaf goes
    assert not pool.contains(key("a")) and pool.contains(key("b")) and a != b
