"""KV events of a real engine (tiny model) over real ZMQ sockets on 127.0.0.1.

Every test subscribes with a real ``ZmqEventSubscriber`` and checks what arrives against the
engine's own state: block hashes are ``event_block_hash`` of the engine's BLAKE3 keys, tokens
are the prompt's, and the events replayed from a snapshot plus the live stream rebuild exactly
the set of blocks resident in every tier.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstrata.engine.engine import EngineConfig, ReferenceEngine
from kvstrata.engine.factory import build_engine
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.sampling import SamplingParams
from kvstrata.events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    ReceivedBatch,
    ZmqEventSubscriber,
)
from kvstrata.identity import BlockKey
from kvstrata.identity.keys import event_block_hash
from kvstrata.identity.vllm_hash import vllm_event_int
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.config import WorkerConfig
from kvstrata.runtime.events import DEVICE_MEDIUM, KVEventEmitter, KVEventsConfig
from kvstrata.store.config import TierConfig, WritePolicy
from kvstrata.store.policies import LRUPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from tier_helpers import FakeClock, worker_tiers

B = 16
TIMEOUT_S = 5.0
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 2 * B * 16 * 4  # tiny: 2 layers, K+V, 2 heads, 16 tokens, head dim 16, fp32
Residency = set[tuple[str, int]]


def tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 40000, size=n)]


def hashes(keys: list[BlockKey]) -> list[int]:
    return [event_block_hash(k) for k in keys]


def emitter(worker_id: str = "w1") -> KVEventEmitter:
    config = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id=worker_id)
    return KVEventEmitter.from_config(config, block_size=B).start()


def engine_with(
    loaded: LoadedModel, events: KVEventEmitter, tiers: WorkerConfig | None, pool_blocks: int = 64
) -> ReferenceEngine:
    return build_engine(
        loaded, EngineConfig(block_size=B, pool_blocks=pool_blocks), tiers, events=events
    )


class Listener:
    """A subscriber that has provably joined the stream before the test publishes."""

    def __init__(self, events: KVEventEmitter, expected_seq: int | None = 0) -> None:
        publisher = events.publisher
        self.sub = ZmqEventSubscriber(
            publisher.endpoint, publisher.replay_endpoint, expected_seq=expected_seq
        ).start()
        assert publisher.wait_for_subscriber(TIMEOUT_S), "subscription did not land"
        self.batches: list[ReceivedBatch] = []
        self.resync_needed = False

    def until_seq(self, next_seq: int) -> list[ReceivedBatch]:
        """Poll until every batch before ``next_seq`` arrived (the engine serves no replay
        here, so these tests see live delivery only)."""
        deadline = time.monotonic() + TIMEOUT_S
        while (not self.batches or self.batches[-1].seq < next_seq - 1) and (
            time.monotonic() < deadline
        ):
            result = self.sub.poll(timeout_ms=50)
            self.batches.extend(result.batches)
            self.resync_needed |= result.resync_needed
        assert self.batches and self.batches[-1].seq == next_seq - 1, [b.seq for b in self.batches]
        return self.batches

    def events(self, next_seq: int) -> list[KVEvent]:
        return [event for batch in self.until_seq(next_seq) for event in batch.batch.events]

    def close(self) -> None:
        self.sub.close()


@pytest.fixture()
def events() -> Iterator[KVEventEmitter]:
    e = emitter()
    yield e
    e.close()


def stored(evs: list[KVEvent], medium: str) -> list[BlockStored]:
    return [e for e in evs if isinstance(e, BlockStored) and e.medium == medium]


def removed(evs: list[KVEvent], medium: str) -> list[int]:
    return [
        h for e in evs if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes
    ]


def apply(state: Residency, evs: list[KVEvent]) -> None:
    for event in evs:
        if isinstance(event, BlockStored):
            state.update((str(event.medium), int(h)) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            state.difference_update((str(event.medium), int(h)) for h in event.block_hashes)
        else:
            state.clear()


def resident(engine: ReferenceEngine) -> Residency:
    """What the engine really holds, read from the pool and the store (not from events)."""
    out = {(DEVICE_MEDIUM, event_block_hash(b.key)) for b in engine.pool.committed_blocks()}
    if engine.bridge is not None:
        for name, metas in engine.bridge.store.resident():
            out.update((name, event_block_hash(m.key)) for m in metas)
    return out


# ---- the hash ---------------------------------------------------------------------------------


def test_event_block_hash_is_vllms_low_64_bits() -> None:
    key = BlockKey(bytes(range(32)))
    assert event_block_hash(key) == vllm_event_int(key) == int.from_bytes(bytes(range(24, 32)))
    with pytest.raises(Exception, match="32 bytes"):
        event_block_hash(BlockKey(b"short"))


# ---- meta carries tokens --------------------------------------------------------------------


def test_meta_tokens_round_trip_and_old_dicts_load() -> None:
    from kvstrata.objects import Representation

    rep = Representation("float32", "x", B, (1,))
    meta = KVObjectMeta(BlockKey(b"k" * 32), None, "t", rep, 4, b"d" * 16, 1.0, tokens=(1, 2))
    assert KVObjectMeta.from_dict(meta.to_dict()) == meta
    old = meta.to_dict()
    del old["tokens"]
    assert KVObjectMeta.from_dict(old).tokens is None
    with pytest.raises(ValueError, match="tokens"):
        KVObjectMeta.from_dict({**meta.to_dict(), "tokens": ["a"]})


# ---- device events --------------------------------------------------------------------------


def test_prefill_announces_its_full_blocks_on_device(
    tiny_model: LoadedModel, events: KVEventEmitter
) -> None:
    engine = engine_with(tiny_model, events, None)
    listener = Listener(events)
    prompt = tokens(150, seed=11)
    engine.generate(prompt, ONE, tenant="acme").run()
    evs = listener.events(events.publisher.next_seq)
    keys = engine.block_keys(prompt, "acme")
    assert len(keys) == 9
    [event] = stored(evs, DEVICE_MEDIUM)
    assert event.block_hashes == hashes(keys)
    assert event.parent_block_hash is None
    assert event.token_ids == prompt[: 9 * B]
    assert (event.block_size, event.namespace) == (B, "acme")
    assert (event.lora_id, event.lora_name) == (None, None)
    batch = listener.batches[0].batch
    assert (batch.worker_id, batch.epoch) == ("w1", events.epoch)
    assert removed(evs, DEVICE_MEDIUM) == []

    # A second turn extending the prompt announces only the new blocks, chained to the old.
    longer = prompt + tokens(40, seed=12)
    seq_before = events.publisher.next_seq
    engine.generate(longer, ONE, tenant="acme").run()
    new = [
        e
        for b in listener.until_seq(events.publisher.next_seq)
        if b.seq >= seq_before
        for e in b.batch.events
    ]
    [extension] = stored(new, DEVICE_MEDIUM)
    longer_keys = engine.block_keys(longer, "acme")
    assert extension.block_hashes == hashes(longer_keys[9:])
    assert extension.parent_block_hash == event_block_hash(keys[-1])
    assert extension.token_ids == longer[9 * B : len(longer_keys) * B]
    listener.close()


def test_pool_eviction_removes_from_device_and_demotion_stores_on_host(
    tiny_model: LoadedModel, events: KVEventEmitter
) -> None:
    host = TierConfig("host", WritePolicy.WRITE_BACK)  # a copy at eviction, not at commit
    engine = engine_with(
        tiny_model, events, worker_tiers(host_bytes=64 * BLOCK_BYTES, host=host), pool_blocks=8
    )
    listener = Listener(events)
    first, second = tokens(96, seed=21), tokens(96, seed=22)
    engine.generate(first, ONE).run()
    engine.generate(second, ONE).run()
    evs = listener.events(events.publisher.next_seq)
    first_keys = engine.block_keys(first)
    gone = removed(evs, DEVICE_MEDIUM)
    assert len(gone) == 4 and set(gone) <= set(hashes(first_keys))  # 8 blocks, 6 + 6 asked
    host_events = stored(evs, "host")
    demoted = [h for e in host_events for h in e.block_hashes]
    assert sorted(demoted) == sorted(gone)
    by_hash = {event_block_hash(k): first[i * B : (i + 1) * B] for i, k in enumerate(first_keys)}
    for event in host_events:
        expected = [t for h in event.block_hashes for t in by_hash[int(h)]]
        assert event.token_ids == expected
    assert resident(engine) == replayed(listener, events)
    engine.close()
    listener.close()


def last_batch(listener: Listener, events: KVEventEmitter) -> list[KVEvent]:
    """The events of the batch published last (waiting for it to arrive)."""
    return listener.until_seq(events.publisher.next_seq)[-1].batch.events


def replayed(listener: Listener, events: KVEventEmitter) -> Residency:
    state: Residency = set()
    apply(state, listener.events(events.publisher.next_seq))
    return state


def test_write_through_announces_host_copies_and_clear_removes_device_blocks(
    tiny_model: LoadedModel, events: KVEventEmitter
) -> None:
    engine = engine_with(tiny_model, events, worker_tiers(host_bytes=64 * BLOCK_BYTES))
    listener = Listener(events)
    prompt = tokens(70, seed=31)
    engine.generate(prompt, ONE, tenant="t2").run()
    keys = engine.block_keys(prompt, "t2")
    evs = listener.events(events.publisher.next_seq)
    [device] = stored(evs, DEVICE_MEDIUM)
    [host] = stored(evs, "host")
    assert device.block_hashes == host.block_hashes == hashes(keys)
    assert host.token_ids == device.token_ids == prompt[: 4 * B]
    assert host.namespace == "t2"
    assert engine.bridge is not None
    assert engine.bridge.store.resident()[0][1][0].tokens is not None  # the meta kept them

    engine.pool.clear()
    engine._flush_events()  # a clear outside a request: the owner flushes (serve does it)
    evs = listener.events(events.publisher.next_seq)
    assert sorted(removed(evs, DEVICE_MEDIUM)) == sorted(hashes(keys))
    assert [e for e in evs if isinstance(e, BlockRemoved) and e.medium == "host"] == []

    # A hit from the host promotes into the pool: announced on device again, with tokens.
    seq = events.publisher.next_seq
    engine.generate(prompt, ONE, tenant="t2").run()
    evs = [
        e
        for b in listener.until_seq(events.publisher.next_seq)
        if b.seq >= seq
        for e in b.batch.events
    ]
    [promoted] = stored(evs, DEVICE_MEDIUM)
    assert promoted.block_hashes == hashes(keys)
    assert promoted.token_ids == prompt[: 4 * B]
    assert resident(engine) == replayed(listener, events)
    engine.close()
    listener.close()


# ---- snapshots ------------------------------------------------------------------------------


def test_snapshot_plus_live_stream_equals_resident_blocks(
    tiny_model: LoadedModel, events: KVEventEmitter
) -> None:
    # A small pool and a small host tier, so both evict.
    host = TierConfig("host", WritePolicy.WRITE_THROUGH)
    options = worker_tiers(host_bytes=10 * BLOCK_BYTES, host=host)
    engine = engine_with(tiny_model, events, options, pool_blocks=8)
    for seed in range(3):
        engine.generate(tokens(64, seed=40 + seed), ONE).run()
    snap = events.snapshot()
    assert snap.epoch == events.epoch and snap.skipped_without_tokens == 0
    state: Residency = set()
    apply(state, snap.events)
    assert state == resident(engine)
    assert {m for m, _ in state} == {DEVICE_MEDIUM, "host"}
    for event in snap.events:  # parents first: a parent in the same tier comes earlier
        assert isinstance(event, BlockStored)
        assert len(event.token_ids) == B * len(event.block_hashes)

    # The stream continues from snap.next_seq; a consumer joining now applies dump + live.
    listener = Listener(events, expected_seq=snap.next_seq)
    for seed in range(3, 7):
        engine.generate(tokens(64, seed=40 + seed), ONE).run()
    engine.generate(tokens(64, seed=41), ONE).run()  # a hit: promotion, then more evictions
    apply(state, listener.events(events.publisher.next_seq))
    assert listener.batches[0].seq == snap.next_seq
    assert state == resident(engine)
    engine.close()
    listener.close()


def test_restarted_engine_has_a_new_epoch_and_dumps_its_disk_blocks(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    disk = TierConfig("disk", WritePolicy.WRITE_THROUGH)
    options = worker_tiers(
        disk_dir=tmp_path / "d", disk_bytes=64 * BLOCK_BYTES, disk=disk, durable_disk=False
    )
    first_events = emitter("w-restart")
    engine = engine_with(tiny_model, first_events, options)
    prompt = tokens(80, seed=51)
    engine.generate(prompt, ONE, tenant="persist").run()
    keys = engine.block_keys(prompt, "persist")
    assert engine.bridge is not None
    tier = engine.bridge.store.levels[0].tier
    assert isinstance(tier, DiskTier)
    # An object written by an older version carries no tokens: kept, served, never announced.
    lease = tier.prepare_load(keys[0])
    assert lease is not None
    old = dataclasses.replace(lease.meta, key=BlockKey(b"\x07" * 32), tokens=None)
    slot = tier.prepare_store(old)
    assert slot is not None
    slot.buffer[:] = lease.buffer
    tier.complete_load(lease)
    assert tier.complete_store(slot, True)
    engine.close()
    first_events.close()

    second_events = emitter("w-restart")
    try:
        restarted = engine_with(tiny_model, second_events, options)
        assert second_events.epoch != first_events.epoch
        snap = second_events.snapshot()
        assert snap.skipped_without_tokens == 1
        [event] = snap.events
        assert isinstance(event, BlockStored)
        assert event.medium == "disk" and event.namespace == "persist"
        assert event.block_hashes == hashes(keys)
        assert event.token_ids == prompt[: len(keys) * B]
        restarted.close()
    finally:
        second_events.close()


def test_engine_without_emitter_publishes_nothing(tiny_model: LoadedModel) -> None:
    engine = ReferenceEngine(tiny_model, EngineConfig(block_size=B, pool_blocks=16))
    assert engine.events is None and not engine.pool._listeners
    engine.generate(tokens(40, seed=61), ONE).run()
    assert engine.pool.blocks_used == 2


def test_write_back_expiry_and_delete_are_announced_per_tier(
    tiny_model: LoadedModel, events: KVEventEmitter, tmp_path: Path
) -> None:
    clock = FakeClock()
    clock.now = time.time()  # the bridge stamps metas with wall time; the tiers read this clock
    host = HostTier(32 * BLOCK_BYTES, BLOCK_BYTES, clock=clock)
    disk = DiskTier(tmp_path / "wb", 32 * BLOCK_BYTES, durable=False, clock=clock)
    store = TieredStore(
        [
            (host, LRUPolicy(), TierConfig("host", WritePolicy.WRITE_THROUGH, ttl_s=60.0)),
            (disk, LRUPolicy(), TierConfig("disk", WritePolicy.WRITE_BACK)),
        ],
        clock=clock,
        record_events=True,
    )
    engine = ReferenceEngine(
        tiny_model, EngineConfig(block_size=B, pool_blocks=16), store=store, events=events
    )
    listener = Listener(events)
    prompt = tokens(50, seed=71)
    engine.generate(prompt, ONE, tenant="wb").run()
    keys = engine.block_keys(prompt, "wb")
    evs = listener.events(events.publisher.next_seq)
    assert [e.block_hashes for e in stored(evs, "host")] == [hashes(keys)]
    assert stored(evs, "disk") == []  # queued for write-back, not on disk yet

    # The write-back flusher copies on its own thread; its events wait for the engine's flush.
    flusher = threading.Thread(target=store.flush)
    flusher.start()
    flusher.join()
    assert events.pending
    events.flush()
    [on_disk] = stored(last_batch(listener, events), "disk")
    assert on_disk.block_hashes == hashes(keys) and on_disk.token_ids == prompt[: 3 * B]
    assert on_disk.namespace == "wb"

    # The host copies expire; the tier drops them by itself (key only): the namespace is kept.
    clock.now += 61.0
    snap = events.snapshot()
    assert {e.medium for e in snap.events} == {"device", "disk"}
    events.flush()
    [gone] = last_batch(listener, events)
    assert isinstance(gone, BlockRemoved)
    assert gone.medium == "host" and gone.namespace == "wb"
    assert sorted(gone.block_hashes) == sorted(hashes(keys))

    assert store.delete(keys) == 3
    events.flush()
    [deleted] = last_batch(listener, events)
    assert isinstance(deleted, BlockRemoved) and deleted.medium == "disk"
    assert sorted(deleted.block_hashes) == sorted(hashes(keys))
    engine.close()
    listener.close()
