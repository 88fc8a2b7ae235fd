"""Continuous batching: which sequences compute how many tokens in the next engine step.

The scheme is vLLM's: every step has a token budget (``max_num_batched_tokens``). Running
sequences that decode take one token each first, then running sequences still prefilling take
chunks of what is left (chunked prefill, oldest first), then waiting sequences are admitted in
arrival order while the batch has room (``max_num_seqs``), budget remains and the engine's
``admit`` callback accepts them (it looks the prompt up and checks the device pool has room).
Admission is FIFO: a sequence that does not fit (``Admission.WAIT``) blocks the ones behind
it, so none starves. FIFO in *placement* order where a router placed the requests: a request
a router placed (``placed_at``, the router's clock) before waiting requests that reached this
engine at most :data:`REORDER_WINDOW_S` ahead of it takes its place before them. Requests
proxied at the same time race to the engine, and the router priced each one's wait as the
queue it placed it behind; the window bounds what a forged placement could gain, and a
request without one is never overtaken. One exception to FIFO, ``Admission.DEFER``: a
sequence whose prompt continues blocks another running sequence is computing right now steps
aside (keeping its place) until those blocks are published and it can hit them, instead of
computing them a second time.
``preempt_last`` hands the most recently admitted running sequence back to the front
of the queue when the pool runs out of blocks mid-step (the engine recomputes it later; its
committed blocks usually still hit).

Pure bookkeeping: no torch, no I/O, no clock. The engine owns the sequences and calls this from
its one step thread; arrivals from other threads go through the engine's inbox.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Final, Generic, Protocol, TypeVar

from kvstrata.errors import ConfigError

REORDER_WINDOW_S: Final = 0.1
"""How far back (in arrival at the engine) a request placed earlier may overtake waiting
requests placed later: wider than requests proxied together take to race here
(milliseconds), far below a queue's worth of steps."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step's batch
    max_num_batched_tokens: int = 512  # tokens computed in one step (decodes + prefill chunks)
    max_waiting: int = 64  # requests queued beyond the batch; more are refused (HTTP 429)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("must be >= 1", key="scheduler.max_num_seqs")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "must be >= scheduler.max_num_seqs (every running sequence decodes each step)",
                key="scheduler.max_num_batched_tokens",
            )
        if self.max_waiting < 0:
            raise ConfigError("must be >= 0", key="scheduler.max_waiting")


class Admission(Enum):
    ADMIT = "admit"  # joins the running batch now
    WAIT = "wait"  # does not fit now; holds the queue behind it
    DEFER = "defer"  # waits for blocks in flight; the ones behind it may go first
    FAILED = "failed"  # admission failed and finished the sequence: it leaves the queue


class Schedulable(Protocol):
    @property
    def pending_tokens(self) -> int:
        """Tokens to compute before this sequence can sample again (1 when decoding)."""
        ...


S = TypeVar("S", bound=Schedulable)


class Scheduler(Generic[S]):
    """Waiting queue and running batch of one engine."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self._placed: dict[int, tuple[float, float]] = {}
        """id(waiting sequence) → (placed_at, arrived_s), until it is first planned."""

    def add(self, seq: S, *, placed_at: float | None = None, arrived_s: float = 0.0) -> None:
        """Queue ``seq``, which reached the engine at ``arrived_s`` (the engine's clock) and
        was placed by a router at ``placed_at`` (None: not placed; it goes last), before the
        waiting sequences placed after it that arrived at most :data:`REORDER_WINDOW_S`
        before it (module docstring)."""
        waiting = self.waiting
        position = len(waiting)
        if placed_at is not None:
            self._placed[id(seq)] = (placed_at, arrived_s)
            while position > 0:
                ahead = self._placed.get(id(waiting[position - 1]))
                if ahead is None or ahead[0] <= placed_at:
                    break
                if arrived_s - ahead[1] > REORDER_WINDOW_S:
                    break
                position -= 1
        waiting.insert(position, seq)

    def plan(self, admit: Callable[[S], Admission]) -> list[tuple[S, int]]:
        """The next step's work: (sequence, tokens to compute), decodes first."""
        budget = self.config.max_num_batched_tokens
        work: list[tuple[S, int]] = []
        for seq in self.running:
            if seq.pending_tokens == 1:
                work.append((seq, 1))
                budget -= 1
        for seq in self.running:
            pending = seq.pending_tokens
            if pending > 1 and budget > 0:
                take = min(pending, budget)
                work.append((seq, take))
                budget -= take
        deferred: list[S] = []
        try:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting.popleft()
                self._placed.pop(id(seq), None)  # planned once: nothing overtakes it now
                try:
                    decision = admit(seq)
                except BaseException:
                    self.waiting.appendleft(seq)  # an ``admit`` that raises loses nothing
                    raise
                if decision is Admission.WAIT:
                    self.waiting.appendleft(seq)
                    break
                if decision is Admission.DEFER:
                    deferred.append(seq)
                    continue
                if decision is Admission.FAILED:
                    continue
                self.running.append(seq)
                take = min(seq.pending_tokens, budget)
                if take > 0:
                    work.append((seq, take))
                    budget -= take
        finally:
            self.waiting.extendleft(reversed(deferred))  # back in front, in their order
        return work

    def preempt_last(self) -> S | None:
        """Move the most recently admitted running sequence to the front of the queue."""
        if not self.running:
            return None
        seq = self.running.pop()
        self.waiting.appendleft(seq)
        return seq

    def remove(self, seq: S) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self._placed.pop(id(seq), None)

    def __iter__(self) -> Iterator[S]:
        yield from self.running
        yield from self.waiting

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)
