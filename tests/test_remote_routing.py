"""The shared remote tier in events, the index and the router (real Valkey, real ZMQ).

Two stores share one remote namespace on the session's real ``valkey-server``, each with its
own ``KVEventEmitter`` publishing on real ZMQ sockets into one ``GlobalIndex``: what one
worker writes to the shared tier counts for the other, and when the shared ledger evicts one
worker's objects to admit the other's, the evicting worker announces the removal (with the
victims' tenant), so the index forgets them for everyone. The router then prices those remote
blocks per worker with each worker's measured fetch figure (``/kv/info``), recomputing where
fetching is slower.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvstrata.costs import PrefillModel
from kvstrata.events import BlockRemoved, BlockStored, KVEvent, ZmqEventSubscriber
from kvstrata.events.schema import KVEventBatch
from kvstrata.fleet.worker_info import WorkerInfo, WorkerProtocolError
from kvstrata.fleet.workers import WorkerState, default_profile
from kvstrata.identity import BlockKey, TenantNamespace, chain_keys, namespace_root
from kvstrata.identity.keys import FingerprintDigest, event_block_hash
from kvstrata.index import GlobalIndex, Medium, PrefixMatch
from kvstrata.objects import KVObjectMeta, Representation, payload_digest
from kvstrata.router import CostProfile, KvstrataPolicy, Router, RouteRequest, WorkerLoad
from kvstrata.runtime.events import KVEventEmitter, KVEventsConfig
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.store.config import TierConfig
from kvstrata.store.events import ObjectRemoved, ObjectStored
from kvstrata.store.levels import RequestScope
from kvstrata.store.policies import SharedLedgerPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig

FP = FingerprintDigest(bytes(range(32)))
BS = 4
OBJ = 1024
TIMEOUT_S = 5.0


def prompt(seed: int, blocks: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, 30_000, size=blocks * BS)]


def chain(tokens: list[int], tenant: str, recompute_s: float) -> list[tuple[KVObjectMeta, bytes]]:
    """One object per block, keyed as an engine keys them (so the index can follow them)."""
    root = namespace_root(FP, TenantNamespace.for_tenant(tenant, b""))
    keys = chain_keys(root, tokens, BS)
    out = []
    for i, key in enumerate(keys):
        payload = key * (OBJ // len(key))
        meta = KVObjectMeta(
            key=key,
            parent=keys[i - 1] if i else None,
            tenant=tenant,
            representation=Representation("uint8", "raw", BS, (OBJ,)),
            size=OBJ,
            digest=payload_digest(payload),
            created_at=time.time(),
            position=i * BS,
            recompute_s=recompute_s,
            tokens=tuple(tokens[i * BS : (i + 1) * BS]),
        )
        out.append((meta, payload))
    return out


def put_all(store: TieredStore, objects: list[tuple[KVObjectMeta, bytes]]) -> None:
    for meta, payload in objects:

        def fill(buffer: memoryview, payload: bytes = payload) -> None:
            buffer[:] = payload

        assert store.put(meta, fill, RequestScope(tenant=meta.tenant))


@dataclass
class Worker:
    """A store on the shared tier with an emitter and a subscriber feeding the index."""

    name: str
    store: TieredStore
    emitter: KVEventEmitter
    sub: ZmqEventSubscriber

    def publish_into(self, index: GlobalIndex) -> list[KVEvent]:
        seq = self.emitter.flush()
        assert seq is not None
        applied: list[KVEvent] = []
        deadline = time.monotonic() + TIMEOUT_S
        while self.sub.expected_seq is None or self.sub.expected_seq <= seq:
            assert time.monotonic() < deadline, "the batch did not arrive"
            for received in self.sub.poll(timeout_ms=50).batches:
                index.apply_batch(self.name, received.batch)
                applied += received.batch.events
        return applied

    def close(self) -> None:
        self.sub.close()
        self.emitter.close()
        self.store.close()


def shared_store(server: ValkeyServer, namespace: str, capacity: int) -> TieredStore:
    """A store whose one level is the shared remote tier (GDSF value = recompute s / byte)."""
    tier = RemoteTier(
        RemoteConfig(url=server.url, namespace=namespace),
        capacity,
        value_of=lambda meta: meta.recompute_s / meta.size,
    )
    return TieredStore([(tier, SharedLedgerPolicy(), TierConfig("remote"))], record_events=True)


def shared_worker(name: str, server: ValkeyServer, namespace: str, capacity: int) -> Worker:
    store = shared_store(server, namespace, capacity)
    config = KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", worker_id=name)
    emitter = KVEventEmitter.from_config(config, block_size=BS).start()
    emitter.attach(None, store)
    publisher = emitter.publisher
    sub = ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, expected_seq=0)
    sub.start()
    assert publisher.wait_for_subscriber(TIMEOUT_S), "subscription did not land"
    return Worker(name, store, emitter, sub)


@pytest.fixture
def pair(remote_server: ValkeyServer, remote_namespace: str) -> Iterator[tuple[Worker, Worker]]:
    a = shared_worker("a", remote_server, remote_namespace, 4 * OBJ)
    b = shared_worker("b", remote_server, remote_namespace, 4 * OBJ)
    yield a, b
    a.close()
    b.close()


def depth(index: GlobalIndex, tenant: str, tokens: list[int]) -> dict[str, tuple[int, ...]]:
    found = index.match(index.request_hashes(tenant, tokens))
    return {w: (m.blocks, *m.tier_blocks) for w, m in found.items()}


def test_shared_tier_removals_reach_the_index_whoever_announced_them(
    pair: tuple[Worker, Worker],
) -> None:
    a, b = pair
    index = GlobalIndex(FP, BS)
    index.add_worker("b")
    cheap, dear = prompt(1, 4), prompt(2, 4)
    put_all(a.store, chain(cheap, "acme", recompute_s=1e-4))
    events = a.publish_into(index)
    assert {e.medium for e in events if isinstance(e, BlockStored)} == {"remote"}
    # a's remote blocks count for b as well: same namespace, same objects.
    assert depth(index, "acme", cheap) == {"a": (4, 0, 0, 0, 4), "b": (4, 0, 0, 0, 4)}

    # b fills the full shared tier with dearer blocks: the ledger evicts a's (lowest value)
    # and b — which never announced them — announces their removal, with their tenant.
    put_all(b.store, chain(dear, "beta", recompute_s=1.0))
    feed_hashes = [event_block_hash(meta.key) for meta, _ in chain(cheap, "acme", 1e-4)]
    events = b.publish_into(index)
    gone = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(gone) == sorted(feed_hashes)
    assert {e.namespace for e in events if isinstance(e, BlockRemoved)} == {"acme"}
    assert {e.medium for e in events if isinstance(e, BlockRemoved)} == {"remote"}
    assert depth(index, "acme", cheap) == {"a": (0, 0, 0, 0, 0), "b": (0, 0, 0, 0, 0)}
    assert depth(index, "beta", dear) == {"a": (4, 0, 0, 0, 4), "b": (4, 0, 0, 0, 4)}
    assert b.store.metrics.value(
        "kvstrata_tier_evictions_total", {"tier": "remote", "outcome": "shared_ledger"}
    ) == len(feed_hashes)
    # a's feed never heard of it, and announces nothing more.
    assert a.emitter.flush() is None


def test_a_delete_of_another_workers_shared_object_is_announced(
    pair: tuple[Worker, Worker],
) -> None:
    a, b = pair
    tokens = prompt(3, 2)
    objects = chain(tokens, "acme", recompute_s=0.01)
    put_all(a.store, objects)
    keys = [meta.key for meta, _ in objects]
    assert len(b.store.lookup(keys, RequestScope(tenant="acme"))) == 2  # b probed them
    b.store.take_events()
    assert b.store.delete(keys) == 2
    removed = [e for e in b.store.take_events() if isinstance(e, ObjectRemoved)]
    assert [(e.tier, e.key, e.tenant) for e in removed] == [("remote", k, "acme") for k in keys]
    stored = [e for e in a.store.take_events() if isinstance(e, ObjectStored)]
    assert [e.meta.key for e in stored] == keys


def test_a_read_ahead_promotion_still_measures_the_network(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """A promotion reads its remote blocks in one batch before loading them one by one; the
    level's measured fetch cost must include that batch, or the router and the engine's
    break-even would price remote fetches at the cost of a memory copy. The batch is slowed
    (20 ms, a stand-in for a distant server) so that leaving it out could not go unseen."""
    writer = shared_store(remote_server, remote_namespace, 64 * OBJ)
    reader = shared_store(remote_server, remote_namespace, 64 * OBJ)
    try:
        objects = chain(prompt(5, 6), "acme", recompute_s=0.01)
        put_all(writer, objects)
        located = reader.lookup([meta.key for meta, _ in objects], RequestScope(tenant="acme"))
        assert len(located) == 6
        tier = reader.levels[0].tier
        fetch = tier.read_ahead
        spent: list[float] = []

        def slow_read_ahead(keys: list[BlockKey]) -> None:
            started = time.perf_counter()
            time.sleep(0.02)
            fetch(keys)
            spent.append(time.perf_counter() - started)

        tier.read_ahead = slow_read_ahead  # type: ignore[method-assign]
        reader.read_ahead(located)
        for loc in located:
            with reader.load(loc, "acme") as lease:
                assert lease is not None
        reader.discard_read_ahead()
        assert tier.remote_counters.read_ahead_unused_bytes == 0  # type: ignore[attr-defined]
        assert reader.levels[0].fetch_s_per_byte >= spent[0] / (6 * OBJ)
    finally:
        writer.close()
        reader.close()


# ---------------------------------------------------------------------------- router pricing
PREFILL_PER_TOKEN = 1e-3


def profile(remote_s_per_block: float) -> CostProfile:
    return CostProfile(
        prefill=PrefillModel(overhead_s=0.01, per_token_s=PREFILL_PER_TOKEN),
        fetch_s_per_block=(0.0, 1e-4, 1e-3, remote_s_per_block),
        block_size=16,
    )


def test_router_prices_shared_remote_blocks_per_worker_and_recomputes_when_slower() -> None:
    """a wrote 32 blocks to the shared tier; b fetches remote fast, c slowly: b is chosen, and
    c's estimate recomputes (fetching 32 blocks would cost more than the prefill)."""
    index = GlobalIndex(FP, 16)
    tokens = prompt(4, 4 * 32)[: 32 * 16]
    root = namespace_root(FP, TenantNamespace.for_tenant("t", b""))
    keys: list[BlockKey] = chain_keys(root, tokens, 16)
    hashes = [event_block_hash(k) for k in keys]
    index.apply_batch(
        "a",
        _batch(BlockStored(hashes, None, tokens, 16, None, "remote", None, namespace="t")),
    )
    for worker in ("b", "c"):
        index.add_worker(worker)
    fast, slow = 1e-3, 0.1  # seconds per block; recomputing a block's 16 tokens: 16 ms
    profiles = {"a": profile(fast), "b": profile(fast), "c": profile(slow)}
    router = Router(index, KvstrataPolicy(profiles.__getitem__, work_weight=0.0))
    request = RouteRequest("r", "t", len(tokens) + 1, index.request_hashes("t", [*tokens, 7]))
    loads = [WorkerLoad("a", queued_s=1.0), WorkerLoad("b"), WorkerLoad("c")]
    decision = router.route(request, loads)
    by = {e.worker_id: e for e in decision.estimates}
    assert by["b"].tier_blocks == by["c"].tier_blocks == (0, 0, 0, 32)
    assert by["b"].fetch_s == pytest.approx(32 * fast)
    assert by["c"].fetch_s == 0.0  # 3.2 s of fetching > 0.52 s of prefill: recompute
    assert by["c"].prefill_s == pytest.approx(0.01 + PREFILL_PER_TOKEN * (len(tokens) + 1))
    assert decision.worker_id == "b"


