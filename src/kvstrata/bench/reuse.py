"""How much prefix reuse a request trace offers, and how large a cache must be to get it.

This is the measurement that sizes the tiers: if an infinite prefix cache saves little, no
tiering helps; if a small LRU already gets most of it, a big tier is wasted. Everything
here is pure computation over ``TraceRequest`` records, so the simulator can reuse the
cache bookkeeping (``LRUCache``) and the replay loop.

Definitions (the trace's ids are chained, so a block can only be reused as part of its
whole prefix, and caches are *prefix-closed*):

* **token hit rate** = hit prompt tokens / all prompt tokens. A request's hit is the longest
  prefix of its ``hash_ids`` that the cache holds *before* the request is inserted, in
  tokens (``TraceRequest.prefix_tokens``: full blocks, except a fully matched prompt counts
  its partial last block as ``input_length - 512 * (n - 1)`` tokens).
* **infinite cache**: every block ever seen stays.
* **LRU(capacity)**: after the lookup, the request's blocks are touched one by one in
  request order (block 0 first), so the prompt's tail ends up most recently used. This
  order reproduces the independently measured 21.5% at 10k blocks on the Mooncake
  conversation trace (touching in reverse order gives 21.6%; at 100k blocks both give
  37.1%). A prompt longer than the capacity evicts its own first blocks.
* **block access stream**: each request's ``hash_ids`` in order, requests in trace order. A
  *reuse* is an access to a block accessed before.
* **stack distance** of a reuse: the number of distinct other blocks accessed since the
  previous access to the same block (A, B, A gives 1; A, A gives 0). An LRU cache of
  ``c`` blocks fed this stream holds the block iff its stack distance is below ``c``.
  Computed in O(n log n) with a Fenwick tree over the positions of each block's latest access.
* **time distance** of a reuse: seconds between the arrivals of the two requests.
* **percentiles** use the nearest-rank method (the value at rank ``ceil(q * n)``), so every
  reported distance was actually observed.
* **top-1% reuse share**: distinct blocks ranked by reuse count (accesses - 1); the
  ``ceil(D / 100)`` most reused of the ``D`` distinct blocks; their reuses / all reuses.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvstrata.errors import InvalidInput
from kvstrata.workloads.mooncake import TraceBlockId, TraceRequest

DEFAULT_CAPACITIES: tuple[int, ...] = (10_000, 100_000)
"""LRU capacities in blocks reported by default (about 5 M and 51 M tokens)."""

K = TypeVar("K", bound=Hashable)


class PrefixCache(Protocol[K]):
    """What ``replay_hit_tokens`` needs from a cache of chained block keys.

    ``matched_prefix(keys)`` -- length of the longest prefix of ``keys`` all resident; must not
    change recency (a lookup is not a use until the request is admitted).
    ``touch(key)`` -- insert or refresh ``key``; return the key evicted to make room, if any.
    """

    def matched_prefix(self, keys: Sequence[K]) -> int: ...

    def touch(self, key: K) -> K | None: ...


class UnboundedCache(Generic[K]):
    """A cache that never evicts: the upper bound on any policy's hit rate."""

    def __init__(self) -> None:
        self._keys: set[K] = set()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def matched_prefix(self, keys: Sequence[K]) -> int:
        return _matched_prefix(self._keys, keys)

    def touch(self, key: K) -> K | None:
        self._keys.add(key)
        return None


class LRUCache(Generic[K]):
    """Least-recently-used set of at most ``capacity`` keys: pure bookkeeping, no values.

    A policy, not a store: a tier that owns the bytes asks it what to evict, so the same
    object serves this benchmark and the simulator. Invariant: ``len(self) <= capacity``.
    Iteration goes from least to most recently used.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise InvalidInput(f"LRU capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._order: OrderedDict[K, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    def matched_prefix(self, keys: Sequence[K]) -> int:
        return _matched_prefix(self._order, keys)

    def touch(self, key: K) -> K | None:
        """Make ``key`` the most recently used; return the evicted key, if one was."""
        order = self._order
        if key in order:
            order.move_to_end(key)
            return None
        if self._capacity == 0:
            return key
        order[key] = None
        if len(order) > self._capacity:
            evicted, _ = order.popitem(last=False)
            return evicted
        return None

    def discard(self, key: K) -> bool:
        """Drop ``key`` if resident (e.g. its bytes were lost); return whether it was."""
        return self._order.pop(key, _ABSENT) is not _ABSENT


_ABSENT: Any = object()


def _matched_prefix(resident: Any, keys: Sequence[Any]) -> int:
    matched = 0
    for key in keys:
        if key not in resident:
            break
        matched += 1
    return matched


class FenwickTree:
    """Prefix sums over ``size`` integer counters, O(log size) per update and per query."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise InvalidInput(f"Fenwick tree size must be >= 0, got {size}")
        self._tree = [0] * (size + 1)

    def __len__(self) -> int:
        return len(self._tree) - 1

    def add(self, index: int, delta: int) -> None:
        """Add ``delta`` to counter ``index`` (0-based)."""
        tree = self._tree
        size = len(tree)
        position = index + 1
        while position < size:
            tree[position] += delta
            position += position & -position

    def prefix_sum(self, end: int) -> int:
        """Sum of counters ``[0, end)``."""
        tree = self._tree
        total = 0
        position = end
        while position > 0:
            total += tree[position]
            position &= position - 1
        return total


