"""Global index throughput: how fast events apply, how fast a long request is looked up.

The index is filled the way a fleet fills it: every worker's engine emits one batch per step
with one ``BlockStored`` per running request (chunked prefill: up to ``step_tokens`` new
tokens per request and step, chained to the previous chunk by its parent hash). Requests
share prefixes (system prompts, documents) drawn by a Zipf law and then add a tail of their
own; a worker stores a shared prefix only the first time it sees it. Two long documents of
``request_tokens`` tokens are held, at several depths and in device and host tiers, by a few
workers each: they are the requests looked up, so every lookup walks the full request (no
early exit at a block nobody holds), the worst case for the index.

Figures:

- ``events_blocks_per_s``: blocks of ``BlockStored`` events applied per second of
  ``apply_batch`` (router hashing of the event tokens included; building the events is not).
- ``hash_ms`` / ``hash_p99_ms``: router hashes of the request (a Python list of token ids, as a
  router receives it, built afresh before each lookup as a router's body decoding builds it);
  ``blake3_hash_ms``: BLAKE3 storage keys of the same tokens, what hashing with the workers'
  own keys would cost instead.
- ``lookup_p50_ms`` / ``lookup_p99_ms``: ``match`` over the request's hashes (every worker's
  longest prefix and its split by tier); ``lookup_with_hash_*``: hashing and match together.
- The peers, in the same run on the same events, their lookups alternating with kvstrata's
  (the order rotates every repeat) and checked to give the same answer (``peer_agrees``):

  - ``NaiveIndex``: one plain dict per worker (engine hash → router hash, router hash → medium
    bits) and a per-worker walk until the first miss. ``naive_*`` figures and the ratios
    naive / kvstrata (> 1: the index is faster).
  - ``SetIndex``, the natural peer (``peer_set_*``): one dict from router hash to a worker
    bitmask, walked once per request, as Dynamo- and llm-d-style indexers do.
    ``peer_set_lookup_with_hash_p99_ms`` includes its hashing (the same router hash function,
    its result as a plain list); ``lookup_with_hash_vs_peer_set_p99`` = kvstrata / peer
    (goal ≤ 1.0), ``peer_set_*_speedup*`` the inverse ratios.
- Every lookup figure is the median over ``rounds`` (≥ 5 by default) rounds of ``repeats``
  alternating lookups of that round's p50 / p99; ``p99_spread_ms`` gives each p99's lowest and
  highest round, ``lookup_with_hash_vs_peer_set_p99_min`` / ``_max`` the per-round ratios'.
- ``apply_s`` includes keeping the index's lookup table (``index.table``) in sync. The rounds
  above find it synced (no events between lookups); in a live fleet a lookup also pays the
  sync of the hashes changed since the last one (at most ``index.table.SYNC_BACKLOG``). The
  live rounds measure that: ``live_lookup_with_hash_p99_ms`` and the set peer's
  ``peer_set_live_lookup_with_hash_p99_ms`` with ``live_batches`` batches of events applied
  to every index (untimed) before each lookup, their per-round ratio
  ``live_lookup_with_hash_vs_peer_set_p99`` (median, ``_min``, ``_max``), and the hashes
  each lookup found pending (``live_backlog_median`` / ``_max``).
- ``index_blocks`` (placements: a block held by two workers counts twice), ``index_entries``
  (distinct blocks), ``rss_mb`` (resident memory the index added while it was filled: an upper
  bound, as freed event objects stay in the allocator's pools) and ``bytes_per_block``.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstrata.bench.index_peers import NaiveIndex, SetIndex, time_lookups
from kvstrata.errors import InvalidInput
from kvstrata.events.schema import BlockStored, KVEvent, KVEventBatch
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index.core import GlobalIndex

VOCAB_SIZE = 151_936
FINGERPRINT = FingerprintDigest(bytes(range(32)))


@dataclass(frozen=True)
class IndexBenchConfig:
    """What to build; the defaults are the issue's target (≥ 1M blocks, 16 workers, 128k)."""

    blocks: int = 1 << 20
    """Fill until the index holds at least this many distinct blocks."""
    workers: int = 16
    request_tokens: int = 131_072
    repeats: int = 100
    """Lookups per round (p50/p99 over them)."""
    rounds: int = 5
    """Rounds of ``repeats`` alternating lookups; figures are medians over rounds."""
    block_size: int = 16
    step_tokens: int = 512
    """New tokens per request and engine step (chunked prefill): one event's size."""
    running_requests: int = 8
    """Requests per engine step, i.e. events per batch."""
    prefixes: int = 1024
    prefix_blocks: tuple[int, int] = (8, 256)
    tail_blocks: tuple[int, int] = (8, 128)
    zipf: float = 1.1
    seed: int = 0
    naive: bool = True
    peer_set: bool = True
    live_batches: int = 4
    """Live rounds: event batches (engine steps, ~1,000 blocks for 4) applied to every index
    between two lookups; 0 skips the live rounds."""

    def check(self) -> None:
        if min(self.block_size, self.workers, self.repeats, self.rounds) <= 0 or self.blocks < 0:
            raise InvalidInput("block size, workers, repeats and rounds must be positive")
        if self.request_tokens < self.block_size:
            raise InvalidInput("the request needs at least one full block of tokens")
        if self.live_batches < 0:
            raise InvalidInput("live batches must be ≥ 0")
        if self.step_tokens < self.block_size or self.running_requests <= 0:
            raise InvalidInput("an engine step must store at least one block")


