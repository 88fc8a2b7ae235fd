"""One simulated worker: device KV pool + host tier driven by the store's policy objects.

Service model (times from the worker's :class:`~kvstrata.sim.profiles.SimProfile`):

* **Prefill queue, FIFO, one batch at a time.** A prefill starts when the previous batch has
  finished and the device pool has room for the request's KV. At its start the worker looks
  up its *own* caches (not the index: the index is only the router's belief): the longest
  prefix of the request's full blocks present in the device pool or, failing that, in the
  host tier. Host blocks are fetched (``fetch_s_per_block[HOST]`` each) unless fetching plus
  the shorter prefill is slower than recomputing everything (the engine's break-even rule),
  then the uncached tokens are computed: ``PrefillModel.seconds(new, cached)``.
* **Short prompts pack into one step**, as the engine's scheduler fills a step's token
  budget (``prefill_chunk_tokens``) from its waiting queue: the prompts behind the head join
  its batch while their new tokens fit in one step with it
  (:func:`kvstrata.router.queue.packs_with`, the rule the router's queue estimate uses) and
  the device pool has room; one that continues blocks the batch computes waits for them
  (the engine's ``Admission.DEFER``). A packed prompt shares the step's fixed cost
  (``overhead_s``, paid once per batch); every prompt of a batch gets its first token at the
  batch's end.
* **Chunked prefill interferes with decode.** With ``b`` decodes running, the prefill of
  ``n`` new tokens takes ``ceil(n / chunk)`` iterations, each also running one decode step
  (``CostProfile.interference_s``); decodes advance one token per iteration meanwhile. The
  batch size is taken at the prefill's start (decodes only join when a prefill *ends*, so
  it can only shrink during one; the small overestimate is accepted).
* **Decode is a continuous batch.** Outside prefills the batch runs back-to-back steps of
  ``decode_step_base_s + decode_interference_s · batch`` seconds. A request needs
  ``output_tokens − 1`` steps after its prefill produced the first token. Steps are not
  simulated one by one: a virtual step counter advances at the current rate and the next
  completion is rescheduled whenever the rate changes.
* **Service-time noise.** The whole prefill (fetch + compute + interference) is multiplied
  by ``service_factor(request index)`` (:class:`kvstrata.sim.view.ServiceNoise`; 1.0
  without): the per-job part is a function of the seed and the request, so every policy
  compared on a trace draws the same noise for the same request.
* **TTFT** = arrival → end of the request's prefill (queueing, fetch, prefill, interference).
* **KV occupancy.** A running request pins its prompt's cached blocks in the device pool and
  holds ``kv_blocks − full blocks`` private blocks (partial last block + output) until its
  decode ends. Its full blocks stay cached afterwards, evictable. A prefill that cannot get
  room waits without evicting anything: blocks are evicted only when that makes room.
* **Tiers.** Device → host is write-through (as the real store's default): every block the
  device stores is also stored in (or touched in) the host tier, so losing a device block
  costs a fetch, not a recompute. Each tier evicts by its own policy object
  (``kvstrata.store`` LRU or the value policy); victims are leaves and never pinned blocks.
* **Reports.** Stores are reported to the index when the prefill that computed them ends
  (the host tier: only the blocks it really holds, not those it had no room for); evictions
  when they happen (the simulation may delay both by an event lag).
* **What the router reads** (:meth:`SimWorker.load`) is what a live router can know, never a
  request's true output length before it ends: see :meth:`SimWorker.load`.

Utilisation: the fraction of the arrival window (first → last arrival) during which a
prefill is in progress (its fetch, compute and the decode steps interleaved with its chunks);
work left after the last arrival (draining a backlog) is not counted, so an overloaded
cluster shows ~100%, not a diluted figure. Decodes run beside prefills and never delay a
TTFT except through that interference, so this is the resource TTFT queues on.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvstrata.identity import BlockKey
from kvstrata.index.core import Medium
from kvstrata.objects import KVObjectMeta
from kvstrata.router.model import WorkerLoad
from kvstrata.router.queue import packs_with
from kvstrata.sim.profiles import BLOCK_TOKENS, SimProfile
from kvstrata.sim.trace import SimRequest
from kvstrata.store.policy import EvictionPolicy

Reporter = Callable[[str, list[int], Medium, bool, float], None]
"""(worker id, block ids, medium, stored?, now) → the index (or a delayed event)."""

PRIOR_OUTPUT_TOKENS: Final = 64.0
"""Expected output of a request before any has finished on the worker: the live fleet's
``WorkerState.mean_output_tokens`` default (:mod:`kvstrata.fleet.workers`)."""
RECENT_OUTPUTS: Final = 128
"""Completed outputs the running mean covers (the live fleet's ``_recent_outputs``)."""


@dataclass(slots=True)
class Job:
    """A request in flight on a worker, and what happened to it."""

    request: SimRequest
    keys: tuple[BlockKey, ...]
    estimate_s: float
    predicted_new_tokens: int
    start_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    """Start → first token: fetch, compute and decode interference, noise included."""
    compute_s: float = 0.0
    """Its own compute, noise included, without the fetch or the decode steps interleaved
    with its chunks: what the live engine reports (``serve.timing``: its share of each step
    by modelled cost; the fetch happens at admission, outside the steps) and so what the
    router refits from."""
    expected_output_tokens: int = 0
    """The output the router's KV figure counts for this request (set when it is enqueued):
    the worker's running mean of completed outputs then, not the request's own length."""
    hit_tokens: int = 0
    device_hit_blocks: int = 0
    host_hit_blocks: int = 0
    finish_steps: float = 0.0
    done_s: float = 0.0
    finished: bool = False
    worker: int = -1
    leads: bool = True
    """The head of its batch (False: packed behind another prompt, sharing its step)."""


def _no_noise(_request_index: int) -> float:
    return 1.0


class SimWorker:
    """State machine of one worker; the simulation calls it in time order."""

    def __init__(
        self,
        worker_id: str,
        profile: SimProfile,
        *,
        device_policy: EvictionPolicy,
        host_policy: EvictionPolicy,
        metas: dict[BlockKey, KVObjectMeta],
        block_ids: dict[BlockKey, int],
        report: Reporter,
    ) -> None:
        self.worker_id = worker_id
        self.profile = profile
        self.cost = profile.cost
        self.device_capacity = profile.device_blocks
        self.host_capacity = profile.host_blocks
        self.device_policy = device_policy
        self.host_policy = host_policy
        self._metas = metas
        self._ids = block_ids
        self._report = report
        self.device: set[BlockKey] = set()
        self.host: set[BlockKey] = set()
        self.pins: dict[BlockKey, int] = {}
        self.private_blocks = 0
        self.observed_kv_tokens = 0
        """Prompt + expected output of every request sent here and not finished (:meth:`load`)."""
        self.mean_output_tokens = PRIOR_OUTPUT_TOKENS
        self._recent_outputs: deque[int] = deque(maxlen=RECENT_OUTPUTS)
        self.queue: deque[Job] = deque()
        self.queued_s = 0.0
        self.queued_new_tokens = 0
        self.running: list[Job] = []
        """The batch in prefill: the head of the queue and the prompts packed behind it."""
        self.current_end_s = 0.0
        self.blocked = False
        self.decoding: list[tuple[float, int, Job]] = []
        self.steps = 0.0
        self.step_rate = 0.0
        self._prefill_step_rate = 0.0
        self._last_s = 0.0
        self.decode_version = 0
        self.busy_s = 0.0
        self.kv_block_s = 0.0
        """Integral of running requests' KV blocks over time, up to ``window_end_s``."""
        self.window_end_s = math.inf
        self._kv_last_s = 0.0
        self.device_evictions = 0
        self.host_evictions = 0
        self.service_factor: Callable[[int], float] = _no_noise
        """Service-time noise: each prefill's model time × ``service_factor(request index)``."""

    # ---------------------------------------------------------------- router's view
    def load(self, now: float) -> WorkerLoad:
        """The figures the router reads, each one a live router can know.

        * ``queued_requests`` / ``queued_prefill_tokens``: the requests sent here whose first
          token has not come back (queued or in prefill — a router cannot see a prefill
          start), and the new tokens the router predicted for them from its index match;
        * ``active_decodes``: first token seen, end not yet;
        * ``active_kv_blocks`` / ``kv_utilisation``: as the live fleet counts them
          (``kvstrata.fleet.workers.WorkerState.load``): per request sent and not finished,
          its prompt + the worker's running mean of its last :data:`RECENT_OUTPUTS`
          completed outputs when the request was sent (:data:`PRIOR_OUTPUT_TOKENS` before
          any), summed and divided by the block size. A request's true output length is
          never read before it ends; the device pool's real occupancy (pins and private
          blocks) is the simulator's own business, never shown to the router;
        * ``queued_s``: exact (the true remaining time of the running prefill): only
          ``SimConfig.oracle`` passes it to the router; otherwise
          :class:`kvstrata.sim.view.RouterView` replaces it with the router's own estimate.
        """
        running = len(self.running)
        queued_s = self.queued_s + (max(0.0, self.current_end_s - now) if running else 0.0)
        blocks = self.observed_kv_tokens // BLOCK_TOKENS
        return WorkerLoad(
            worker_id=self.worker_id,
            queued_requests=len(self.queue) + running,
            queued_prefill_tokens=self.queued_new_tokens,
            queued_s=queued_s,
            active_decodes=len(self.decoding),
            active_kv_blocks=blocks,
            kv_utilisation=min(1.0, blocks / max(self.device_capacity, 1)),
        )

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_s += job.estimate_s
        self.queued_new_tokens += job.predicted_new_tokens
        job.expected_output_tokens = int(self.mean_output_tokens)
        self.observed_kv_tokens += job.request.prompt_tokens + job.expected_output_tokens

    # ---------------------------------------------------------------- prefill
    def try_start(self, now: float) -> float | None:
        """Start the head of the queue, and the prompts behind it that pack into its step,
        if possible; returns the batch's end time (None: nothing started)."""
        if self.running or not self.queue:
            return None
        self.kv_tick(now)  # before pins change at ``now``
        head = self.queue[0]
        device_hits, host_hits = self._lookup(head)
        if not self._reserve(head, now):
            self.blocked = True
            return None
        self.blocked = False
        fresh = self._admit(self._dequeue(), now)
        batch = [(head, device_hits, host_hits)]
        budget = self.cost.prefill_chunk_tokens
        step_new = self._new_tokens(head, device_hits + host_hits)
        while self.queue:
            follower = self.queue[0]
            device_hits, host_hits = self._lookup(follower)
            if any(key in fresh for key in follower.keys[:device_hits]):
                break  # it continues blocks this batch computes: it waits for them
            new = self._new_tokens(follower, device_hits + host_hits)  # before break-even
            if not packs_with(step_new, new, budget) or not self._reserve(follower, now):
                break
            fresh |= self._admit(self._dequeue(), now)
            batch.append((follower, device_hits, host_hits))
            step_new += new
        return self._run(batch, now)

    def _lookup(self, job: Job) -> tuple[int, int]:
        """The job's cached prefix here: (leading blocks in the device pool, then the blocks
        after them in the host tier)."""
        device, host = self.device, self.host
        device_hits = host_hits = 0
        for key in job.keys:
            if key in device:
                device_hits += 1
            elif key in host:
                host_hits += 1
            else:
                break
        return device_hits, host_hits

    def _new_tokens(self, job: Job, matched: int) -> int:
        return job.request.prompt_tokens - job.request.hit_tokens(matched)

    def _reserve(self, job: Job, now: float) -> bool:
        """Pin the job's blocks the device pool holds and make room for the rest and its
        private blocks; False (nothing pinned, nothing evicted) when they cannot fit."""
        pins = self.pins
        present = [key for key in job.keys if key in self.device]
        for key in present:
            pins[key] = pins.get(key, 0) + 1
        need = job.request.kv_blocks - len(present)  # its missing full blocks + private ones
        if not self._make_device_room(need, now):
            for key in present:
                self._unpin(key)
            return False
        return True

    def _dequeue(self) -> Job:
        job = self.queue.popleft()
        self.queued_s = max(0.0, self.queued_s - job.estimate_s)
        return job

    def _admit(self, job: Job, now: float) -> set[BlockKey]:
        """Store a reserved job's blocks and hold its private ones; returns the blocks it
        added to the device pool (it computes them)."""
        fresh = {key for key in job.keys if key not in self.device}
        self._store(job, now)
        self.private_blocks += job.request.kv_blocks - len(job.keys)
        return fresh

    def _run(self, batch: list[tuple[Job, int, int]], now: float) -> float:
        """Price the admitted batch and start it (:meth:`try_start`).

        Each prompt is priced alone: fetch + ``PrefillModel.seconds(new, cached)``, or a
        full recompute when that is cheaper (the engine's break-even rule), × its noise
        factor. Prompts packed behind the head share its step's fixed cost (``overhead_s``,
        paid once); the decode steps interleaved with the batch's chunks come on top. Every
        prompt of the batch gets its first token at the batch's end."""
        model = self.cost.prefill
        fetch_per_block = self.cost.fetch_s_per_block[Medium.HOST]
        decodes = len(self.decoding)
        head_s = duration = 0.0
        new_total = 0
        for position, (job, device_hits, host_hits) in enumerate(batch):
            request = job.request
            prompt = request.prompt_tokens
            cached = request.hit_tokens(device_hits + host_hits)
            prefill_s = model.seconds(prompt - cached, cached)
            fetch_s = host_hits * fetch_per_block
            full_s = model.seconds(prompt, 0)
            if fetch_s + prefill_s > full_s:
                prefill_s, fetch_s, cached = full_s, 0.0, 0
                device_hits = host_hits = 0
            factor = self.service_factor(request.index)
            if position:
                duration += (fetch_s + prefill_s - min(model.overhead_s, prefill_s)) * factor
            else:
                head_s = fetch_s + prefill_s
            new_total += prompt - cached
            job.start_s = now
            job.compute_s = prefill_s * factor
            job.hit_tokens = cached
            job.device_hit_blocks = device_hits
            job.host_hit_blocks = host_hits
            job.leads = not position
        interference_s = self.cost.interference_s(new_total, decodes)
        duration += (head_s + interference_s) * self.service_factor(batch[0][0].request.index)
        self._advance(now)
        for job, _, _ in batch:
            job.prefill_s = duration
        self.running = [job for job, _, _ in batch]
        self.current_end_s = now + duration
        if decodes and self.cost.prefill_chunk_tokens > 0:
            chunks = -(-max(new_total, 1) // self.cost.prefill_chunk_tokens)
            self._prefill_step_rate = chunks / duration
        else:
            self._prefill_step_rate = 0.0
        self._update_rate()
        self.busy_s += duration
        return self.current_end_s

    def _store(self, job: Job, now: float) -> None:
        """Pin the request's blocks in the device pool and write them through to host."""
        device, host, pins = self.device, self.host, self.pins
        device_policy, host_policy, metas = self.device_policy, self.host_policy, self._metas
        for key in job.keys:
            if key in device:
                device_policy.on_access(key, now)
            else:
                device.add(key)
                pins[key] = pins.get(key, 0) + 1
                device_policy.on_insert(metas[key], now)
        if self.host_capacity <= 0:
            return
        mine = frozenset(job.keys)
        for key in job.keys:
            if key in host:
                host_policy.on_access(key, now)
                continue
            if len(host) >= self.host_capacity and not self._evict_host(now, mine):
                break
            host.add(key)
            host_policy.on_insert(metas[key], now)

    def finish_prefill(self, now: float) -> list[Job]:
        """The running batch's first tokens: its jobs, in queue order."""
        batch, self.running = self.running, []
        assert batch, "finish_prefill without a running prefill"
        self._advance(now)
        for job in batch:
            self.queued_new_tokens = max(0, self.queued_new_tokens - job.predicted_new_tokens)
            job.ttft_s = now - job.request.arrival_s
            ids = [self._ids[key] for key in job.keys]
            if ids:
                self._report(self.worker_id, ids, Medium.DEVICE, True, now)
                # Only what the host tier took (``_store`` stops where it has no room);
                # nothing left the host since the prefill started (only a start evicts there).
                held = [self._ids[key] for key in job.keys if key in self.host]
                if held:
                    self._report(self.worker_id, held, Medium.HOST, True, now)
            remaining = job.request.output_tokens - 1
            if remaining <= 0:
                self._release(job, now)
            else:
                job.finish_steps = self.steps + remaining
                heapq.heappush(self.decoding, (job.finish_steps, job.request.index, job))
        self._prefill_step_rate = 0.0
        self._update_rate()
        return batch

    # ---------------------------------------------------------------- decode
    def next_decode_s(self, now: float) -> float | None:
        if not self.decoding or self.step_rate <= 0.0:
            return None
        return now + max(0.0, self.decoding[0][0] - self.steps) / self.step_rate

    def finish_decodes(self, now: float) -> list[Job]:
        self._advance(now)
        done: list[Job] = []
        while self.decoding and self.decoding[0][0] <= self.steps + 1e-6:
            job = heapq.heappop(self.decoding)[2]
            self._release(job, now)
            done.append(job)
        self._update_rate()
        return done

    def _release(self, job: Job, now: float) -> None:
        self.kv_tick(now)
        job.done_s = now
        job.finished = True
        for key in job.keys:
            self._unpin(key)
        self.private_blocks -= job.request.kv_blocks - len(job.keys)
        request = job.request
        self.observed_kv_tokens -= request.prompt_tokens + job.expected_output_tokens
        self._recent_outputs.append(request.output_tokens)  # known now: the request ended
        self.mean_output_tokens = sum(self._recent_outputs) / len(self._recent_outputs)

    def kv_tick(self, now: float) -> None:
        """Accumulate KV occupancy (block-seconds) inside the arrival window."""
        end = min(now, self.window_end_s)
        if end > self._kv_last_s:
            # Distinct blocks pinned by running requests + their private (partial/output)
            # blocks: what the device pool cannot evict right now.
            self.kv_block_s += (len(self.pins) + self.private_blocks) * (end - self._kv_last_s)
            self._kv_last_s = end

    def _advance(self, now: float) -> None:
        if now > self._last_s:
            self.steps += (now - self._last_s) * self.step_rate
            self._last_s = now

    def _update_rate(self) -> None:
        self.decode_version += 1
        batch = len(self.decoding)
        if not batch:
            self.step_rate = 0.0
        elif self.running and self._prefill_step_rate > 0.0:
            self.step_rate = self._prefill_step_rate
        elif self.running:
            self.step_rate = 0.0  # unchunked prefill: decodes wait for it
        else:
            self.step_rate = 1.0 / self.cost.decode_step_s(batch)

    # ---------------------------------------------------------------- space
    def _unpin(self, key: BlockKey) -> None:
        count = self.pins[key] - 1
        if count:
            self.pins[key] = count
        else:
            del self.pins[key]

    def _device_evictable(self, key: BlockKey) -> bool:
        return key not in self.pins

    def _make_device_room(self, need: int, now: float) -> bool:
        """Evict unpinned blocks until ``need`` more fit; evict nothing if they cannot.

        Every cached block a running request does not pin is evictable (a pinned request pins
        its whole prefix chain, so no unpinned block has a pinned descendant), and pins are
        held by blocks in the pool: the evictable count is ``len(device) − len(pins)``."""
        excess = len(self.device) + self.private_blocks + need - self.device_capacity
        if excess <= 0:
            return True
        if excess > len(self.device) - len(self.pins):
            return False  # the job cannot start: keep the cache (vLLM refuses before evicting)
        removed: list[int] = []
        ok = True
        while len(self.device) + self.private_blocks + need > self.device_capacity:
            victim = self.device_policy.victim(now, can_evict=self._device_evictable)
            if victim is None:
                ok = False
                break
            self.device.remove(victim)
            self.device_policy.on_remove(victim)
            removed.append(self._ids[victim])
        if removed:
            self.device_evictions += len(removed)
            self._report(self.worker_id, removed, Medium.DEVICE, False, now)
        return ok

    def _evict_host(self, now: float, protected: frozenset[BlockKey]) -> bool:
        victim = self.host_policy.victim(now, can_evict=lambda key: key not in protected)
        if victim is None:
            return False
        self.host.remove(victim)
        self.host_policy.on_remove(victim)
        self.host_evictions += 1
        self._report(self.worker_id, [self._ids[victim]], Medium.HOST, False, now)
        return True

    def fits_alone(self, request: SimRequest) -> bool:
        return request.kv_blocks <= self.device_capacity
