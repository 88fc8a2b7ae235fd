"""``KvstrataConnector``: kvstrata's tiered store as the KV storage backend of vLLM (0.32).

Load it with::

    KVTransferConfig(kv_connector="KvstrataConnector",
                     kv_connector_module_path="kvstrata.connectors.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"host_gib": 1, "disk_dir": "...", "disk_gib": 4})

(or ``{"remote_url": "redis://host:6379/0", "remote_gib": 4}``: a Redis/Valkey tier that every
vLLM instance with the same url and ``remote_namespace`` shares.)

(``vllm_settings`` lists every key.) vLLM builds one instance per role:

- scheduler side (``SchedulerPlanner``): keys every full block of a request with kvstrata's
  chained BLAKE3 keys, rooted in a ``ModelFingerprint`` of vLLM's model and the tenant of the
  request's ``cache_salt``; asks the worker's store how many blocks beyond vLLM's own prefix
  hit it holds (``get_num_new_matched_tokens``), and ships a ``StepPlan`` (blocks to load, blocks
  to store) to the worker in the connector metadata — a plain, picklable record, because in
  vLLM's default multiprocess mode the worker is another process;
- worker side (``ConnectorWorker``): owns the store. ``start_load_kv`` starts fetching the
  step's planned blocks on a thread; each attention layer's ``wait_for_layer_load`` places that
  layer's slice (``vllm_loader``); a load that fails or misses ``connector.load_timeout_ms``
  is reported through ``get_block_ids_with_load_errors`` (so with
  ``kv_load_failure_policy="recompute"`` vLLM recomputes instead of using bad KV).
  ``wait_for_save`` only queues the step's new full blocks for the background saver
  (``vllm_saver``), which reads them in place: ``request_finished`` lets vLLM free a request's
  blocks at once, fenced (``vllm_plan``) until the worker reports its saves done
  (``build_connector_worker_meta`` → ``update_connector_output``); a fenced block handed out
  again first has its reader's saves finished (``handle_preemptions``). Counters go to vLLM's
  ``KVConnectorStats`` and ``/metrics`` (``vllm_stats``) and to the JSON stats file; kvstrata
  KV events (``medium`` = tier) go out on kvstrata's own ZMQ publisher (``[events]``), not
  vLLM's connector event path, so they carry kvstrata's keys, tenant and epoch.

``kv_role="kv_producer"`` / ``"kv_consumer"`` add P/D disaggregation through a shared tier
(``vllm_pd``: the producer returns a kvstrata offer in ``kv_transfer_params``, the consumer
checks it with the transfer handshake and waits for the offered blocks before loading them);
``kv_both`` is the ordinary behaviour.

A model kvstrata cannot identify (``ReuseDisabled``), and requests with LoRA, multimodal inputs
or prompt embeddings, get 0 external tokens and are never stored.
With ``vllm_stats``, the only kvstrata module that imports vLLM when loaded (an optional extra:
``kvstrata[vllm]``); ``vllm_identity.model_fingerprint`` imports it when called.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvstrata.connectors.vllm_identity import KV_LAYOUT, model_fingerprint, tenant_for_salt
from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_loader import StepLoads
from kvstrata.connectors.vllm_lookup import (
    LookupClient,
    LookupServer,
    endpoint_for,
    register_local,
    unregister_local,
)
from kvstrata.connectors.vllm_pd import Gate, Role, RoleSide, vllm_kv_layout
from kvstrata.connectors.vllm_plan import (
    Lookup,
    RequestSave,
    ScheduledRequest,
    SchedulerPlanner,
    StepPlan,
)
from kvstrata.connectors.vllm_saver import BackgroundSaver
from kvstrata.connectors.vllm_settings import connector_audit, connector_config, lookup_keys
from kvstrata.connectors.vllm_stats import KvstrataConnectorStats, KvstrataPromMetrics, StatsDelta
from kvstrata.connectors.vllm_worker import ConnectorWorker
from kvstrata.identity import (
    BlockKey,
    ModelFingerprint,
    ReuseDisabled,
)
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.runtime.store_factory import build_store
from kvstrata.runtime.wiring import wire
from kvstrata.tiers.base import TierError
from kvstrata.transfer.layout import KVLayout

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvstrata.connectors.vllm")


class KvstrataConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler → worker, once per step: what to load before and store after the forward."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvstrataWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker → scheduler, once per step: every save of the plans up to ``saved_through`` has
    run (with several workers, the least of theirs)."""

    def __init__(self, saved_through: int) -> None:
        self.saved_through = saved_through

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvstrataWorkerMetadata):
            return KvstrataWorkerMetadata(min(self.saved_through, other.saved_through))
        return self


class KvstrataConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = connector_config(transfer.kv_connector_extra_config)
        self._lookup_keys = lookup_keys(self.settings)
        self.engine_id = str(transfer.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.model_name = str(vllm_config.model_config.served_model_name or "")
        parallel = vllm_config.parallel_config
        self._ranks = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self._planner: SchedulerPlanner | None = None
        self._lookup: LookupClient | None = None
        self._worker: ConnectorWorker | None = None
        self._server: LookupServer | None = None
        self._loads: StepLoads | None = None
        # Without a store (no tier opened) it still reports plans as saved.
        self._saver = BackgroundSaver(_no_save, max_blocks=0)
        self._deltas = StatsDelta()
        self.pd_role = Role.of(transfer.kv_role)
        self._side: RoleSide | None = None  # kv_producer / kv_consumer
        if role == KVConnectorRole.SCHEDULER:
            fingerprint = model_fingerprint(vllm_config, kv_cache_config)
            if isinstance(fingerprint, ReuseDisabled):
                logger.warning(
                    "kvstrata: KV reuse disabled for this model (%s: %s)",
                    fingerprint.reason.value,
                    fingerprint.detail,
                )
            self.fingerprint = fingerprint
            self._lookup = LookupClient(
                self.engine_id, timeout_ms=self.settings.lookup_timeout_ms, curve=self._lookup_keys
            )
            secret = self.settings.tenant_secret
            self._planner = SchedulerPlanner(
                fingerprint,
                self.block_size,
                self._lookup,
                tenant_of=lambda salt: tenant_for_salt(salt, secret),
            )
            self._start_role(vllm_config, fingerprint)

    def _start_role(self, vllm_config: Any, fingerprint: ModelFingerprint | ReuseDisabled) -> None:
        """kv_producer / kv_consumer (``vllm_pd``): this side's model digest and layout."""
        if self.pd_role is Role.BOTH:
            return
        identity: tuple[bytes, KVLayout] | None = None
        if isinstance(fingerprint, ModelFingerprint):
            layout = vllm_kv_layout(
                vllm_config, kv_dtype=fingerprint.kv_dtype, order=_kv_order(), codec_id=KV_LAYOUT
            )
            if layout.problem() is None:
                identity = (bytes(fingerprint.model_digest()), layout)
        assert self._planner is not None and self._lookup is not None
        wait_s = self.settings.pd_wait_ms / 1000
        self._side = RoleSide(
            self.pd_role, self._planner, self._lookup, identity, wait_s=wait_s, clock=time.monotonic
        )

    # ==== worker side ==========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        codec = BlockCodec(kv_caches, int(self._kv_cache_config.num_blocks), self.block_size)
        events = self.settings.events
        audit = connector_audit(self.settings).start()
        store, why = None, "no tier could be opened"  # a remote-only store that is unreachable
        if self._ranks > 1:  # the fingerprint disables reuse; every rank would open the tiers
            why = f"{self._ranks} tensor/pipeline-parallel ranks (reuse is disabled)"
        else:
            try:
                store = build_store(
                    codec.block_bytes,
                    self.settings,
                    CollectorRegistry(),
                    record_events=events is not None,
                    audit=audit,
                )
            except TierError as exc:  # e.g. a disk tier another process holds
                why = f"a tier failed to open: {exc}"
        if store is None:
            audit.close()
            logger.warning("kvstrata: %s; vLLM runs without kvstrata's KV", why)
            register_local(self.engine_id, _no_hits)
            self._server = self._lookup_server(_no_hits)
            return
        emitter = None
        if events is not None:
            emitter = KVEventEmitter.from_config(events, block_size=self.block_size).start()
            emitter.start_replay()  # a router fills a gap in the lower-tier stream by replay
        wire(pool=None, store=store, emitter=emitter)
        self._worker = ConnectorWorker(
            store,
            codec,
            model=self.model_name,
            emitter=emitter,
            stats_path=self.settings.stats_path,
            audit=audit,
        )
        self._loads = StepLoads(self._worker.finish_load)
        max_blocks = self.settings.save_queue_blocks
        self._saver = BackgroundSaver(self._worker.save_request, max_blocks=max_blocks).start()
        register_local(self.engine_id, self._worker.lookup)
        self._server = self._lookup_server(self._worker.lookup)
        logger.info(
            "kvstrata: %d KV layers, %d B per block, tiers %s",
            len(codec.names),
            codec.block_bytes,
            [level.name for level in store.levels],
        )

    def _lookup_server(self, lookup: Lookup) -> LookupServer:
        endpoint = endpoint_for(self.engine_id)
        return LookupServer(endpoint, lookup, curve=self._lookup_keys).start()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvstrataConnectorMetadata)
        return metadata.plan

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker, loads = self._worker, self._loads
        if worker is None or loads is None:
            return
        plan = self._plan()
        if not plan.loads:
            return
        timeout_s = self.settings.load_timeout_ms / 1000
        loads.begin(lambda: worker.begin_load(plan.loads, timeout_s=timeout_s))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._loads is not None:
            self._loads.layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks of every layer are queued after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan.pd_counts and self._worker is not None:
            self._worker.pd_counts(plan.pd_counts)
        if self._worker is None or self._loads is None:
            self._saver.submit((), seq=plan.seq)  # nothing to store: reported saved at once
            return
        skip, tainted = self._loads.end_step()
        chosen: list[RequestSave] = []
        if plan.saves:  # nothing computed on a failed load is saved (``select_saves``)
            chosen = self._worker.select_saves(plan.saves, skip=skip, tainted=tainted)
        self._saver.submit(chosen, seq=plan.seq)
        self._copy_saver_counts()
        self._worker.end_step()

    def _copy_saver_counts(self) -> None:
        if self._worker is not None:
            saver = self._saver
            self._worker.saver_counts(
                dropped=saver.dropped_blocks,
                failed=saver.failed_jobs,
                flushed=saver.flushed,
                flush_seconds=saver.flush_seconds,
            )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward: a preempted request's blocks are freed at once, and a finished
        request's fenced block was handed out again (``StepPlan.flush``): finish their saves."""
        if isinstance(kv_connector_metadata, KvstrataConnectorMetadata):
            plan = kv_connector_metadata.plan
            if plan.preempted:
                self._saver.drain_requests(plan.preempted)
            self._saver.flush(plan.flush)

    def build_connector_worker_meta(self) -> KvstrataWorkerMetadata:
        return KvstrataWorkerMetadata(self._saver.saved_through())

    def get_kv_connector_stats(self) -> KvstrataConnectorStats | None:
        if self._worker is None:
            return None
        self._copy_saver_counts()
        gauges = {"save_queued_blocks": float(self._saver.queued_blocks)}
        delta = self._deltas.take(self._worker.snapshot_stats(), gauges)
        delta.update(self._worker.take_pd_reasons())
        return KvstrataConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvstrataConnectorStats:
        return KvstrataConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvstrataPromMetrics:
        return KvstrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def drain_write_back(self) -> None:
        """Worker side: return once every save queued so far and every write-back has reached
        its tier (a benchmark's "stored" point; vLLM itself never calls it)."""
        self._saver.wait_idle()
        if self._worker is not None:
            self._worker.store.flush()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """May come before ``wait_for_save`` (speculative decoding): books the step's load
        first, so its failures are in this step's output (``StepLoads``)."""
        return set() if self._loads is None else self._loads.errors()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        unregister_local(self.engine_id)
        if self._loads is not None:
            self._loads.close()
        self._saver.close()  # drains: every queued save reaches the store before it closes
        self._copy_saver_counts()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._lookup is not None:
            self._lookup.close()

    # ==== scheduler side =======================================================================
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        eligible = (
            request.lora_request is None
            and not request.mm_features
            and getattr(request, "prompt_embeds", None) is None
        )
        if eligible and self._side is not None:
            gate = self._side.admit(request)
            if gate is Gate.WAIT:
                return None, False  # the producer's blocks are not all stored yet: ask again
            eligible = gate is not Gate.LOCAL
        tokens = self._planner.matched_tokens(
            request.request_id,
            request.all_token_ids,
            request.cache_salt,
            num_computed_tokens,
            eligible=eligible,
        )
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.after_alloc(
            request.request_id, blocks.get_block_ids()[0], num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvstrataConnectorMetadata:
        assert self._planner is not None
        scheduled: list[ScheduledRequest] = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append(
                ScheduledRequest(
                    new.req_id,
                    new.block_ids[0],
                    True,
                    new.num_computed_tokens,
                    counts.get(new.req_id, 0),
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    new_blocks[0] if new_blocks is not None else [],
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[i],
                    counts.get(req_id, 0),
                )
            )
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        for req_id in preempted:  # first: a request may be resumed in the same step
            self._planner.preempted(req_id)
        plan = self._planner.build(scheduled)
        plan.preempted = tuple(sorted(preempted))
        if self._side is not None:
            plan.pd_counts = self._side.take_counts()
        return KvstrataConnectorMetadata(plan)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._planner is None:
            return False, None
        params = self._side.offer_params(request) if self._side is not None else None
        # Freed at once, fenced (``vllm_plan``); a consumer of the offer waits until the store
        # holds the offered blocks.
        self._planner.finished(request.request_id)
        return False, params

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._planner is not None and isinstance(meta, KvstrataWorkerMetadata):
            self._planner.saves_done(meta.saved_through)


def _no_hits(
    tenant: str, keys: Sequence[BlockKey], presence: bool = False, req_id: str | None = None
) -> int:
    return 0


def _no_save(request: RequestSave) -> None:
    return


def _kv_order() -> str:
    """Axis order of a stored block's payload (``vllm_layout``: each layer's block in logical
    order): CPU ``[heads, tokens, K|V · head_dim]``; GPU ``[K|V, tokens, heads, head_dim]``."""
    from vllm.platforms import current_platform  # type: ignore[import-not-found]

    return "LHTKD" if str(current_platform.device_type) == "cpu" else "LKTHD"