def test_a_device_prefix_is_kept_when_the_remote_rest_is_recomputed() -> None:
    """Device blocks are used in place; only the store's part is fetched or recomputed."""
    policy = KvstrataPolicy(lambda _: profile(0.1), work_weight=0.0)
    request = RouteRequest("r", "t", 64 * 16, list(range(64)))
    match = PrefixMatch("w", 64, (32, 0, 0, 32))
    (estimate,) = policy.choose(request, {"w": match}, [WorkerLoad("w")]).estimates
    assert estimate.fetch_s == 0.0
    assert estimate.prefill_s == pytest.approx(0.01 + PREFILL_PER_TOKEN * 32 * 16)


def _batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


# ---------------------------------------------------------------------------- fleet learning
def _info(**extra: object) -> dict[str, object]:
    return {
        "worker_id": "w",
        "epoch": 1,
        "model": "tiny",
        "fingerprint": bytes(32).hex(),
        "block_size": 16,
        "events_endpoint": "tcp://127.0.0.1:1",
        **extra,
    }


def test_worker_info_carries_measured_fetch_figures() -> None:
    info = WorkerInfo.from_json(
        "http://w",
        _info(
            tiers=["device", "host", "remote"],
            fetch_s_per_block={"host": 2e-4, "remote": None, "bogus": 1.0},
        ),
    )
    assert info.fetch_s_per_block == (None, 2e-4, None, None)
    assert info.reaches_shared_tier
    assert not WorkerInfo.from_json("http://w", _info(tiers=["device", "host"])).reaches_shared_tier
    assert WorkerInfo.from_json("http://w", _info()).reaches_shared_tier  # it does not say
    with pytest.raises(WorkerProtocolError):
        WorkerInfo.from_json("http://w", _info(fetch_s_per_block={"remote": "fast"}))
    measured = WorkerInfo.from_json("http://w", _info(fetch_s_per_block={"remote": -1.0}))
    assert measured.fetch_s_per_block[Medium.REMOTE] is None  # a negative figure is ignored


def test_worker_profile_prices_with_what_it_measured() -> None:
    info = WorkerInfo.from_json("http://w", _info(fetch_s_per_block={"host": 5e-4}))
    state = WorkerState(info, default_profile(16))
    prior = state.profile_prior.fetch_s_per_block
    state.measured_fetch = info.fetch_s_per_block
    assert state.profile().fetch_s_per_block == (prior[0], 5e-4, prior[2], prior[3])
    # Unmeasured remote: another worker's figure for the same shared tier stands in.
    assert state.profile(shared_fetch_s=0.03).fetch_s_per_block[Medium.REMOTE] == 0.03
    state.measured_fetch = (None, None, None, 0.002)
    assert state.profile(shared_fetch_s=0.03).fetch_s_per_block[Medium.REMOTE] == 0.002
