"""``index.matching.slot_prefixes`` against a per-block, per-slot reference: the run-length
shortcut must answer exactly what walking every block of every slot answers."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.index.matching import BITS_PER_SLOT, pack_words, slot_prefixes


def _reference(
    values: list[int], slots: int, live: int, shared: int | None, reach: int
) -> list[list[int]]:
    out = [[0] * slots for _ in range(4)]
    for slot in range(slots):
        if not live >> (BITS_PER_SLOT * slot) & 1:
            continue
        depth = device = host = disk = 0
        for value in values:
            nibble = value >> (BITS_PER_SLOT * slot) & 0xF
            lent = shared is not None and value >> (BITS_PER_SLOT * shared + 3) & 1
            if lent and reach >> (BITS_PER_SLOT * slot) & 1:
                nibble |= 0x8
            if not nibble:
                break
            depth += 1
            device += nibble & 1
            host += nibble & 2 and not nibble & 1
            disk += nibble & 4 and not nibble & 3
        for row, figure in enumerate((depth, device, host, disk)):
            out[row][slot] = figure
    return out


@pytest.mark.parametrize("seed", range(12))
def test_slot_prefixes_equal_a_walk_over_every_block_and_slot(seed: int) -> None:
    """Random fleets of 1-40 slots; values in runs (as chains give) with random single-block
    changes between them; a random live set and, half the time, a shared slot lending its
    remote bit to a random reach set. Ints and the table's uint64 words answer alike."""
    rng = np.random.default_rng(seed)
    slots = int(rng.integers(1, 41))
    width = BITS_PER_SLOT * slots
    n = int(rng.integers(1, 3000))
    values: list[int] = []
    while len(values) < n:
        value = int.from_bytes(rng.bytes(-(-width // 8)), "little") & ((1 << width) - 1)
        if rng.random() < 0.3:  # sparse values: slots drop out, so prefixes end at random
            value &= int.from_bytes(rng.bytes(-(-width // 8)), "little")
        values.extend([value] * int(rng.integers(1, 200) if rng.random() < 0.7 else 1))
    values = values[:n]
    live = sum(1 << (BITS_PER_SLOT * s) for s in range(slots) if rng.random() < 0.8)
    shared = int(rng.integers(slots)) if rng.random() < 0.5 else None
    reach = sum(1 << (BITS_PER_SLOT * s) for s in range(slots) if rng.random() < 0.6)
    expected = _reference(values, slots, live, shared, reach)
    got = slot_prefixes(values, slots, live, shared=shared, reach=reach)
    assert got.tolist() == expected
    words = pack_words(values, -(-slots // 16))
    assert slot_prefixes(words, slots, live, shared=shared, reach=reach).tolist() == expected


def test_slot_prefixes_of_no_values_are_zero() -> None:
    assert slot_prefixes([], 3, 0x111).tolist() == [[0, 0, 0]] * 4
    empty = np.zeros((0, 1), dtype=np.uint64)
    assert slot_prefixes(empty, 3, 0x111).tolist() == [[0, 0, 0]] * 4
