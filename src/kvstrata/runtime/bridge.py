"""The byte bridge between an engine's blocks and the tiered store (no torch here).

Every engine adapter does the same four things with the store, and they live here once:

- ``make_meta`` describes a block about to be stored: key, parent, tenant, the adapter's
  ``Representation``, size, payload digest, first token position, its tokens (so KV events
  from any tier can carry them) and ``recompute_s`` from the one cost model;
- ``put`` stores one block's payload (write-through at commit, a demotion, a connector save);
- ``wants_demotion`` / ``wants_write_through`` apply the first level's write policy to the
  device pool's evictions and commits (a selective level wants ``selective_min_uses`` uses);
- ``plan_promotion`` finds the longest prefix the store holds beyond the device hit and applies
  the break-even test: fewer reusable tokens than a tier's ``min_reusable_tokens``, or a fetch
  estimated (from measured tier throughput) to take longer than recomputing those tokens,
  means recompute; the plan's objects are held against eviction until ``finish_promotion``
  (the loads themselves make room, and the room must not come out of the plan);
- ``load_verified`` pins one object and hands its verified bytes to a sink — only when it
  carries exactly the adapter's representation and size (anything else is incompatible and
  recomputed, invariant 7). Digests are checked by the tiers on every read (a per-tier
  setting, on by default); a failed check surfaces here as ``LoadOutcome.DIGEST_MISMATCH``.

Engines own their pools and tensors; they hand this bridge memoryviews.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from enum import Enum

from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.runtime.blocks import DELETED, BlockInfo, EvictedBlock
from kvstrata.security.audit import Action
from kvstrata.store.config import WritePolicy
from kvstrata.store.levels import Located, RejectedObject, RequestScope
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.base import CORRUPT

RecomputeEstimate = Callable[[int, int], float]
"""Seconds that recomputing ``n`` tokens at context offset ``c`` adds to a forward."""

PayloadSink = Callable[[memoryview], None]
"""Receives a verified object's payload (read-only, valid only during the call)."""

logger = logging.getLogger("kvstrata.runtime")


class LoadOutcome(Enum):
    LOADED = "loaded"
    MISSING = "missing"  # gone since lookup (evicted, expired, deleted) or another tenant's
    DIGEST_MISMATCH = "digest_mismatch"
    INCOMPATIBLE = "incompatible"  # another representation or size
    TIER_ERROR = "tier_error"  # the medium failed