def stack_distances(keys: Iterable[K]) -> list[int | None]:
    """LRU stack distance of every access: ``None`` for a first access.

    The tree marks, for each distinct key, the position of its latest access. At a reuse of
    a key last seen at ``previous``, the distinct keys accessed since are exactly the marks
    after ``previous``: all marks (one per distinct key so far) minus those up to it.
    """
    sequence = list(keys)
    tree = FenwickTree(len(sequence))
    latest: dict[K, int] = {}
    distances: list[int | None] = []
    for position, key in enumerate(sequence):
        previous = latest.get(key)
        if previous is None:
            distances.append(None)
        else:
            distances.append(len(latest) - tree.prefix_sum(previous + 1))
            tree.add(previous, -1)
        tree.add(position, 1)
        latest[key] = position
    return distances


def nearest_rank_percentile(sorted_values: Sequence[float], percent: int) -> float | None:
    """Value at rank ``ceil(percent / 100 * n)`` of ascending ``sorted_values``; None if empty.

    ``percent`` is an int so the rank is computed exactly, without float rounding.
    """
    if not 0 < percent <= 100:
        raise InvalidInput(f"percentile must be in (0, 100], got {percent}")
    if not sorted_values:
        return None
    return sorted_values[_ceil_percent(percent, len(sorted_values)) - 1]


def _ceil_percent(percent: int, count: int) -> int:
    return -(-percent * count // 100)


@dataclass(frozen=True)
class Percentiles:
    """p50/p90/p99 of a distribution; ``None`` when there were no samples."""

    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Percentiles:
        ordered = sorted(values)
        return cls(
            p50=nearest_rank_percentile(ordered, 50),
            p90=nearest_rank_percentile(ordered, 90),
            p99=nearest_rank_percentile(ordered, 99),
        )


@dataclass(frozen=True)
class LruHitRate:
    """Token hit rate of one LRU capacity."""

    capacity_blocks: int
    hit_tokens: int
    hit_rate: float


@dataclass(frozen=True)
class ReuseReport:
    """Everything ``kvstrata bench reuse`` reports about one trace (see module docstring)."""

    requests: int
    total_tokens: int
    infinite_hit_tokens: int
    infinite_hit_rate: float
    lru: tuple[LruHitRate, ...]
    block_accesses: int
    reuses: int
    distinct_blocks: int
    reuse_distance_blocks: Percentiles
    reuse_distance_s: Percentiles
    top1pct_reuse_share: float

    @property
    def reused_access_share(self) -> float:
        """Fraction of block accesses that hit a block seen before (ignores prefix closure)."""
        return self.reuses / self.block_accesses if self.block_accesses else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "lru": [asdict(entry) for entry in self.lru],
            "reused_access_share": self.reused_access_share,
        }


def replay_hit_tokens(requests: Iterable[TraceRequest], cache: PrefixCache[TraceBlockId]) -> int:
    """Feed requests through ``cache`` in order; return the prompt tokens served from it."""
    hit_tokens = 0
    for request in requests:
        hit_tokens += request.prefix_tokens(cache.matched_prefix(request.hash_ids))
        for block in request.hash_ids:
            cache.touch(block)
    return hit_tokens


def top_reuse_share(reuse_counts: Iterable[int], percent: int = 1) -> float:
    """Share of all reuses that go to the ``ceil(percent / 100 * D)`` most reused of D blocks.

    Tells whether a small pinned "hot set" (system prompts, popular documents) would capture
    most of the reuse, or whether reuse is spread across the long tail.
    """
    if not 0 < percent <= 100:
        raise InvalidInput(f"percent must be in (0, 100], got {percent}")
    counts = sorted(reuse_counts, reverse=True)
    total = sum(counts)
    if total == 0:
        return 0.0
    return sum(counts[: _ceil_percent(percent, len(counts))]) / total


def analyse_reuse(
    requests: Sequence[TraceRequest], capacities: Iterable[int] = DEFAULT_CAPACITIES
) -> ReuseReport:
    """Compute the whole ``ReuseReport`` for a trace (requests taken in the given order)."""
    total_tokens = sum(request.input_length for request in requests)

    def rate(hit_tokens: int) -> float:
        return hit_tokens / total_tokens if total_tokens else 0.0

    infinite = replay_hit_tokens(requests, UnboundedCache())
    lru: list[LruHitRate] = []
    for capacity in capacities:
        hit_tokens = replay_hit_tokens(requests, LRUCache(capacity))
        lru.append(LruHitRate(capacity, hit_tokens, rate(hit_tokens)))

    blocks = [block for request in requests for block in request.hash_ids]
    block_distances = [d for d in stack_distances(blocks) if d is not None]

    last_seen_ms: dict[TraceBlockId, int] = {}
    time_distances: list[float] = []
    for request in requests:
        now = request.timestamp_ms
        for block in request.hash_ids:
            previous = last_seen_ms.get(block)
            if previous is not None:
                time_distances.append((now - previous) / 1000.0)
            last_seen_ms[block] = now

    accesses = Counter(blocks)
    return ReuseReport(
        requests=len(requests),
        total_tokens=total_tokens,
        infinite_hit_tokens=infinite,
        infinite_hit_rate=rate(infinite),
        lru=tuple(lru),
        block_accesses=len(blocks),
        reuses=len(block_distances),
        distinct_blocks=len(accesses),
        reuse_distance_blocks=Percentiles.of(block_distances),
        reuse_distance_s=Percentiles.of(time_distances),
        top1pct_reuse_share=top_reuse_share(count - 1 for count in accesses.values()),
    )
