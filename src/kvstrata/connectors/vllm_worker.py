"""The worker side of the vLLM connector: kvstrata's tiered store behind vLLM's KV tensors.

One ``ConnectorWorker`` per vLLM worker process owns the ``TieredStore`` (host, disk and/or a
shared remote tier), the ``BlockCodec`` over vLLM's registered KV tensors, an optional KV event
emitter and the counters. It is driven by the connector, once per engine step, on the worker
thread:

- ``begin_load(plan.loads)`` from ``start_load_kv``: a ``BackgroundLoad`` (``vllm_loader``)
  whose thread runs ``fetch`` per request: its blocks are planned again through the bridge's
  ``plan_promotion`` (a shared remote tier then fetches the whole prefix in one pipelined,
  shard-parallel batch — read-ahead — instead of a round trip per block; what no load took is
  dropped by ``finish_promotion`` and counted as unused), pinned, checked (representation and
  size here; the payload digest by the tier, on every read unless a tier's ``verify_reads`` is
  off) and copied from the tier's buffer into vLLM's tensors — through the runtime's
  ``StoreBridge``, the same code the reference engine loads with. The forward waits for it at
  its first attention layer; ``finish_load`` (after the forward) books it: the first block
  that is missing, fails a check or whose tier errs ends that request's load, and it and
  every later block are returned as failed (``get_block_ids_with_load_errors``), so vLLM
  recomputes them (never uses them); a load past its deadline fails all its blocks.
- ``select_saves(plan.saves)`` on the step thread (bookkeeping: blocks kvstrata does not hold
  yet), ``save_request`` on the background saver (``vllm_saver``): gathered and put, each with
  its xxh3-128 payload digest, parent key, position and tokens. A block whose load failed is
  replaced when vLLM has recomputed it (its later blocks may hold bad bytes that no read has
  found yet).
- ``end_step()`` publishes the step's KV events (one batch, ``medium`` = tier name). When
  asked, a ``kvstrata-stats`` thread writes the counters to a JSON file (how tests in another
  process read them) at most every ``STATS_INTERVAL_S``, off the step thread (written per
  step, its JSON and file I/O cost a prefill step ~3 ms, mostly waiting for the interpreter
  lock), and once more at ``close``.

Saves stage whole-block rows in a buffer kept across steps (``Staging``): a fresh buffer per
save cost its first touch every time (~0.5 ms per MB on these VMs: 6 ms of a 16-block load,
when loads staged too).

``lookup(tenant, keys)`` answers the scheduler side (in-process or through ``vllm_lookup``) with
the blocks held *and* worth loading (the bridge's break-even test, the one ``plan_promotion``
applies), so the scheduler never promises blocks the load would then refuse, and holds what
it promised against eviction until the request's load (``vllm_holds``: a promise used to be
broken by other requests' saves in between, and vLLM recomputed the blocks); the store is
thread-safe, so lookups may come from the lookup server's thread.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvstrata.connectors.vllm_holds import LookupHolds
from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_loader import BackgroundLoad, Placer
from kvstrata.connectors.vllm_plan import BlockSave, RequestLoad, RequestSave
from kvstrata.costs import DEFAULT_PREFILL_MODEL, PrefillModel
from kvstrata.errors import KvstrataError
from kvstrata.identity import BlockKey
from kvstrata.runtime.blocks import BlockInfo
from kvstrata.runtime.bridge import LoadOutcome, StoreBridge
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.security.audit import NULL_AUDIT, AuditLog
from kvstrata.store.levels import Located, RequestScope
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.base import Tier
from kvstrata.tiers.remote import RemoteTier

logger = logging.getLogger("kvstrata.connectors.vllm")

STATS_INTERVAL_S = 0.25


class Staging:
    """A CPU ``uint8`` buffer of whole-block rows, reused: allocated (and touched) when a
    bigger one is needed, kept otherwise. One owner thread at a time."""

    def __init__(self, block_bytes: int) -> None:
        self._rows = _touched_rows(0, block_bytes)

    def rows(self, count: int) -> torch.Tensor:
        if count > self._rows.shape[0]:
            self._rows = _touched_rows(count, self._rows.shape[1])
        return self._rows[:count]


def _touched_rows(count: int, block_bytes: int) -> torch.Tensor:
    """Zeroed rows, every page touched, allocated without any torch kernel.

    Background threads (the saver, the fetch) call this. A torch kernel there would start an
    OpenMP team of its own for that thread; with more OpenMP threads than CPUs, libgomp
    stops spinning between parallel regions (its throttled spin count), so every kernel of
    vLLM's forward paid a futex wake-up: the model ran ~1.5x slower in the connector's
    process (docs/results-history.md). numpy's fill is a plain single-threaded memset."""
    rows = np.empty((count, block_bytes), dtype=np.uint8)
    rows.fill(0)
    return torch.from_numpy(rows)


