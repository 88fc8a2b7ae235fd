"""What an engine's device pool tells the runtime about its blocks (no torch here).

An engine adapter owns its device pool; the runtime (store bridge, event emitter) only needs
to hear what changes and to list what is resident. These types are that contract:

- ``BlockInfo`` is the runtime's per-block record an engine keeps beside each pool block:
  the tenant, the block's first token position and its tokens (so KV events and stored metas
  can carry them; a fleet index hashes tokens itself).
- ``ResidentBlock`` is a committed block as a listener or a snapshot sees it.
- ``EvictedBlock`` is handed to listeners while an evicted block's bytes are still in place
  (so demotion can copy them before the slot is reused). ``reason`` is ``EVICTED`` (room was
  needed: demotion may keep it below) or ``DELETED`` (a deletion request: nothing may keep it,
  and a block a running sequence still reads leaves the pool's index now, its slot later).
- ``PoolListener`` hears commits and evictions, on the thread that makes them (the engine's),
  in subscription order; neither call may raise.
- ``PoolView`` is what the event emitter reads: the committed blocks, parents first, and a way
  to subscribe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstrata.identity import BlockKey

EVICTED = "evicted"
DELETED = "deleted"


@dataclass(frozen=True)
class BlockInfo:
    tenant: str
    position: int
    tokens: tuple[int, ...] | None = None
    created_at: float | None = None  # wall time its KV was computed (deletion's older_than)


def block_tokens(token_ids: Sequence[int] | None, index: int, size: int) -> tuple[int, ...] | None:
    """Tokens of full block ``index`` of ``token_ids`` (None when the caller has none)."""
    if token_ids is None:
        return None
    tokens = tuple(int(t) for t in token_ids[index * size : (index + 1) * size])
    return tokens if len(tokens) == size else None


@dataclass(frozen=True)
class ResidentBlock:
    """A committed block as listeners and snapshots see it (``info`` is the owner's data)."""

    key: BlockKey
    parent_key: BlockKey | None
    info: object


@dataclass(frozen=True)
class EvictedBlock:
    """A block being evicted, handed to listeners while its bytes are still in place."""

    block_id: int
    key: BlockKey
    parent_key: BlockKey | None
    uses: int
    info: object
    reason: str = EVICTED


class PoolListener(Protocol):
    def block_committed(self, block: ResidentBlock) -> None: ...

    def block_evicted(self, block: EvictedBlock) -> None: ...


class PoolView(Protocol):
    def committed_blocks(self) -> list[ResidentBlock]: ...

    def subscribe(self, listener: PoolListener) -> None: ...
