"""One step's loads for the vLLM connector: fetched in the background, placed layer by layer.

vLLM calls ``start_load_kv`` before the forward and ``wait_for_layer_load(layer)`` inside each
attention layer, before it reads that layer's KV. ``LayerwiseLoad``:

- ``start()``: one fetch thread reads every planned block from the store (the tiers' reads,
  the payload digest check, a remote tier's pipelined read-ahead) into a private staging
  buffer, while the forward runs what precedes the first attention. The thread leaves the
  forward's core first (``unpin_current_thread``, as the saver does): it inherits vLLM's pin
  and would otherwise take its CPU time from the very forward that waits for it;
- ``layer(name)``: the forward thread waits for the fetch (at most ``timeout_s``, counted from
  ``start``) and copies *that layer's* slice of every loaded block into vLLM's tensor, so the
  copies are spread over the layers instead of all before the forward. Only the forward thread
  ever writes vLLM's KV: a fetch that is late or fails can never write into a block that vLLM
  has meanwhile given up and recomputes;
- ``finish()`` (from ``wait_for_save``, after the forward): places the layers the forward did
  not ask for, and returns what failed — every block from a request's first unloaded one on;
  all of the step's blocks when the fetch did not finish in time. The connector reports them
  through ``get_block_ids_with_load_errors``, and vLLM (``kv_load_failure_policy="recompute"``)
  rewinds the request and recomputes them: wrong KV is never used.

The granularity is the stored object (one block, all layers: ``vllm_layout``), so layer 0
waits for the whole fetch; per-layer objects would let later layers' bytes still be in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_plan import RequestLoad
from kvstrata.connectors.vllm_saver import unpin_current_thread


@dataclass(frozen=True)
class Fetched:
    """A request's fetch: ``rows[:loaded]`` hold its first ``loaded`` blocks' payloads."""

    request: RequestLoad
    rows: torch.Tensor
    loaded: int


FetchFn = Callable[[RequestLoad], Fetched]


@dataclass(frozen=True)
class LoadResult:
    fetched: tuple[Fetched, ...]
    failed: frozenset[int]
    timed_out: bool
    seconds: float


class LayerwiseLoad:
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
        self._layer_of = {name: index for index, name in enumerate(codec.names)}
        self._placed: set[int] = set()
        self._done = threading.Event()
        self._results: list[Fetched] = []
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self.timed_out = False

    def start(self) -> LayerwiseLoad:
        self._started = self._clock()
        self._thread = threading.Thread(target=self._run, name="kvstrata-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        unpin_current_thread()
        try:
            for request in self.loads:
                self._results.append(self._fetch(request))
        except Exception as exc:  # reported by finish(): the blocks are recomputed
            self._error = exc
        finally:
            self._done.set()

    def _ready(self) -> bool:
        """Whether the fetch finished in time (the first call waits; later ones do not)."""
        if self.timed_out:
            return False
        left = self.timeout_s - (self._clock() - self._started)
        if not self._done.wait(max(left, 0.0)):
            self.timed_out = True
            return False
        return self._error is None

    def layer(self, name: str) -> None:
        index = self._layer_of.get(name)
        if index is None or index in self._placed:
            return
        self._placed.add(index)
        if not self._ready():
            return
        for item in self._results:
            if item.loaded:
                self.codec.scatter_layer(
                    index, item.request.block_ids[: item.loaded], item.rows[: item.loaded]
                )

    def finish(self) -> LoadResult:
        for name in self.codec.names:
            self.layer(name)
        seconds = self._clock() - self._started
        if not self._ready():
            failed = frozenset(b for request in self.loads for b in request.block_ids)
            return LoadResult((), failed, self.timed_out, seconds)
        failed_ids: set[int] = set()
        for item in self._results:
            failed_ids.update(item.request.block_ids[item.loaded :])
        return LoadResult(tuple(self._results), frozenset(failed_ids), False, seconds)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the fetch thread (a late one still reads the store: only its staging
        buffer, never vLLM's KV)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def error(self) -> Exception | None:
        return self._error