MAX_SUSPECT_KEYS = 1 << 16
"""Keys of failed loads remembered for replacement at most (``ConnectorWorker._suspect``)."""


@dataclass
class ConnectorStats:
    lookups: int = 0
    lookup_blocks_found: int = 0
    blocks_loaded: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0  # blocks reported to vLLM for recomputation
    load_missing: int = 0
    lookup_holds_expired: int = 0  # promises held until no longer renewed, never loaded
    load_digest_mismatch: int = 0
    load_incompatible: int = 0
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_skipped_present: int = 0
    save_skipped_failed_load: int = 0  # computed on a block whose load failed: never saved
    save_rejected: int = 0
    save_dropped: int = 0  # beyond the saver's queue bound: not saved (only reuse is lost)
    save_failed: int = 0  # background save jobs that raised
    load_timeouts: int = 0  # step loads given up at connector.load_timeout_ms
    save_flushes: int = 0  # finished requests a step waited for: their block was handed out
    pd_offers_sent: int = 0  # kv_producer: offers returned in kv_transfer_params
    pd_offers_accepted: int = 0  # kv_consumer: offers the handshake accepted
    pd_refused: int = 0  # kv_consumer: offers refused (local prefill); by reason: pd_refusals
    pd_wait_timeouts: int = 0  # kv_consumer: accepted offers whose blocks did not all arrive
    steps: int = 0
    load_seconds: float = 0.0  # fetch threads' time, start to end (overlaps the forward)
    load_wait_seconds: float = 0.0  # of which the step blocked (first layer, or finish)
    save_seconds: float = 0.0
    save_flush_seconds: float = 0.0  # the steps' time spent finishing them (before forwards)


