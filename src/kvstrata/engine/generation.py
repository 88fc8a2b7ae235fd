"""A generation in progress: the handle a caller holds while the engine's steps produce tokens.

The engine thread appends tokens and finally marks the generation done (``_emit`` /
``_finish``); any other thread reads them. Iterating yields token ids as they arrive: when the
engine runs its own step loop (a server), the iterator waits; when it does not (tests,
benchmarks, ``kvstrata verify``), the iterator drives the engine's steps itself, so several
generations iterated from one thread still share steps. ``subscribe`` registers a callback the
engine thread calls after every token and at the end (the server's bridge to its event loop).
``close`` cancels: the engine frees the sequence at its next step and keeps every block it
completed reusable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvstrata.engine.sampling import SamplingParams
from kvstrata.telemetry import RequestRecord


class Driver(Protocol):
    """What a generation needs from its engine."""

    @property
    def loop_running(self) -> bool: ...

    def step(self) -> bool: ...

    def cancel(self, generation: Generation) -> None: ...


@dataclass(eq=False)
class Generation:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    record: RequestRecord
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)
    keep_logits: bool = False
    close_reason: str = "abort"  # why ``close`` ended it early (the engine's counters)
    _driver: Driver | None = field(default=None, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _done: bool = False
    _listeners: list[Callable[[], None]] = field(default_factory=list, repr=False)

    # ---- caller side ------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            with self._cond:
                while (
                    seen == len(self.output_ids)
                    and not self._done
                    and self._driver is not None
                    and self._driver.loop_running
                ):
                    self._cond.wait(0.5)
                if seen < len(self.output_ids):
                    token = self.output_ids[seen]
                    seen += 1
                elif self._done:
                    if self.error is not None:
                        raise self.error
                    return
                else:
                    token = -1
            if token >= 0:
                yield token
            elif self._driver is not None:
                self._driver.step()  # no engine loop: this caller drives the steps
            else:
                return

    def run(self) -> Generation:
        for _ in self:
            pass
        return self

    def close(self, reason: str = "abort") -> None:
        """Stop early: the engine frees it at its next step. ``reason``: ``"abort"`` (the
        client is gone: counted in ``kvstrata_cancelled_requests_total``) or ``"stop"`` (a
        stop string matched: a normal end, not counted)."""
        with self._cond:
            if self._done:
                return
            self.close_reason = reason
        if self._driver is not None:
            self._driver.cancel(self)

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the engine thread) after each token and once at the end."""
        with self._cond:
            self._listeners.append(listener)
            done = self._done
        if done:
            listener()

    # ---- engine side ------------------------------------------------------------------
    def _emit(self, token: int) -> None:
        with self._cond:
            self.output_ids.append(token)
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self._done:
                return
            self.finish_reason = reason
            self.error = error
            self.record.output_tokens = len(self.output_ids)
            if self.record.finish_reason is None:  # a follower may have named it ("stop")
                self.record.finish_reason = reason
            if error is not None:
                self.record.error = type(error).__name__
            self._done = True
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
