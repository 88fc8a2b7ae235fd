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
iterating a generation when no loop runs. ``call`` runs a function between steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvstrata.costs import DEFAULT_PREFILL_MODEL, OnlinePrefillFit
from kvstrata.engine.adapter import Adapter
from kvstrata.engine.generation import Generation
from kvstrata.engine.hf_identity import fingerprint_model
from kvstrata.engine.kv_pool import PagedKVPool, PoolConfig
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.paged_attention import (
    BATCH_KWARG,
    BatchLayout,
    SeqSlice,
    use_paged_attention,
)
from kvstrata.engine.sampling import SamplingParams, sample_next
from kvstrata.engine.sequence import Sequence as Seq
from kvstrata.engine.tiering import PoolBridge
from kvstrata.errors import ContextTooLong, EngineError, InvalidInput, QueueFull, RequestCancelled
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
from kvstrata.runtime.blocks import BlockInfo, block_tokens
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.runtime.scheduler import Scheduler, SchedulerConfig
from kvstrata.runtime.wiring import wire
from kvstrata.store.levels import RequestScope
from kvstrata.store.tiered import TieredStore
from kvstrata.telemetry import KvMetrics, RequestRecord

logger = logging.getLogger("kvstrata.engine")
_MAX_CACHED_ROOTS = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    pool_blocks: int = 1024
    device: str = "auto"  # "auto" → cuda when available, else cpu
    tenant_secret: bytes = b""
    max_model_len: int | None = None  # None → the model's max_position_embeddings
    reuse: bool = True  # False: never look up or store (the fresh-prefill baseline)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


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
                store, self.pool, model_id=self.model_id, recompute_estimate=self.costs.marginal_s
            )
        self.events = events
        wire(pool=self.pool, store=store, demotion=self.bridge, emitter=events)
        self.eos_token_ids = self._eos_ids()
        self._roots: OrderedDict[str, NamespaceRoot] = OrderedDict()
        self.scheduler: Scheduler[Seq] = Scheduler(self.config.scheduler)
        self._step_lock = threading.RLock()  # one step at a time; held by the step thread
        self._inbox_lock = threading.Lock()
        self._wake = threading.Condition(self._inbox_lock)
        self._inbox: list[Seq] = []
        self._cancels: list[Generation] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._queued = 0  # submitted, never admitted yet (the bound of ``max_waiting``)
        self._by_gen: dict[int, Seq] = {}
        self._loop: threading.Thread | None = None
        self._stopping = False
        self._step_s_avg = 0.05

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
    ) -> Generation:
        """Queue a generation; iterate the result (or call ``run()``) to get its tokens.

        ``use_cache=False`` is a fresh prefill that neither reads nor writes the pool;
        ``lookup`` and ``store`` override the two halves separately. Raises ``QueueFull``
        when ``max_waiting`` requests are queued already.
        """
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidInput("prompt must contain at least one token")
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
        return generation

    def cancel(self, generation: Generation) -> None:
        """Free ``generation`` at the next step (``Generation.close`` calls this)."""
        with self._wake:
            self._cancels.append(generation)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the step thread between two steps (now, when no loop runs)."""
        future: Future[T] = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        if not self.loop_running:
            with self._step_lock:
                self._run_calls()
        return future

    def _retry_after(self) -> float:
        """Seconds until the queue has likely moved: queued work over the batch's pace."""
        waiting = self._queued + len(self.scheduler.running)
        per_request = self._step_s_avg * 32  # ~a prefill chunk and a short answer
        return max(1.0, waiting * per_request / self.config.scheduler.max_num_seqs)

    # ---- the step loop ------------------------------------------------------------------------
    @property
    def loop_running(self) -> bool:
        return self._loop is not None

    def start_loop(self) -> None:
        """Run steps on a thread of the engine's own until ``stop_loop`` (a server)."""
        if self._loop is not None:
            return
        self._stopping = False
        self._loop = threading.Thread(target=self._run_loop, name="kvstrata-engine", daemon=True)
        self._loop.start()

    def stop_loop(self) -> None:
        """Cancel every queued and running request and stop the loop thread."""
        loop = self._loop
        if loop is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        loop.join()
        self._loop = None

    def _run_loop(self) -> None:
        while True:
            with self._wake:
                while (
                    not self._stopping
                    and not self._inbox
                    and not self._cancels
                    and not self._calls
                    and not len(self.scheduler)
                ):
                    self._wake.wait(0.5)
                if self._stopping:
                    break
            try:
                self.step()
            except Exception:  # the failing step's requests got the error; keep serving
                logger.exception("engine step failed")
        with self._step_lock:
            self._abort_all(RequestCancelled("the engine stopped"))
            self._run_calls()

    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        with self._step_lock, torch.inference_mode():
            self._run_calls()
            self._take_inbox()
            work = self.scheduler.plan(self._admit)
            work = self._reserve(work)
            self.metrics.running.set(len(self.scheduler.running))
            if not work:
                self._flush_events()
                return False
            started = time.perf_counter()
            try:
                self._forward(work)
            except Exception as exc:
                for seq, _ in work:
                    self._finish(seq, "error", exc)
                self._flush_events()
                raise
            elapsed = time.perf_counter() - started
            self._step_s_avg = 0.9 * self._step_s_avg + 0.1 * elapsed
            self.metrics.step.observe(elapsed)
            self.metrics.batch_sequences.observe(len(work))
            self.metrics.batch_tokens.observe(sum(n for _, n in work))
            self._flush_events()
            return True

    def _run_calls(self) -> None:
        with self._wake:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

    def _take_inbox(self) -> None:
        with self._wake:
            arrivals, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for seq in arrivals:
            self._by_gen[id(seq.gen)] = seq
            self.scheduler.add(seq)
        for generation in cancels:
            cancelled = self._by_gen.get(id(generation))
            if cancelled is not None:
                self._finish(cancelled, "abort")
                self.metrics.cancelled.inc()

    def _abort_all(self, error: BaseException) -> None:
        self._take_inbox()
        for seq in list(self.scheduler):
            self._finish(seq, "abort", error)

    # ---- admission: lookup, promotion, the partial tail --------------------------------------
    def _admit(self, seq: Seq) -> bool:
        block_size = self.config.block_size
        needed = math.ceil((len(seq.tokens) + 1) / block_size)
        if self.scheduler.running and self.pool.blocks_available < needed:
            return False
        now = time.perf_counter()
        if not seq.started:
            with self._wake:
                self._queued -= 1
                self.metrics.queue_depth.set(self._queued)
            seq.gen.record.queue_s = now - seq.arrival
            self.metrics.queue_delay.observe(seq.gen.record.queue_s)
        seq.admitted_at = now
        matched_by_tier = self._lookup(seq) if seq.lookup else {}
        if not seq.started:
            seq.started = True
            record = seq.gen.record
            record.matched_tokens = seq.num_computed
            record.computed_tokens = len(seq.tokens) - seq.num_computed
            record.matched_by_tier = matched_by_tier
            if record.reuse_disabled_reason is not None:
                self.metrics.reuse_disabled.labels(reason=record.reuse_disabled_reason).inc()
            self.metrics.observe_prefill(
                prompt_tokens=len(seq.tokens), matched_by_tier=matched_by_tier
            )
        return True

    def _lookup(self, seq: Seq) -> dict[str, int]:
        """Reference the longest reusable prefix of ``seq.tokens`` (all but the last token)."""
        block_size = self.config.block_size
        tokens = seq.tokens
        full = (len(tokens) - 1) // block_size  # blocks wholly before the last token
        keys = [seq.key(i, block_size) for i in range(len(tokens) // block_size)]
        held = self.pool.lookup_prefix(keys[:full])
        self.pool.acquire(held)
        by_tier = {"device": len(held) * block_size} if held else {}
        seq.table, seq.committed = list(held), len(held)
        if self.bridge is not None and len(held) < full:
            promoted = self.bridge.promote(keys[:full], len(held), self._scope(seq), tokens)
            seq.table += promoted.block_ids
            seq.committed = len(seq.table)
            for tier, count in promoted.tokens_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + count
        seq.num_computed = seq.committed * block_size
        rest = len(tokens) - 1 - seq.num_computed
        if seq.committed == full and rest > 0:
            tail_tier = self._reuse_tail(seq, keys, rest)
            if tail_tier is not None:
                seq.num_computed += rest
                by_tier[tail_tier] = by_tier.get(tail_tier, 0) + rest
        return by_tier

    def _reuse_tail(self, seq: Seq, keys: list[BlockKey], rest: int) -> str | None:
        """Copy the first ``rest`` positions of block ``committed`` from a cached block that
        continues the prompt (its full key, or a child whose tokens start the same way)."""
        block_size = self.config.block_size
        index = seq.committed
        donor: int | None = None
        tier = "device"
        acquired: list[int] = []
        if index < len(keys):  # the prompt fills this block: its key names the donor
            donor = self.pool.block_id(keys[index])
            if donor is not None:
                self.pool.acquire([donor])
                acquired = [donor]
            elif self.bridge is not None:
                promoted = self.bridge.promote(
                    keys[: index + 1], index, self._scope(seq), seq.tokens
                )
                if promoted.block_ids:
                    donor, acquired = promoted.block_ids[0], promoted.block_ids
                    tier = next(iter(promoted.tokens_by_tier))
        elif index > 0:
            want = tuple(seq.tokens[index * block_size : index * block_size + rest])
            for child, info in self.pool.children(keys[index - 1]):
                tokens = info.tokens if isinstance(info, BlockInfo) else None
                if tokens is not None and tokens[:rest] == want:
                    donor = child
                    self.pool.acquire([donor])
                    acquired = [donor]
                    break
        if donor is None:
            return None
        try:
            scratch = self.pool.allocate_scratch()
            if scratch is None:
                return None
            self.pool.copy_block(donor, scratch)
            seq.table.append(scratch)
        finally:
            self.pool.release(acquired)
        return tier

    def _scope(self, seq: Seq) -> RequestScope:
        return RequestScope(tenant=seq.tenant, model=self.model_id, request_id=seq.gen.request_id)

    # ---- blocks for this step's tokens ----------------------------------------------------
    def _reserve(self, work: list[tuple[Seq, int]]) -> list[tuple[Seq, int]]:
        """Give every scheduled sequence the blocks its new tokens go to, preempting the most
        recently admitted sequences when the pool runs out."""
        planned = list(work)
        i = 0
        while i < len(planned):
            seq, count = planned[i]
            if self._grow(seq, count):
                i += 1
                continue
            victim = self.scheduler.preempt_last()
            if victim is None:  # cannot happen: ``seq`` itself is running
                raise EngineError("the KV pool has no free block")
            self._preempt(victim)
            planned = [(s, n) for s, n in planned if s is not victim]
            if victim is not seq:  # retry ``seq``, wherever it now stands
                i = next(k for k, (s, _) in enumerate(planned) if s is seq)
        return planned

    def _grow(self, seq: Seq, count: int) -> bool:
        """Scratch blocks until ``seq``'s table covers ``count`` more tokens; False: pool full."""
        needed = math.ceil((seq.num_computed + count) / self.config.block_size)
        while len(seq.table) < needed:
            block_id = self.pool.allocate_scratch()
            if block_id is None:
                return False
            seq.table.append(block_id)
        return True

    def _preempt(self, seq: Seq) -> None:
        seq.release(self.pool)
        seq.keys = seq.keys[: len(seq.tokens) // self.config.block_size]
        seq.gen.record.preemptions += 1
        self.metrics.preemptions.inc()

    # ---- the forward ---------------------------------------------------------------------------
    def _forward(self, work: list[tuple[Seq, int]]) -> None:
        block_size = self.config.block_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        slices: list[SeqSlice] = []
        sampled: list[int] = []
        rows: list[int] = []
        for index, (seq, count) in enumerate(work):
            start, stop = seq.num_computed, seq.num_computed + count
            table = torch.tensor(seq.table, dtype=torch.long)
            pos = torch.arange(start, stop)
            ids += seq.tokens[start:stop]
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            n_blocks = math.ceil(stop / block_size)
            blocks = table[:n_blocks].to(self.device)
            slices.append(SeqSlice.make(len(ids) - count, count, stop, blocks))
            if stop == len(seq.tokens):
                sampled.append(index)
                rows.append(len(ids) - 1)
        layout = BatchLayout(
            kv=self.pool.kv, slots=torch.cat(slots).to(self.device), seqs=tuple(slices)
        )
        forward_started = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.cat(positions).unsqueeze(0).to(self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(rows, dtype=torch.long, device=self.device),
            **{BATCH_KWARG: layout},
        )
        logits = out.logits[0].float()
        if len(work) == 1:  # a step of one prefill chunk: a clean observation of its cost
            seq, count = work[0]
            if count > 1:
                self.costs.observe(count, seq.num_computed, time.perf_counter() - forward_started)
        for seq, count in work:
            seq.num_computed += count
            self._publish_full_blocks(seq)
        for row, index in enumerate(sampled):
            self._sample(work[index][0], logits[row])

    def _publish_full_blocks(self, seq: Seq) -> None:
        """Commit every scratch block that is now full, so others reuse it at once."""
        block_size = self.config.block_size
        full = seq.num_computed // block_size
        if not seq.store or seq.root is None or not seq.publishable:
            return
        while seq.committed < full:
            index = seq.committed
            key = seq.key(index, block_size)
            parent = seq.keys[index - 1] if index else None
            scratch = seq.table[index]
            existing = self.pool.block_id(key)
            if existing is not None:  # another request published the same block first
                self.pool.acquire([existing])
                self.pool.free_scratch(scratch)
                seq.table[index] = existing
                seq.committed += 1
                continue
            info = BlockInfo(
                seq.tenant, index * block_size, block_tokens(seq.tokens, index, block_size)
            )
            if not self.pool.publish(scratch, key, parent, info):
                seq.publishable = False
                return
            seq.committed += 1
            if self.bridge is not None:
                self.bridge.write_through([scratch], seq.keys, index, seq.tenant, seq.tokens)

    # ---- sampling and the end of a sequence ------------------------------------------------
    def _sample(self, seq: Seq, logits: torch.Tensor) -> None:
        gen = seq.gen
        if gen.keep_logits:
            gen.step_logits.append(logits.detach().cpu())
        token = sample_next(logits, gen.params, seq.generator)
        seq.tokens.append(token)
        if len(gen.output_ids) == 0:
            now = time.perf_counter()
            record = gen.record
            record.ttft_s = now - seq.arrival
            record.prefill_s = now - (seq.admitted_at or seq.arrival)
            self.metrics.ttft.observe(record.ttft_s)
            self.metrics.prefill.observe(record.prefill_s)
        gen._emit(token)
        if self._is_stop(token, gen.params):
            self._finish(seq, "stop")
        elif len(gen.output_ids) >= gen.params.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Seq, reason: str, error: BaseException | None = None) -> None:
        if self._by_gen.pop(id(seq.gen), None) is None:
            return
        if not seq.started:
            with self._wake:
                self._queued -= 1
                self.metrics.queue_depth.set(self._queued)
        self.scheduler.remove(seq)
        seq.release(self.pool)
        seq.gen._finish(reason, error)

    def _root(self, tenant: str) -> NamespaceRoot | None:
        if isinstance(self.fingerprint, ReuseDisabled):
            return None
        root = self._roots.get(tenant)
        if root is None:
            namespace = TenantNamespace.for_tenant(tenant, self.config.tenant_secret)
            root = namespace_root(self.fingerprint.digest(), namespace)
            self._roots[tenant] = root
            if len(self._roots) > _MAX_CACHED_ROOTS:  # tenant names come from clients
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(tenant)
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
