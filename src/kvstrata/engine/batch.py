"""The step thread's side of the engine: a running batch, one forward per step.

``BatchRunner`` owns the scheduler and every ``Sequence`` once it has left the engine's inbox,
and does what a step does (see ``engine``'s docstring and docs/engine.md): plan with the
scheduler, admit (lookup, promotion, the partial tail), reserve scratch blocks (preempting
when the pool is full), run one packed forward, publish the blocks that filled, sample, and
finish sequences. Only the step thread calls it; it takes no locks of its own.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvstrata.costs import OnlinePrefillFit
from kvstrata.engine.generation import Generation
from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.engine.paged_attention import (
    BATCH_KWARG,
    BatchLayout,
    DecodeBatch,
    LayerListener,
    SeqSlice,
)
from kvstrata.engine.relayout import StoredRelayout
from kvstrata.engine.sampling import SamplingParams, sample_next
from kvstrata.engine.sequence import Sequence as Seq
from kvstrata.engine.tiering import PoolBridge
from kvstrata.errors import EngineError
from kvstrata.identity import BlockKey
from kvstrata.runtime.blocks import BlockInfo, block_tokens
from kvstrata.runtime.scheduler import Admission, Scheduler, SchedulerConfig
from kvstrata.store.levels import Located, RequestScope
from kvstrata.telemetry import KvMetrics

logger = logging.getLogger(__name__)


class StepShape(NamedTuple):
    """One step's batch: its sequences, the tokens it computed, and its seconds."""

    sequences: int
    tokens: int
    seconds: float


