"""The asynchronous parts of the vLLM connector, without vLLM: the background saver (which
plans' saves have all run, flushes before a block is reused, bounded, drained on close) and
the background load (each block placed as it passes its checks; a late fetch is given up and
writes nothing)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_loader import BackgroundLoad, FetchFn, Placer
from kvstrata.connectors.vllm_plan import BlockSave, RequestLoad, RequestSave
from kvstrata.connectors.vllm_saver import BackgroundSaver
from kvstrata.connectors.vllm_worker import Staging
from kvstrata.errors import InvalidInput

BLOCKS, HEADS, BS, HEAD = 6, 2, 4, 8


def _layer(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=gen).to(torch.bfloat16)


def _save(req_id: str, blocks: int) -> RequestSave:
    items = tuple(BlockSave(i, bytes([i]) * 32, None, i * BS, (1,) * BS) for i in range(blocks))
    return RequestSave(req_id, "default", items)


# ---- saver ---------------------------------------------------------------------------------
def test_saved_through_names_the_plans_whose_saves_all_ran() -> None:
    gate = threading.Event()
    saved: list[str] = []

    def slow_save(request: RequestSave) -> None:
        gate.wait(10)
        saved.append(request.req_id)

    saver = BackgroundSaver(slow_save, max_blocks=16).start()
    assert saver.saved_through() == 0
    saver.submit([_save("a", 2)], seq=1)
    saver.submit([_save("b", 0)], seq=2)  # nothing to write
    saver.submit([_save("c", 1)], seq=3)
    assert saver.saved_through() == 0  # plan 1 is still saving: nothing later counts yet
    gate.set()
    assert saver.wait_idle(10)
    assert saver.saved_through() == 3 and saved == ["a", "c"]
    saver.submit([], seq=4)  # a plan without saves is saved at once
    assert saver.saved_through() == 4
    saver.close()


def test_a_flush_finishes_the_named_requests_saves_on_the_calling_thread() -> None:
    saved: list[str] = []
    saver = BackgroundSaver(lambda r: saved.append(r.req_id), max_blocks=16)  # not started
    saver.submit([_save("a", 1)], seq=1)
    saver.submit([_save("b", 1), _save("c", 1)], seq=2)
    saver.flush(["b", "c"])
    assert saved == ["b", "c"] and saver.flushed == 2 and saver.flush_seconds >= 0
    assert saver.saved_through() == 0  # plan 1 ("a") still waits
    saver.flush([])
    assert saver.flushed == 2
    saver.close()
    assert saved == ["b", "c", "a"] and saver.saved_through() == 2


def test_a_flush_waits_for_the_job_the_saver_is_running() -> None:
    started, gate = threading.Event(), threading.Event()
    saved: list[str] = []

    def slow_save(request: RequestSave) -> None:
        started.set()
        gate.wait(10)
        saved.append(request.req_id)

    saver = BackgroundSaver(slow_save, max_blocks=16).start()
    saver.submit([_save("a", 1)], seq=1)
    assert started.wait(10)
    flushing = threading.Thread(target=saver.flush, args=(["a"],))
    flushing.start()
    flushing.join(0.2)
    assert flushing.is_alive() and saved == []  # "a" is being read: the step waits
    gate.set()
    flushing.join(10)
    assert not flushing.is_alive() and saved == ["a"] and saver.flushed == 1
    saver.close()


def test_the_queue_is_bounded_and_close_drains_it() -> None:
    saved: list[str] = []
    saver = BackgroundSaver(lambda r: saved.append(r.req_id), max_blocks=3)  # not started
    saver.submit([_save("a", 2), _save("b", 2), _save("c", 1)], seq=1)
    assert saver.dropped_blocks == 2 and saver.queued_blocks == 3  # b's first block fits
    saver.close()
    assert saved == ["a", "b"] and saver.idle() and saver.saved_through() == 1


def test_a_job_larger_than_the_queue_saves_its_first_blocks() -> None:
    saved: list[tuple[str, int]] = []
    saver = BackgroundSaver(lambda r: saved.append((r.req_id, len(r.blocks))), max_blocks=2)
    saver.submit([_save("big", 3)], seq=1)
    assert saver.dropped_blocks == 1 and saver.queued_blocks == 2
    saver.close()
    assert saved == [("big", 2)]


def test_preempted_requests_are_saved_before_their_blocks_go() -> None:
    saved: list[str] = []
    saver = BackgroundSaver(lambda r: saved.append(r.req_id), max_blocks=16)  # not started
    saver.submit([_save("a", 1), _save("b", 1)], seq=1)
    saver.drain_requests(["b"])
    assert saved == ["b"]
    saver.close()
    assert saved == ["b", "a"]


def test_a_failing_save_is_counted_and_its_plan_still_saved() -> None:
    def broken(request: RequestSave) -> None:
        raise OSError("disk gone")

    saver = BackgroundSaver(broken, max_blocks=16).start()
    saver.submit([_save("a", 1)], seq=1)
    assert saver.wait_idle(10)
    assert saver.failed_jobs == 1 and saver.saved_through() == 1  # nothing reads vLLM now
    saver.close()


# ---- background load -----------------------------------------------------------------------
def _codec() -> tuple[BlockCodec, dict[str, torch.Tensor], torch.Tensor]:
    source = BlockCodec({"l0": _layer(0), "l1": _layer(1)}, BLOCKS, BS)
    rows = source.gather([0, 1, 2])
    target = {"l0": torch.zeros_like(_layer(0)), "l1": torch.zeros_like(_layer(1))}
    return BlockCodec(target, BLOCKS, BS), target, rows


def _placing(rows: torch.Tensor, count: int, gate: threading.Event | None = None) -> FetchFn:
    """A fetch that places the first ``count`` of ``rows`` into the request's blocks (after
    ``gate``, if given) and records what ``place`` answered."""

    def fetch(request: RequestLoad, place: Placer) -> int:
        if gate is not None:
            gate.wait(10)
        placed = 0
        for block_id, row in zip(request.block_ids[:count], rows, strict=False):
            if not place(block_id, memoryview(row.numpy())):
                break
            placed += 1
        answers.append(placed)
        return placed

    answers: list[int] = []
    fetch.answers = answers  # type: ignore[attr-defined]
    return fetch


def test_the_fetch_places_checked_blocks_and_the_forward_waits_at_its_first_layer() -> None:
    codec, target, rows = _codec()
    request = RequestLoad("a", "default", (3, 4, 5), (b"k0", b"k1", b"k2"))
    load = BackgroundLoad(
        [request], _placing(rows, 2), codec, timeout_s=10
    ).start()  # the third block failed to fetch
    load.layer("l0")  # returns once the fetch is done: every layer of its blocks is in place
    for name in ("l0", "l1"):
        assert torch.equal(target[name][3:5], _layer(int(name[1]))[0:2])
        assert not target[name][5].any()
    result = load.finish()
    assert result.failed == {5} and not result.timed_out


def test_a_load_reports_its_fetch_time_and_the_forwards_wait_apart() -> None:
    """``fetch_s`` ends with the fetch, not with the forward; ``wait_s`` is only the blocking."""
    codec, _, rows = _codec()
    gate = threading.Event()
    now = [0.0]
    request = RequestLoad("a", "default", (3, 4), (b"k0", b"k1"))
    load = BackgroundLoad(
        [request], _placing(rows, 2, gate), codec, timeout_s=60, clock=lambda: now[0]
    ).start()
    now[0] = 5.0  # the forward reaches its first attention layer 5 s after start

    def fetch_ends() -> None:
        now[0] = 7.0
        gate.set()

    threading.Timer(0.05, fetch_ends).start()
    load.layer("l0")  # blocks until the fetch ends, at 7 s
    now[0] = 20.0  # the rest of the forward
    result = load.finish()
    assert not result.failed
    assert result.fetch_s == 7.0 and result.wait_s == 2.0


def test_without_a_layer_asking_finish_is_where_the_step_waits() -> None:
    codec, _, rows = _codec()
    gate = threading.Event()
    now = [0.0]
    request = RequestLoad("a", "default", (3,), (b"k0",))
    load = BackgroundLoad(
        [request], _placing(rows, 1, gate), codec, timeout_s=60, clock=lambda: now[0]
    ).start()
    now[0] = 1.0  # the forward ends without an attention layer asking (nothing to read)

    def fetch_ends() -> None:
        now[0] = 4.0
        gate.set()

    threading.Timer(0.05, fetch_ends).start()
    result = load.finish()
    assert result.fetch_s == 4.0 and result.wait_s == 3.0


def test_a_late_fetch_is_given_up_and_never_writes_vllm_kv() -> None:
    codec, target, rows = _codec()
    gate = threading.Event()
    request = RequestLoad("a", "default", (3, 4), (b"k0", b"k1"))
    fetch = _placing(rows, 2, gate)
    load = BackgroundLoad([request], fetch, codec, timeout_s=0.05).start()
    load.layer("l0")
    result = load.finish()
    assert result.timed_out and result.failed == {3, 4}
    assert result.fetch_s == 0.05 and 0.0 < result.wait_s <= 0.05 + 5.0  # the deadline's
    gate.set()
    assert load.join(10)
    assert fetch.answers == [0]  # type: ignore[attr-defined]  # place refused the first block
    assert not target["l0"].any() and not target["l1"].any()


def test_a_fetch_that_raises_fails_every_block() -> None:
    codec, _, rows = _codec()

    def broken(r: RequestLoad, place: Placer) -> int:
        place(r.block_ids[0], memoryview(rows[0].numpy()))
        raise OSError("tier gone")

    request = RequestLoad("a", "default", (3, 4), (b"k0", b"k1"))
    load = BackgroundLoad([request], broken, codec, timeout_s=10).start()
    result = load.finish()
    assert result.failed == {3, 4} and isinstance(load.error, OSError)  # 3 too: recomputed


def test_place_refuses_a_payload_of_the_wrong_size() -> None:
    codec, target, rows = _codec()
    with pytest.raises(InvalidInput):
        codec.place(3, memoryview(rows[0].numpy()[:-1]))
    with pytest.raises(InvalidInput):
        codec.place(BLOCKS, memoryview(rows[0].numpy()))
    assert not target["l0"].any()


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 CPUs"
)
def test_saver_thread_leaves_the_core_its_creator_is_pinned_to() -> None:
    """vLLM pins its CPU worker to its OpenMP core; the saver must not inherit that pin."""
    seen: list[set[int]] = []
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("this process may use one CPU only")

    def pinned_creator() -> None:
        os.sched_setaffinity(0, {min(allowed)})  # this thread only, like vLLM's worker
        saver = BackgroundSaver(lambda r: seen.append(os.sched_getaffinity(0)), max_blocks=4)
        saver.start()
        saver.submit([_save("r", 1)], seq=1)
        saver.close()

    creator = threading.Thread(target=pinned_creator)
    creator.start()
    creator.join()
    assert seen and seen[0] == allowed


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 CPUs"
)
def test_fetch_thread_leaves_the_core_its_creator_is_pinned_to() -> None:
    """The background load's fetch thread, like the saver, must not take the forward's core."""
    codec, _, rows = _codec()
    seen: list[set[int]] = []
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("this process may use one CPU only")

    def fetch(r: RequestLoad, place: Placer) -> int:
        seen.append(os.sched_getaffinity(0))
        return 1 if place(r.block_ids[0], memoryview(rows[0].numpy())) else 0

    def pinned_creator() -> None:
        os.sched_setaffinity(0, {min(allowed)})  # this thread only, like vLLM's worker
        request = RequestLoad("a", "default", (3,), (b"k0",))
        BackgroundLoad([request], fetch, codec, timeout_s=10).start().finish()

    creator = threading.Thread(target=pinned_creator)
    creator.start()
    creator.join()
    assert seen and seen[0] == allowed


# ---- background threads never start an OpenMP team ----------------------------------------
def _new_os_threads(work: Callable[[], object]) -> int:
    """OS threads the process gained while ``work`` ran on a fresh Python thread (counted
    before that thread ends: libgomp retires a team with the thread that started it)."""
    gained: list[int] = []

    def run() -> None:
        before = set(os.listdir("/proc/self/task"))
        work()
        gained.append(len(set(os.listdir("/proc/self/task")) - before))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return gained[0]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_staging_rows_start_no_openmp_team_on_a_background_thread() -> None:
    """The saver allocates its staging rows on its own thread. A torch kernel there started a
    second OpenMP team; with more OpenMP threads than CPUs libgomp stops spinning between
    parallel regions, and vLLM's whole forward ran ~1.5x slower in the connector's process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.zeros(8)  # the main thread's own team exists before we count
        control = _new_os_threads(lambda: torch.zeros((8, 1 << 20), dtype=torch.uint8))
        if control == 0:
            pytest.skip("torch's kernels start no OpenMP team on new threads here")
        assert _new_os_threads(lambda: Staging(1 << 20).rows(8)) == 0
    finally:
        torch.set_num_threads(threads)
