"""One wiring for every engine adapter: who hears the device pool and the store, in what order.

The reference engine has a device pool; the vLLM connector has none of its own (vLLM publishes
its pool's events itself). Both call ``wire`` once, at construction, before any request:

1. the demotion listener (``demotion``, e.g. the engine's pool bridge) subscribes to the pool
   first, so an evicted block is copied into the store while its bytes are still in place;
2. the event emitter subscribes after it (it then reports the lower tier's copy before the
   device copy goes) and attaches to the store's change feed, which already lists objects
   recovered from a durable medium, so their tenants are known to later removal events.
"""

from __future__ import annotations

from kvstrata.runtime.blocks import PoolListener, PoolView
from kvstrata.runtime.events import KVEventEmitter
from kvstrata.store.tiered import TieredStore


def wire(
    *,
    pool: PoolView | None,
    store: TieredStore | None,
    demotion: PoolListener | None = None,
    emitter: KVEventEmitter | None = None,
) -> None:
    if demotion is not None:
        if pool is None:
            raise ValueError("a demotion listener needs a pool to listen to")
        pool.subscribe(demotion)
    if emitter is not None:
        emitter.attach(pool, store)
