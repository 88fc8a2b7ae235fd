"""Following a generation from the event loop and turning its token ids into text deltas.

The engine computes on its own step thread; a generation's subscriber wakes the event loop
(``loop.call_soon_threadsafe``) after every token, and ``follow`` turns the tokens seen so far
into text on the loop. The loop never computes and never waits on the engine. Leaving
``follow`` early (a stop string, a client gone) closes the generation: the engine frees its
sequence at the next step.

``TextAssembler`` detokenises incrementally (decode a short window of recent ids, emit the
new suffix, so the cost stays linear in the output) and applies stop strings: text that
could still become a stop string is held back, and a matched stop ends generation and is
trimmed. How much to hold back is tracked as the text grows (``_StopTails``, one KMP
automaton per stop string), so each token costs its own characters' worth of work, not the
square of the longest stop string's length (a 100 KB stop held the loop for seconds).
Streaming and non-streaming requests go through the same assembler, so the concatenated
deltas of a stream equal the text of the same request answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from kvstrata.engine.generation import Generation

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
        self._tails = _StopTails(self._stops)
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
            added = window[len(prefix) :]
            self.text += added
            self._tails.feed(added)
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
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string
        (``text`` only grows until the assembler stops or finishes, and it is asked only
        before: the tails fed in ``push`` are ``text``'s)."""
        return self._tails.longest()


class _StopTails:
    """For each stop string, the longest tail of a growing text that is a prefix of it.

    One Knuth–Morris–Pratt automaton per stop, fed only the characters appended: amortised
    O(1) work per character and stop, where slicing every tail up to the longest stop's
    length cost O(len(stop)^2) per token.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)  # an empty one matches at once
        self._failure = [_failure(stop) for stop in self._stops]
        self._states = [0] * len(self._stops)

    def feed(self, text: str) -> None:
        """The text grew by ``text``."""
        for i, stop in enumerate(self._stops):
            failure, state, size = self._failure[i], self._states[i], len(stop)
            for char in text:
                while state and (state == size or stop[state] != char):
                    state = failure[state - 1]
                if stop[state] == char:
                    state += 1
            self._states[i] = state

    def longest(self) -> int:
        """Length of the longest tail of the text fed so far that is a proper prefix of a
        stop string. A whole stop at the end (the assembler stops before it asks) counts as
        its longest proper prefix that is also its suffix."""
        best = 0
        for stop, failure, state in zip(self._stops, self._failure, self._states, strict=True):
            best = max(best, state if state < len(stop) else failure[-1])
        return best


def _failure(stop: str) -> list[int]:
    """KMP's failure function: ``[i]`` is the length of the longest proper prefix of
    ``stop[: i + 1]`` that is also its suffix."""
    failure = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        if stop[i] == stop[k]:
            k += 1
        failure[i] = k
    return failure


@dataclass
class Outcome:
    """A finished (or stopped, or abandoned) generation and its final text."""

    generation: Generation
    text: str
    finish_reason: str
    completion_tokens: int


async def follow(
    generation: Generation, assembler: TextAssembler, outcome: list[Outcome]
) -> AsyncGenerator[str, None]:
    """Text deltas of ``generation`` as its tokens arrive; appends the ``Outcome`` at the end.

    Raises the engine's error, if the generation failed. Closing the iterator early cancels the
    generation (its completed blocks stay cached).
    """
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def notify() -> None:  # on the engine thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(wake.set)

    generation.subscribe(notify)
    seen = 0
    try:
        while True:
            await wake.wait()
            wake.clear()
            done = generation.done  # read before the ids: no token can follow ``done``
            count = len(generation.output_ids)
            if count > seen:
                seen = count
                delta = assembler.push(generation.output_ids[:seen])
                if delta:
                    yield delta
                if assembler.stopped:
                    break
            if done:
                if generation.error is not None:
                    raise generation.error
                break
        tail = assembler.finish(generation.output_ids[:seen])
        if tail:
            yield tail
    finally:
        if not generation.done:
            generation.close("stop" if assembler.stopped else "abort")
    if assembler.stopped:
        reason = "stop"
    elif generation.finish_reason is not None:
        reason = generation.finish_reason
    else:
        reason = "abort"
    generation.record.finish_reason = reason
    outcome.append(Outcome(generation, assembler.text, reason, seen))
