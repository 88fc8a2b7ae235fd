"""The fleet's worker table: worker id → state and base URL → worker id, copy-on-write.

A writer builds a new table and swaps the fleet's reference under the fleet lock; a reader
that must not hold the lock iterates the table it read once (see :mod:`kvstrata.fleet.fleet`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvstrata.fleet.workers import WorkerState


@dataclass(frozen=True, slots=True)
class Table:
    """The worker table; replaced whole (copy-on-write), never changed in place."""

    by_id: Mapping[str, WorkerState]
    by_url: Mapping[str, str]

    def with_worker(self, state: WorkerState) -> Table:
        by_id = {**self.by_id, state.worker_id: state}
        by_url = {**self.by_url, state.info.base_url: state.worker_id}
        return Table(MappingProxyType(by_id), MappingProxyType(by_url))
