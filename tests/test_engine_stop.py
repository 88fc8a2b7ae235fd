"""Stopping the engine's loop: a call made while it stops still runs (never a future that
nothing will complete), also from the loop thread's own last drain."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.model_loader import LoadedModel


def test_a_call_made_after_the_loops_last_drain_still_runs(tiny_model: LoadedModel) -> None:
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=4, pool_blocks=16))
    engine.start_loop()
    futures: list[Future[int]] = []
    caller: list[threading.Thread] = []
    real = engine._run_calls

    def last_drain_then_a_call() -> None:
        real()
        if engine._stopping and not caller:  # the loop's final drain has just run
            thread = threading.Thread(target=lambda: futures.append(engine.call(lambda: 42)))
            caller.append(thread)
            thread.start()
            thread.join(timeout=1.0)  # queued (old code) or waiting for the step lock (now)

    engine._run_calls = last_drain_then_a_call  # type: ignore[method-assign]
    engine.stop_loop()
    caller[0].join(timeout=5)
    (future,) = futures
    assert future.result(timeout=2) == 42
    engine.close()


def test_a_call_from_the_loop_thread_while_it_stops_does_not_wait_on_itself(
    tiny_model: LoadedModel,
) -> None:
    """What a request's end does when the loop aborts it (e.g. a prefill handle released
    from its done-callback): ``call(...).result()`` on the loop thread itself."""
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=4, pool_blocks=16))
    engine.start_loop()
    got: list[int] = []
    real = engine._abort_all

    def abort_then_call(error: BaseException) -> None:
        real(error)
        got.append(engine.call(lambda: 7).result(timeout=2))

    engine._abort_all = abort_then_call  # type: ignore[method-assign]
    engine.stop_loop()
    assert got == [7]
    engine.close()