@dataclass
class IndexBenchResult:
    workers: int
    block_size: int
    request_tokens: int
    request_blocks: int
    repeats: int
    index_blocks: int
    index_entries: int
    batches: int
    events: int
    blocks_per_event: float
    apply_s: float
    events_blocks_per_s: float
    matched_blocks: list[int]
    """Per worker (descending), the blocks of the looked-up requests held (the last lookup)."""
    peer_agrees: bool | None
    """Every lookup's per-worker depth and tier split equal every peer's (None: no peer)."""
    hash_ms: float
    hash_p99_ms: float
    blake3_hash_ms: float
    lookup_p50_ms: float
    lookup_p99_ms: float
    lookup_with_hash_p50_ms: float
    lookup_with_hash_p99_ms: float
    rss_mb: float
    bytes_per_block: float
    rounds: int = 1
    p99_spread_ms: dict[str, list[float]] = field(default_factory=dict)
    """Per figure (``hash``, ``lookup``, ``both``, ``set``, ``set_both``, ``naive``): the
    lowest and highest per-round p99 (ms) around the median reported."""
    naive: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        naive = body.pop("naive")
        body.update(naive)
        return body


# ------------------------------------------------------------------------------ workload
@dataclass(eq=False)
class _Request:
    """A request's blocks still to store: (tokens, engine hashes, parent) segments."""

    tokens: npt.NDArray[np.uint32]
    hashes: npt.NDArray[np.uint64]
    parent: int | None
    medium: str = "GPU"
    prefix: int | None = None
    document: bool = False