class BatchRunner:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        pool: PagedKVPool,
        bridge: PoolBridge | None,
        relayout: StoredRelayout | None = None,
        scheduler: SchedulerConfig,
        metrics: KvMetrics,
        costs: OnlinePrefillFit,
        device: str,
        model_id: str,
        is_stop: Callable[[int, SamplingParams], bool],
        dequeued: Callable[[], None],
    ) -> None:
        """``dequeued`` is called once per request when it leaves the queue the first time
        (admitted, or finished while waiting): the engine's bound on waiting requests."""
        self.model = model
        self.pool = pool
        self.bridge = bridge
        self.relayout = relayout  # stored objects of other layouts, converted at admission
        self.block_size = pool.config.block_size
        self.scheduler: Scheduler[Seq] = Scheduler(scheduler)
        self.metrics = metrics
        self.costs = costs
        self.device = device
        self.model_id = model_id
        self._is_stop = is_stop
        self._dequeued = dequeued
        self._by_gen: dict[int, Seq] = {}
        self.step_s_avg = 0.05
        self.last_step: StepShape | None = None  # read by bench prefill's decode curve

    # ---- sequences in and out ------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        self._by_gen[id(seq.gen)] = seq
        self.scheduler.add(seq, placed_at=seq.placed_at, arrived_s=seq.arrival)

    def cancel(self, generation: Generation) -> None:
        seq = self._by_gen.get(id(generation))
        if seq is not None:
            self._finish(seq, "abort")  # freed like any early end; the caller has its text
            if generation.close_reason == "abort":  # a stop string is a normal end
                self.metrics.cancelled.inc()

    def abort_all(self, error: BaseException) -> None:
        for seq in list(self.scheduler):
            self._finish(seq, "abort", error)

    def __len__(self) -> int:
        return len(self.scheduler)

    # ---- one step ---------------------------------------------------------------------------
    def run_step(self) -> bool:
        """Plan, admit, reserve, forward, publish, sample; False when there was nothing to do."""
        work = self._reserve(self.scheduler.plan(self._admit))
        self.metrics.running.set(len(self.scheduler.running))
        if not work:
            return False
        started = time.perf_counter()
        try:
            self._forward(work)
        except Exception as exc:
            for seq, _ in work:
                self._finish(seq, "error", exc)
            raise
        elapsed = time.perf_counter() - started
        self.metrics.running.set(len(self.scheduler.running))  # what finished this step left
        self.step_s_avg = 0.9 * self.step_s_avg + 0.1 * elapsed
        self.last_step = StepShape(len(work), sum(n for _, n in work), elapsed)
        self.metrics.step.observe(elapsed)
        self.metrics.batch_sequences.observe(self.last_step.sequences)
        self.metrics.batch_tokens.observe(self.last_step.tokens)
        return True

    # ---- admission: lookup, promotion, the partial tail --------------------------------------
    def _admit(self, seq: Seq) -> Admission:
        """:meth:`_admission`; a sequence whose admission raised (a store lookup or a
        promotion that failed in a way its tier did not absorb) is finished with that error
        — its caller gets it — instead of falling out of both queues unanswered."""
        try:
            return self._admission(seq)
        except Exception as exc:
            logger.exception("admitting request %s failed", seq.gen.request_id)
            self._finish(seq, "error", exc)
            return Admission.FAILED

    def _admission(self, seq: Seq) -> Admission:
        block_size = self.block_size
        needed = math.ceil((len(seq.tokens) + 1) / block_size)
        # Also with nothing running: blocks pinned outside the batch (a prefill handle's) can
        # leave too few, and an admitted sequence would preempt itself at every step.
        if self.pool.blocks_available < needed:
            return Admission.WAIT
        if seq.lookup and self._waits_for_blocks_in_flight(seq):
            self.metrics.deferred.inc()
            return Admission.DEFER
        now = time.perf_counter()
        first = not seq.started
        if first:
            seq.started = True  # dequeued now: ``_finish`` must not count it out again
            self._dequeued()
            if self.bridge is not None:
                self.bridge.prefetch_done(seq.gen.request_id)  # admission loads the rest
            seq.gen.record.queue_s = now - seq.arrival
            self.metrics.queue_delay.observe(seq.gen.record.queue_s)
        seq.admitted_at = now
        matched_by_tier = self._lookup(seq) if seq.lookup else {}
        if first:
            record = seq.gen.record
            record.matched_tokens = seq.num_computed
            record.computed_tokens = len(seq.tokens) - seq.num_computed
            record.matched_by_tier = matched_by_tier
            if record.reuse_disabled_reason is not None:
                self.metrics.reuse_disabled.labels(reason=record.reuse_disabled_reason).inc()
            self.metrics.observe_prefill(
                prompt_tokens=len(seq.tokens), matched_by_tier=matched_by_tier
            )
        return Admission.ADMIT

    def _waits_for_blocks_in_flight(self, seq: Seq) -> bool:
        """Is the first block ``seq`` would compute being computed by a running sequence that
        will publish it? Then ``seq`` hits it in a step or two instead of computing it too."""
        if seq.root is None:
            return False
        full = (len(seq.tokens) - 1) // self.block_size
        keys = [seq.key(i, self.block_size) for i in range(full)]
        matched = len(self.pool.lookup_prefix(keys))
        if matched >= full:
            return False
        wanted = keys[matched]
        return any(
            other.store and other.publishable and wanted in other.keys[other.committed :]
            for other in self.scheduler.running
        )

    def _lookup(self, seq: Seq) -> dict[str, int]:
        """Reference the longest reusable prefix of ``seq.tokens`` (all but the last token).

        What the store holds of the prompt beyond the device hit is held against eviction
        for the whole lookup (``PoolBridge.hold``): each promoted block makes room in the pool,
        a block evicted there may be demoted into a full store level, and that level's victim
        must not be the tail's donor (block ``full``, loaded by a second promotion). Unheld, a
        2,048-token prompt found its 2,032 full-block tokens and lost the 15 after them."""
        block_size = self.block_size
        full = (len(seq.tokens) - 1) // block_size  # blocks wholly before the last token
        keys = [seq.key(i, block_size) for i in range(len(seq.tokens) // block_size)]
        held = self.pool.lookup_prefix(keys[:full])
        self.pool.acquire(held)
        seq.table, seq.committed = list(held), len(held)  # released with ``seq``, come what may
        stored: list[Located] = []
        if self.bridge is not None and len(held) < len(keys):
            stored = self.bridge.hold(keys[len(held) :], self._scope(seq))
        try:
            return self._reference(seq, keys, full, held)
        finally:
            if stored:
                assert self.bridge is not None
                self.bridge.release(stored)

    def _reference(
        self, seq: Seq, keys: list[BlockKey], full: int, held: list[int]
    ) -> dict[str, int]:
        """``_lookup`` past the device hit ``held``: promotions, relayout, the tail."""
        block_size = self.block_size
        tokens = seq.tokens
        by_tier = {"device": len(held) * block_size} if held else {}
        if self.bridge is not None and len(held) < full:
            promoted = self.bridge.promote(keys[:full], len(held), self._scope(seq), tokens)
            seq.table += promoted.block_ids
            seq.committed = len(seq.table)
            for tier, count in promoted.tokens_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + count
        if self.relayout is not None and seq.committed < full:
            converted = self.relayout.extend(tokens, keys, seq.committed, full, self._scope(seq))
            seq.table += converted.block_ids
            seq.committed = len(seq.table)
            for tier, count in converted.tokens_by_tier.items():
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
        block_size = self.block_size
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
        needed = math.ceil((seq.num_computed + count) / self.block_size)
        while len(seq.table) < needed:
            block_id = self.pool.allocate_scratch()
            if block_id is None:
                return False
            seq.table.append(block_id)
        return True

    def _preempt(self, seq: Seq) -> None:
        seq.release(self.pool)
        seq.keys = seq.keys[: len(seq.tokens) // self.block_size]
        seq.gen.record.preemptions += 1
        self.metrics.preemptions.inc()

    # ---- the forward ---------------------------------------------------------------------------
    def _forward(self, work: list[tuple[Seq, int]]) -> None:
        started = time.perf_counter()
        block_size = self.block_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        slices: list[SeqSlice] = []
        sampled: list[int] = []
        rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_contexts: list[int] = []
        listeners: list[tuple[LayerListener, tuple[int, ...]]] = []
        for index, (seq, count) in enumerate(work):
            start, stop = seq.num_computed, seq.num_computed + count
            table = torch.tensor(seq.table, dtype=torch.long)
            pos = torch.arange(start, stop)
            ids += seq.tokens[start:stop]
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            n_blocks = math.ceil(stop / block_size)
            if seq.on_layer is not None:  # each block once: when it is full, or at the end
                named_end = n_blocks if stop == len(seq.tokens) else stop // block_size
                named = tuple(seq.table[start // block_size : named_end])
                listeners.append((_guarded(seq, seq.on_layer), named))
            if count == 1:  # one token: batched with every other such sequence
                decode_rows.append(len(ids) - 1)
                decode_tables.append(seq.table[:n_blocks])
                decode_contexts.append(stop)
            else:
                blocks = table[:n_blocks].to(self.device)
                slices.append(SeqSlice.make(len(ids) - count, count, stop, blocks))
            if stop == len(seq.tokens):
                sampled.append(index)
                rows.append(len(ids) - 1)
        decode = None
        if decode_rows:
            decode = DecodeBatch.make(
                decode_rows, decode_tables, decode_contexts, block_size, self.device
            )
        layout = BatchLayout(
            kv=self.pool.kv,
            slots=torch.cat(slots).to(self.device),
            seqs=tuple(slices),
            decode=decode,
            layer_listeners=tuple(listeners),
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
        if logits.is_cuda:  # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize(logits.device)
        done = time.perf_counter()
        if len(work) == 1:  # a step of one prefill chunk: a clean observation of its cost
            seq, count = work[0]
            if count > 1:
                self.costs.observe(count, seq.num_computed, done - forward_started)
        self._attribute(work, done - started)
        for seq, count in work:
            seq.num_computed += count
            self._publish_full_blocks(seq)
        for row, index in enumerate(sampled):
            if work[index][0].listener_error is None:
                self._sample(work[index][0], logits[row])
        for seq, _ in work if listeners else ():
            if seq.listener_error is not None:
                self._finish(seq, "error", seq.listener_error)

    def _attribute(self, work: list[tuple[Seq, int]], step_s: float) -> None:
        """Add to each prefilling sequence its own share of this step (``compute_s``): what
        its part would have taken as a step of its own, ``t0 + m_i``, scaled by how this
        step's measured time compares with the cost model's price of the whole step,
        ``step_s · (t0 + m_i) / (t0 + Σ_j m_j)`` (``t0``: the model's fixed cost of a forward,
        ``m_i``: the marginal cost of part ``i``, its new tokens after its context). Alone
        in a step, a part gets the step's measured time exactly; beside others it gets its
        own cost, not the shared step's. Summed over a prompt's steps up to its first token
        this is what its prefill would have taken alone (``RequestRecord.prefill_compute_s``):
        the sample the router fits a worker's prefill model from, on a busy worker too,
        where the wall time from admission to first token counts every shared step in full."""
        model = self.costs.model()
        fixed = model.overhead_s
        parts = [model.marginal_s(count, seq.num_computed) for seq, count in work]
        if fixed + sum(parts) <= 0:  # a model that prices nothing: split the step evenly
            fixed, parts = 0.0, [1.0] * len(work)
        scale = max(step_s, 0.0) / (fixed + sum(parts))
        for (seq, _), part in zip(work, parts, strict=True):
            if not seq.gen.output_ids:
                seq.compute_s += (fixed + part) * scale

    def _publish_full_blocks(self, seq: Seq) -> None:
        """Commit every scratch block that is now full, so others reuse it at once."""
        block_size = self.block_size
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
            tokens = block_tokens(seq.tokens, index, block_size)
            info = BlockInfo(seq.tenant, index * block_size, tokens, created_at=time.time())
            if not self.pool.publish(scratch, key, parent, info):
                seq.publishable = False
                return
            seq.committed += 1
            if self.bridge is not None:
                self.bridge.write_through(
                    [scratch],
                    seq.keys,
                    index,
                    seq.tenant,
                    seq.tokens,
                    request_id=seq.gen.request_id,
                )

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
            if record.preemptions == 0:  # a preempted prefill's steps were not one prefill
                record.prefill_compute_s = seq.compute_s
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
            self._dequeued()
            if self.bridge is not None:
                self.bridge.prefetch_done(seq.gen.request_id)
        self.scheduler.remove(seq)
        if seq.hold is not None and error is None and reason in ("stop", "length"):
            seq.hold(seq.hand_over(self.block_size, len(seq.gen.prompt_ids)))
        else:
            seq.release(self.pool)
        seq.gen._finish(reason, error)


def _guarded(seq: Seq, listener: LayerListener) -> LayerListener:
    """``listener`` for ``seq``: what it raises fails ``seq`` alone (after the step), not the
    step's other sequences; once it has raised it is not called again."""

    def call(layer: int, block_ids: tuple[int, ...]) -> None:
        if seq.listener_error is not None:
            return
        try:
            listener(layer, block_ids)
        except Exception as exc:  # handed to the request's caller as its error
            seq.listener_error = exc

    return call
