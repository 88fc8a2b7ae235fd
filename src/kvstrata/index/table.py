"""A numpy mirror of the index's packed entries, so a lookup probes in C, not in Python.

Why: a 128k-token request is 8,192 blocks; probing a Python dict of a million entries once per
block costs about half a microsecond each (cache misses on the dict's table, the entry and the
key object, plus the interpreter), which is most of a lookup. This table holds the same
mapping, router hash → packed value, in one array of ``[key, word 0, …, word W-1]`` rows
(the value split into W little-endian uint64 words, 16 worker slots a word) with open
addressing and linear probing, so a request's blocks are probed by a few vectorised passes
(one row gather per probe round: key and value share a cache line, so a probe costs one cache
miss, not one per array; a lookup runs right after other work has evicted the table from the
caches). Key 0 marks an empty row; the hash 0 itself, possible
but rare, is held beside the table (``_zero``).

The dict (``IndexEntries._entries``) stays the source of truth: every write to it marks the
router hash dirty (``mark`` / ``mark_many``, C-level set updates on the event path), and the
dirty hashes are copied from the dict into the table in one vectorised pass (``sync``)
before a lookup, or earlier when many are pending (the index syncs in ``apply_batch``), so a
lookup never pays for more than a bounded backlog (about 1.4 µs a pending hash on this
2-core machine: under ~0.4 ms for 256), and never for a rebuild (``would_rebuild``: the event
path takes those). A key removed from the dict becomes a
tombstone (kept, value 0: absent); tombstones and growth are handled by rebuilding from the
dict (at most half full after a rebuild, rebuilt past 70 %). A key's first position is
Fibonacci hashing of it (the top bits of key × 2^64/φ), so keys that are not mixed hashes (the
simulator's block ids) do not cluster.

W follows the index's slot count (``set_words``: a fleet that grows past a multiple of 16
slots rebuilds the table one word wider). Only used while every key fits 64 bits; otherwise
the index keeps the dict probe (``matching.probe``).
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import Final

import numpy as np
import numpy.typing as npt

from kvstrata.index.matching import pack_words

SLOTS_PER_WORD: Final = 16
"""Worker slots whose 4-bit nibbles fit one uint64 word of a value."""
SYNC_BACKLOG: Final = 256
"""Dirty hashes after which the event path syncs (bounds the sync a lookup may pay). Measured
with ``kvstrata bench index`` (200k blocks, 32k-token requests, 4 event batches between
lookups, 2026-12-06): 1,024 gave a live hash + lookup p99 of 1.8–2.1 ms against the set
peer's 1.2; 256 gives 1.1 (0.95× the peer) for 17 % fewer events applied per second."""
_MIN_BITS: Final = 12
_FIB: Final = np.uint64(0x9E3779B97F4A7C15)
_ONE: Final = np.uint64(1)
_ZERO: Final = np.uint64(0)
_MAX_LOAD: Final = 0.7
_SCALAR_TAIL: Final = 16
"""Keys still probing when the vectorised rounds stop and a scalar loop finishes them."""

U64 = npt.NDArray[np.uint64]


