"""One step's loads for the vLLM connector: fetched and placed in the background, fenced by
the forward.

vLLM calls ``start_load_kv`` before the forward and ``wait_for_layer_load(layer)`` inside each
attention layer, before it reads that layer's KV. ``BackgroundLoad``:

- ``start()``: one fetch thread reads every planned block from the store (the tiers' reads,
  the payload digest check, a remote tier's pipelined read-ahead) and, as each block passes
  its checks, copies it from the tier's buffer straight into vLLM's tensors (every layer of
  that block, ``BlockCodec.place``): one copy per block, no staging buffer, none of it on the
  forward's thread, which meanwhile runs what precedes the first attention (embedding, the
  first projections, writing the new tokens' KV into blocks no load targets). The thread
  leaves the forward's core first (``unpin_current_thread``, as the saver does): it inherits
  vLLM's pin and would otherwise take its CPU time from the forward that waits for it;
- ``layer(name)``: at the first attention layer the forward waits for the fetch, at most
  ``timeout_s`` counted from ``start``. A fetch that is late is *given up*: under the
  placement lock, so that no block copy is in progress and none starts afterwards — a late
  fetch can never write into a block that vLLM has meanwhile given up and recomputes. Later
  layers return at once;
- ``finish()`` (from ``wait_for_save``, after the forward; it waits the same way if the
  forward never asked) returns what failed — every block from a request's first unloaded one
  on; all of the step's blocks when the fetch did not finish in time or raised. The connector
  reports them through ``get_block_ids_with_load_errors``, and vLLM
  (``kv_load_failure_policy="recompute"``) rewinds the request and recomputes them, writing
  over whatever was placed: wrong KV is never used.

Until 2026-12-03 the fetch staged whole blocks in a buffer and the forward thread copied each
layer's slice into vLLM's tensor when it reached that layer: the same bytes copied twice, the
second copy (~10 ms for 63 blocks of SmolLM2) on the forward's critical path.

The granularity is the stored object (one block, all layers: ``vllm_layout``), so the first
layer waits for the whole fetch; per-layer objects would let later layers' bytes still be in
flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_plan import RequestLoad
from kvstrata.connectors.vllm_saver import unpin_current_thread

Placer = Callable[[int, memoryview], bool]
"""``place(block_id, payload)``: copy a checked block into vLLM's tensors; False (nothing
written) once the load was given up."""

FetchFn = Callable[[RequestLoad, Placer], int]
"""Reads a request's planned blocks in order, placing each one that passes its checks;
returns how many leading blocks it placed."""


@dataclass(frozen=True)
class Fetched:
    """A request's fetch: its first ``loaded`` blocks are in vLLM's tensors."""

    request: RequestLoad
    loaded: int


@dataclass(frozen=True)
class LoadResult:
    fetched: tuple[Fetched, ...]
    failed: frozenset[int]
    timed_out: bool
    fetch_s: float
    """From ``start`` to the fetch's end (to the deadline when it was given up)."""
    wait_s: float
    """How long the forward's first layer (or ``finish``, when no layer asked) blocked waiting
    for the fetch: the load's cost on the critical path; the rest of ``fetch_s`` overlapped
    what ran before. Not counted: ``StepLoads.begin`` joining a late earlier fetch."""


