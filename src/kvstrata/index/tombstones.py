"""What the global index needs to apply a deletion: tombstones, and each entry's lineage.

Why tombstones: after a deletion the index drops the deleted blocks, but events that describe
the state *before* the deletion may still arrive — a batch queued on the subscriber, a replay
of an old batch, a dump taken before the deletion and applied after it. Any of them would bring
a deleted block back into routing. A tombstone remembers, per deleted hash, where each worker's
stream stood once its deletion was published (``StreamPosition``: the epoch and the first
sequence number that describes the state after it, the worker's ``events_next_seq``), and
refuses a ``BlockStored`` of that hash from an earlier position:

- same epoch, ``seq < next_seq``: refused (late, replayed, or a stale dump's);
- same epoch, ``seq >= next_seq``: accepted (the block was stored again after the deletion —
  deletion removes data, it does not ban a prompt);
- another epoch: refused if it is one the index knew the worker by at the deletion
  (``refused_epochs``: the deletion answer came from a newer incarnation), else accepted
  (a restarted worker's recovery drops deleted objects itself, so its events are facts);
- a worker with no position (it did not confirm the deletion: unreachable, refused), or an
  event with no sequence number: refused. When unsure, do not route to deleted data.

Tombstones expire ``ttl_s`` after the deletion (longer than any event lag or write-back
delay: ``security.tombstone_ttl_s``). Time is passed in; nothing here reads a clock.

Why lineage: the index's packed entries know neither their tenant nor their parent, yet a
deletion names a tenant (``all``) or a prefix whose descendants go too. ``Lineage`` keeps, for
every router hash placed from an event, its namespace and its parent's router hash.

Both are pure bookkeeping owned by the :class:`~kvstrata.index.core.GlobalIndex`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where a worker's event stream stood once its deletion was published."""

    epoch: int | None
    next_seq: int
    """The first live seq that describes the state after the deletion."""
    refused_epochs: frozenset[int] = frozenset()
    """Older incarnations of the worker: every event of theirs is refused."""

    def refuses(self, epoch: int | None, seq: int | None) -> bool:
        if epoch is not None and epoch in self.refused_epochs:
            return True
        if epoch is not None and self.epoch is not None and epoch != self.epoch:
            return False
        return seq is None or seq < self.next_seq


@dataclass(frozen=True, slots=True)
class Tombstone:
    """One deletion's verdict, shared by every hash it deleted."""

    deleted_at: float
    expires_at: float
    positions: Mapping[str, StreamPosition]

    def refuses(self, worker_id: str, epoch: int | None, seq: int | None) -> bool:
        position = self.positions.get(worker_id)
        return position is None or position.refuses(epoch, seq)


@dataclass
class Tombstones(Generic[K]):
    """Deleted hashes → their tombstone; expiring in deletion order (one TTL for all)."""

    ttl_s: float
    _by_hash: dict[K, Tombstone] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError("the tombstone TTL must be positive")

    def __len__(self) -> int:
        return len(self._by_hash)

    def add(
        self, hashes: Iterable[K], positions: Mapping[str, StreamPosition], now: float
    ) -> Tombstone:
        """Tombstone ``hashes`` (a later deletion of a hash replaces the earlier verdict)."""
        tombstone = Tombstone(now, now + self.ttl_s, dict(positions))
        by_hash = self._by_hash
        for block_hash in hashes:
            by_hash.pop(block_hash, None)  # re-inserted at the end: dict order = expiry order
            by_hash[block_hash] = tombstone
        return tombstone

    def get(self, block_hash: K, now: float) -> Tombstone | None:
        tombstone = self._by_hash.get(block_hash)
        if tombstone is None or tombstone.expires_at <= now:
            return None
        return tombstone

    def expire(self, now: float) -> int:
        """Drop expired tombstones (oldest first); returns how many."""
        by_hash = self._by_hash
        expired = []
        for block_hash, tombstone in by_hash.items():
            if tombstone.expires_at > now:
                break
            expired.append(block_hash)
        for block_hash in expired:
            del by_hash[block_hash]
        return len(expired)


class Lineage:
    """Router hash → (namespace, parent router hash) of every entry placed from an event."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[str, int | None]] = {}

    def __len__(self) -> int:
        return len(self._of)

    def add(self, namespace: str, parent: int | None, chain: Sequence[int]) -> None:
        """A chain of blocks (each the parent of the next) below ``parent``."""
        of = self._of
        for router_hash in chain:
            of[router_hash] = (namespace, parent)
            parent = router_hash

    def discard(self, router_hash: int) -> None:
        self._of.pop(router_hash, None)

    def namespace_of(self, router_hash: int) -> str | None:
        """The namespace ``router_hash`` was placed in; None when unknown."""
        known = self._of.get(router_hash)
        return None if known is None else known[0]

    def namespace(self, namespace: str) -> set[int]:
        """Every known entry of ``namespace``."""
        return {h for h, (ns, _parent) in self._of.items() if ns == namespace}

    def descendants(self, namespace: str, roots: Iterable[int]) -> set[int]:
        """``roots`` and every known entry below one of them (a scan of the namespace: a
        deletion is rare, a child map kept on every store would cost every event)."""
        children: dict[int, list[int]] = {}
        for router_hash, (ns, parent) in self._of.items():
            if ns == namespace and parent is not None:
                children.setdefault(parent, []).append(router_hash)
        found = set(roots)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        return found


__all__ = ["Lineage", "StreamPosition", "Tombstone", "Tombstones"]
