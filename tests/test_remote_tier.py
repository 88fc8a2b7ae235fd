"""The remote tier beyond the shared contract: verification of server bytes, sharing between
workers, the shared ledger (value order, prefix closure, quotas), batching, failures.

Every test runs against real valkey-server processes (``remote_server`` / ``remote_cluster``
fixtures, or its own server when it kills one); tests keep apart by namespace.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.config import WorkerConfig, remote_tier
from kvstrata.runtime.processes import free_port
from kvstrata.runtime.store_factory import build_store
from kvstrata.runtime.valkey_server import ValkeyCluster, ValkeyServer
from kvstrata.store.config import TierConfig
from kvstrata.store.levels import RequestScope
from kvstrata.store.policies import SharedLedgerPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.tiers.base import CORRUPT, Dropped
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import CircuitBreaker, RemoteConfig
from tier_helpers import OBJ, load_bytes, make_object, remote_tier_on, store

HERE = Path(__file__).parent


tier_on = remote_tier_on


@pytest.fixture
def tier(remote_server: ValkeyServer, remote_namespace: str) -> Iterator[RemoteTier]:
    t = tier_on(remote_server.url, remote_namespace)
    yield t
    t.close()


# ------------------------------------------------------------------ server bytes are verified


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "garbage_meta", "other_meta"])
def test_damaged_server_bytes_are_caught(tier: RemoteTier, damage: str) -> None:
    meta, payload = make_object(1)
    other, _ = make_object(2)
    assert store(tier, meta, payload)
    with tier.client.connection("single") as conn:
        data, mkey = tier.data_key(meta.key), tier.meta_key(meta.key)
        if damage == "flip":
            conn.setrange(data, 100, bytes([payload[100] ^ 0xFF]))
        elif damage == "truncate":
            conn.set(data, payload[:-1])
        elif damage == "extend":
            conn.append(data, b"x")
        elif damage == "garbage_meta":
            conn.set(mkey, b"\x00" * 40)
        else:  # a valid meta, but of another key
            from kvstrata.tiers.remote_format import encode_meta

            conn.set(mkey, encode_meta(other))
    assert tier.prepare_load(meta.key) is None
    assert tier.counters.invalidated == 1
    assert tier.take_dropped() == [Dropped(meta.key, CORRUPT)]
    assert not tier.contains(meta.key) and tier.used_bytes == 0
    with tier.client.connection("single") as conn:
        assert conn.exists(tier.data_key(meta.key), tier.meta_key(meta.key)) == 0
    assert store(tier, meta, payload)  # the key is free again
    assert load_bytes(tier, meta.key) == payload


# ------------------------------------------------------------------ sharing between writers


def test_a_second_worker_reads_what_the_first_wrote(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    a = tier_on(remote_server.url, remote_namespace)
    b = tier_on(remote_server.url, remote_namespace)
    try:
        meta, payload = make_object(7)
        assert store(a, meta, payload)
        assert not b.contains(meta.key)  # b has not looked yet: local views do no I/O
        b.probe([meta.key])
        assert b.meta(meta.key) == meta
        assert load_bytes(b, meta.key) == payload
        assert b.prepare_store(meta) is None  # held by another writer: refused as "exists"
        assert b.remote_counters.refused == {"exists": 1}
        b.refresh_usage(["t0"])
        assert b.used_bytes == a.used_bytes == OBJ and b.tenant_bytes("t0") == OBJ
    finally:
        a.close()
        b.close()


def _store_of(tier: RemoteTier) -> TieredStore:
    return TieredStore([(tier, SharedLedgerPolicy(), TierConfig("remote"))])


def _chain(n: int, tenant: str) -> list[tuple[KVObjectMeta, bytes]]:
    out = []
    parent: BlockKey | None = None
    for i in range(n):
        meta, payload = make_object(100 + i, tenant=tenant)
        meta = KVObjectMeta(**{**meta.__dict__, "parent": parent})
        out.append((meta, payload))
        parent = meta.key
    return out


def test_tenants_stay_apart_in_the_shared_tier(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Paired: the owner hits through another worker's store; another tenant does not."""
    writer = _store_of(tier_on(remote_server.url, remote_namespace))
    reader = _store_of(tier_on(remote_server.url, remote_namespace))
    try:
        chain = _chain(3, tenant="alice")
        for meta, payload in chain:
            assert writer.put(meta, lambda buf, p=payload: buf.__setitem__(slice(None), p))
        keys = [meta.key for meta, _ in chain]
        assert len(reader.lookup(keys, RequestScope("alice"))) == 3
        assert reader.lookup(keys, RequestScope("mallory")) == []
        located = reader.lookup(keys, RequestScope("alice"))[0]
        with reader.load(located, "mallory") as lease:
            assert lease is None  # the tenant recorded in the object is re-checked
        with reader.load(located, "alice") as lease:
            assert lease is not None and bytes(lease.buffer) == chain[0][1]
    finally:
        writer.close()
        reader.close()


