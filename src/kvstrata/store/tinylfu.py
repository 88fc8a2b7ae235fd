"""TinyLFUPolicy ("tinylfu"): a TinyLFU admission filter in front of LRU — Einziger, Friedman,
Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM Transactions on Storage 13(4),
2017.

Frequency sketch: a count-min sketch (``DEPTH`` rows of 4-bit counters, ``min`` over rows)
counting every insert and hit of a key. Aging ("reset"): after ``SAMPLE_FACTOR × W`` counted
events, where ``W`` is the largest number of resident objects seen, every counter is halved —
the paper's sample size of about ten times the cache size. The sketch width is the power of
two ≥ 2 × ``W`` (resized, and cleared, when the tier grows past it). No doorkeeper (the
paper's optional Bloom filter for one-hit keys; it saves memory, not hits).

Admission (``policy.AdmissionFilter``): when the tier is full, a newcomer is admitted only
when its estimated frequency (this request counted) exceeds that of the victim LRU would evict
(the least recently used leaf); otherwise the victim stays and the newcomer is not stored, as
in the paper. Every request for a key is counted once: hits, admitted and refused newcomers,
and the rest of a refused prompt (``on_refused``). Inserts while the tier has room are
admitted without a comparison. Every hit moves an object to LRU's hot end.

Prefix closure: the LRU order is ``LeafHeapPolicy``'s heap over *leaves*, so victims and the
admission comparison only ever consider leaves.
"""

from __future__ import annotations

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.store.leafheap import LeafHeapPolicy

DEPTH = 4
SAMPLE_FACTOR = 10
MAX_COUNT = 15
MIN_WIDTH = 1024
_SALTS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1


class CountMinSketch:
    """4-bit count-min sketch with TinyLFU's reset (halve every counter)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._rows = [[0] * width for _ in range(DEPTH)]

    def _slots(self, key: BlockKey) -> list[int]:
        value = int.from_bytes(key[:8], "little") ^ len(key)
        slots = []
        for salt in _SALTS[:DEPTH]:
            mixed = ((value ^ salt) * 0xFF51AFD7ED558CCD) & _MASK64
            slots.append((mixed ^ (mixed >> 29)) % self.width)
        return slots

    def add(self, key: BlockKey) -> None:
        for row, slot in zip(self._rows, self._slots(key), strict=True):
            if row[slot] < MAX_COUNT:
                row[slot] += 1

    def estimate(self, key: BlockKey) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key), strict=True))

    def halve(self) -> None:
        for row in self._rows:
            for index, count in enumerate(row):
                row[index] = count >> 1


class TinyLFUPolicy(LeafHeapPolicy):
    name = "tinylfu"

    def __init__(self, *, sample_factor: float = SAMPLE_FACTOR) -> None:
        super().__init__()
        if sample_factor <= 0:
            raise ValueError(f"sample_factor must be > 0, got {sample_factor}")
        self._sample_factor = sample_factor
        self.sketch = CountMinSketch(MIN_WIDTH)
        self._peak = 0
        self._events = 0
        self._counted: BlockKey | None = None

    def _count(self, key: BlockKey) -> None:
        resident = len(self)
        if resident > self._peak:
            self._peak = resident
            if 2 * resident > self.sketch.width:
                self.sketch = CountMinSketch(1 << (2 * resident - 1).bit_length())
                self._events = 0
        self.sketch.add(key)
        self._events += 1
        if self._events >= self._sample_factor * max(self._peak, 1):
            self.sketch.halve()
            self._events = 0

    def admit(self, meta: KVObjectMeta, victim: BlockKey, now: float) -> bool:
        self._count(meta.key)
        admitted = self.sketch.estimate(meta.key) > self.sketch.estimate(victim)
        self._counted = meta.key if admitted else None  # its insert must not count it again
        return admitted

    def on_refused(self, key: BlockKey, now: float) -> None:
        self._count(key)

    def _priority_on_insert(self, meta: KVObjectMeta, now: float) -> float:
        if self._counted == meta.key:
            self._counted = None
        else:
            self._count(meta.key)
        return now

    def _priority_on_access(self, key: BlockKey, now: float) -> float:
        self._count(key)
        return now