class _Workload:
    """Deterministic engine steps of every worker (the same sequence for index and peer)."""

    def __init__(self, config: IndexBenchConfig) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        bs = config.block_size
        low, high = config.prefix_blocks
        lengths = self.rng.integers(low, high + 1, size=config.prefixes)
        self.prefix_tokens = [self._tokens(int(n) * bs) for n in lengths]
        self.prefix_hashes = [self._hashes(int(n)) for n in lengths]
        ranks = np.arange(1, config.prefixes + 1, dtype=np.float64)
        weights = ranks**-config.zipf
        self.prefix_p = weights / weights.sum()
        request_blocks = config.request_tokens // bs
        self.documents = [self._tokens(request_blocks * bs) for _ in range(2)]
        self.document_hashes = [self._hashes(request_blocks) for _ in range(2)]
        self.steps_per_chunk = max(1, config.step_tokens // bs)
        self.pending_documents = 0
        """Document requests not yet fully stored (lookups need them complete)."""

    def _tokens(self, n: int) -> npt.NDArray[np.uint32]:
        return self.rng.integers(0, VOCAB_SIZE, size=n, dtype=np.uint32)

    def _hashes(self, n: int) -> npt.NDArray[np.uint64]:
        return self.rng.integers(0, 2**63, size=n, dtype=np.uint64)

    def _documents(self, workers: list[str]) -> dict[str, list[_Request]]:
        """Each document on up to four workers: full, 3/4, 1/2, 1/4 deep; the first also on host."""
        queued: dict[str, list[_Request]] = {w: [] for w in workers}
        blocks = len(self.document_hashes[0])
        bs = self.config.block_size
        for d, (toks, hashes) in enumerate(zip(self.documents, self.document_hashes, strict=True)):
            for k in range(4):
                worker = workers[(d + 2 * k) % len(workers)]
                depth = max(1, blocks * (4 - k) // 4)
                for medium in ("GPU", "CPU") if k == 0 else ("GPU",):
                    queued[worker].append(
                        _Request(toks[: depth * bs], hashes[:depth], None, medium, document=True)
                    )
                    self.pending_documents += 1
        return queued

    def batches(self, workers: list[str]) -> Iterator[tuple[str, KVEventBatch]]:
        """Round-robin over workers, one engine step each, for ever (the caller stops)."""
        config = self.config
        bs = config.block_size
        queued = self._documents(workers)
        running: dict[str, list[_Request]] = {w: [] for w in workers}
        held: dict[str, set[int]] = {w: set() for w in workers}
        in_flight: dict[str, set[int]] = {w: set() for w in workers}
        ts = 0.0
        while True:
            for worker in workers:
                active = running[worker]
                while len(active) < config.running_requests:
                    active.append(
                        queued[worker].pop(0)
                        if queued[worker]
                        else self._new_request(held[worker], in_flight[worker])
                    )
                events: list[KVEvent] = []
                for request in active:
                    n = min(self.steps_per_chunk, len(request.hashes))
                    chunk = request.hashes[:n].tolist()
                    events.append(
                        BlockStored(
                            block_hashes=chunk,
                            parent_block_hash=request.parent,
                            token_ids=request.tokens[: n * bs].tolist(),
                            block_size=bs,
                            lora_id=None,
                            medium=request.medium,
                            lora_name=None,
                        )
                    )
                    request.parent = chunk[-1]
                    request.hashes = request.hashes[n:]
                    request.tokens = request.tokens[n * bs :]
                for request in [r for r in active if not len(r.hashes)]:
                    active.remove(request)
                    self.pending_documents -= request.document
                    if request.prefix is not None:
                        in_flight[worker].discard(request.prefix)
                ts += 0.001
                yield worker, KVEventBatch(ts=ts, events=events)

    def _new_request(self, held: set[int], in_flight: set[int]) -> _Request:
        """A shared prefix (stored first if this worker lacks it) and a tail of its own."""
        config = self.config
        prefix = int(self.rng.choice(len(self.prefix_p), p=self.prefix_p))
        low, high = config.tail_blocks
        tail = int(self.rng.integers(low, high + 1))
        tail_tokens, tail_hashes = self._tokens(tail * config.block_size), self._hashes(tail)
        if prefix in in_flight:  # another running request is storing it: start a fresh chain
            return _Request(tail_tokens, tail_hashes, None)
        parent = int(self.prefix_hashes[prefix][-1])
        if prefix in held:
            return _Request(tail_tokens, tail_hashes, parent)
        held.add(prefix)
        in_flight.add(prefix)
        return _Request(
            np.concatenate([self.prefix_tokens[prefix], tail_tokens]),
            np.concatenate([self.prefix_hashes[prefix], tail_hashes]),
            None,
            prefix=prefix,
        )


# ------------------------------------------------------------------------------ measuring
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak RSS, KiB on Linux/BSD
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fill(
    apply: Callable[[str, KVEventBatch], None],
    steps: Iterator[tuple[str, KVEventBatch]],
    done: Callable[[int], bool],
) -> tuple[float, int, int, int]:
    """Apply batches until ``done(batches)``; returns apply seconds, batches, events, blocks."""
    seconds = 0.0
    batches = events = blocks = 0
    while not done(batches):
        worker, batch = next(steps)
        start = time.perf_counter()
        apply(worker, batch)
        seconds += time.perf_counter() - start
        batches += 1
        events += len(batch.events)
        blocks += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
    return seconds, batches, events, blocks


def _live_rounds(
    config: IndexBenchConfig,
    index: GlobalIndex,
    steps: Iterator[tuple[str, KVEventBatch]],
    requests: list[npt.NDArray[np.uint32]],
    naive: NaiveIndex | None,
    peer_set: SetIndex | None,
) -> tuple[dict[str, float], bool | None]:
    """Lookups with events in between, as in a live fleet: before each repeat the next
    ``live_batches`` batches of the fill's workload are applied (untimed) to the index and to
    every peer, so each lookup also pays what its index defers from the event path to the
    lookup (kvstrata: syncing the lookup table's backlog; the peers defer nothing). The index
    grows by those events (about ``rounds × repeats × live_batches × 250`` blocks)."""
    backlog: list[int] = []

    def between() -> None:
        for _ in range(config.live_batches):
            worker, batch = next(steps)
            index.apply_batch(worker, batch)
            if naive is not None:
                naive.apply_batch(worker, batch)
            if peer_set is not None:
                peer_set.apply_batch(worker, batch)
        backlog.append(index.table_backlog)

    rounds = [
        time_lookups(config.repeats, config.block_size, index, requests, naive, peer_set, between)
        for _ in range(config.rounds)
    ]
    p99 = {  # per round
        name: [_round_quantiles_ms(samples[name])[1] for samples, *_ in rounds]
        for name in ("both", "set_both")
        if rounds[0][0][name]
    }
    figures = {
        "live_lookup_with_hash_p99_ms": float(np.median(p99["both"])),
        "live_backlog_median": float(np.median(backlog)),
        "live_backlog_max": float(max(backlog)),
        "live_batches": float(config.live_batches),
    }
    if "set_both" in p99:
        ratios = [ours / max(theirs, 1e-9) for ours, theirs in zip(*p99.values(), strict=True)]
        figures.update(
            peer_set_live_lookup_with_hash_p99_ms=float(np.median(p99["set_both"])),
            live_lookup_with_hash_vs_peer_set_p99=float(np.median(ratios)),
            live_lookup_with_hash_vs_peer_set_p99_min=min(ratios),
            live_lookup_with_hash_vs_peer_set_p99_max=max(ratios),
        )
    agreed = [a for _, _, a in rounds]
    return figures, None if agreed[0] is None else all(agreed)


def _round_quantiles_ms(samples: list[float]) -> tuple[float, float]:
    values = np.array(samples) * 1e3
    return float(np.quantile(values, 0.5)), float(np.quantile(values, 0.99))


def run_index_bench(config: IndexBenchConfig | None = None) -> IndexBenchResult:
    """Fill the index (and the peers), then time hashing and lookups of the long requests."""
    config = config or IndexBenchConfig()
    config.check()
    workers = [f"worker-{i:02d}" for i in range(config.workers)]
    index = GlobalIndex(FINGERPRINT, config.block_size, clock=lambda: 0.0)
    gc.collect()
    rss_before = _rss_bytes()
    workload = _Workload(config)
    steps = workload.batches(workers)  # continued by the live rounds
    apply_s, batches, events, blocks = _fill(
        index.apply_batch,
        steps,
        lambda _: len(index) >= config.blocks and not workload.pending_documents,
    )
    start = time.perf_counter()
    index.sync_table()  # the lookup table's last backlog: event-side work, timed as such
    apply_s += time.perf_counter() - start
    gc.collect()
    rss_added = max(0, _rss_bytes() - rss_before)
    index_blocks = sum(sum(index.blocks_held(w)) for w in workers)
    index_entries = len(index)  # as filled (the live rounds add more)

    figures: dict[str, float] = {}
    naive: NaiveIndex | None = None
    if config.naive:
        naive = NaiveIndex(index)
        naive_steps = _Workload(config).batches(workers)
        naive_apply_s, *_ = _fill(naive.apply_batch, naive_steps, batches.__le__)
        figures["naive_events_blocks_per_s"] = blocks / max(naive_apply_s, 1e-9)
    peer_set: SetIndex | None = None
    if config.peer_set:
        peer_set = SetIndex(index, width=max(64, config.workers))
        set_steps = _Workload(config).batches(workers)
        set_apply_s, *_ = _fill(peer_set.apply_batch, set_steps, batches.__le__)
        figures["peer_set_events_blocks_per_s"] = blocks / max(set_apply_s, 1e-9)

    requests = workload.documents
    rounds: list[dict[str, list[float]]] = []
    agrees: bool | None = None
    for _ in range(config.rounds):  # each round alternates kvstrata and the peers per lookup
        samples, matched, agreed = time_lookups(
            config.repeats, config.block_size, index, requests, naive, peer_set
        )
        rounds.append(samples)
        agrees = agreed if agrees is None else agrees and bool(agreed)
    if config.live_batches:
        live, live_agrees = _live_rounds(config, index, steps, requests, naive, peer_set)
        figures.update(live)
        agrees = agrees if live_agrees is None else bool(agrees) and live_agrees
    spread: dict[str, list[float]] = {}

    def _quantiles_ms(name: str) -> tuple[float, float]:
        """Median over rounds of each round's p50 and p99 (ms); spread kept for the p99."""
        per_round = [_round_quantiles_ms(r[name]) for r in rounds]
        p99s = [q[1] for q in per_round]
        spread[name] = [min(p99s), max(p99s)]
        return float(np.median([q[0] for q in per_round])), float(np.median(p99s))

    hash_p50, hash_p99 = _quantiles_ms("hash")
    lookup_p50, lookup_p99 = _quantiles_ms("lookup")
    both_p50, both_p99 = _quantiles_ms("both")
    blake3_ms = float(np.median([x for r in rounds for x in r["blake3"]])) * 1e3
    ours_per_s = blocks / max(apply_s, 1e-9)
    if naive is not None:
        naive_p50, naive_p99 = _quantiles_ms("naive")
        figures.update(
            naive_lookup_p50_ms=naive_p50,
            naive_lookup_p99_ms=naive_p99,
            lookup_speedup_p99=naive_p99 / max(lookup_p99, 1e-9),
            apply_speedup=ours_per_s / max(figures["naive_events_blocks_per_s"], 1e-9),
        )
    if peer_set is not None:
        set_p50, set_p99 = _quantiles_ms("set")
        set_both_p50, set_both_p99 = _quantiles_ms("set_both")
        ratios = [  # per round: kvstrata's p99 (hash + match) / the set peer's
            _round_quantiles_ms(r["both"])[1] / max(_round_quantiles_ms(r["set_both"])[1], 1e-9)
            for r in rounds
        ]
        figures.update(
            peer_set_lookup_p50_ms=set_p50,
            peer_set_lookup_p99_ms=set_p99,
            peer_set_lookup_with_hash_p50_ms=set_both_p50,
            peer_set_lookup_with_hash_p99_ms=set_both_p99,
            peer_set_lookup_speedup_p99=set_p99 / max(lookup_p99, 1e-9),
            peer_set_with_hash_speedup_p99=set_both_p99 / max(both_p99, 1e-9),
            lookup_with_hash_vs_peer_set_p99=both_p99 / max(set_both_p99, 1e-9),
            lookup_with_hash_vs_peer_set_p99_min=min(ratios),
            lookup_with_hash_vs_peer_set_p99_max=max(ratios),
            peer_set_apply_speedup=ours_per_s / max(figures["peer_set_events_blocks_per_s"], 1e-9),
        )
    return IndexBenchResult(
        workers=config.workers,
        block_size=config.block_size,
        request_tokens=config.request_tokens,
        request_blocks=config.request_tokens // config.block_size,
        repeats=config.repeats,
        index_blocks=index_blocks,
        index_entries=index_entries,
        batches=batches,
        events=events,
        blocks_per_event=blocks / max(events, 1),
        apply_s=apply_s,
        events_blocks_per_s=ours_per_s,
        matched_blocks=matched,
        peer_agrees=agrees,
        hash_ms=hash_p50,
        hash_p99_ms=hash_p99,
        blake3_hash_ms=blake3_ms,
        lookup_p50_ms=lookup_p50,
        lookup_p99_ms=lookup_p99,
        lookup_with_hash_p50_ms=both_p50,
        lookup_with_hash_p99_ms=both_p99,
        rss_mb=rss_added / 2**20,
        bytes_per_block=rss_added / max(index_blocks, 1),
        rounds=config.rounds,
        p99_spread_ms=spread,
        naive=figures,
    )


__all__ = ["IndexBenchConfig", "IndexBenchResult", "NaiveIndex", "SetIndex", "run_index_bench"]
