"""``StoreIngress``: a transfer received into a ``TieredStore`` level through the store's own
two-phase path — invisible until committed, aborted without a trace, a delete wins, and a
committed block is an ordinary object of the store (lookup, change feed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, payload_digest
from kvstrata.store.config import TierConfig
from kvstrata.store.events import ObjectStored
from kvstrata.store.levels import RequestScope
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.host import HostTier
from kvstrata.transfer import frames
from kvstrata.transfer.ingress import StoreIngress
from kvstrata.transfer.stream import TransferReceiver
from kvstrata.transfer.transport import Buffer, PeerLost
from tier_helpers import OBJ, FakeClock, make_object


def _store(clock: FakeClock, slots: int = 8) -> TieredStore:
    host = HostTier(slots * OBJ, OBJ, clock=clock)
    return TieredStore([(host, LRUPolicy(), TierConfig("host"))], clock=clock, record_events=True)


def _visible(store: TieredStore, keys: Sequence[BlockKey]) -> int:
    return len(store.lookup(list(keys), RequestScope("t0")))


def test_reserved_object_is_invisible_until_committed_and_abort_leaves_nothing() -> None:
    clock = FakeClock()
    store = _store(clock)
    ingress = StoreIngress(store)
    meta, payload = make_object(1)
    slot = ingress.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    assert _visible(store, [meta.key]) == 0  # PENDING: not visible
    assert ingress.complete_store(slot, True)
    assert _visible(store, [meta.key]) == 1
    assert any(isinstance(e, ObjectStored) for e in store.take_events())
    other, _ = make_object(2)
    slot = ingress.prepare_store(other)
    assert slot is not None
    assert not ingress.complete_store(slot, False)
    assert _visible(store, [other.key]) == 0 and store.levels[0].tier.meta(other.key) is None
    again = ingress.prepare_store(meta)  # held already: a scratch slot, the store untouched
    assert again is not None and ingress.complete_store(again, True)


def test_delete_during_reception_wins() -> None:
    clock = FakeClock()
    store = _store(clock)
    ingress = StoreIngress(store)
    meta, payload = make_object(3)
    slot = ingress.prepare_store(meta)
    assert slot is not None
    store.delete([meta.key])
    slot.buffer[:] = payload
    assert not ingress.complete_store(slot, True)
    assert _visible(store, [meta.key]) == 0


class _Scripted:
    """A connection that replays frames, then reports the peer gone."""

    path = "test"

    def __init__(self, frames_: list[bytes]) -> None:
        self.frames = frames_

    def send_frame(self, *parts: Buffer, timeout_s: float | None = None) -> None:
        raise AssertionError("the receiver sends nothing")

    def recv_frame(self, *, timeout_s: float | None = None) -> Buffer:
        if not self.frames:
            raise PeerLost("gone")
        return self.frames.pop(0)

    def close(self) -> None:
        return None


def _chain(count: int) -> tuple[list[KVObjectMeta], list[bytes]]:
    metas, payloads, parent = [], [], None
    for seed in range(10, 10 + count):
        meta, payload = make_object(seed)
        metas.append(replace(meta, parent=parent))
        payloads.append(payload)
        parent = meta.key
    return metas, payloads


def test_receiver_into_the_store_commits_whole_or_nothing() -> None:
    clock = FakeClock()
    store = _store(clock)
    metas, payloads = _chain(2)
    half = OBJ // 2
    begin = frames.encode_begin("r", 2, 2, half)
    layer_frames = []
    for block, payload in enumerate(payloads):
        for layer in range(2):
            piece = payload[layer * half : (layer + 1) * half]
            header = frames.layer_header("r", block, layer, payload_digest(piece))
            layer_frames.append(bytes(header) + piece)
    receiver = TransferReceiver(StoreIngress(store))
    cut = _Scripted([begin, *layer_frames[:3]])  # the sender dies before the last layer
    result = receiver.receive(cut, metas, timeout_s=5)
    assert result.outcome == "peer_lost"
    assert _visible(store, [m.key for m in metas]) == 0
    complete = frames.encode_complete("r", [payload_digest(p) for p in payloads])
    whole = _Scripted([begin, *layer_frames, complete])
    result = receiver.receive(whole, metas, timeout_s=5)
    assert result.outcome == "committed", result.detail
    assert _visible(store, [m.key for m in metas]) == 2


def _transfer_frames(metas: Sequence[KVObjectMeta], payloads: list[bytes]) -> list[bytes]:
    half = OBJ // 2
    out = [frames.encode_begin("r", len(metas), 2, half)]
    for block, payload in enumerate(payloads):
        for layer in range(2):
            piece = payload[layer * half : (layer + 1) * half]
            out.append(bytes(frames.layer_header("r", block, layer, payload_digest(piece))) + piece)
    out.append(frames.encode_complete("r", [payload_digest(p) for p in payloads]))
    return out


class _DeleteAtComplete(_Scripted):
    """Delivers the frames; just before COMPLETE, a delete of ``key`` reaches the store."""

    def __init__(self, frames_: list[bytes], store: TieredStore, key: BlockKey) -> None:
        super().__init__(frames_)
        self.store, self.key = store, key

    def recv_frame(self, *, timeout_s: float | None = None) -> Buffer:
        frame = super().recv_frame(timeout_s=timeout_s)
        if not self.frames:
            self.store.delete([self.key])
        return frame


def test_a_commit_refused_midway_keeps_what_was_there_and_what_verified() -> None:
    """Block 0 is in the store before the transfer (the ingress commits it "again" without a
    write); a delete of block 1 wins at COMPLETE. The transfer fails, and block 0 — which it
    never wrote — is still there: no unwind may delete another request's block."""
    clock = FakeClock()
    store = _store(clock)
    metas, payloads = _chain(3)
    ingress = StoreIngress(store)
    slot = ingress.prepare_store(metas[0])
    assert slot is not None
    slot.buffer[:] = payloads[0]
    assert ingress.complete_store(slot, True)
    conn = _DeleteAtComplete(_transfer_frames(metas, payloads), store, metas[1].key)
    result = TransferReceiver(ingress).receive(conn, metas, timeout_s=5)
    assert result.outcome == "digest_mismatch" and not result.ok
    assert result.committed == (metas[0].key,)
    assert _visible(store, [metas[0].key]) == 1
    assert _visible(store, [m.key for m in metas]) == 1  # the chain stops where the delete won
    assert store.levels[0].tier.meta(metas[2].key) is None  # aborted, not committed