class BackgroundLoad:
    def __init__(
        self,
        loads: Sequence[RequestLoad],
        fetch: FetchFn,
        codec: BlockCodec,
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loads = list(loads)
        self._fetch = fetch
        self.codec = codec
        self.timeout_s = timeout_s
        self._clock = clock
        self._place_lock = threading.Lock()  # held for one block's copy; guards _given_up
        self._given_up = False
        self._waited = False
        self._done = threading.Event()
        self._results: list[Fetched] = []
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._fetch_s: float | None = None  # set by the fetch thread before _done
        self._wait_s = 0.0
        self.timed_out = False

    def start(self) -> BackgroundLoad:
        self._started = self._clock()
        self._thread = threading.Thread(target=self._run, name="kvstrata-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        unpin_current_thread()
        try:
            for request in self.loads:
                self._results.append(Fetched(request, self._fetch(request, self._place)))
        except Exception as exc:  # reported by finish(): the blocks are recomputed
            self._error = exc
        finally:
            self._fetch_s = self._clock() - self._started
            self._done.set()

    def _place(self, block_id: int, payload: memoryview) -> bool:
        with self._place_lock:
            if self._given_up:
                return False
            self.codec.place(block_id, payload)
            return True

    def _wait(self) -> None:
        """Wait for the fetch until the deadline (once); give a late one up."""
        if self._waited:
            return
        self._waited = True
        began = self._clock()
        left = self.timeout_s - (began - self._started)
        done = self._done.wait(max(left, 0.0))
        self._wait_s = self._clock() - began
        if done:
            return
        with self._place_lock:  # a copy in progress ends first; none starts after this
            self._given_up = True
        self.timed_out = True

    def layer(self, name: str) -> None:
        self._wait()

    def finish(self) -> LoadResult:
        self._wait()
        fetch_s = self.timeout_s if self.timed_out or self._fetch_s is None else self._fetch_s
        if self.timed_out or self._error is not None:
            failed = frozenset(b for request in self.loads for b in request.block_ids)
            return LoadResult((), failed, self.timed_out, fetch_s, self._wait_s)
        failed_ids: set[int] = set()
        for item in self._results:
            failed_ids.update(item.request.block_ids[item.loaded :])
        return LoadResult(tuple(self._results), frozenset(failed_ids), False, fetch_s, self._wait_s)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the fetch thread (a given-up one still reads the store, never writes)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def error(self) -> Exception | None:
        return self._error


class StepLoads:
    """The connector's loads across steps, and the failures vLLM has not collected yet.

    vLLM asks for a step's load errors (``get_block_ids_with_load_errors``) right after the
    forward, and calls ``wait_for_save`` either before that (the usual order) or after it:
    with speculative decoding the runner defers ``wait_for_save`` until after the drafter
    (``defer_finalize``). Either call therefore books the step's load first (``book``): a
    failure must reach vLLM in the output of the step whose forward read the unfilled blocks,
    or vLLM would emit a token sampled from them.
    """

    def __init__(self, finish: Callable[[BackgroundLoad], set[int]]) -> None:
        self._finish = finish
        self.current: BackgroundLoad | None = None
        self._previous: BackgroundLoad | None = None
        self._unreported: set[int] = set()  # failed, not yet collected by vLLM
        self._step_failed: set[int] = set()
        self._step_tainted: set[str] = set()

    def begin(self, load: Callable[[], BackgroundLoad]) -> None:
        """Start the step's load (after joining a late fetch of an earlier step: the store
        bridge is one)."""
        if self._previous is not None:
            self._previous.join()
            self._previous = None
        self.current = load()

    def layer(self, name: str) -> None:
        if self.current is not None:
            self.current.layer(name)

    def book(self) -> None:
        """Finish and book the step's load, once (later calls in the step do nothing)."""
        load = self.current
        if load is None:
            return
        failed = self._finish(load)
        self._step_tainted |= {r.req_id for r in load.loads if failed & set(r.block_ids)}
        self._step_failed |= failed
        self._unreported |= failed
        self._previous, self.current = load, None

    def errors(self) -> set[int]:
        """The block ids vLLM must recompute, this step's included; each reported once."""
        self.book()
        failed, self._unreported = self._unreported, set()
        return failed

    def end_step(self) -> tuple[set[int], set[str]]:
        """For ``wait_for_save``: (block ids whose KV must not be saved: every failure not yet
        collected and this step's, requests whose load failed this step); starts a new step."""
        self.book()
        skip, tainted = self._unreported | self._step_failed, self._step_tainted
        self._step_failed, self._step_tainted = set(), set()
        return skip, tainted

    def close(self) -> None:
        for load in (self.current, self._previous):
            if load is not None:
                load.join()
