"""The index's vocabulary: media, consistency modes, a worker's prefix match, the counters."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Final

import numpy as np


class Medium(IntEnum):
    """Where a worker holds a block, fastest first (the bit index inside a worker's nibble)."""

    DEVICE = 0
    HOST = 1
    DISK = 2
    REMOTE = 3


MEDIUM_ALIASES: Final[dict[str, Medium]] = {
    "device": Medium.DEVICE,
    "gpu": Medium.DEVICE,
    "cuda": Medium.DEVICE,
    "host": Medium.HOST,
    "cpu": Medium.HOST,
    "dram": Medium.HOST,
    "disk": Medium.DISK,
    "local_disk": Medium.DISK,
    "remote": Medium.REMOTE,
    "redis": Medium.REMOTE,
    "valkey": Medium.REMOTE,
}
"""Event ``medium`` strings: kvstrata's tier names plus vLLM's ``GPU``/``CPU`` (any case)."""


def parse_medium(name: str | None) -> Medium | None:
    """``None`` (vLLM before it sent a medium) means the device pool; unknown names → None."""
    if name is None:
        return Medium.DEVICE
    return MEDIUM_ALIASES.get(name.lower())


class ConsistencyMode(StrEnum):
    EXACT = "exact"
    APPROXIMATE = "approximate"


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A worker's longest cached prefix of a request, in blocks, split by fastest medium."""

    worker_id: str
    blocks: int
    tier_blocks: tuple[int, int, int, int]
    """Blocks held at best in device, host, disk, remote (sums to ``blocks``)."""
    predicted: bool = False
    """True in approximate mode: the router's own guess, not a reported fact."""


@dataclass(frozen=True, slots=True)
class IndexDeletion:
    """What one :meth:`GlobalIndex.delete` did."""

    removed: int
    """Block placements removed (one per worker slot and medium, or shared block)."""
    tombstoned: int
    """Hashes (engine and router) that now refuse late events."""


@dataclass
class IndexStats:
    """Counters and lag samples the fleet exports as metrics; owned, never global."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    duplicate_stores: int = 0
    unknown_removals: int = 0
    orphan_blocks: int = 0
    """Stored blocks whose parent the worker never reported: unplaceable, skipped."""
    bad_events: int = 0
    """Token count or block size disagree with the hashes; skipped."""
    unknown_mediums: int = 0
    clears: int = 0
    stale_batches: int = 0
    """Batches stamped with an epoch the worker already left behind (ignored)."""
    epoch_changes: int = 0
    stale_entries_dropped: int = 0
    resyncs: int = 0
    inconsistent_marks: int = 0
    routes_recorded: int = 0
    predictions_expired: int = 0
    deletions: int = 0
    deleted_entries: int = 0
    """Block placements (worker slot or shared tier) removed by deletions."""
    tombstone_refusals: int = 0
    """Stored blocks refused because a deletion's tombstone predates them."""
    lag_samples: deque[float] = field(default_factory=lambda: deque(maxlen=8192))

    def lag_quantile(self, q: float) -> float | None:
        if not self.lag_samples:
            return None
        return float(np.quantile(np.fromiter(self.lag_samples, dtype=np.float64), q))
