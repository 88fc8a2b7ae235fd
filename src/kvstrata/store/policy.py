"""Eviction policy interface: pure bookkeeping over the keys of one tier.

A policy never touches bytes or does I/O. The tier owns bytes and pins; the tiered store asks
the policy for a victim and then removes (or demotes) it through the tier. The same policy
objects run inside the real store and inside the simulator / ``kvstrata bench eviction``, in
simulated time (``now`` is always passed in, never read from a clock).

Contract (checked by tests for every policy):
- ``victim`` returns only keys that were inserted and not removed, that are *leaves* in this
  tier (no child of theirs is present — prefix closure: leaves leave before ancestors), and
  for which ``can_evict(key)`` is true (the store passes "not pinned" here).
- With ``tenant`` set, only that tenant's objects are candidates (a tenant over its quota
  evicts its own objects first).
- Expired objects (``meta.expired(now)``) are preferred over everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str:
        """The policy's name in benchmarks and metrics (a class attribute is fine)."""

    def on_insert(self, meta: KVObjectMeta, now: float) -> None:
        """An object became COMMITTED in this tier."""

    def on_access(self, key: BlockKey, now: float) -> None:
        """A request used this object (a hit, or a re-store of the same key)."""

    def on_remove(self, key: BlockKey) -> None:
        """The object left the tier (evicted, demoted, invalidated, deleted, expired)."""

    def victim(
        self,
        now: float,
        *,
        tenant: str | None = None,
        can_evict: Callable[[BlockKey], bool] | None = None,
    ) -> BlockKey | None:
        """The next object to evict, or None when no candidate exists."""


@runtime_checkable
class AdmissionFilter(Protocol):
    """A policy that may keep its victim and refuse the newcomer instead (TinyLFU).

    Whoever evicts for a newcomer (the store, ``kvstrata bench eviction``'s replay) asks
    ``admit`` once it has the victim and before removing it; False: the victim stays and the
    newcomer is not stored. A refused block's descendants in the same request cannot be
    stored either (prefix closure); they are reported with ``on_refused`` (requested, not
    stored), so a filter that counts requests still counts them. A caller that never asks
    gets the policy's plain eviction order.
    """

    def admit(self, meta: KVObjectMeta, victim: BlockKey, now: float) -> bool:
        """The tier is full and evicting ``victim`` would make room for ``meta``."""

    def on_refused(self, key: BlockKey, now: float) -> None:
        """``key`` was requested but not offered for storing (an ancestor was refused)."""
