"""The reference engine: a real transformers model, a paged KV pool, continuous batching and
exact prefix reuse.

Requests become ``Sequence``s. Every ``step`` asks the scheduler (``kvstrata.runtime.scheduler``)
which sequences compute how many tokens — decodes first, then chunked prefills, then newly
admitted requests, under one token budget — packs them into one forward of the real model and
samples the sequences whose chunk reached their end. Attention reads and writes the pool
directly (``paged_attention``): a cached prefix is used in place, never copied.

Admission looks a prompt up by its chained block keys: the longest committed prefix in the pool
is referenced, then blocks found in lower tiers are promoted, then the tail: reuse reaches the
last prompt token but one (the last one is always computed, so a hit produces the logits of a
fresh prefill). A partial tail block is copied from a cached block that continues the prompt
(copy-on-write), so a repeated prompt of 2,048 tokens computes one token. A running sequence's
new KV goes to scratch blocks; each one that fills is published under its key at once, so
concurrent requests and later turns hit it, and a cancelled request keeps what it completed.

Threads: ``generate`` and ``Generation.close`` may be called from any thread; everything else
runs on the step thread — the engine's own loop (``start_loop``) in a server, or the caller
iterating a generation when no loop runs. ``call`` runs a function between steps. That
machinery is ``step_loop.StepLoop``, the engine's base; ``EngineConfig`` and
``pool_config_for`` are ``engine_config`` (both re-exported here).

Prefetch: with the loop running and a store whose shared (remote) level sits below a local
one, a request submitted while the engine is busy (a step in progress, or others queued) has
its prefix handed to the pool bridge's prefetcher at once: it copies what only the shared
level holds into the local level on its own thread, so admission finds it there. Admission
(or leaving the queue) cancels it. A request submitted to an idle engine is admitted at the
next step, before any prefetch could finish, so none is started.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvstrata.costs import DEFAULT_PREFILL_MODEL, OnlinePrefillFit
from kvstrata.engine.adapter import Adapter
from kvstrata.engine.batch import BatchRunner
from kvstrata.engine.deletion import delete_everywhere
from kvstrata.engine.engine_config import EngineConfig, pool_config_for
from kvstrata.engine.generation import Generation
from kvstrata.engine.hf_identity import fingerprint_model
from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.paged_attention import LayerListener, use_paged_attention
from kvstrata.engine.prefill import PrefillHandle
from kvstrata.engine.relayout import StoredRelayout
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.sequence import HeldBlocks
from kvstrata.engine.sequence import Sequence as Seq
from kvstrata.engine.step_loop import StepLoop
from kvstrata.engine.tiering import PoolBridge
from kvstrata.errors import ContextTooLong, EngineError, InvalidInput, QueueFull
from kvstrata.identity import (
    DEFAULT_TENANT,
    BlockKey,
    ModelFingerprint,
    NamespaceRoot,
    ReuseDisabled,
    TenantNamespace,
    chain_keys,
    namespace_root,
)
from kvstrata.runtime import tokenization
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.runtime.wiring import wire
from kvstrata.store.deletion import DeleteReport, DeleteSelector
from kvstrata.store.levels import RequestScope
from kvstrata.store.tiered import TieredStore
from kvstrata.telemetry import KvMetrics, RequestRecord

_MAX_CACHED_ROOTS = 4096


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class ReferenceEngine(StepLoop):
    """A real model, a device KV pool, continuous batching and exact prefix reuse."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        metrics: KvMetrics | None = None,
        adapter: Adapter | None = None,
        chat_template: str | None = None,
        pool: PagedKVPool | None = None,
        store: TieredStore | None = None,
        costs: OnlinePrefillFit | None = None,
        events: KVEventEmitter | None = None,
    ) -> None:
        """``events``: publish KV events of the pool and the store (None: no events, no cost).
        The caller starts and closes the emitter; the engine attaches it and flushes it."""
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.metrics = metrics if metrics is not None else KvMetrics()
        self.device = _resolve_device(self.config.device)
        self.model.to(self.device)
        if adapter is not None:
            adapter.merge_into(self.model)
        self.chat_template = chat_template
        model_config = self.model.config
        self.max_model_len = self.config.max_model_len or int(model_config.max_position_embeddings)
        use_paged_attention(self.model)  # before the fingerprint, which names the kernel
        self.fingerprint: ModelFingerprint | ReuseDisabled = fingerprint_model(
            loaded,
            block_size=self.config.block_size,
            kv_dtype=str(self.model.dtype).removeprefix("torch."),
            adapter=adapter.identity() if adapter is not None else None,
            chat_template=chat_template,
        )
        pool_config = pool_config_for(
            loaded, self.config.block_size, self.config.pool_blocks, self.device
        )
        if pool is not None and pool.config != pool_config:
            raise EngineError("shared pool does not match this model's KV shape")
        self.pool = pool if pool is not None else PagedKVPool(pool_config, self.metrics)
        self.costs = costs if costs is not None else OnlinePrefillFit(DEFAULT_PREFILL_MODEL)
        self.bridge: PoolBridge | None = None
        if store is not None:
            self.bridge = PoolBridge(
                store,
                self.pool,
                model_id=self.model_id,
                recompute_estimate=self.costs.marginal_s,
                prefetch=self.config.prefetch,
            )
        relayout = None
        if (
            self.bridge is not None
            and self.config.read_layouts
            and isinstance(self.fingerprint, ModelFingerprint)
        ):
            relayout = StoredRelayout(
                self.bridge,
                self.fingerprint,
                self.config.read_layouts,
                tenant_secret=self.config.tenant_secret,
                metrics=self.metrics,
            )
        self.events = events
        wire(pool=self.pool, store=store, demotion=self.bridge, emitter=events)
        self.eos_token_ids = self._eos_ids()
        self._roots: OrderedDict[str, NamespaceRoot] = OrderedDict()
        self._roots_lock = threading.Lock()  # ``generate`` runs on any thread
        self.batch = BatchRunner(
            model=self.model,
            pool=self.pool,
            bridge=self.bridge,
            relayout=relayout,
            scheduler=self.config.scheduler,
            metrics=self.metrics,
            costs=self.costs,
            device=self.device,
            model_id=self.model_id,
            is_stop=self._is_stop,
            dequeued=self._dequeued,
        )
        self._step_lock = threading.RLock()  # one step at a time; held by the step thread
        self._wake = threading.Condition()  # guards the inbox, cancels, calls and the queue bound
        self._inbox: list[Seq] = []
        self._cancels: list[Generation] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._queued = 0  # submitted, never admitted yet (the bound of ``max_waiting``)
        self._stepping = False  # a step is running (guarded by ``_wake``): arrivals will wait
        self._loop: threading.Thread | None = None
        self._stopping = False

    def close(self) -> None:
        """Stop the loop, keep what the write policies promise, close the tiers (graceful stop).

        A write-back (or selective) first level copies a device block only when the pool
        evicts it, so blocks still only in the pool are evicted now: the demotion listener
        stores each one the store wants, as eviction under pressure would. ``store.close()``
        then drains every write-back queue below. Blocks held by a running generation stay.
        """
        self.stop_loop()
        if self.bridge is not None:
            self.pool.clear()
            self.bridge.store.close()
        self._flush_events()  # what the demotions and the write-back drain just stored

    # ---- tokenisation -------------------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return tokenization.encode_prompt(self.tokenizer, prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return tokenization.encode_chat(self.tokenizer, messages, self.chat_template)

    def chat_content_start(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], int]:
        """``encode_chat`` and the first token that depends on the messages' content."""
        return tokenization.chat_content_start(self.tokenizer, messages, self.chat_template)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ---- identity -----------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        """The fingerprint digest (hex) — what a tier's rollout ``models`` target names."""
        if isinstance(self.fingerprint, ReuseDisabled):
            return ""
        return self.fingerprint.digest().hex()

    @property
    def reuse_disabled(self) -> ReuseDisabled | None:
        return self.fingerprint if isinstance(self.fingerprint, ReuseDisabled) else None

    def block_keys(self, token_ids: Sequence[int], tenant: str = DEFAULT_TENANT) -> list[BlockKey]:
        root = self._root(tenant)
        if root is None:
            return []
        return chain_keys(root, token_ids, self.config.block_size)

    # ---- submission (any thread) ----------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        use_cache: bool = True,
        lookup: bool | None = None,
        store: bool | None = None,
        keep_logits: bool = False,
        request_id: str | None = None,
        on_layer: LayerListener | None = None,
        hold: Callable[[HeldBlocks], None] | None = None,
        placed_at: float | None = None,
    ) -> Generation:
        """Queue a generation; iterate the result (or call ``run()``) to get its tokens.

        ``use_cache=False`` is a fresh prefill that neither reads nor writes the pool;
        ``lookup`` and ``store`` override the two halves separately. Raises ``QueueFull``
        when ``max_waiting`` requests are queued already. ``on_layer(layer, block_ids)`` is
        called on the step thread after each layer of each step of this request has written
        its K/V, naming the blocks that step completed (``paged_attention.LayerListener``);
        ``hold`` receives the blocks of a request that
        finished normally instead of their release (``prefill`` uses both). ``placed_at``:
        when a router placed the request (its wall clock), so requests proxied together are
        admitted in the order they were placed (``runtime.scheduler``).
        """
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidInput("prompt must contain at least one token")
        vocab = int(self.model.config.vocab_size)
        if min(prompt) < 0 or max(prompt) >= vocab:  # else the batch's forward fails for all
            raise InvalidInput(f"token ids must lie in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextTooLong(
                f"prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} exceeds "
                f"the context window of {self.max_model_len} tokens"
            )
        block_size = self.config.block_size
        if math.ceil((len(prompt) + params.max_tokens) / block_size) > self.pool.config.num_blocks:
            raise ContextTooLong(
                f"prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} does not "
                f"fit the KV pool of {self.pool.config.num_blocks * block_size} tokens"
            )
        disabled = self.reuse_disabled
        allowed = self.config.reuse and disabled is None
        lookup = (use_cache if lookup is None else lookup) and allowed
        store = (use_cache if store is None else store) and allowed
        rid = request_id or uuid.uuid4().hex
        record = RequestRecord(request_id=rid, tenant=tenant, prompt_tokens=len(prompt))
        if disabled is not None:
            record.reuse_disabled_reason = disabled.reason.value
        generation = Generation(
            request_id=rid, prompt_ids=prompt, params=params, record=record, keep_logits=keep_logits
        )
        generator = torch.Generator(device="cpu")
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        seq = Seq(gen=generation, tenant=tenant, lookup=lookup, store=store, generator=generator)
        seq.on_layer, seq.hold, seq.placed_at = on_layer, hold, placed_at
        seq.tokens = list(prompt)
        if lookup or store:
            seq.root = self._root(tenant)
        with self._wake:
            if self._queued >= self.config.scheduler.max_waiting:
                self.metrics.rejected.inc()
                raise QueueFull(
                    f"{self._queued} requests are waiting (scheduler.max_waiting); retry later",
                    retry_after_s=self._retry_after(),
                )
            self._queued += 1
            self.metrics.queue_depth.set(self._queued)
            generation._driver = self
            self._inbox.append(seq)
            self._wake.notify()
            waits = self._stepping or self._queued > 1
        if waits and lookup:
            self._prefetch(seq, prompt)
        return generation

    def prefill(
        self,
        prompt_ids: Sequence[int],
        *,
        tenant: str = DEFAULT_TENANT,
        on_layer: LayerListener | None = None,
        request_id: str | None = None,
    ) -> PrefillHandle:
        """A prefill-only request (a prefill for transfer): compute the prompt's KV, sample its
        first token greedily, and keep every block of the prompt pinned until the handle's
        ``release`` — see :mod:`kvstrata.engine.prefill`."""
        handle = PrefillHandle(self.pool, self.call)
        handle.generation = self.generate(
            prompt_ids,
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            tenant=tenant,
            request_id=request_id,
            on_layer=on_layer,
            hold=handle._hold,
        )
        return handle

    def _prefetch(self, seq: Seq, prompt: list[int]) -> None:
        """Hand a queued request's prefix to the prefetcher (keys are hashed on its thread)."""
        root, bridge, block_size = seq.root, self.bridge, self.config.block_size
        full = len(prompt) // block_size  # admission's blocks, and the tail's donor if full
        if root is None or bridge is None or full == 0:
            return
        blocks = prompt[: full * block_size]
        rid = seq.gen.request_id
        scope = RequestScope(tenant=seq.tenant, model=self.model_id, request_id=rid)
        bridge.prefetch(rid, lambda: chain_keys(root, blocks, block_size), scope)

    def delete(self, selector: DeleteSelector, now: float | None = None) -> DeleteReport:
        """Delete what ``selector`` names from the device pool and every store tier, leaving
        tombstones (``engine.deletion``). Engine thread only:
        ``engine.call(lambda: engine.delete(selector)).result()``."""
        store = self.bridge.store if self.bridge is not None else None
        report = delete_everywhere(self.pool, store, selector, time.time() if now is None else now)
        self._flush_events()
        return report

    def _retry_after(self) -> float:
        """Seconds until the queue has likely moved: queued work over the batch's pace."""
        waiting = self._queued + len(self.batch.scheduler.running)
        per_request = self.batch.step_s_avg * 32  # ~a prefill chunk and a short answer
        return max(1.0, waiting * per_request / self.config.scheduler.max_num_seqs)

    def _root(self, tenant: str) -> NamespaceRoot | None:
        if isinstance(self.fingerprint, ReuseDisabled):
            return None
        with self._roots_lock:
            root = self._roots.get(tenant)
            if root is not None:
                self._roots.move_to_end(tenant)
                return root
        namespace = TenantNamespace.for_tenant(tenant, self.config.tenant_secret)
        root = namespace_root(self.fingerprint.digest(), namespace)
        with self._roots_lock:
            self._roots[tenant] = root
            if len(self._roots) > _MAX_CACHED_ROOTS:  # tenant names come from clients
                self._roots.popitem(last=False)
        return root

    def _is_stop(self, token: int, params: SamplingParams) -> bool:
        if token in params.stop_token_ids:
            return True
        return not params.ignore_eos and token in self.eos_token_ids

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(int(v) for v in value)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)


__all__ = ["EngineConfig", "ReferenceEngine", "pool_config_for"]