class ConnectorWorker:
    def __init__(
        self,
        store: TieredStore,
        codec: BlockCodec,
        *,
        model: str,
        emitter: KVEventEmitter | None = None,
        stats_path: Path | None = None,
        cost_model: PrefillModel = DEFAULT_PREFILL_MODEL,
        audit: AuditLog = NULL_AUDIT,
    ) -> None:
        self.store = store
        self.audit = audit
        """The store's audit log (started by the connector): closed after the store."""
        self.codec = codec
        self.model = model
        self.emitter = emitter
        self.stats_path = stats_path
        self.cost_model = cost_model
        self.representation = codec.representation
        self.stats = ConnectorStats()
        self.pd_refusals: dict[str, int] = {}
        self._pd_reasons: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        self._dirty = True
        # keys whose load failed: replaced when recomputed (oldest forgotten beyond the bound:
        # a request aborted before recomputing never saves its keys again)
        self._suspect: OrderedDict[bytes, None] = OrderedDict()
        # One Staging per saving thread: the saver's, and the step thread's (flushes, drains).
        self._save_staging = threading.local()
        self._stats_stop = threading.Event()
        self._stats_thread: threading.Thread | None = None
        if stats_path is not None:
            self._stats_thread = threading.Thread(
                target=self._write_stats_loop, name="kvstrata-stats", daemon=True
            )
            self._stats_thread.start()
            atexit.register(self._write_stats_at_exit)  # a process that ends without close()
        self._holds = LookupHolds(store)
        self.bridge = StoreBridge(
            store,
            representation=codec.representation,
            block_bytes=codec.block_bytes,
            model_id=model,
            recompute_estimate=cost_model.marginal_s,
        )

    # ---- scheduler queries ------------------------------------------------------------------
    def lookup(
        self,
        tenant: str,
        keys: Sequence[BlockKey],
        presence: bool = False,
        req_id: str | None = None,
    ) -> int:
        """Leading blocks of ``keys`` worth loading (``vllm_plan.Lookup``); ``presence``:
        held at all, whether or not worth loading, and not counted (a P/D arrival probe)."""
        scope = RequestScope(tenant=tenant, model=self.model, request_id=req_id)
        located = self.store.lookup(keys, scope)
        if presence:
            return len(located)
        # The keys start after vLLM's own hit, whose length is not sent: context offset 0.
        found = len(located) if self.bridge.worth_loading(located, 0) else 0
        if req_id is not None:  # kept from eviction until the load (``vllm_holds``)
            self._holds.take(req_id, located[:found])
        self._count(lookups=1, lookup_blocks_found=found)
        return found

    def holds(self, key: BlockKey) -> bool:
        return self.bridge.holds(key)

    # ---- loads (fetch thread, then step thread) ---------------------------------------------
    def begin_load(self, loads: Sequence[RequestLoad], *, timeout_s: float) -> BackgroundLoad:
        """Start fetching the step's planned blocks; each is placed into vLLM's tensors as it
        passes its checks (``vllm_loader``)."""
        return BackgroundLoad(loads, self.fetch, self.codec, timeout_s=timeout_s).start()

    def fetch(self, request: RequestLoad, place: Placer) -> int:
        """Read a request's planned blocks on the fetch thread, handing each checked payload to
        ``place``; returns how many leading blocks were placed: the first block missing,
        failing a check or whose tier errs (or a load given up) ends the request's load."""
        keys = [BlockKey(k) for k in request.keys]
        scope = RequestScope(tenant=request.tenant, model=self.model, request_id=request.req_id)
        located = self.bridge.plan_promotion(keys, 0, scope)
        loaded = 0
        try:
            for loc, block_id in zip(located, request.block_ids, strict=False):
                if not self._load_one(loc, request.tenant, block_id, place):
                    break
                loaded += 1
        finally:
            if located:
                self.bridge.finish_promotion(located)
        if loaded == len(located) < len(keys):  # gone since the scheduler looked
            self._count(load_missing=1)
        return loaded

    def finish_load(self, load: BackgroundLoad) -> set[int]:
        """Book a finished step's load (step thread); returns the block ids vLLM recomputes."""
        result = load.finish()
        for request in load.loads:  # the promise is kept: fetched, failed or never fetched
            self._holds.end(request.req_id)
        loaded = sum(item.loaded for item in result.fetched)
        for request in load.loads:
            done = next((f.loaded for f in result.fetched if f.request is request), 0)
            # vLLM recomputes these blocks; their fresh KV replaces whatever the store holds.
            self._suspect.update(dict.fromkeys(request.keys[done:]))
        while len(self._suspect) > MAX_SUSPECT_KEYS:
            self._suspect.popitem(last=False)
        if result.timed_out:
            self._count(load_timeouts=1)
            logger.warning(
                "kvstrata: a load missed its %.0f ms deadline; vLLM recomputes %d blocks",
                1000 * load.timeout_s,
                len(result.failed),
            )
        elif load.error is not None:
            logger.error("kvstrata: a load failed (%s); vLLM recomputes it", load.error)
        elif result.failed:
            logger.warning(
                "kvstrata: %d blocks failed to load; vLLM recomputes them", len(result.failed)
            )
        self._count(
            blocks_loaded=loaded,
            tokens_loaded=loaded * self.codec.block_size,
            bytes_loaded=loaded * self.codec.block_bytes,
            load_errors=len(result.failed),
            load_seconds=result.fetch_s,
            load_wait_seconds=result.wait_s,
        )
        return set(result.failed)

    def load(self, loads: Sequence[RequestLoad], *, timeout_s: float = 60.0) -> set[int]:
        """Fill the planned blocks now (every layer); returns the block ids not filled."""
        return self.finish_load(self.begin_load(loads, timeout_s=timeout_s))

    def _load_one(self, loc: Located, tenant: str, block_id: int, place: Placer) -> bool:
        placed = False

        def copy(payload: memoryview) -> None:
            nonlocal placed
            placed = place(block_id, payload)

        outcome = self.bridge.load_verified(loc, tenant, copy)
        if outcome is LoadOutcome.DIGEST_MISMATCH:
            self._count(load_digest_mismatch=1)
        elif outcome is LoadOutcome.INCOMPATIBLE:
            self._count(load_incompatible=1)
        elif outcome is not LoadOutcome.LOADED:
            self._count(load_missing=1)
        return outcome is LoadOutcome.LOADED and placed

    # ---- saves: chosen on the step thread, written by the saver thread ----------------------
    def select_saves(
        self,
        saves: Sequence[RequestSave],
        skip: set[int] | frozenset[int] = frozenset(),
        tainted: set[str] | frozenset[str] = frozenset(),
    ) -> list[RequestSave]:
        """The blocks worth saving (bookkeeping only: no bytes move here).

        ``skip``: block ids whose load failed. A request's blocks from the first of them on
        are not saved: the step computed the later ones attending to what the failed load
        left in vLLM's cache (vLLM rewinds the request there and plans them again).
        ``tainted``: requests whose load failed this step although none of their planned
        saves is a failed block (their saves begin after their loads): none is saved."""
        chosen = []
        skipped = dropped = 0
        for request in saves:
            todo = []
            failed_here = any(block.block_id in skip for block in request.blocks)
            drop_all = request.req_id in tainted and not failed_here
            for index, block in enumerate(request.blocks):
                if drop_all or block.block_id in skip:
                    dropped += len(request.blocks) - index  # this one and all computed on it
                    break
                if block.key in self._suspect:
                    del self._suspect[block.key]
                    self.store.delete([BlockKey(block.key)])  # e.g. bytes not yet read
                elif self.holds(BlockKey(block.key)):
                    continue
                todo.append(block)
            chosen.append(RequestSave(request.req_id, request.tenant, tuple(todo)))
            skipped += len(request.blocks) - len(todo)
        if skipped - dropped:
            self._count(save_skipped_present=skipped - dropped)
        if dropped:
            self._count(save_skipped_failed_load=dropped)
        return chosen

    def save_request(self, request: RequestSave) -> None:
        """Gather a request's blocks out of vLLM's KV and put them: on the saver thread, or on
        the step thread (a flush or drain) at the same time, each into its own rows."""
        if not request.blocks:
            return
        started = time.perf_counter()
        ids = [block.block_id for block in request.blocks]
        staging: Staging | None = getattr(self._save_staging, "staging", None)
        if staging is None:
            staging = self._save_staging.staging = Staging(self.codec.block_bytes)
        rows = self.codec.gather(ids, out=staging.rows(len(ids))).numpy()
        for block, row in zip(request.blocks, rows, strict=True):
            self._put(request, block, row)
        self._count(save_seconds=time.perf_counter() - started)

    def save(
        self,
        saves: Sequence[RequestSave],
        skip: set[int] | frozenset[int] = frozenset(),
        tainted: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """Select and write now, on the calling thread."""
        for request in self.select_saves(saves, skip, tainted):
            self.save_request(request)

    def _put(self, request: RequestSave, block: BlockSave, row: np.ndarray) -> None:
        info = BlockInfo(request.tenant, block.position, block.tokens)
        parent = BlockKey(block.parent) if block.parent is not None else None
        try:
            stored = self.bridge.put(
                BlockKey(block.key), parent, info, memoryview(row.data), request_id=request.req_id
            )
        except KvstrataError:
            logger.exception("kvstrata: storing a block failed")
            stored = False
        if stored:
            self._count(blocks_saved=1, bytes_saved=self.codec.block_bytes)
        else:
            self._count(save_rejected=1)

    # ---- counters and per step --------------------------------------------------------------
    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)
            self._dirty = True

    def pd_counts(self, counts: dict[str, int]) -> None:
        """The scheduler side's producer/consumer counters (``vllm_pd``, via the step plan):
        ``pd_refused:<reason>`` keys go to ``pd_refusals`` (stats file) and are kept for the
        next report to vLLM (``take_pd_reasons``)."""
        plain = {k: v for k, v in counts.items() if ":" not in k and hasattr(self.stats, k)}
        if plain:
            self._count(**plain)
        with self._stats_lock:
            for key, value in counts.items():
                if key.startswith("pd_refused:"):
                    reason = key.partition(":")[2]
                    self.pd_refusals[reason] = self.pd_refusals.get(reason, 0) + value
                    self._pd_reasons[key] = self._pd_reasons.get(key, 0) + value
                    self._dirty = True

    def take_pd_reasons(self) -> dict[str, float]:
        with self._stats_lock:
            reasons, self._pd_reasons = self._pd_reasons, {}
        return {k: float(v) for k, v in reasons.items()}

    def saver_counts(
        self, *, dropped: int, failed: int, flushed: int, flush_seconds: float
    ) -> None:
        """The background saver's own counters (it owns them; copied here once a step)."""
        stats, now = self.stats, (dropped, failed, flushed, flush_seconds)
        with self._stats_lock:
            flushes = (stats.save_flushes, stats.save_flush_seconds)
            changed = (stats.save_dropped, stats.save_failed, *flushes) != now
            stats.save_dropped, stats.save_failed = dropped, failed
            stats.save_flushes, stats.save_flush_seconds = flushed, flush_seconds
            self._dirty = self._dirty or changed

    def end_step(self) -> None:
        expired = self._holds.reap()  # promises no lookup renewed and no load took
        with self._stats_lock:
            self.stats.steps += 1
            self.stats.lookup_holds_expired += expired
        if self.emitter is not None:
            self.emitter.flush()

    def _write_stats_at_exit(self) -> None:
        with contextlib.suppress(OSError):
            self.write_stats()

    def _write_stats_loop(self) -> None:
        while not self._stats_stop.wait(STATS_INTERVAL_S):
            try:
                self.write_stats()
            except OSError:
                logger.exception("kvstrata: writing the stats file failed")

    def snapshot_stats(self) -> ConnectorStats:
        with self._stats_lock:
            return ConnectorStats(**asdict(self.stats))

    def write_stats(self, *, force: bool = False) -> None:
        """Write the counters (and tier usage) to ``stats_path`` when they changed (a flag
        checked once per step: no snapshot unless something moved)."""
        if self.stats_path is None:
            return
        with self._stats_lock:
            if not (self._dirty or force):
                return
            self._dirty = False
        current = self.snapshot_stats()
        body = asdict(current) | {
            "tiers": {level.name: _tier_stats(level.tier) for level in self.store.levels},
            "block_bytes": self.codec.block_bytes,
            "pd_refusals": dict(self.pd_refusals),
            "pid": os.getpid(),
        }
        tmp = self.stats_path.with_name(f".{self.stats_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body, sort_keys=True))
        tmp.replace(self.stats_path)

    def close(self) -> None:
        atexit.unregister(self._write_stats_at_exit)
        self._stats_stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join()
        self.write_stats(force=True)
        self._holds.close()
        self.store.close()
        self.audit.close()
        if self.emitter is not None:
            self.emitter.flush()
            self.emitter.close()


def _tier_stats(tier: Tier) -> dict[str, int]:
    """A tier's usage for the stats file (a remote tier adds its read-ahead bytes)."""
    body = {
        "objects": tier.object_count,
        "used_bytes": tier.used_bytes,
        "loads": tier.counters.loads,
    }
    if isinstance(tier, RemoteTier):
        body["read_ahead_bytes"] = tier.remote_counters.read_ahead_bytes
        body["read_ahead_unused_bytes"] = tier.remote_counters.read_ahead_unused_bytes
    return body
