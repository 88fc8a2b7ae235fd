"""Running generations on one engine thread and turning token ids into text deltas.

The reference engine is compute-bound and serves one request at a time, so every engine
call runs on one dedicated worker thread (``EngineWorker``); the event loop only parses,
awaits and writes. A streaming generation hands its text deltas to the loop through
``loop.call_soon_threadsafe`` into an ``asyncio.Queue``; a non-streaming one is just awaited.

``TextAssembler`` detokenises incrementally (decode a short window of recent ids, emit the
new suffix, so the cost stays linear in the output) and applies stop strings: text that
could still become a stop string is held back, and a matched stop ends generation and is
trimmed. Streaming and non-streaming requests go through the same assembler, so the
concatenated deltas of a stream equal the text of the same request answered at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from kvstrata.engine.generation import Generation
from kvstrata.errors import EngineError

T = TypeVar("T")

_REPLACEMENT = "\ufffd"  # a decode that ends inside a multi-byte character


class TextAssembler:
    """Incremental detokeniser with stop strings.

    Invariants: ``emitted`` is a prefix of ``text``; ``emitted`` never contains a stop string;
    once ``stopped`` is set, ``text`` ends right before the first stop string.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self.emitted = ""
        self.stopped = False

    def push(self, output_ids: Sequence[int]) -> str:
        """Account for the ids produced so far; return text that is now safe to emit."""
        if self.stopped:
            return ""
        prefix = self._decode(output_ids[self._prefix_offset : self._read_offset])
        window = self._decode(output_ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(_REPLACEMENT):
            self.text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        return self._release(final=False)

    def finish(self, output_ids: Sequence[int]) -> str:
        """The generation ended: reconcile with a full decode and release what is held back."""
        if not self.stopped:
            full = self._decode(output_ids)
            if full.startswith(self.emitted):
                self.text = full
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._stops and not self.stopped:
            start = max(0, len(self.emitted) - self._longest_stop)
            hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        safe = len(self.text)
        if not (final or self.stopped):
            safe -= self._partial_stop_len()
        delta = self.text[len(self.emitted) : safe]
        self.emitted += delta
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for size in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0


@dataclass(frozen=True)
class Outcome:
    """A finished (or stopped, or abandoned) generation and its final text."""

    generation: Generation
    text: str
    finish_reason: str


def produce(
    generation: Generation,
    assembler: TextAssembler,
    on_text: Callable[[str], None],
    cancelled: threading.Event,
) -> Outcome:
    """Drive ``generation`` to its end on the calling (engine) thread.

    Stops early on a stop string or when ``cancelled`` is set; either way the engine's
    generator is closed here, on this thread, so its pool blocks and lock are released.
    """
    iterator = iter(generation)
    try:
        for _token in iterator:
            delta = assembler.push(generation.output_ids)
            if delta:
                on_text(delta)
            if assembler.stopped or cancelled.is_set():
                break
    finally:
        generation.close()
    tail = assembler.finish(generation.output_ids)
    if tail:
        on_text(tail)
    if assembler.stopped:
        reason = "stop"
    elif generation.finish_reason is not None:
        reason = generation.finish_reason
    else:
        reason = "abort"
    generation.record.finish_reason = reason
    return Outcome(generation=generation, text=assembler.text, finish_reason=reason)


@dataclass(frozen=True)
class TextEvent:
    text: str


@dataclass(frozen=True)
class DoneEvent:
    outcome: Outcome


@dataclass(frozen=True)
class ErrorEvent:
    error: Exception
    generation: Generation | None


StreamEvent = TextEvent | DoneEvent | ErrorEvent


class EngineWorker:
    """The one thread that runs engine calls, with explicit ``start()`` / ``close()``."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._active: set[threading.Event] = set()

    def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-engine")

    def close(self) -> None:
        """Abandon running streams, drop queued work and wait for the current call."""
        for event in list(self._active):
            event.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and await its result."""
        if self._executor is None:
            raise EngineError("engine worker is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def stream(
        self,
        prepare: Callable[[], Generation],
        decode: Callable[[Sequence[int]], str],
        stops: Sequence[str],
        on_end: Callable[[Generation], None],
    ) -> AsyncGenerator[StreamEvent, None]:
        """Prepare and run a generation on the engine thread, yielding events on the loop.

        The last event is a ``DoneEvent`` or an ``ErrorEvent``. Closing the iterator early
        (client disconnect) asks the engine thread to stop after its current token.
        ``on_end`` runs on the engine thread once a prepared generation ends in any way,
        so its record is reported even when nobody is listening any more.
        """
        if self._executor is None:
            raise EngineError("engine worker is not started")
        return self._stream(self._executor, prepare, decode, stops, on_end)

    async def _stream(
        self,
        executor: ThreadPoolExecutor,
        prepare: Callable[[], Generation],
        decode: Callable[[Sequence[int]], str],
        stops: Sequence[str],
        on_end: Callable[[Generation], None],
    ) -> AsyncGenerator[StreamEvent, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        cancelled = threading.Event()

        def post(event: StreamEvent) -> None:
            if cancelled.is_set():
                return
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop closed under us (shutdown); nobody is listening
                cancelled.set()

        def job() -> None:
            generation: Generation | None = None
            try:
                generation = prepare()
                assembler = TextAssembler(decode, stops)
                outcome = produce(generation, assembler, lambda t: post(TextEvent(t)), cancelled)
            except Exception as exc:  # handed to the loop, which answers it as an error
                if generation is not None:
                    generation.record.error = type(exc).__name__
                    on_end(generation)
                post(ErrorEvent(exc, generation))
                return
            on_end(generation)
            post(DoneEvent(outcome))

        self._active.add(cancelled)
        try:
            executor.submit(job)
            while True:
                event = await queue.get()
                yield event
                if not isinstance(event, TextEvent):
                    return
        finally:
            cancelled.set()
            self._active.discard(cancelled)
