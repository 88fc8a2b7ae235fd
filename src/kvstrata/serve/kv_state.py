"""The worker's KV state over HTTP, and the threads that keep its event stream flowing.

Why here: a fleet index learns a worker's blocks from its live KV events and, after losing
some (a gap replay cannot fill, a new epoch), rebuilds its view from a dump. Endpoints:

- ``GET /kv/info``: worker id, epoch, model name, fingerprint (hex digest), block size, the
  bound live/replay endpoints (random ports resolved), the next live seq, the media and each
  store tier's measured fetch seconds per block (``fetch_s_per_block``: the store's EWMA of
  its loads times the block size in bytes; null until the tier served a load). The router
  polls this page for health, so it prices fetches with what the worker measured.
  ``curve_public_key``: the event sockets' CURVE server key (z85; null without CURVE), which
  a subscriber needs (with a client certificate the worker lists) to receive anything.
  ``transfer`` (a decode worker only): its transfer listener ``{host, port, layout,
  model_digest, active}`` (``serve.transfer_receiver``; ``docs/disaggregation.md``).
  ``step_tokens``: the scheduler's step budget (``max_num_batched_tokens``), so the router
  packs queued prompts into steps as this engine does (``router.queue``).
  ``compute``: where this worker computes (``router.placement``: host and boot, device, CPU
  affinity, read once at start), so a router can tell two workers that share cores apart
  from two machines.
- ``GET /kv/dump``: a msgpack ``KVEventBatch`` (worker id and epoch set) of ``BlockStored``
  events for every resident block; headers ``X-Kvstrata-Next-Seq`` (the live seq the dump is
  consistent with: apply the dump, then live batches from that seq on), ``X-Kvstrata-Epoch``
  and ``X-Kvstrata-Skipped-Without-Tokens``. Taken on the engine thread, so no publish
  interleaves.
- ``POST /kv/debug/drop-events?count=N[&evict_replay=1]`` (only with ``debug_endpoints``):
  the next N batches get a seq but are not sent live (and with ``evict_replay`` are not kept
  for replay either), to inject a gap in recovery tests.

Access (``HttpAuth``): ``/kv/info`` needs an observer, fleet or admin key (open on a
single-tenant server); ``/kv/dump`` carries every tenant's token ids, so it needs a fleet or
admin key and is off without one; the debug endpoint needs an admin key.

``KvStateRuntime`` runs beside the engine loop: the emitter's replay thread
(``KVEventEmitter.start_replay``: it only touches the publisher's ROUTER socket) and an idle
flush that publishes events the store made off the engine thread (write-back) when no request
comes to flush them. Both stop on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Final

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.events import encode_batch, make_batch
from kvstrata.identity import secret_digest
from kvstrata.router.placement import ComputePlace
from kvstrata.runtime.events import DEVICE_MEDIUM, EventSnapshot, KVEventEmitter
from kvstrata.security import ADMINISTER, DUMP, OBSERVE
from kvstrata.serve.auth import HttpAuth

KV_PREFIX: Final = "/kv"
NEXT_SEQ_HEADER: Final = "X-Kvstrata-Next-Seq"
EPOCH_HEADER: Final = "X-Kvstrata-Epoch"
SKIPPED_HEADER: Final = "X-Kvstrata-Skipped-Without-Tokens"
MSGPACK: Final = "application/msgpack"
_IDLE_FLUSH_S: Final = 0.1
logger = logging.getLogger("kvstrata.serve")


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return JSONResponse(body, status_code=status)


class KvStateRuntime:
    """The replay thread and the idle flush of one worker's emitter; ``start``/``close``."""

    def __init__(self, emitter: KVEventEmitter, engine: ReferenceEngine) -> None:
        self.emitter = emitter
        self.engine = engine
        self._stop = threading.Event()
        self._flusher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start both; call from the running event loop (the app's lifespan)."""
        self._stop.clear()
        self.emitter.start_replay()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_idle())

    async def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        await asyncio.to_thread(self.emitter.stop_replay)

    async def _flush_idle(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(_IDLE_FLUSH_S)
            if self.emitter.pending:
                try:
                    await asyncio.wrap_future(self.engine.call(self.emitter.flush))
                except Exception:  # keep flushing later; a request's flush may succeed
                    logger.exception("publishing buffered KV events failed")


def register_kv_state(
    app: FastAPI,
    engine: ReferenceEngine,
    *,
    model_name: str,
    auth: HttpAuth,
    debug_endpoints: bool = False,
    transfer_info: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Add the ``/kv`` endpoints (404 with a clear message when the engine has no emitter).
    ``transfer_info``: the decode worker's transfer listener, advertised as ``"transfer"``."""
    emitter = engine.events
    compute = local_compute_place(str(engine.device)).to_json()  # host, boot, CPUs: at start

    def no_events() -> JSONResponse:
        message = "this worker publishes no KV events (start it with --events-endpoint)"
        return _error(404, message, "kv_events_disabled")

    @app.get(KV_PREFIX + "/info", response_model=None)
    async def kv_info(request: Request) -> Response:
        auth.check(request, OBSERVE, "read /kv/info", open_single_tenant=True)
        if emitter is None and transfer_info is None:
            return no_events()
        body = kv_info_body(engine, emitter, model_name) if emitter is not None else {}
        if transfer_info is not None:
            body["transfer"] = transfer_info()
        body["compute"] = compute
        return JSONResponse(body)

    @app.get(KV_PREFIX + "/dump", response_model=None)
    async def kv_dump(request: Request) -> Response:
        auth.check(request, DUMP, "read /kv/dump")
        if emitter is None:
            return no_events()
        snapshot: EventSnapshot = await asyncio.wrap_future(engine.call(emitter.snapshot))
        batch = make_batch(snapshot.events, worker_id=emitter.worker_id, epoch=snapshot.epoch)
        headers = {
            NEXT_SEQ_HEADER: str(snapshot.next_seq),
            EPOCH_HEADER: str(snapshot.epoch),
            SKIPPED_HEADER: str(snapshot.skipped_without_tokens),
        }
        return Response(encode_batch(batch), media_type=MSGPACK, headers=headers)

    if not debug_endpoints:
        return

    @app.post(KV_PREFIX + "/debug/drop-events", response_model=None)
    async def drop_events(
        request: Request, count: int = Query(ge=0), evict_replay: bool = Query(default=False)
    ) -> Response:
        auth.check(request, ADMINISTER, "inject event gaps")
        if emitter is None:
            return no_events()

        def arm() -> int:
            emitter.publisher.drop_next(count, evict_replay=evict_replay)
            return emitter.publisher.next_seq

        # the publishing (step) thread owns the drop counter
        next_seq = await asyncio.wrap_future(engine.call(arm))
        return JSONResponse({"dropping": count, "evict_replay": evict_replay, "next_seq": next_seq})


def local_compute_place(device: str) -> ComputePlace:
    """This process's place: hostname + kernel boot id, ``device`` (``cpu`` for any CPU
    engine), the CPUs it may run on."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the hostname alone
        boot = ""
    getaffinity = getattr(os, "sched_getaffinity", None)
    cpus = getaffinity(0) if getaffinity is not None else range(os.cpu_count() or 1)
    kind = "cpu" if device.startswith("cpu") else device
    return ComputePlace(host=f"{socket.gethostname()}/{boot}", device=kind, cpus=frozenset(cpus))


def kv_info_body(
    engine: ReferenceEngine, emitter: KVEventEmitter, model_name: str
) -> dict[str, Any]:
    publisher = emitter.publisher
    tiers = [DEVICE_MEDIUM]
    fetch: dict[str, float | None] = {}
    if engine.bridge is not None:
        store = engine.bridge.store
        tiers += [level.name for level in store.levels]
        block_bytes = engine.pool.config.bytes_per_block
        with store.exclusive():  # the figures are the store lock's
            for level in store.levels:
                per_byte = level.fetch_s_per_byte
                fetch[level.name] = per_byte * block_bytes if per_byte > 0 else None
    return {
        "worker_id": emitter.worker_id,
        "epoch": emitter.epoch,
        "model": model_name,
        "fingerprint": engine.model_id or None,
        "block_size": engine.config.block_size,
        "events_endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "next_seq": publisher.next_seq,
        "tiers": tiers,
        "fetch_s_per_block": fetch,
        "secret_digest": secret_digest(engine.config.tenant_secret),
        "curve_public_key": publisher.curve_public_key,
        "step_tokens": engine.config.scheduler.max_num_batched_tokens,
    }
