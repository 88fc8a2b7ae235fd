"""A deletion request on the reference engine: its device pool and its store, one report.

Runs on the engine thread (``engine.call(lambda: engine.delete(selector)).result()``), between
two steps, so no block is pending in the pool and no demotion or write-through of this engine
interleaves. Order: survey (the pool's committed blocks of the tenant, every store level's
objects, the remote server's), select (``store.deletion.select``: descendants followed across
holders), the store (tombstones, then every replica: ``TieredStore.delete_selected``), then the
pool (its deleted blocks are announced with reason ``deleted`` and never demoted). A sequence
still running on a deleted block keeps reading it, but cannot publish a block under it (its
parent is no longer indexed).
The remote survey and erase are round trips made on the engine thread: a deletion pauses
serving for that long.
"""

from __future__ import annotations

from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.objects.tombstone import ObjectRef
from kvstrata.runtime.blocks import BlockInfo
from kvstrata.runtime.events import DEVICE_MEDIUM
from kvstrata.store.deletion import DeleteReport, DeleteSelector, select
from kvstrata.store.tiered import TieredStore


def pool_refs(pool: PagedKVPool, tenant: str) -> list[ObjectRef]:
    """The pool's committed blocks of ``tenant`` (the tenant is kept per block in its info)."""
    refs = []
    for block in pool.committed_blocks():
        info = block.info
        if isinstance(info, BlockInfo) and info.tenant == tenant:
            refs.append(ObjectRef(block.key, block.parent_key, tenant, info.created_at))
    return refs


def delete_everywhere(
    pool: PagedKVPool, store: TieredStore | None, selector: DeleteSelector, now: float
) -> DeleteReport:
    refs = pool_refs(pool, selector.tenant)
    if store is not None:
        report = store.delete_selected(selector, now=now, extra=refs)
    else:
        report = DeleteReport({}, select(selector, refs, now))
    in_pool = pool.delete(report.keys)
    report.removed = {DEVICE_MEDIUM: len(in_pool.removed), **report.removed}
    report.pending += len(in_pool.held)
    return report