class StoreBridge:
    def __init__(
        self,
        store: TieredStore,
        *,
        representation: Representation,
        block_bytes: int,
        model_id: str,
        recompute_estimate: RecomputeEstimate,
    ) -> None:
        self.store = store
        self.representation = representation
        self.block_bytes = block_bytes
        self.block_size = representation.block_size
        self.model_id = model_id
        self.recompute_estimate = recompute_estimate

    # ---- engine → store ---------------------------------------------------------------------
    def make_meta(
        self, key: BlockKey, parent: BlockKey | None, info: BlockInfo, payload: memoryview
    ) -> KVObjectMeta:
        tokens = info.tokens
        block_tokens = len(tokens) if tokens is not None else self.block_size
        return KVObjectMeta(
            key=key,
            parent=parent,
            tenant=info.tenant,
            representation=self.representation,
            size=self.block_bytes,
            digest=payload_digest(payload),
            # The KV's age, not the copy's: a block that waited in the device pool is not
            # made younger by its demotion (older_than deletes, TTLs and tombstones see it).
            created_at=info.created_at if info.created_at is not None else time.time(),
            position=info.position,
            recompute_s=self.recompute_estimate(block_tokens, info.position),
            model=self.model_id,
            tokens=tokens,
        )

    def put(
        self,
        key: BlockKey,
        parent: BlockKey | None,
        info: BlockInfo,
        payload: memoryview,
        *,
        uses: int = 1,
        request_id: str | None = None,
    ) -> bool:
        """Store one block's payload; whether any level admitted it. ``request_id``: the
        request that computed it (a canary level's share); None for a demotion."""
        meta = self.make_meta(key, parent, info, payload)

        def fill(buffer: memoryview) -> None:
            buffer[:] = payload

        scope = RequestScope(tenant=info.tenant, model=self.model_id, request_id=request_id)
        return self.store.put(meta, fill, scope, uses=uses)

    def wants_write_through(self) -> bool:
        """Does the first level want every block copied as soon as it commits?"""
        levels = self.store.levels
        return bool(levels) and levels[0].config.write_policy is WritePolicy.WRITE_THROUGH

    def wants_demotion(self, evicted: EvictedBlock) -> bool:
        """Should an evicted device block be copied into the store? Not when it is there
        already, nor for a selective first level before it was used often enough."""
        if evicted.reason == DELETED or not isinstance(evicted.info, BlockInfo):
            return False  # a deleted block is never kept anywhere
        if not self.store.levels:
            return False
        top = self.store.levels[0]
        if top.tier.contains(evicted.key):
            return False
        if (
            top.config.write_policy is WritePolicy.SELECTIVE
            and evicted.uses < top.config.selective_min_uses
        ):
            self.store.metrics.evictions.labels(tier="device", outcome="dropped_low_value").inc()
            return False
        return True

    def demote(self, evicted: EvictedBlock, payload: memoryview) -> None:
        """Copy an evicted block (``wants_demotion`` said yes) into the store, best effort:
        a failing medium drops the block (counted) and never wedges the device pool."""
        assert isinstance(evicted.info, BlockInfo)
        try:
            kept = self.put(
                evicted.key, evicted.parent_key, evicted.info, payload, uses=evicted.uses
            )
        except KvstrataError:
            logger.exception("demotion of an evicted device block failed")
            self.store.metrics.evictions.labels(tier="device", outcome="demotion_failed").inc()
            return
        outcome = "demoted" if kept else "demotion_refused"  # no level admitted it (room, quota …)
        self.store.metrics.evictions.labels(tier="device", outcome=outcome).inc()

    # ---- store → engine ---------------------------------------------------------------------
    def plan_promotion(
        self, keys: Sequence[BlockKey], first: int, scope: RequestScope
    ) -> list[Located]:
        """The blocks ``keys[first:]`` worth loading from the store (empty: recompute),
        held against eviction (``TieredStore.hold``) until ``finish_promotion``."""
        located = self.store.lookup(keys[first:], scope)
        if not self.worth_loading(located, first):
            return []
        held = self.store.hold(located)
        if len(held) < len(located) and not self.worth_loading(held, first):
            self.store.release(held)  # what is left of the plan is not worth a load
            return []
        self.store.read_ahead(held)  # a shared tier fetches the whole plan in one batch
        return held

    def worth_loading(self, located: Sequence[Located], first: int) -> bool:
        """The break-even test of ``plan_promotion`` alone (no read-ahead): may an engine
        promise these blocks (e.g. the vLLM connector's scheduler side) before it loads them?"""
        if not located:
            return False
        tokens = len(located) * self.block_size
        min_tokens = max(
            self.store.levels[loc.level].config.rollout.min_reusable_tokens for loc in located
        )
        if tokens < min_tokens:
            self.store.metrics.recompute_decisions.labels(reason="below_min_tokens").inc()
            return False
        fetch_s = self.store.estimated_fetch_s(located)
        if fetch_s > self.recompute_estimate(tokens, first * self.block_size):
            self.store.metrics.recompute_decisions.labels(reason="fetch_slower").inc()
            return False
        return True

    def finish_promotion(self, located: Sequence[Located]) -> None:
        """End the plan ``located`` (``plan_promotion``'s result): release its holds and drop
        what it read ahead and no load took (counted as unused)."""
        self.store.release(located)
        self.store.discard_read_ahead()

    def load_verified(self, located: Located, tenant: str, sink: PayloadSink) -> LoadOutcome:
        """Pin ``located``, check it, hand its bytes to ``sink``; what happened."""
        level = self.store.levels[located.level]
        miss: list[str] = []
        try:
            with self.store.load(located, tenant, miss=miss) as lease:
                if lease is None:
                    if miss == [CORRUPT]:
                        return LoadOutcome.DIGEST_MISMATCH
                    return LoadOutcome.MISSING
                meta = lease.meta
                if meta.representation != self.representation or meta.size != self.block_bytes:
                    raise RejectedObject(f"{located.key.hex()}: another representation or size")
                sink(lease.buffer)
        except RejectedObject:  # the store removed it: the next request recomputes
            self.store.metrics.invalid.labels(tier=level.name, reason="incompatible").inc()
            keys = [located.key]
            self.store.audit.record(
                Action.INVALIDATE, "incompatible", tier=level.name, keys=keys, tenant=tenant
            )
            return LoadOutcome.INCOMPATIBLE
        except KvstrataError:
            logger.exception("a tier failed while loading a block")
            return LoadOutcome.TIER_ERROR
        return LoadOutcome.LOADED

    def holds(self, key: BlockKey) -> bool:
        return any(level.tier.contains(key) for level in self.store.levels)