# ------------------------------------------------------------------ the shared ledger


def _valued(seed: int, value: float, *, tenant: str = "t0") -> tuple[KVObjectMeta, bytes]:
    meta, payload = make_object(seed, tenant=tenant)
    return KVObjectMeta(**{**meta.__dict__, "recompute_s": value}), payload


def test_lowest_value_goes_first_and_hits_raise_value(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    from kvstrata.store.value_policy import value_per_byte

    t = tier_on(remote_server.url, remote_namespace, capacity=4 * OBJ, value_of=value_per_byte)
    try:
        objects = [_valued(i, value) for i, value in enumerate([4.0, 1.0, 3.0, 2.0])]
        for meta, payload in objects:
            assert store(t, meta, payload)
        assert load_bytes(t, objects[1][0].key) is not None  # a hit: 2 uses × 1.0
        t.flush_touches()
        assert store(t, *_valued(10, 5.0))  # evicts the lowest score: 2.0 (seed 3)
        assert store(t, *_valued(11, 5.0))  # then 1.0 × 2 uses = 2.0 vs 3.0: seed 1
        assert t.remote_counters.evicted == {"value": 2}
        assert {k for k, _ in t.take_evicted()} == {objects[3][0].key, objects[1][0].key}
        left = sorted(k.hex() for k in t.scan_keys())
        expect = [
            objects[0][0].key,
            objects[2][0].key,
            _valued(10, 0)[0].key,
            _valued(11, 0)[0].key,
        ]
        assert left == sorted(k.hex() for k in expect)
    finally:
        t.close()


def test_leaves_go_before_their_prefix(remote_server: ValkeyServer, remote_namespace: str) -> None:
    from kvstrata.store.value_policy import value_per_byte

    t = tier_on(remote_server.url, remote_namespace, capacity=3 * OBJ, value_of=value_per_byte)
    try:
        chain = _chain(3, tenant="t0")
        # The root is worth the least on its own; its children lift it above themselves.
        for (meta, payload), value in zip(chain, [1.0, 5.0, 3.0], strict=True):
            assert store(t, KVObjectMeta(**{**meta.__dict__, "recompute_s": value}), payload)
        assert store(t, *_valued(50, 10.0))
        assert t.take_evicted() == [(chain[2][0].key, "t0")]  # the leaf, not the cheap root
    finally:
        t.close()


def test_quota_evicts_only_the_tenants_own(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    quotas = {"a": 2 * OBJ}
    t = tier_on(remote_server.url, remote_namespace, capacity=8 * OBJ, quota_of=quotas.get)
    try:
        assert store(t, *_valued(1, 0.1, tenant="b"))  # b's object is worth the least
        for i in range(2, 6):
            assert store(t, *_valued(i, 5.0, tenant="a"))
        assert t.tenant_bytes("a") == 2 * OBJ
        assert t.remote_counters.evicted == {"quota": 2}
        t.refresh_usage(["b"])
        assert t.tenant_bytes("b") == OBJ  # untouched, although it scores lowest
        big, _ = make_object(9, size=3 * OBJ, tenant="a")
        assert t.prepare_store(big) is None and t.remote_counters.refused == {"quota": 1}
    finally:
        t.close()


def test_stale_reservation_of_a_dead_writer_is_reclaimed(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    from tier_helpers import FakeClock

    clock = FakeClock()
    config = RemoteConfig(url=remote_server.url, namespace=remote_namespace, pending_timeout_s=5)
    dead = RemoteTier(config, 2 * OBJ, clock=clock)
    live = RemoteTier(config, 2 * OBJ, clock=clock)
    try:
        assert dead.prepare_store(make_object(1)[0]) is not None  # never completed
        assert dead.prepare_store(make_object(2)[0]) is not None
        assert live.prepare_store(make_object(3)[0]) is None  # full of pending bytes
        clock.now += 6.0
        assert store(live, *make_object(3))
    finally:
        dead.close()
        live.close()


# ------------------------------------------------------------------ batching


def test_read_ahead_serves_loads_without_round_trips(
    remote_cluster: ValkeyCluster, remote_namespace: str
) -> None:
    config = RemoteConfig(cluster=remote_cluster.seeds, namespace=remote_namespace)
    t = RemoteTier(config, 64 * OBJ)
    try:
        objects = [make_object(i) for i in range(32)]
        for meta, payload in objects:
            assert store(t, meta, payload)
        nodes = {t.client.node_of(t.meta_key(meta.key)) for meta, _ in objects}
        assert len(nodes) == 3  # the objects spread over every shard

        def mgets() -> int:
            total = 0
            for node in remote_cluster.nodes:
                with node.connection() as conn:
                    total += int(conn.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))
            return total

        before = mgets()
        t.read_ahead([meta.key for meta, _ in objects])
        fetched = mgets()
        assert fetched - before == 32  # one MGET per object, in one pipeline per shard
        for meta, payload in objects:
            assert load_bytes(t, meta.key) == payload
        assert mgets() == fetched  # every load was served from the batch
        assert t.remote_counters.read_ahead_bytes == 32 * OBJ
    finally:
        t.close()


# ------------------------------------------------------------------ breaker (pure)


def test_breaker_opens_backs_off_and_closes() -> None:
    b = CircuitBreaker(failures=2, backoff_s=1.0, max_backoff_s=4.0)
    assert b.allow(0.0)
    b.failure(0.0)
    assert b.allow(0.0) and not b.is_open
    b.failure(0.1)
    assert b.is_open and not b.allow(0.5) and b.trips == 1
    assert b.allow(1.2)  # half-open: one trial
    assert not b.allow(1.2)
    b.failure(1.2)  # the trial failed: twice the backoff
    assert not b.allow(3.0) and b.allow(3.3)
    b.success()
    assert not b.is_open and b.allow(3.3) and b.backoff_s == 1.0


# ------------------------------------------------------------------ failures (real SIGKILL)


def test_server_killed_under_load_costs_only_misses_then_comes_back() -> None:
    server = ValkeyServer().start()
    config = RemoteConfig(
        url=server.url, namespace="kill", timeout_s=0.2, connect_timeout_s=0.2,
        breaker_failures=2, breaker_backoff_s=0.2, breaker_max_backoff_s=0.5,
    )  # fmt: skip
    t = RemoteTier(config, 256 * OBJ)
    objects = [make_object(i) for i in range(40)]
    for meta, payload in objects[:20]:
        assert store(t, meta, payload)
    errors: list[BaseException] = []
    slowest = [0.0]
    stop = threading.Event()

    def work(seed: int) -> None:
        i = seed
        while not stop.is_set():
            meta, payload = objects[i % len(objects)]
            i += 7
            started = time.monotonic()
            try:
                got = load_bytes(t, meta.key)
                assert got is None or got == payload  # never wrong bytes
                try:
                    slot = t.prepare_store(meta)
                    if slot is not None:
                        slot.buffer[:] = payload
                        t.complete_store(slot, True)
                except Exception as exc:  # only the tier's own error may come out
                    from kvstrata.tiers.base import TierError

                    assert isinstance(exc, TierError), exc
            except BaseException as exc:
                errors.append(exc)
                return
            slowest[0] = max(slowest[0], time.monotonic() - started)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        server.kill()
        time.sleep(1.0)
        assert t.remote_counters.errors, "the outage was not counted"
        assert t.breaker_open()
        server.restart()  # same port, empty
        back = _retry_store(t, *make_object(99), within_s=10.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        t.close()
        server.stop()
    assert not errors, errors
    assert back, "the tier did not come back by itself after the restart"
    assert slowest[0] < 3.0  # bounded by the timeouts and the breaker, never a hang
    assert not t.breaker_open()


def _retry_store(t: RemoteTier, meta: KVObjectMeta, payload: bytes, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            slot = t.prepare_store(meta)
        except Exception:
            slot = None
        if slot is not None:
            slot.buffer[:] = payload
            try:
                if t.complete_store(slot, True):
                    return True
            except Exception:
                pass
        time.sleep(0.1)
    return False


def test_one_dead_shard_leaves_the_others_serving() -> None:
    cluster = ValkeyCluster().start()
    try:
        config = RemoteConfig(
            cluster=cluster.seeds, namespace="shard", timeout_s=0.2, connect_timeout_s=0.2,
            breaker_failures=1, breaker_backoff_s=5.0,
        )  # fmt: skip
        t = RemoteTier(config, 256 * OBJ)
        objects = [make_object(i) for i in range(30)]
        for meta, payload in objects:
            assert store(t, meta, payload)
        ledger = t.ledger_node
        victim = next(n for n in cluster.nodes if n.address != ledger)
        on_victim = [m for m, _ in objects if t.client.node_of(t.meta_key(m.key)) == victim.address]
        assert on_victim
        victim.kill()
        served = 0
        for meta, payload in objects:
            got = load_bytes(t, meta.key)
            if meta in on_victim:
                assert got is None
            else:
                assert got == payload
                served += 1
        assert served == len(objects) - len(on_victim)
        t.close()
    finally:
        cluster.stop()


def test_unreachable_at_start_up_the_worker_starts_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import CollectorRegistry

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    config = WorkerConfig(
        tiers=(remote_tier(RemoteConfig(url=url, timeout_s=0.2, connect_timeout_s=0.2), OBJ),)
    )
    with caplog.at_level(logging.WARNING):
        built = build_store(OBJ, config, CollectorRegistry())
    assert built is None  # its only tier is gone
    assert "unreachable at start-up" in caplog.text and url in caplog.text


# ------------------------------------------------------------------ workers in processes


def _worker(mode: str, url: str, namespace: str, *extra: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, str(HERE / "remote_worker.py"), mode, "--url", url,
         "--namespace", namespace, *extra],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_worker_b_hits_what_worker_a_wrote_exactly(
    remote_server: ValkeyServer, remote_namespace: str, model: str
) -> None:
    args = ("--model", model, "--tokens", "150")
    _worker("write", remote_server.url, remote_namespace, *args)
    got = _worker("read", remote_server.url, remote_namespace, *args)
    assert got["matched_by_tier"] == {"remote": 144}
    assert got["cached"] == got["fresh"]
    assert float(got["max_logit_diff"]) <= 1e-4  # type: ignore[arg-type]
    if model == "tiny":  # the paired miss (one more process start: not repeated for SmolLM2)
        other = _worker("read", remote_server.url, remote_namespace, *args, "--tenant", "other")
        assert other["matched_by_tier"] == {}  # another tenant's salt: no hit there


# ------------------------------------------------------------------ several writer processes


def _writers(
    url: str, namespace: str, capacity: int, jobs: list[list[str]], quotas: list[str]
) -> list[dict[str, Any]]:
    start_at = time.time() + 3.0  # every process is up by then (imports take ~1 s)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "remote_writer.py"),
                "--url",
                url,
                "--namespace",
                namespace,
                "--capacity",
                str(capacity),
                "--start-at",
                str(start_at),
                "--objects",
                ",".join(job),
                *[a for q in quotas for a in ("--quota", q)],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in jobs
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _hex(seed: int) -> str:
    return make_object(seed)[0].key.hex()


def test_three_writers_evict_the_lowest_value_cluster_wide(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Three processes fill one tier, interleaved; then each adds objects worth more. The
    objects that go are exactly the lowest-valued ones, whichever writer wrote them."""
    capacity = 30 * OBJ
    values = {seed: 1.0 + (seed * 37 % 30) for seed in range(30)}  # 30 distinct values
    fill = [[f"{s}:t{w}:{values[s]}" for s in range(w, 30, 3)] for w in range(3)]
    results = _writers(remote_server.url, remote_namespace, capacity, fill, [])
    assert sorted(s for r in results for s in r["stored"]) == list(range(30))
    assert all(not r["evicted"] for r in results)
    # Phase 2: 3 new objects per writer, each worth more than anything stored.
    more = [[f"{100 + 3 * i + w}:t{w}:100.0" for i in range(3)] for w in range(3)]
    results = _writers(remote_server.url, remote_namespace, capacity, more, [])
    evicted = {h for r in results for h in r["evicted"]}
    lowest = sorted(values, key=values.__getitem__)[:9]
    assert evicted == {_hex(s) for s in lowest}
    writers_of_victims = {s % 3 for s in lowest}
    assert len(writers_of_victims) > 1  # cluster-wide: writers evicted each other's objects
    t = tier_on(remote_server.url, remote_namespace, capacity=capacity)
    try:
        assert len(t.scan_keys()) == 30
    finally:
        t.close()


def test_writers_within_quota_never_lose_objects_to_another_tenant(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Quotas that do not oversubscribe the tier (3 × 10 objects = capacity): a writer whose
    tenant exceeds its quota evicts its own objects, never the other tenants', even though
    theirs are worth less."""
    capacity = 30 * OBJ
    quotas = [f"t{w}:{10 * OBJ}" for w in range(3)]
    fill = [[f"{w * 10 + i}:t{w}:{1.0 if w else 50.0}" for i in range(10)] for w in range(3)]
    _writers(remote_server.url, remote_namespace, capacity, fill, quotas)
    # t0 (whose objects are worth the most) writes 5 more; t1 and t2 one more each.
    extra = [[f"{200 + i}:t0:60.0" for i in range(5)], ["301:t1:1.0"], ["302:t2:1.0"]]
    results = _writers(remote_server.url, remote_namespace, capacity, extra, quotas)
    t = tier_on(remote_server.url, remote_namespace, capacity=capacity)
    try:
        t.refresh_usage(["t0", "t1", "t2"])
        assert [t.tenant_bytes(f"t{w}") for w in range(3)] == [10 * OBJ] * 3
        own = [{_hex(s) for s in range(10 * w, 10 * w + 10)} for w in range(3)]
        for w, result in enumerate(results):
            assert result["evicted"], f"writer {w} over its quota evicted nothing"
            assert set(result["evicted"]) <= own[w]  # only its own tenant's objects
        assert len(results[0]["evicted"]) == 5
    finally:
        t.close()


def test_engine_recomputes_exactly_while_the_server_is_dead(tiny_model: Any) -> None:
    """End to end on the engine: a dead remote tier costs a recompute, never wrong tokens;
    the outage shows in the metrics; after a restart the tier is written and hit again."""
    from kvstrata.engine.engine import EngineConfig
    from kvstrata.engine.factory import build_engine
    from kvstrata.engine.sampling import SamplingParams

    server = ValkeyServer().start()
    remote = RemoteConfig(
        url=server.url, namespace="engine", timeout_s=0.2, connect_timeout_s=0.2,
        breaker_failures=1, breaker_backoff_s=0.2, breaker_max_backoff_s=0.4,
    )  # fmt: skip
    config = WorkerConfig(tiers=(remote_tier(remote, 64 << 20),))
    engine = build_engine(tiny_model, EngineConfig(block_size=16, pool_blocks=64), config)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [int(t) for t in range(100, 250)]
    try:
        fresh = engine.generate(prompt, greedy, use_cache=False).run()
        engine.generate(prompt, greedy).run()  # written through to the remote tier
        engine.pool.clear()
        server.kill()
        dead = engine.generate(prompt, greedy).run()
        assert dead.output_ids == fresh.output_ids
        assert dead.record.matched_by_tier == {}
        errors = sum(
            engine.metrics.value("kvstrata_remote_errors_total", {"op": op})
            for op in ("probe", "load", "read_ahead", "reserve")
        )
        assert errors > 0
        server.restart()  # empty
        time.sleep(0.5)  # past the breaker's backoff
        engine.pool.clear()  # the pool's blocks are demoted into the restarted tier
        back = engine.generate(prompt, greedy).run()
        assert back.output_ids == fresh.output_ids
        assert back.record.matched_by_tier == {"remote": 144}
    finally:
        engine.close()
        server.stop()
