"""Holds on what the vLLM scheduler was promised, from its lookup to the request's load.

vLLM asks the connector, scheduler side, how many tokens of a waiting request kvstrata can
provide (``get_num_new_matched_tokens`` → ``ConnectorWorker.lookup``), allocates device blocks
for them, and a step or more later the worker side loads them (``ConnectorWorker.fetch``).
Between the answer and the load the store may evict the promised blocks (another request's
saves fill the level): the load then comes up short, and vLLM recomputes what is missing
(counted as ``load_missing``). LMCache's connector pins what its lookup found for the same
reason (``LMCacheEngine.lookup(..., pin=True)``, released by ``lookup_unpin`` after the
retrieve).

``LookupHolds`` keeps, per vLLM request, a ``TieredStore.hold`` on the blocks its latest lookup
answered:

* a new lookup for the same request replaces its hold (vLLM asks again each time it tries to
  schedule a request that is still waiting, and a preempted request is looked up again);
* the request's load ends it (``end``, from ``ConnectorWorker.finish_load`` for every request
  of the step, fetched or not: a fetch thread stops at the first that raises);
* a hold that no lookup renewed for ``LOOKUP_HOLD_S`` ends (``reap``, every engine step): a
  request aborted, or scheduled without a load, before it was loaded;
* ``close`` ends them all.

Holds are matched to loads by request id only: a load of a request that was looked up again
since (preempted, resumed) ends the newer hold a little early, which only costs protection.

These are reservations (``TieredStore.hold(..., reserve=True)``): the store refuses one past
``store.state.HOLD_SHARE`` of a level, so a long queue of looked-up requests delays eviction
but never fills a level; blocks past the cap are promised unprotected, as before. Objects of
a shared remote tier cannot be held (it evicts on its own); their promise stays best effort.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from kvstrata.store.levels import Located
from kvstrata.store.tiered import TieredStore

LOOKUP_HOLD_S: Final = 10.0
"""How long a lookup's hold lasts without a newer lookup or a load of its request. vLLM loads
a request in the step it schedules it, milliseconds to a few seconds after the lookup; a
request it keeps waiting is looked up again at each attempt, which renews the hold."""


class LookupHolds:
    """Per vLLM request: the store hold on what its latest lookup promised (module docstring).

    Thread-safe: lookups come from the lookup server's thread, loads from the fetch thread.
    The store's own calls run outside this object's lock."""

    def __init__(
        self,
        store: TieredStore,
        *,
        hold_s: float = LOOKUP_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, tuple[list[Located], float]] = {}  # req → (held, deadline)
        self._closed = False

    def take(self, req_id: str, located: Sequence[Located]) -> None:
        """Hold ``located`` (a lookup's answer) for ``req_id`` in place of its previous hold
        (released first, so it never counts against the cap of its own replacement); the
        store ends a reservation at its level's cap or at a block gone since the lookup."""
        self.end(req_id)
        held = self._store.hold(located, reserve=True) if located else []
        with self._lock:
            if self._closed:
                stale = held
            else:
                stale = []
                if held:
                    self._held[req_id] = (held, self._clock() + self._hold_s)
        self._store.release(stale)

    def end(self, req_id: str) -> None:
        """The request's load is over (or it needs no hold any more): release its hold."""
        with self._lock:
            entry = self._held.pop(req_id, None)
        if entry is not None:
            self._store.release(entry[0])

    def reap(self) -> int:
        """End the holds no lookup renewed for ``LOOKUP_HOLD_S``; returns how many (the worker
        calls it every engine step, and the module docstring's expiry depends on it)."""
        now = self._clock()
        with self._lock:
            expired = [r for r, (_, deadline) in self._held.items() if deadline <= now]
            stale = [self._held.pop(r)[0] for r in expired]
        for held in stale:
            self._store.release(held)
        return len(stale)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._held = list(self._held.values()), {}
        for held, _ in entries:
            self._store.release(held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
