"""Stored objects written under another layout, read and converted into the pool's own.

A worker restarted with another block size finds none of its keys in its disk and remote tiers:
keys are rooted in the full fingerprint, which names the representation (block size, layout,
dtype, TP). ``StoredRelayout`` reads them anyway, for the layouts the worker names
(``[[pool.read_layouts]]``, ``runtime.read_layouts``). At admission, where the engine's own
keys stop matching (device pool, then the store under its own keys), for each alternate:

1. the prompt's keys are chained under the writer's fingerprint (the engine's own with the
   alternate's block size, dtype, layout and TP rank — one chain per source TP rank the plan
   needs) and the store looks up the longest stored prefix, starting at the last token that
   both block sizes align on at or before the engine's own hit;
2. unless it would not reach beyond the own hit, fails the break-even test, or the plan is
   lossy (a dtype change: refused and counted, never an exact hit), each object is loaded
   through ``StoreBridge.load_verified`` (COMMITTED, the tier's digest check, exactly the
   writer's ``Representation`` and size); the first failure ends the prefix there (counted);
3. ``transfer.convert.convert_blocks`` turns the loaded blocks into the pool's, bit-exact;
4. the own blocks beyond the hit are allocated PENDING under the engine's *own* keys, written,
   committed parents first and acquired for the sequence, then written through to the store
   like computed blocks: from then on they are ordinary own-layout blocks. Tokens that fill no
   own block are recomputed.

Counted in ``KvMetrics``: ``kvstrata_relayout_blocks_total`` / ``_tokens_total`` by
``from_layout`` and ``to_layout``, ``kvstrata_relayout_refused_total`` by ``from_layout`` and
``reason`` (``lossy_not_allowed``, a ``LoadOutcome`` value, ``conversion_error``). Only the
step thread calls it (the pool is the step thread's).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvstrata.engine.hf_identity import KV_LAYOUT
from kvstrata.engine.kv_pool import PagedKVPool, PoolConfig
from kvstrata.engine.tiering import PoolBridge, Promotion
from kvstrata.errors import ConversionError, EngineError
from kvstrata.identity import (
    BlockKey,
    FingerprintDigest,
    ModelFingerprint,
    NamespaceRoot,
    TenantNamespace,
    chain_keys,
    namespace_root,
)
from kvstrata.objects import Representation
from kvstrata.runtime.blocks import BlockInfo, block_tokens
from kvstrata.runtime.bridge import LoadOutcome, StoreBridge
from kvstrata.runtime.read_layouts import ReadLayout
from kvstrata.store.levels import Located, RequestScope
from kvstrata.telemetry import KvMetrics
from kvstrata.transfer.convert import convert_blocks, dtype_name, torch_dtype
from kvstrata.transfer.layout import (
    CANONICAL_ORDER,
    ConversionPlan,
    KVLayout,
    RefuseReason,
    plan_conversion,
)

_MAX_ROOTS = 4096
_AXIS_NAMES = {"K": "2", "T": "B"}  # the store's layout names: kvstrata.block.v1[L,2,H,B,D]


def pool_layout(config: PoolConfig) -> KVLayout:
    """The layout of one block of a pool configured by ``config`` (``kv[L, 2, H, N, B, D]``)."""
    return KVLayout(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        block_size=config.block_size,
        dtype=dtype_name(config.dtype),
    )


def layout_representation(layout: KVLayout) -> Representation:
    """The ``Representation`` an engine of ``layout`` gives its stored objects (the pool's own
    is ``PoolBridge``'s: ``kvstrata.block.v1[L,2,H,B,D]``, TP 1)."""
    axes = ",".join(_AXIS_NAMES.get(axis, axis) for axis in layout.order)
    return Representation(
        dtype=layout.dtype,
        layout=f"kvstrata.block.v1[{axes}]",
        block_size=layout.block_size,
        shape=layout.block_shape(),
        codec_id=layout.codec_id,
        codec_version=layout.codec_version,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
    )


def layout_label(layout: KVLayout) -> str:
    """A metric label: ``b32/LKHTD/tp1/float32``."""
    return f"b{layout.block_size}/{layout.order}/tp{layout.tp_size}/{layout.dtype}"


def writer_fingerprint(own: ModelFingerprint, layout: KVLayout) -> ModelFingerprint:
    """The fingerprint of an engine of the same model writing ``layout`` (one TP rank)."""
    kv_layout = (
        KV_LAYOUT if layout.order == CANONICAL_ORDER else f"kvstrata.pool.v1[{layout.order}]"
    )
    return replace(
        own,
        block_size=layout.block_size,
        kv_dtype=layout.dtype,
        kv_layout=kv_layout,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
    )


@dataclass(frozen=True)
class Alternate:
    """One layout the engine reads: its plan into the pool's, and per source rank the digest
    its keys are rooted in and a bridge that loads exactly its representation."""

    layout: KVLayout
    plan: ConversionPlan
    label: str
    digests: dict[int, bytes]
    bridges: dict[int, StoreBridge]

    @property
    def refusal(self) -> RefuseReason | None:
        return None if self.plan.lossless else RefuseReason.LOSSY_NOT_ALLOWED


class StoredRelayout:
    def __init__(
        self,
        bridge: PoolBridge,
        fingerprint: ModelFingerprint,
        read_layouts: Sequence[ReadLayout],
        *,
        tenant_secret: bytes,
        metrics: KvMetrics,
    ) -> None:
        """Raises ``EngineError`` for an alternate no plan converts (another shape, heads a
        TP size does not shard): a configuration that can never read anything."""
        self.bridge = bridge
        self.pool: PagedKVPool = bridge.pool
        self.own = pool_layout(self.pool.config)
        self.own_label = layout_label(self.own)
        self.metrics = metrics
        self.tenant_secret = tenant_secret
        self._roots: dict[tuple[bytes, str], NamespaceRoot] = {}
        self.alternates = [
            alt
            for alt in (self._alternate(fingerprint, read) for read in read_layouts)
            if alt is not None
        ]

    def _alternate(self, fingerprint: ModelFingerprint, read: ReadLayout) -> Alternate | None:
        own = self.own
        layout = replace(
            own,
            block_size=read.block_size or own.block_size,
            order=read.order or own.order,
            tp_size=read.tp_size or 1,
            dtype=read.dtype or own.dtype,
        )
        plan = plan_conversion(layout, own)
        if not isinstance(plan, ConversionPlan):
            raise EngineError(f"read layout {read.describe()}: {plan.reason.value} ({plan.detail})")
        if plan.identity:
            return None  # the pool's own layout: its own lookup reads it
        store = self.bridge.store
        inner = self.bridge.bridge
        digests: dict[int, bytes] = {}
        bridges: dict[int, StoreBridge] = {}
        for rank in plan.source_ranks:
            ranked = layout.rank(rank)
            digests[rank] = writer_fingerprint(fingerprint, ranked).digest()
            bridges[rank] = StoreBridge(
                store,
                representation=layout_representation(ranked),
                block_bytes=ranked.block_bytes(),
                model_id=inner.model_id,
                recompute_estimate=inner.recompute_estimate,
            )
        return Alternate(layout, plan, layout_label(layout), digests, bridges)

    def _root(self, digest: bytes, tenant: str) -> NamespaceRoot:
        root = self._roots.get((digest, tenant))
        if root is None:
            if len(self._roots) >= _MAX_ROOTS:  # tenant names come from clients
                self._roots.clear()
            namespace = TenantNamespace.for_tenant(tenant, self.tenant_secret)
            root = namespace_root(FingerprintDigest(digest), namespace)
            self._roots[(digest, tenant)] = root
        return root

    def refused(self, alt: Alternate, reason: str) -> None:
        self.metrics.relayout_refused.labels(from_layout=alt.label, reason=reason).inc()

    # ---- admission ------------------------------------------------------------------------
    def extend(
        self,
        tokens: Sequence[int],
        keys: Sequence[BlockKey],
        held: int,
        full: int,
        scope: RequestScope,
    ) -> Promotion:
        """Own blocks ``held..`` (at most ``full``) read under the alternates, committed and
        acquired; ``keys`` are the engine's own keys of ``tokens``'s full blocks."""
        result = Promotion(block_ids=[], tokens_by_tier={})
        for alt in self.alternates:
            start = held + len(result.block_ids)
            if start >= full:
                break
            got = self._extend_one(alt, tokens, keys, start, full, scope)
            result.block_ids += got.block_ids
            for tier, count in got.tokens_by_tier.items():
                result.tokens_by_tier[tier] = result.tokens_by_tier.get(tier, 0) + count
        return result

    def _extend_one(
        self,
        alt: Alternate,
        tokens: Sequence[int],
        keys: Sequence[BlockKey],
        start: int,
        full: int,
        scope: RequestScope,
    ) -> Promotion:
        own_size, alt_size = self.own.block_size, alt.layout.block_size
        step = math.lcm(own_size, alt_size)
        first_token = start * own_size // step * step  # where both block sizes align
        first_alt, first_own = first_token // alt_size, first_token // own_size
        last_alt = min(len(tokens) // alt_size, math.ceil(full * own_size / alt_size))
        if min(full, last_alt * alt_size // own_size) <= start:
            return Promotion([], {})
        store = self.bridge.store
        located: dict[int, list[Located]] = {}
        for rank, digest in alt.digests.items():
            alt_keys = chain_keys(
                self._root(digest, scope.tenant), tokens[: last_alt * alt_size], alt_size
            )
            located[rank] = store.lookup(alt_keys[first_alt:], scope)
        count = min(len(found) for found in located.values())
        reach = min(full, first_own + count * alt_size // own_size)
        if reach <= start:
            return Promotion([], {})
        if alt.refusal is not None:
            self.refused(alt, alt.refusal.value)
            return Promotion([], {})
        count = min(count, math.ceil((reach * own_size - first_token) / alt_size))
        plan = {rank: found[:count] for rank, found in located.items()}
        if not self._worth_loading(plan, (reach - start) * own_size, start * own_size):
            return Promotion([], {})
        for found in plan.values():
            store.read_ahead(found)
        try:
            blocks = self._load(alt, plan, scope.tenant)
        finally:
            store.discard_read_ahead()
        if blocks is None:
            return Promotion([], {})
        reach = min(full, first_own + blocks.shape[0])
        tier_of = [store.levels[loc.level].name for loc in plan[min(plan)]]
        return self._write(alt, blocks, first_own, start, reach, tokens, keys, scope, tier_of)

    def _worth_loading(self, plan: dict[int, list[Located]], tokens: int, offset: int) -> bool:
        """The break-even test of ``StoreBridge.worth_loading`` over every source rank."""
        store = self.bridge.store
        located = [loc for found in plan.values() for loc in found]
        min_tokens = max(
            store.levels[loc.level].config.rollout.min_reusable_tokens for loc in located
        )
        if tokens < min_tokens:
            store.metrics.recompute_decisions.labels(reason="below_min_tokens").inc()
            return False
        if store.estimated_fetch_s(located) > self.bridge.bridge.recompute_estimate(tokens, offset):
            store.metrics.recompute_decisions.labels(reason="fetch_slower").inc()
            return False
        return True

    def _load(
        self, alt: Alternate, plan: dict[int, list[Located]], tenant: str
    ) -> torch.Tensor | None:
        """The plan's objects, verified, converted into own blocks ``[m, L, 2, H, B, D]``
        (starting at the aligned first own block); None when nothing usable came."""
        dtype = torch_dtype(alt.layout.dtype)
        count = min(len(found) for found in plan.values())
        loaded: dict[int, torch.Tensor] = {}
        for rank, found in plan.items():
            shape = alt.layout.rank(rank).block_shape()
            buffer = torch.empty((count, *shape), dtype=dtype)
            got = 0
            for index, loc in enumerate(found[:count]):

                def sink(
                    payload: memoryview,
                    target: torch.Tensor = buffer[index],
                    shape: tuple[int, ...] = shape,
                ) -> None:
                    with warnings.catch_warnings():  # read-only buffer: we only read from it
                        warnings.simplefilter("ignore", UserWarning)
                        source = torch.frombuffer(payload, dtype=dtype)
                    target.copy_(source.view(shape))

                outcome = alt.bridges[rank].load_verified(loc, tenant, sink)
                if outcome is not LoadOutcome.LOADED:
                    self.refused(alt, outcome.value)
                    break
                got += 1
            count = min(count, got)
            loaded[rank] = buffer
        if count == 0:
            return None
        try:
            converted = convert_blocks(alt.plan, {r: t[:count] for r, t in loaded.items()})
        except ConversionError:
            self.refused(alt, "conversion_error")
            return None
        return converted.blocks if converted.num_blocks else None

    def _write(
        self,
        alt: Alternate,
        blocks: torch.Tensor,
        first_own: int,
        start: int,
        reach: int,
        tokens: Sequence[int],
        keys: Sequence[BlockKey],
        scope: RequestScope,
        tier_of: list[str],
    ) -> Promotion:
        """Own blocks ``start..reach`` into the pool under the own keys, committed, acquired."""
        pool, size = self.pool, self.own.block_size
        result = Promotion(block_ids=[], tokens_by_tier={})
        try:
            for i in range(start, reach):
                info = BlockInfo(scope.tenant, i * size, block_tokens(tokens, i, size), time.time())
                block_id = pool.allocate(keys[i], keys[i - 1] if i else None, info)
                if block_id is None:
                    break
                try:
                    with torch.inference_mode():
                        pool.write_block(block_id, blocks[i - first_own])
                except BaseException:
                    pool.abort(block_id)
                    raise
                pool.commit(block_id)
                pool.acquire([block_id])
                result.block_ids.append(block_id)
                tier = tier_of[
                    min(len(tier_of) - 1, (i * size - first_own * size) // alt.layout.block_size)
                ]
                result.tokens_by_tier[tier] = result.tokens_by_tier.get(tier, 0) + size
        except BaseException:
            pool.release(result.block_ids)  # the caller never learns of them
            raise
        if result.block_ids:
            converted = len(result.block_ids)
            labels = {"from_layout": alt.label, "to_layout": self.own_label}
            self.metrics.relayout_blocks.labels(**labels).inc(converted)
            self.metrics.relayout_tokens.labels(**labels).inc(converted * size)
            self.bridge.write_through(
                result.block_ids, keys, start, scope.tenant, tokens, request_id=scope.request_id
            )
        return result
