"""The eviction policies people deploy, as kvstrata's peers (``kvstrata bench eviction`` and a
tier's ``eviction_policy``): S3-FIFO, ARC, GDSF and TinyLFU in front of LRU. Each module cites
its paper and says how it honours prefix closure."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.store.arc import ARCPolicy
from kvstrata.store.gdsf import GDSFPolicy
from kvstrata.store.policy import EvictionPolicy
from kvstrata.store.s3fifo import S3FIFOPolicy
from kvstrata.store.tinylfu import TinyLFUPolicy

__all__ = ["DEPLOYED_POLICIES", "ARCPolicy", "GDSFPolicy", "S3FIFOPolicy", "TinyLFUPolicy"]


def _gdsf(demotion_fetch_s_per_byte: float | None) -> EvictionPolicy:
    return GDSFPolicy(demotion_fetch_s_per_byte=demotion_fetch_s_per_byte)


DEPLOYED_POLICIES: dict[str, Callable[[float | None], EvictionPolicy]] = {
    "s3fifo": lambda _fetch: S3FIFOPolicy(),
    "arc": lambda _fetch: ARCPolicy(),
    "gdsf": _gdsf,
    "tinylfu": lambda _fetch: TinyLFUPolicy(),
}
"""name → factory taking the demotion target's fetch cost (seconds per byte, or None)."""
