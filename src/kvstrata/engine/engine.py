"""The reference engine: a real transformers model with a paged KV pool and exact prefix reuse.

One request runs at a time (a lock serialises them); that keeps the engine simple and its
timings honest. A request's tokens become chained block keys; the longest committed prefix
of those keys is gathered from the pool into the attention cache, and only the rest of the
prompt is computed. The last prompt token is always computed, so a hit still produces the
logits of a fresh prefill. After prefill, and again after decoding, every new full block is
written to the pool, so later requests (and later turns of the same chat) hit it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.costs import DEFAULT_PREFILL_MODEL, OnlinePrefillFit
from kvstrata.engine.adapter import Adapter
from kvstrata.engine.cache_io import cache_from_blocks, store_blocks
from kvstrata.engine.generation import Generation, Prefill
from kvstrata.engine.hf_identity import fingerprint_model
from kvstrata.engine.kv_pool import PagedKVPool, PoolConfig
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams, sample_next
from kvstrata.engine.tiering import PoolBridge
from kvstrata.errors import ContextTooLong, EngineError, InvalidInput
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
from kvstrata.store.levels import RequestScope
from kvstrata.store.tiered import TieredStore
from kvstrata.telemetry import KvMetrics, RequestRecord

_MAX_CACHED_ROOTS = 4096


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    pool_blocks: int = 1024
    device: str = "auto"  # "auto" → cuda when available, else cpu
    tenant_secret: bytes = b""
    max_model_len: int | None = None  # None → the model's max_position_embeddings
    reuse: bool = True  # False: never look up or store (the fresh-prefill baseline)


def pool_config_for(
    loaded: LoadedModel, block_size: int, num_blocks: int, device: str = "cpu"
) -> PoolConfig:
    """The KV shape of this model's pool (``PoolConfig.bytes_per_block`` sizes it)."""
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return PoolConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=loaded.model.dtype,
        device=device,
    )


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class ReferenceEngine:
    """A real model, a device KV pool and exact prefix reuse."""

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
                store, self.pool, model_id=self.model_id, recompute_estimate=self.costs.marginal_s
            )
        self.events = events
        wire(pool=self.pool, store=store, demotion=self.bridge, emitter=events)
        self.eos_token_ids = self._eos_ids()
        self._roots: OrderedDict[str, NamespaceRoot] = OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Keep what the write policies promise, then close the tiers (a graceful stop).

        A write-back (or selective) first level copies a device block only when the pool
        evicts it, so blocks still only in the pool are evicted now: the demotion listener
        stores each one the store wants, as eviction under pressure would. ``store.close()``
        then drains every write-back queue below. Blocks held by a running generation stay.
        """
        if self.bridge is not None:
            self.pool.clear()
            self.bridge.store.close()
        self._flush_events()  # what the demotions and the write-back drain just stored

    def _flush_events(self) -> None:
        """Publish this step's KV events as one batch (on the engine thread, as ZMQ needs)."""
        if self.events is not None:
            self.events.flush()

    # ---- tokenisation -------------------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return tokenization.encode_prompt(self.tokenizer, prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return tokenization.encode_chat(self.tokenizer, messages, self.chat_template)

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
        if isinstance(self.fingerprint, ReuseDisabled):
            return []
        root = self._roots.get(tenant)
        if root is None:
            namespace = TenantNamespace.for_tenant(tenant, self.config.tenant_secret)
            root = namespace_root(self.fingerprint.digest(), namespace)
            self._roots[tenant] = root
            if len(self._roots) > _MAX_CACHED_ROOTS:  # tenant names come from clients
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(tenant)
        return chain_keys(root, token_ids, self.config.block_size)

    # ---- prefill ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        tenant: str = DEFAULT_TENANT,
        lookup: bool = True,
        store: bool = True,
        request_id: str | None = None,
    ) -> Prefill:
        """Process a prompt, reusing the longest cached prefix when ``lookup`` allows.

        ``store`` writes the prompt's new full blocks to the pool. The caller owns the
        returned blocks (``held_blocks``) and must ``pool.release`` them.
        """
        if not token_ids:
            raise InvalidInput("prompt must contain at least one token")
        started = time.perf_counter()
        disabled = self.reuse_disabled
        allowed = self.config.reuse and disabled is None
        lookup, store = lookup and allowed, store and allowed
        keys = self.block_keys(token_ids, tenant) if lookup or store else []
        # The last prompt token is always computed: at most (n - 1) // B blocks may match.
        max_blocks = (len(token_ids) - 1) // self.config.block_size
        held = self.pool.lookup_prefix(keys[:max_blocks]) if lookup else []
        self.pool.acquire(held)
        by_tier = {"device": len(held) * self.config.block_size} if held else {}
        try:
            if lookup and self.bridge is not None and len(held) < max_blocks:
                scope = RequestScope(tenant=tenant, model=self.model_id, request_id=request_id)
                promoted = self.bridge.promote(keys[:max_blocks], len(held), scope, token_ids)
                held = held + promoted.block_ids
                by_tier.update(promoted.tokens_by_tier)
            matched = len(held) * self.config.block_size
            cache = cache_from_blocks(self.pool, self.model.config, held)
            input_ids = torch.tensor([list(token_ids[matched:])], device=self.device)
            forward_started = time.perf_counter()
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
            self.costs.observe(
                len(token_ids) - matched, matched, time.perf_counter() - forward_started
            )
            logits = out.logits[0, -1].float()
            if store:
                store_blocks(
                    self.pool,
                    self.bridge,
                    keys,
                    out.past_key_values,
                    first_block=len(held),
                    tenant=tenant,
                    token_ids=token_ids,
                )
        except BaseException:
            self.pool.release(held)
            self._flush_events()
            raise
        self._flush_events()
        return Prefill(
            logits=logits,
            cache=out.past_key_values,
            matched_tokens=matched,
            matched_by_tier=by_tier,
            keys=keys,
            held_blocks=held,
            reuse_disabled=disabled,
            prefill_s=time.perf_counter() - started,
        )

    # ---- generation ---------------------------------------------------------------------
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
    ) -> Generation:
        """Start a generation; iterate the result (or call ``run()``) to produce tokens.

        ``use_cache=False`` is a fresh prefill that neither reads nor writes the pool;
        ``lookup`` and ``store`` override the two halves separately.
        """
        params = params or SamplingParams()
        params.validate()
        prompt = list(prompt_ids)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextTooLong(
                f"prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} exceeds "
                f"the context window of {self.max_model_len} tokens"
            )
        rid = request_id or uuid.uuid4().hex
        record = RequestRecord(request_id=rid, tenant=tenant, prompt_tokens=len(prompt))
        generation = Generation(request_id=rid, prompt_ids=prompt, params=params, record=record)
        generation._iterator = self._run(
            generation,
            lookup=use_cache if lookup is None else lookup,
            store=use_cache if store is None else store,
            keep_logits=keep_logits,
        )
        return generation

    def _run(
        self, gen: Generation, *, lookup: bool, store: bool, keep_logits: bool
    ) -> Iterator[int]:
        with self._lock, torch.inference_mode():
            started = time.perf_counter()
            state = self.prefill(
                gen.prompt_ids,
                tenant=gen.record.tenant,
                lookup=lookup,
                store=store,
                request_id=gen.request_id,
            )
            record = gen.record
            record.matched_tokens = state.matched_tokens
            record.computed_tokens = len(gen.prompt_ids) - state.matched_tokens
            record.prefill_s = state.prefill_s
            if state.reuse_disabled is not None:
                record.reuse_disabled_reason = state.reuse_disabled.reason.value
                self.metrics.reuse_disabled.labels(reason=record.reuse_disabled_reason).inc()
            record.matched_by_tier = dict(state.matched_by_tier)
            self.metrics.observe_prefill(
                prompt_tokens=len(gen.prompt_ids), matched_by_tier=state.matched_by_tier
            )
            self.metrics.prefill.observe(state.prefill_s)
            generator = torch.Generator(device="cpu")
            if gen.params.seed is not None:
                generator.manual_seed(gen.params.seed)
            else:
                generator.seed()
            logits, cache = state.logits, state.cache
            consistent = True  # the cache holds exactly prompt + output_ids[:-1]
            try:
                for step in range(gen.params.max_tokens):
                    if keep_logits:
                        gen.step_logits.append(logits.detach().cpu())
                    token = sample_next(logits, gen.params, generator)
                    gen.output_ids.append(token)
                    if step == 0:
                        record.ttft_s = time.perf_counter() - started
                        self.metrics.ttft.observe(record.ttft_s)
                    yield token
                    if self._is_stop(token, gen.params):
                        gen.finish_reason = "stop"
                        break
                    if step + 1 == gen.params.max_tokens:
                        break
                    consistent = False
                    out = self.model(
                        input_ids=torch.tensor([[token]], device=self.device),
                        past_key_values=cache,
                        use_cache=True,
                    )
                    logits, cache = out.logits[0, -1].float(), out.past_key_values
                    consistent = True
                if gen.finish_reason is None:
                    gen.finish_reason = "length"
            finally:
                try:
                    if store and state.keys and consistent:
                        # Generated tokens whose KV exists (all but the last) become reusable,
                        # also when the caller stopped early. Not after a failed forward: the
                        # cache may then hold a partial step.
                        all_ids = gen.prompt_ids + gen.output_ids[:-1]
                        keys = self.block_keys(all_ids, gen.record.tenant)
                        store_blocks(
                            self.pool,
                            self.bridge,
                            keys,
                            cache,
                            first_block=len(state.held_blocks),
                            tenant=record.tenant,
                            token_ids=all_ids,
                        )
                finally:
                    self.pool.release(state.held_blocks)
                    self._flush_events()
                record.output_tokens = len(gen.output_ids)
                record.finish_reason = gen.finish_reason

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
