"""How a transfer into a decode worker ended (``TransferStatus``) and what a decode request
waits on for it (``TransferWaiter``): the records ``serve.transfer_receiver.DecodeTransfers``
keeps per request id, guarded by its lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.store.levels import Located


@dataclass(frozen=True)
class TransferStatus:
    """How one transfer ended on this worker: ``outcome`` is a ``TransferMetrics`` outcome;
    ``reason`` a ``RefuseReason`` value for a refused handshake (else empty)."""

    request_id: str
    outcome: str
    blocks: int
    payload_bytes: int
    seconds: float
    reason: str = ""
    detail: str = ""  # why a transfer that began did not commit (logs, never a label)

    @property
    def committed(self) -> bool:
        return self.outcome == "committed"


class TransferWaiter:
    """One transfer's end as a decode request waits for it, and the blocks held for it."""

    def __init__(self, now: float) -> None:
        self.done = threading.Event()
        self.status: TransferStatus | None = None
        self.created = now
        self.callbacks: list[Callable[[TransferStatus], None]] = []  # guarded by the lock
        self.held: list[Located] = []  # the received blocks held for the request (the lock)
        self.held_until = 0.0
        self.owned = False  # a transfer began that will end it (``_begin``; the lock)
