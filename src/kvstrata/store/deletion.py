"""What a deletion request selects and what it reports (pure: no I/O, time passed in).

A ``DeleteSelector`` names one tenant (a namespace, as in ``KVObjectMeta.tenant``) and one
criterion: ``keys`` (the chained keys of a prompt: those blocks and all their descendants),
``all`` (every object of the tenant) or ``older_than_s`` (the tenant's objects created more
than that long ago, and their descendants: a child without its parent can never be hit, since
lookups are prefix-closed). ``select`` turns it into keys over the ``ObjectRef``s that every
holder reported (the device pool, each store level, the remote server), following parents to
descendants across holders; the keys come parents first.

``DeleteReport`` is the answer: replicas removed per tier (every tier listed, ``device``
included), every key deleted or tombstoned (for the audit and the index), how many replicas
are pinned or in flight (invisible now, removed when released) and which media failed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects.tombstone import ObjectRef


@dataclass(frozen=True)
class DeleteSelector:
    tenant: str  # namespace name, as in KVObjectMeta.tenant
    keys: tuple[BlockKey, ...] = ()  # prefix keys: these AND all their descendants (chain)
    all: bool = False  # every object of the tenant
    older_than_s: float | None = None  # the tenant's objects created more than this long ago

    def __post_init__(self) -> None:
        if not self.tenant:
            raise InvalidInput("a deletion names a tenant")
        criteria = bool(self.keys) + self.all + (self.older_than_s is not None)
        if criteria != 1:
            raise InvalidInput("a deletion selects by exactly one of keys, all, older_than_s")
        if self.older_than_s is not None and not self.older_than_s >= 0:
            raise InvalidInput(f"older_than_s must be >= 0, got {self.older_than_s}")


@dataclass
class DeleteReport:
    removed: dict[str, int]  # per tier name, "device" included (0 entries present)
    keys: list[BlockKey]  # every key deleted/tombstoned (audit, index)
    pending: int = 0  # replicas pinned/in flight: invisible now, removed later
    unreachable: list[str] = field(default_factory=list)  # tiers whose medium failed

    @property
    def total(self) -> int:
        return sum(self.removed.values())


def select(selector: DeleteSelector, refs: Iterable[ObjectRef], now: float) -> list[BlockKey]:
    """The keys ``selector`` deletes among ``refs`` (any holder's), parents first."""
    mine = [ref for ref in refs if ref.tenant == selector.tenant]
    children: dict[BlockKey, list[BlockKey]] = {}
    for ref in mine:
        if ref.parent is not None:
            children.setdefault(ref.parent, []).append(ref.key)
    seeds: list[BlockKey] = list(selector.keys)
    if selector.all:
        seeds += [ref.key for ref in mine]
    if selector.older_than_s is not None:
        cutoff = now - selector.older_than_s
        seeds += [ref.key for ref in mine if ref.created_at is not None and ref.created_at < cutoff]
    selected = dict.fromkeys(seeds)
    queue = list(selected)
    for key in queue:  # breadth first (a parent before its children); grows as it goes
        for child in children.get(key, ()):
            if child not in selected:
                selected[child] = None
                queue.append(child)
    return queue
