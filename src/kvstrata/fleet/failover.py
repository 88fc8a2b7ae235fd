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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


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
        raise
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone
