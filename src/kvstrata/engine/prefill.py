"""A prefill-only request (prefill for transfer): its blocks stay pinned until released.

``ReferenceEngine.prefill(prompt, tenant=…, on_layer=…)`` queues the prompt as a request of
one greedy token whose blocks are *handed over* when it finishes instead of released
(``Sequence.hand_over``): committed blocks keep their reader reference (never evicted), the
partial tail block stays a scratch block the handle owns. A sender ships layer ``l``'s
blocks from ``on_layer(l, block_ids)`` as each step computes them, and the blocks the request
matched in the pool at admission (``matched_tokens``: computed by no step, so no listener
call names them) straight from ``PrefillResult.block_ids``.

Contract:

* ``result()`` drives the engine (or waits for its loop) until the prefill finished and
  returns the held blocks; a prefill that failed or was cancelled raises and holds nothing.
* ``release()`` gives the blocks back, on the step thread (``engine.call``); it may be
  called before the prefill finished (the blocks are then released as it finishes) and more
  than once (later calls do nothing).
* After a preemption the request recomputes from its start into other blocks, so listener
  calls repeat for the same positions: the latest call for a position names its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.generation import Generation
from kvstrata.engine.kv_pool import PagedKVPool
from kvstrata.engine.sequence import HeldBlocks
from kvstrata.errors import EngineError, RequestCancelled
from kvstrata.identity import BlockKey


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    prompt_tokens: int
    first_token: int
    matched_tokens: int  # reused at admission (no listener call names these positions)
    compute_s: float  # its own share of the steps (``RequestRecord.prefill_compute_s``)
    block_ids: tuple[int, ...]  # block i holds positions i·B … i·B+B−1 of the prompt
    committed: int  # the first ``committed`` block ids are committed (published) blocks
    keys: tuple[BlockKey, ...]  # chained keys of the prompt's full blocks


class PrefillHandle:
    """The caller's side of a prefill-only request (module docstring)."""

    def __init__(
        self, pool: PagedKVPool, call: Callable[[Callable[[], None]], Future[Any]]
    ) -> None:
        self._pool = pool
        self._call = call
        self._held: HeldBlocks | None = None
        self._released = False  # step thread only
        self.generation: Generation | None = None

    def _hold(self, held: HeldBlocks) -> None:
        """On the step thread, when the prefill finished normally."""
        if self._released:
            held.release(self._pool)
        else:
            self._held = held

    def result(self) -> PrefillResult:
        generation = self.generation
        if generation is None:
            raise EngineError("the prefill was not submitted")
        generation.run()  # raises the request's error
        held = self._held
        if held is None or not generation.output_ids:
            raise RequestCancelled(
                f"prefill {generation.request_id} ended: {generation.finish_reason}"
            )
        return PrefillResult(
            request_id=generation.request_id,
            prompt_tokens=len(generation.prompt_ids),
            first_token=generation.output_ids[0],
            matched_tokens=generation.record.matched_tokens,
            compute_s=generation.record.prefill_compute_s,
            block_ids=held.block_ids,
            committed=held.committed,
            keys=held.keys,
        )

    def release(self) -> None:
        self._call(self._release_on_step_thread).result()

    def _release_on_step_thread(self) -> None:
        if self._released:
            return
        self._released = True
        if self._held is not None:
            self._held.release(self._pool)
            self._held = None
