"""Re-routing requests whose worker was declared dead while they waited on it.

A worker that hangs (SIGSTOP, a wedged event loop) still accepts connections, so a request
sent there waits for the front door's ``request_timeout_s`` (minutes) — the connection never
fails. The health round declares such a worker dead after ``health_failures`` unanswered
probes (``FleetConfig.health_timeout_s`` each); ``WorkerDeaths`` turns that declaration,
made on the health round's thread, into an ``asyncio.Event`` per worker on the front door's
loop, and ``unless_dead`` races each wait on a worker against it: the request is then
re-routed if the client was sent nothing yet, or its stream is cut (never ended cleanly: a
clean end would read as a whole answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response

from kvstrata.fleet.fleet import Fleet, Reservation

T = TypeVar("T")
_log = logging.getLogger("kvstrata.fleet.frontdoor")


class WorkerGone(Exception):
    """The worker a request waited on was declared dead."""


class ClientGone(Exception):
    """The client of a request that waited on a worker disconnected."""


CLIENT_POLL_S = 0.25
"""How often a wait on a worker checks whether its client is still there."""


class WorkerDeaths:
    """Per worker, an event set when the worker is declared dead; one per death (a worker
    attached again starts with a fresh one). Owned by the front door's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: dict[str, asyncio.Event] = {}

    def event(self, worker_id: str) -> asyncio.Event:
        """The event of ``worker_id``'s next death (call on the loop)."""
        return self._events.setdefault(worker_id, asyncio.Event())

    def declare(self, worker_id: str) -> None:
        """``Fleet.on_worker_dead``'s listener: safe from any thread."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing waits
            self._loop.call_soon_threadsafe(self._fire, worker_id)

    def _fire(self, worker_id: str) -> None:
        event = self._events.pop(worker_id, None)
        if event is not None:
            event.set()


async def unless_dead(gone: asyncio.Event, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, unless ``gone`` is set first: then it is cancelled and
    ``WorkerGone`` raised."""
    task = asyncio.ensure_future(awaitable)
    if gone.is_set():
        task.cancel()
        raise WorkerGone
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise WorkerGone


async def until_dead(gone: asyncio.Event, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` until they end, or until ``gone`` is set (then ``WorkerGone``)."""
    while True:
        try:
            chunk = await unless_dead(gone, anext(chunks))
        except StopAsyncIteration:
            return
        yield chunk


async def unless_client_left(
    is_disconnected: Callable[[], Awaitable[bool]], awaitable: Awaitable[T]
) -> T:
    """``await awaitable``, unless the client disconnects first (polled every
    ``CLIENT_POLL_S``): then it is cancelled — closing the connection to the worker, whose
    own watcher then stops the generation — and ``ClientGone`` raised. A non-streamed answer
    arrives whole at its end: without this, a client that left kept the worker generating
    (and the request counted in flight) to ``max_tokens``."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CLIENT_POLL_S)
            if done:
                return task.result()
            if await is_disconnected():
                break
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_close_unread)  # it may have finished meanwhile: close it
        raise
    task.cancel()
    with contextlib.suppress(BaseException):
        await _close(await task)  # it finished while we asked: nobody will read it
    raise ClientGone


async def _close(result: object) -> None:
    """Close an answer nobody will read (an open streaming response holds a connection)."""
    close = getattr(result, "aclose", None)
    if close is not None:
        await close()


_CLOSING: set[asyncio.Future[None]] = set()  # held until done (the loop keeps weak refs)


def _close_unread(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        closing = asyncio.ensure_future(_close(task.result()))
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)


def client_left(fleet: Fleet, reservation: Reservation, request_id: str) -> Response:
    """The client disconnected while its request waited on a worker: the connection to the
    worker is closed (it stops generating), the reservation released; nobody reads the
    answer (499, nginx's "client closed request", for the metrics)."""
    fleet.finish(reservation, time.time(), None, None)
    _log.info("client of %s left before its answer; worker %s told", request_id,
              reservation.worker_id)  # fmt: skip
    return Response(status_code=499)


def re_route(
    fleet: Fleet, reservation: Reservation, when: str, exc: BaseException, request_id: str
) -> None:
    """The worker failed (or was declared dead) before the client got anything: flag it and
    count the retry; the caller then tries the next best worker."""
    fleet.unreachable(reservation)
    fleet.metrics.retries.labels(reservation.worker_id).inc()
    _log.warning("worker %s failed%s (%r); re-routing %s",
                 reservation.worker_id, when, exc, request_id)  # fmt: skip
