"""The deletion contract between the engine and its callers (types only, for now).

``ReferenceEngine.delete(selector, now=None) -> DeleteReport`` (on the engine thread) removes
the selected objects from the device pool and every store level and leaves tombstones. The
implementation lives on the data side (branch ``delcore``); until it lands these types let
the deletion plane (``serve.deletion``, ``fleet.deletion``) be written against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.identity import BlockKey


@dataclass(frozen=True)
class DeleteSelector:
    tenant: str
    """Namespace name, as in ``KVObjectMeta.tenant``."""
    keys: tuple[BlockKey, ...] = ()
    """Prefix keys: these and all their descendants (the chain)."""
    all: bool = False
    """Every object of the tenant."""
    older_than_s: float | None = None
    """The tenant's objects created more than this long ago."""


@dataclass
class DeleteReport:
    removed: dict[str, int]
    """Replicas removed per tier name, ``device`` included."""
    keys: list[BlockKey]
    """Every key deleted (audit, index)."""
    pending: int = 0
    """Replicas pinned or in flight: invisible now, removed when released."""
    unreachable: list[str] = field(default_factory=list)
    """Tiers whose medium failed: their replicas may remain (invisible here)."""


__all__ = ["DeleteReport", "DeleteSelector"]
