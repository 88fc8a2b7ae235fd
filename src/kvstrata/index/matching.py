"""Longest-prefix matching over the index's packed values, for every worker slot at once.

Each indexed router hash maps to an int with 4 bits per worker slot (one per medium:
device, host, disk, remote). A lookup probes the request's hashes in order and stops at the
first block nobody holds; :func:`slot_prefixes` then turns the probed values into each slot's
prefix depth and fastest-medium split with a few numpy passes (16 slots per uint64 word)
over one value per run of equal values.

A shared slot (the index's fleet-wide remote tier) is not a worker: its remote bit is lent to
every slot in ``reach`` before the prefix is taken, so each of those workers counts a shared
block as held in its own remote tier.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from typing import Final, cast

import numpy as np
import numpy.typing as npt

BITS_PER_SLOT: Final = 4
SLOT_MASK: Final = (1 << BITS_PER_SLOT) - 1
_NUMPY_SLOTS: Final = 64 // BITS_PER_SLOT
"""16 worker slots pack into one uint64 word; more slots take several words per block."""
_MASK64: Final = (1 << 64) - 1
_LOW_INT: Final = 0x1111_1111_1111_1111
_LOW_BITS: Final = np.uint64(_LOW_INT)
"""Bit 0 of every nibble: one presence bit per slot."""
_START: Final = np.zeros(1, dtype=np.int64)
_ONE: Final = np.uint64(1)
_TWO: Final = np.uint64(2)
_THREE: Final = np.uint64(3)
_PROBE_CHUNK: Final = 512
"""Blocks probed between checks for a block nobody holds (where every prefix ends)."""


def words_for(slots: int) -> int:
    """The uint64 words a packed value of ``slots`` worker slots takes (at least one)."""
    return max(1, -(-slots // _NUMPY_SLOTS))


def pack_words(values: Iterable[int], words: int) -> npt.NDArray[np.uint64]:
    """Packed values as ``[n, words]`` little-endian uint64 words (OverflowError if one does
    not fit, or is negative)."""
    if words == 1:  # array.array converts ints faster than numpy or to_bytes do
        return np.frombuffer(array.array("Q", values), dtype=np.uint64).reshape(-1, 1)
    width = 8 * words
    raw = b"".join(int(v).to_bytes(width, "little") for v in values)
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64, copy=False).reshape(-1, words)


def probe(entries: dict[int, int], hashes: Sequence[int]) -> list[int]:
    """The packed values of the request's blocks, up to (without) the first block nobody holds."""
    get = entries.get
    values: list[int] = []
    for start in range(0, len(hashes), _PROBE_CHUNK):
        chunk: list[int | None] = list(map(get, hashes[start : start + _PROBE_CHUNK]))
        if None in chunk:
            values.extend(cast(list[int], chunk[: chunk.index(None)]))
            break
        values.extend(cast(list[int], chunk))
    return values


def slot_prefixes(
    values: list[int] | npt.NDArray[np.uint64],
    slots: int,
    live: int,
    *,
    shared: int | None = None,
    reach: int = 0,
) -> npt.NDArray[np.int64]:
    """``[4, slots]``: per slot, prefix depth and its blocks at best on device, host, disk.

    ``values`` are ints, or the lookup table's ``[n, words]`` uint64 words
    (``ProbeTable.values``). ``live`` has bit ``4·slot`` set for every slot that may match.
    Int values wider than one uint64 (more than 16 slots) are split into 64-bit words through
    their bytes; each word is then handled alike: a slot's block is present when its nibble is
    non-zero, a running AND of presence gives the prefix (prefix-closed by construction), and
    masked bit counts per nibble give the depth and the fastest-medium split. All of that is
    done once per run of equal values (a chain's values change at few blocks), weighed by the
    run's length. ``shared`` is the shared slot: where its remote bit is set, every slot with
    bit ``4·slot`` in ``reach`` gets its remote bit too.
    """
    if isinstance(values, np.ndarray):
        if not len(values):  # reshape(0, -1) cannot infer the width
            return np.zeros((4, slots), dtype=np.int64)
        packed = values.reshape(len(values), -1)
    else:
        packed = pack_words(values, words_for(slots))
    words = packed.shape[1]
    counts = np.zeros((4, words * _NUMPY_SLOTS), dtype=np.int64)
    if not len(packed):
        return counts[:, :slots]
    lent: npt.NDArray[np.uint64] | None = None
    if shared is not None and reach:
        shared_word, lane = divmod(shared, _NUMPY_SLOTS)
        bit = np.uint64(BITS_PER_SLOT * lane + 3)
        lent = (packed[:, shared_word] >> bit) & _ONE  # 1 where the shared slot holds it
    for word in range(words):
        v = np.ascontiguousarray(packed[:, word], dtype=np.uint64)
        mask = np.uint64((live >> (64 * word)) & _MASK64)
        if not mask:
            continue
        if lent is not None:
            lanes = np.uint64(((reach >> (64 * word)) & _LOW_INT) << 3)
            v = v | (lent * lanes)
        # A chain's values change at few blocks (a worker gains or drops it, a medium
        # changes): every figure below is constant over a run of equal values, so work on one
        # value per run and weigh it by the run's length.
        starts = np.flatnonzero(v[1:] != v[:-1])
        starts += 1
        starts = np.concatenate([_START, starts])
        lengths = np.diff(starts, append=len(v))
        v = v[starts]
        present = (v | (v >> _ONE) | (v >> _TWO) | (v >> _THREE)) & _LOW_BITS
        alive = np.bitwise_and.accumulate(present) & mask
        device = v & alive
        host = (v >> _ONE) & ~v & alive
        disk = (v >> _TWO) & ~(v >> _ONE) & ~v & alive
        # one flag per bit: nibble s holds slot s's alive, device, host, disk (bits 0..3)
        flags = alive | (device << _ONE) | (host << _TWO) | (disk << _THREE)
        columns = slice(word * _NUMPY_SLOTS, (word + 1) * _NUMPY_SLOTS)
        counts[:, columns] = _bit_counts(flags, lengths).reshape(_NUMPY_SLOTS, BITS_PER_SLOT).T
    return counts[:, :slots]


def _bit_counts(
    bits: npt.NDArray[np.uint64], weights: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """For each of the 64 bits ``b``: the summed weights of the values with bit ``b`` set."""
    if not len(bits):
        return np.zeros(64, dtype=np.int64)
    octets = np.ascontiguousarray(bits, dtype="<u8").view(np.uint8).reshape(-1, 8)
    unpacked = np.unpackbits(octets, axis=1, bitorder="little")  # [n, 64]: bit b at column b
    counts: npt.NDArray[np.int64] = weights @ unpacked.astype(np.int64)
    return counts
