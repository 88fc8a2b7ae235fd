"""The index side of a deletion after the event plane has applied the worker's stream past
the deletion's position (real ZMQ sockets on 127.0.0.1, a real ``EventPlane``).

The front door applies ``GlobalIndex.delete`` only once every worker has answered; by then a
fast worker's stream may have brought its ``BlockRemoved`` and a fresh ``BlockStored`` of the
same prompt. The plane hands the index each batch's live seq, so the index knows the slot is
past the position and keeps that fresh store. A slot also fed by a vLLM connector's stream
(whose seqs count apart) is not known to be: its entries go, as before.
"""

from __future__ import annotations

import threading

from eventplane_helpers import (
    BS,
    LIVE_EPOCH,
    Worker,
    fresh_index,
    info_of,
    matched,
    stored,
    wait_for,
)
from kvstrata.events import ZmqEventPublisher
from kvstrata.events.schema import BlockRemoved, BlockStored
from kvstrata.fleet.eventplane import EventPlane
from kvstrata.identity import DEFAULT_TENANT
from kvstrata.index import GlobalIndex
from kvstrata.index.tombstones import StreamPosition

LOCAL = "tcp://127.0.0.1:*"


def _deleted_and_stored_again(
    index: GlobalIndex, lock: threading.Lock, worker: Worker, lower: ZmqEventPublisher | None
) -> list[int]:
    """The worker's stream: the prompt (seq 0), its deletion (seq 1, the answer's position
    is 2), the prompt recomputed (seq 2); then the index side of the deletion."""
    event, tokens = stored(21, seed=21)
    worker.store(event)
    wait_for(lambda: matched(index, lock, tokens) == 1, "the prompt")
    worker.publisher.publish([BlockRemoved([21], "device")])
    wait_for(lambda: matched(index, lock, tokens) == 0, "its deletion")
    if lower is not None:  # the connector's own stream feeds the slot too
        _, other = stored(22, seed=22)
        lower.publish([BlockStored([22], None, other, BS, None, "host", None)])
        wait_for(lambda: matched(index, lock, other) == 1, "the connector's block")
    worker.store(event)
    wait_for(lambda: matched(index, lock, tokens) == 1, "the prompt stored again")
    with lock:
        index.delete(
            DEFAULT_TENANT,
            router_hashes=index.request_hashes(None, tokens),
            positions={"w0": StreamPosition(LIVE_EPOCH, 2)},
        )
    return tokens


def test_a_store_the_plane_applied_after_the_deletion_survives_its_index_side() -> None:
    index, lock = fresh_index()
    with ZmqEventPublisher(LOCAL, worker_id="w0", epoch=LIVE_EPOCH) as publisher:
        worker = Worker(publisher)
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", publisher))
            tokens = _deleted_and_stored_again(index, lock, worker, None)
            assert matched(index, lock, tokens) == 1  # before the fix: 0, for good
        finally:
            plane.close()


def test_a_slot_fed_by_a_connector_stream_too_loses_its_entries() -> None:
    index, lock = fresh_index()
    with (
        ZmqEventPublisher(LOCAL, worker_id="w0", epoch=LIVE_EPOCH) as publisher,
        ZmqEventPublisher(LOCAL, worker_id="w0", epoch=5) as lower,
    ):
        worker = Worker(publisher)
        plane = EventPlane(index, lock, source=worker, subscribe_settle_s=0.3)
        plane.start()
        try:
            plane.attach(info_of("w0", publisher, lower))
            tokens = _deleted_and_stored_again(index, lock, worker, lower)
            assert matched(index, lock, tokens) == 0
        finally:
            plane.close()