class ProbeTable:
    """Router hash → packed value (0: absent), open addressing, linear probing, numpy arrays."""

    def __init__(self) -> None:
        self.words = 1
        """uint64 words per value (``set_words``)."""
        self._allocate(_MIN_BITS)
        self._zero = 0
        """The value of the key 0, which cannot live in the table (0 marks an empty row)."""
        self.dirty: set[int] = set()
        self.stale = True
        """The table must be rebuilt from the dict (at first, and after a wide fleet)."""
        self.usable = True
        """False once a key did not fit 64 bits: the index probes its dict instead."""

    def _allocate(self, bits: int) -> None:
        capacity = 1 << bits
        self._rows: U64 = np.zeros((capacity, 1 + self.words), dtype=np.uint64)
        """``[key, word 0, …]``; key 0: empty. A key whose value went to 0 stays (a tombstone:
        a probe stops only at an empty row)."""
        self._mask = np.uint64(capacity - 1)
        self._shift = np.uint64(64 - bits)
        self._filled = 0

    def _home(self, keys: U64) -> U64:
        home: U64 = (keys * _FIB) >> self._shift
        return home

    def set_words(self, words: int) -> None:
        """Hold values of ``words`` uint64 words; a change rebuilds the table at the next sync."""
        if words != self.words:
            self.words = words
            self.stale = True
            self.dirty.clear()

    def mark(self, router_hash: int) -> None:
        self.dirty.add(router_hash)

    def mark_many(self, router_hashes: Iterable[int]) -> None:
        self.dirty.update(router_hashes)

    @property
    def pending(self) -> int:
        return len(self.dirty)

    @property
    def would_rebuild(self) -> bool:
        """The next sync may rebuild the table (stale, or the pending hashes could push it past
        its load limit): a caller on the event path syncs now, so no lookup pays a rebuild."""
        return self.stale or self._filled + len(self.dirty) > _MAX_LOAD * len(self._rows)

    # ---------------------------------------------------------------- sync
    def sync(self, entries: dict[int, int]) -> None:
        """Copy the dirty hashes' current values (0 if gone) from ``entries`` into the table."""
        if not self.usable:
            self.dirty.clear()
            return
        try:
            if self.stale:
                self._rebuild(entries)
                return
            if not self.dirty:
                return
            keys = np.frombuffer(array.array("Q", self.dirty), dtype=np.uint64)
            get = entries.get
            values = pack_words([get(k, 0) for k in self.dirty], self.words)
        except OverflowError:  # a key or value wider than 64 bits (or negative)
            self.usable = False
            self.dirty.clear()
            return
        self.dirty.clear()
        zero = keys == 0
        if zero.any():
            self._zero = entries.get(0, 0)
            keys, values = keys[~zero], values[~zero]
        positions = self._find(keys)
        found = positions >= 0
        self._rows[positions[found], 1:] = values[found]
        new = ~found & values.any(axis=1)
        if not new.any():
            return
        if self._filled + int(new.sum()) > _MAX_LOAD * len(self._rows):
            self._rebuild(entries)
            return
        self._insert(keys[new], values[new])

    def _rebuild(self, entries: dict[int, int]) -> None:
        n = len(entries)
        bits = max(_MIN_BITS, (2 * n - 1).bit_length())
        self._allocate(bits)
        self.dirty.clear()
        self.stale = False
        self._zero = entries.get(0, 0)
        if not n:
            return
        try:
            keys = np.frombuffer(array.array("Q", entries.keys()), dtype=np.uint64)
            values = pack_words(entries.values(), self.words)
        except OverflowError:
            self.usable = False
            return
        if self._zero:
            kept = keys != 0
            keys, values = keys[kept], values[kept]
            n = len(keys)
        # Linear probing into an empty table, all at once: in order of home position, each
        # key goes to the first position at or after its home past the previous key's.
        home = self._home(keys).astype(np.int64)
        order = np.argsort(home, kind="stable")
        steps = np.arange(n, dtype=np.int64)
        at = np.maximum.accumulate(home[order] - steps) + steps
        fits = at < len(self._rows)
        placed = order[fits]
        self._rows[at[fits], 0] = keys[placed]
        self._rows[at[fits], 1:] = values[placed]
        self._filled = len(placed)
        wrapped = order[~fits]  # past the end: they wrap around to the start
        if len(wrapped):
            self._insert(keys[wrapped], values[wrapped])

    def _insert(self, keys: U64, values: U64) -> None:
        """Place non-zero keys known to be absent; keys competing for one free position take
        turns."""
        positions = self._home(keys)
        order = np.arange(len(keys))
        rows = self._rows
        while len(order) > _SCALAR_TAIL:
            free = rows[positions, 0] == 0
            if free.any():
                at = positions[free]
                _, first = np.unique(at, return_index=True)
                winners = np.flatnonzero(free)[first]
                won = positions[winners]
                rows[won, 0] = keys[order[winners]]
                rows[won, 1:] = values[order[winners]]
                self._filled += len(winners)
                left = np.ones(len(order), dtype=np.bool_)
                left[winners] = False
                order, positions = order[left], positions[left]
            positions = (positions + _ONE) & self._mask
        mask = int(self._mask)
        for i, at in zip(order.tolist(), positions.tolist(), strict=True):
            while rows[at, 0]:
                at = (at + 1) & mask
            rows[at, 0] = keys[i]
            rows[at, 1:] = values[i]
            self._filled += 1

    # ---------------------------------------------------------------- lookup
    def _find(self, keys: U64) -> npt.NDArray[np.int64]:
        """Each non-zero key's position in the table, -1 where absent (key 0 is never in it)."""
        result = np.full(len(keys), -1, dtype=np.int64)
        positions = self._home(keys)
        order = np.arange(len(keys))
        rows = self._rows
        while len(order) > _SCALAR_TAIL:
            found = np.take(rows, positions, axis=0)  # one gather: key and value together
            hit = found[:, 0] == keys[order]
            result[order[hit]] = positions[hit]
            more = (found[:, 0] != 0) & ~hit
            order = order[more]
            positions = (positions[more] + _ONE) & self._mask
        if len(order):  # the few long probe sequences: one at a time beats a round per step
            mask = int(self._mask)
            for i, at in zip(order.tolist(), positions.tolist(), strict=True):
                key = keys[i]
                while rows[at, 0]:
                    if rows[at, 0] == key:
                        result[i] = at
                        break
                    at = (at + 1) & mask
        return result

    def values(self, keys: U64) -> U64:
        """``[n, words]``: the packed value of each key as uint64 words (all 0 where nobody
        holds it); call after ``sync``.

        The same probe as :meth:`_find`, kept separate on purpose: this is the lookup's hot
        path, and taking each value from the row the probe already gathered, rather than
        finding positions and gathering again, saves ~0.1 ms of a 128k-token lookup's p99
        (measured with ``kvstrata bench index``, 2026-12-02)."""
        rows = self._rows
        # One word: work on 1-D values (numpy's 1-D fancy indexing is markedly faster than 2-D
        # on this hot path); several: on [n, words]. Either way the result is [n, words].
        cols: int | slice = 1 if self.words == 1 else slice(1, None)
        positions = self._home(keys)
        found = np.take(rows, positions, axis=0)  # the first round, for all keys at once
        hit = found[:, 0] == keys
        out: U64 = np.where(hit if self.words == 1 else hit[:, None], found[:, cols], _ZERO)
        order = np.flatnonzero((found[:, 0] != 0) & ~hit)
        positions = (positions[order] + _ONE) & self._mask
        while len(order) > _SCALAR_TAIL:
            found = np.take(rows, positions, axis=0)
            hit = found[:, 0] == keys[order]
            out[order[hit]] = found[hit, cols]
            more = (found[:, 0] != 0) & ~hit
            order = order[more]
            positions = (positions[more] + _ONE) & self._mask
        mask = int(self._mask)
        for i, at in zip(order.tolist(), positions.tolist(), strict=True):
            key = keys[i]
            while rows[at, 0]:
                if rows[at, 0] == key:
                    out[i] = rows[at, cols]
                    break
                at = (at + 1) & mask
        out = out.reshape(len(keys), self.words)
        if self._zero:
            zero = keys == 0
            if zero.any():
                out[zero] = pack_words([self._zero], self.words)[0]
        return out

    def prefix_values(self, keys: U64, first: int = 1024) -> U64:
        """The values (``[n, words]``) up to (without) the first key nobody holds, probed in
        chunks growing 8-fold from ``first`` keys (a request that misses early stops early)."""
        parts: list[U64] = []
        start, chunk = 0, first
        while start < len(keys):
            part = self.values(keys[start : start + chunk])
            zero = np.flatnonzero(part[:, 0] == 0 if self.words == 1 else ~part.any(axis=1))
            if len(zero):
                parts.append(part[: zero[0]])
                break
            parts.append(part)
            start, chunk = start + chunk, 8 * chunk
        if not parts:
            return np.zeros((0, self.words), dtype=np.uint64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    @property
    def nbytes(self) -> int:
        return int(self._rows.nbytes)
