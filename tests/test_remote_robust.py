"""The remote tier against garbage on the server: corrupt ledger entries, usage figures, GDSF
clock and tombstones, foreign keys in the namespace, non-finite inputs.

None of them may fail a script for good (a script error is the server answering, not the node
being down: the breaker stays closed), leave bytes the ledger does not account for, or stop a
tenant's deletion. Every test runs against the real valkey-server of the ``remote_server``
fixture, in its own namespace.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import pytest
import redis

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.store.config import TierConfig
from kvstrata.store.deletion import DeleteSelector
from kvstrata.store.policies import SharedLedgerPolicy
from kvstrata.store.tiered import TieredStore
from kvstrata.store.value_policy import value_per_byte
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteReplyError, RemoteUnavailable
from kvstrata.tiers.remote_format import key_of_meta, meta_pattern
from kvstrata.tiers.remote_tombstones import tomb_key
from tier_helpers import OBJ, FakeClock, load_bytes, make_object, remote_tier_on, store


def _conn(t: RemoteTier) -> redis.Redis:
    conn = t.client.single
    assert conn is not None
    return conn


def _valued(seed: int, value: float) -> tuple[KVObjectMeta, bytes]:
    meta, payload = make_object(seed)
    return KVObjectMeta(**{**meta.__dict__, "recompute_s": value}), payload


def _full(t: RemoteTier, n: int = 4) -> list[tuple[KVObjectMeta, bytes]]:
    """Fill the tier with ``n`` objects of rising value (seed 0 scores lowest)."""
    objects = [_valued(i, 1.0 + i) for i in range(n)]
    for meta, payload in objects:
        assert store(t, meta, payload)
    return objects


def _ledger_is_consistent(t: RemoteTier) -> dict[str, dict[str, object]]:
    """The ledger's usage figures match its entries, every committed entry is scored, and
    every object on the server has an entry (no bytes nobody accounts for)."""
    conn, prefix = _conn(t), t._prefix
    info = {k.decode(): json.loads(v) for k, v in conn.hgetall(prefix + "info").items()}
    usage = {k.decode(): int(v) for k, v in conn.hgetall(prefix + "u").items()}
    assert usage.get("used", 0) == sum(int(r["s"]) for r in info.values())
    assert usage.get("n", 0) == len(info)
    committed = {k for k, r in info.items() if r["st"] == "C"}
    assert {m.decode() for m in conn.zrange(prefix + "z", 0, -1)} == committed
    on_server = set()
    for name in conn.scan_iter(match=meta_pattern(t._ns), count=1000):
        key = key_of_meta(t._ns, name.decode())
        if key is not None:
            on_server.add(key.hex())
    assert on_server <= set(info), on_server - set(info)
    return info


@pytest.fixture
def full_tier(remote_server: ValkeyServer, remote_namespace: str) -> Iterator[RemoteTier]:
    t = remote_tier_on(remote_server.url, remote_namespace, 4 * OBJ, value_of=value_per_byte)
    yield t
    t.close()


# ------------------------------------------------------------------ D6: corrupt ledger values


@pytest.mark.parametrize(
    "garbage",
    [b"{not json", b"[]", b'{"s":"big","t":"t0","st":"C","u":1,"x":-1,"p":"","v":0}', b"{}"],
)
def test_a_corrupt_ledger_entry_is_dropped_not_fatal(full_tier: RemoteTier, garbage: bytes) -> None:
    t = full_tier
    objects = _full(t)
    conn = _conn(t)
    lowest = objects[0][0].key
    conn.hset(t._ledger_key, lowest.hex(), garbage)
    for seed in range(10, 14):  # was: ResponseError x3, then "circuit open"
        assert store(t, *_valued(seed, 100.0 + seed))
    assert not t.breaker_open()
    assert t.remote_counters.evicted.get("corrupt") == 1
    assert t.remote_counters.errors == {}
    assert conn.exists(t.meta_key(lowest), t.data_key(lowest)) == 0  # deleted like a victim
    _ledger_is_consistent(t)
    t.refresh_usage()
    assert t.used_bytes == 4 * OBJ and t.object_count == 4
    assert load_bytes(t, _valued(13, 0)[0].key) is not None


def test_a_corrupt_entry_met_by_a_hit_or_a_commit_is_dropped(full_tier: RemoteTier) -> None:
    t = full_tier
    objects = _full(t, 3)
    conn = _conn(t)
    conn.hset(t._ledger_key, objects[2][0].key.hex(), b"\xff\x00")
    assert load_bytes(t, objects[2][0].key) is not None  # its bytes still verify
    t.flush_touches()  # TOUCH meets the corrupt entry
    assert t.remote_counters.errors == {} and not t.breaker_open()
    assert t.remote_counters.evicted == {"corrupt": 1}
    meta, payload = _valued(20, 1.0)
    slot = t.prepare_store(meta)
    assert slot is not None
    conn.hset(t._ledger_key, meta.key.hex(), b"nonsense")  # the pending entry goes bad
    slot.buffer[:] = payload
    assert not t.complete_store(slot, True)  # its commit finds no entry: a refused store
    assert t.remote_counters.errors == {} and not t.breaker_open()
    _ledger_is_consistent(t)


@pytest.mark.parametrize("damage", ["wrong_type", "garbage_field", "garbage_tenant"])
def test_garbage_usage_figures_are_recounted(full_tier: RemoteTier, damage: str) -> None:
    t = full_tier
    _full(t)
    conn, usage = _conn(t), t._prefix + "u"
    if damage == "wrong_type":
        conn.delete(usage)
        conn.rpush(usage, "x")
    elif damage == "garbage_field":
        conn.hset(usage, "used", "lots")
    else:
        conn.hset(usage, "t:t0", "1.5e")
    for seed in range(10, 14):
        assert store(t, *_valued(seed, 100.0 + seed))
    assert t.remote_counters.errors == {} and not t.breaker_open()
    info = _ledger_is_consistent(t)
    assert len(info) == 4
    t.refresh_usage(["t0"])
    assert t.used_bytes == 4 * OBJ and t.tenant_bytes("t0") == 4 * OBJ


def test_a_non_hex_ledger_field_is_dropped(full_tier: RemoteTier) -> None:
    t = full_tier
    _full(t)
    conn = _conn(t)
    good = '{"s":4096,"t":"t0","st":"C","u":1,"x":-1,"p":"","v":0}'
    conn.hset(t._ledger_key, "not-hex", good)
    conn.zadd(t._prefix + "z", {"not-hex": -1.0})  # it scores lowest: the first victim
    assert store(t, *_valued(10, 100.0))
    assert t.remote_counters.errors == {} and not t.breaker_open()
    assert conn.hexists(t._ledger_key, "not-hex") == 0
    _ledger_is_consistent(t)


def test_a_reply_error_does_not_count_as_the_node_down(full_tier: RemoteTier) -> None:
    t = full_tier
    conn = _conn(t)
    conn.rpush(t._prefix + "junk", "x")
    for _ in range(5):
        with pytest.raises(RemoteReplyError):
            t.client.call("single", lambda c: c.hget(t._prefix + "junk", "f"))
    assert not t.breaker_open() and t.client.breaker("single").consecutive == 0
    t.ping()  # still answers


# ------------------------------------------------------------------ D7: no partial updates


@pytest.mark.parametrize("value", [math.inf, math.nan])  # -inf prices as 0 (value_per_byte)
def test_a_non_finite_value_is_refused_before_the_ledger(
    full_tier: RemoteTier, value: float
) -> None:
    t = full_tier
    objects = _full(t)
    assert t.prepare_store(_valued(10, value)[0]) is None
    assert t.remote_counters.refused == {"invalid": 1}
    assert t.remote_counters.errors == {} and t.remote_counters.evicted == {}
    info = _ledger_is_consistent(t)
    assert set(info) == {meta.key.hex() for meta, _ in objects}  # nobody was evicted
    for meta, payload in objects:
        assert load_bytes(t, meta.key) == payload


def test_the_reserve_script_checks_its_numbers_before_any_write(full_tier: RemoteTier) -> None:
    """A writer that skips the Python check (another version) still cannot half-evict."""
    t = full_tier
    objects = _full(t)
    meta = _valued(10, 0.0)[0]
    for bad in ["inf", "nan", "-inf", "x", "1e999"]:
        args = [t._prefix, meta.key.hex(), OBJ, "t0", bad, -1, 4 * OBJ, "2000.0", "2030.0"]
        args += [-1, "", "1000.0"]
        reply = t._script("reserve", args)
        assert reply.status == "invalid" and reply.victims == []
    info = _ledger_is_consistent(t)
    assert set(info) == {m.key.hex() for m, _ in objects}


@pytest.mark.parametrize("damage", ["garbage", "nan", "wrong_type"])
def test_a_garbage_gdsf_clock_does_not_half_evict(full_tier: RemoteTier, damage: str) -> None:
    t = full_tier
    objects = _full(t)
    conn, clock = _conn(t), t._prefix + "clock"
    if damage == "wrong_type":
        conn.rpush(clock, "x")
    else:
        conn.set(clock, "not a number" if damage == "garbage" else "nan")
    assert store(t, *_valued(10, 100.0))  # evicts seed 0, whose bytes must go too
    assert t.remote_counters.errors == {} and t.remote_counters.evicted == {"value": 1}
    lowest = objects[0][0].key
    assert conn.exists(t.meta_key(lowest), t.data_key(lowest)) == 0
    _ledger_is_consistent(t)
    assert math.isfinite(float(conn.get(clock) or b"0"))
    assert load_bytes(t, objects[1][0].key) is not None
    t.flush_touches()  # TOUCH reads the clock too
    assert t.remote_counters.errors == {}


# ------------------------------------------------------------------ D8: foreign keys


def test_foreign_keys_in_the_namespace_do_not_stop_a_tenant_deletion(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    t = remote_tier_on(remote_server.url, remote_namespace)
    s = TieredStore([(t, SharedLedgerPolicy(), TierConfig("remote"))])
    try:
        objects = [make_object(i) for i in range(3)]
        for meta, payload in objects:
            assert store(t, meta, payload)
        conn = _conn(t)
        conn.set(f"{remote_namespace}:{{backup}}:m", b"x")
        conn.set(f"{remote_namespace}:{{abc}}:m", b"x")  # odd-length hex
        conn.hset(t._ledger_key, "not-hex", "{}")
        parent_bad = '{"s":1,"t":"t0","st":"C","u":1,"x":-1,"p":"zz","v":0}'
        conn.hset(t._ledger_key, "00ff", parent_bad)
        assert sorted(k.hex() for k in t.scan_keys()) == sorted(m.key.hex() for m, _ in objects)
        report = s.delete_selected(DeleteSelector(tenant="t0", all=True))
        assert set(report.keys) >= {meta.key for meta, _ in objects}
        assert report.unreachable == []
        for meta, _ in objects:
            assert conn.exists(t.meta_key(meta.key), t.data_key(meta.key)) == 0
        assert conn.exists(f"{remote_namespace}:{{backup}}:m") == 1  # not ours: left alone
        assert t.remote_counters.foreign_keys >= 3
    finally:
        s.close()


def test_key_of_meta_refuses_what_is_not_a_meta_key() -> None:
    key = BlockKey(bytes(range(32)))
    assert key_of_meta("ns", f"ns:{{{key.hex()}}}:m") == key
    for name in [
        "ns:{backup}:m",
        "ns:{abc}:m",
        "ns:{}:m",
        "ns:{00}:x",
        "other:{00}:m",
        "ns:{0g}:m",
    ]:
        assert key_of_meta("ns", name) is None


# ------------------------------------------------------------------ Q3: garbage tombstones


@pytest.mark.parametrize("damage", ["garbage", "nan", "wrong_type"])
def test_a_garbage_object_tombstone_buries_without_a_script_error(
    remote_server: ValkeyServer, remote_namespace: str, damage: str
) -> None:
    """A deletion marker that cannot be read still marks a deletion: the key stays buried
    (never resurrected) until the marker goes, and no script fails on it."""
    t = remote_tier_on(remote_server.url, remote_namespace)
    try:
        conn = _conn(t)
        stored, payload = make_object(1)
        assert store(t, stored, payload)
        fresh, fresh_payload = make_object(2)
        for meta in (stored, fresh):
            tk = tomb_key(remote_namespace, meta.key)
            if damage == "wrong_type":
                conn.rpush(tk, "x")
            else:
                conn.set(tk, "yesterday" if damage == "garbage" else "nan")
        if damage != "wrong_type":  # (an MGET reads a wrong-typed key as absent)
            assert load_bytes(t, stored.key) is None  # a reader treats it as buried
        for _ in range(4):
            slot = t.prepare_store(fresh)
            assert slot is not None
            slot.buffer[:] = fresh_payload
            assert not t.complete_store(slot, True)  # WRITE refuses it, no Lua error
        assert t.remote_counters.errors == {} and not t.breaker_open()
        assert t.remote_counters.refused == {"tombstoned": 4}
        assert conn.exists(t.meta_key(fresh.key), t.data_key(fresh.key)) == 0
        _ledger_is_consistent(t)
    finally:
        t.close()


@pytest.mark.parametrize("damage", ["garbage", "wrong_type"])
def test_a_garbage_ledger_tombstone_refuses_and_a_deletion_replaces_it(
    remote_server: ValkeyServer, remote_namespace: str, damage: str
) -> None:
    # the tier's clock is the deletion's: on wall time a tombstone dated 2000 would get a
    # 1 ms server TTL and could expire before the asserts read it (a CI flake once)
    t = remote_tier_on(remote_server.url, remote_namespace, clock=lambda: 2000.0)
    s = TieredStore([(t, SharedLedgerPolicy(), TierConfig("remote"))])
    try:
        conn = _conn(t)
        meta, payload = make_object(3)
        ledger_tomb = t._prefix + "x:" + meta.key.hex()
        if damage == "wrong_type":
            conn.rpush(ledger_tomb, "x")
            conn.rpush(tomb_key(t._ns, meta.key), "x")
        else:
            conn.set(ledger_tomb, "garbage")
            conn.set(tomb_key(t._ns, meta.key), "garbage")
        assert t.prepare_store(meta) is None
        assert t.remote_counters.refused == {"tombstoned": 1}
        done = s.delete_keys([meta.key], now=2000.0)  # ERASE and ERASE_OBJECT overwrite them
        assert done.unreachable == []
        assert float(conn.get(ledger_tomb) or b"0") == 2000.0
        assert float(conn.get(tomb_key(t._ns, meta.key)) or b"0") == 2000.0
        later = KVObjectMeta(**{**meta.__dict__, "created_at": 2001.0})
        assert store(t, later, payload)  # created after the deletion: accepted again
        assert t.remote_counters.errors == {} and not t.breaker_open()
    finally:
        s.close()


def test_garbage_in_a_reply_error_is_still_unavailable_to_callers() -> None:
    assert issubclass(RemoteReplyError, RemoteUnavailable)


# ------------------------------------------------------------------ entries whose bytes are gone


def test_a_committed_entry_whose_bytes_are_gone_does_not_block_the_key(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """An outside DEL (or a server evicting keys itself) left the ledger entry behind: the key
    answered 'exists' to every later store, so a hot block missed for good. Past the grace
    (a writer between its commit and its write is not lost) the entry is dropped as 'lost'
    and the key is stored again. (Half an object is a corrupt read: the reader drops that
    entry itself.)"""
    clock = FakeClock()
    t = remote_tier_on(
        remote_server.url, remote_namespace, 4 * OBJ, value_of=value_per_byte, clock=clock
    )
    try:
        conn = _conn(t)
        meta, payload = make_object(1)
        assert store(t, meta, payload)
        conn.delete(t.meta_key(meta.key), t.data_key(meta.key))
        assert load_bytes(t, meta.key) is None
        clock.now += t.config.pending_timeout_s / 2  # within the grace: kept
        assert t.prepare_store(meta) is None
        assert conn.hexists(t._ledger_key, meta.key.hex())
        clock.now += t.config.pending_timeout_s  # past it: dropped, stored again
        assert store(t, meta, payload)
        assert t.remote_counters.evicted.get("lost") == 1
        assert load_bytes(t, meta.key) == payload
        _ledger_is_consistent(t)
        t.refresh_usage()
        assert t.used_bytes == OBJ and t.object_count == 1
    finally:
        t.close()


def test_a_stored_object_is_not_taken_for_lost(full_tier: RemoteTier) -> None:
    t = full_tier
    meta, payload = make_object(1)
    assert store(t, meta, payload)
    assert t.prepare_store(meta) is None  # exists, bytes present: nothing dropped
    assert "lost" not in t.remote_counters.evicted
    assert load_bytes(t, meta.key) == payload


# ------------------------------------------------------------------ wrong-typed ledger indexes


@pytest.mark.parametrize("damaged", ["z", "e", "p", "t:t0", "z+t:t0"])
def test_a_wrong_typed_ledger_index_is_rebuilt_from_what_is_left(
    full_tier: RemoteTier, damaged: str
) -> None:
    """``z`` and a tenant set rebuild each other (same members, same scores), ``e`` comes from
    the entries; what only a lost index held (a pending reservation's deadline; a score when
    both ``z`` and its tenant set are lost) is dropped as corrupt. Before, every script that
    met the wrong type failed, so the tier refused every store until someone cleaned up; a
    script that failed half-way kept its earlier writes, which is why scripts now check their
    indexes before writing."""
    t = full_tier
    conn, prefix = _conn(t), t._prefix
    objects = _full(t, 2)
    expiring = make_object(3, created_at=time.time(), ttl=3600.0)
    assert store(t, *expiring)
    last, last_payload = make_object(4, created_at=time.time())
    pending = t.prepare_store(last)  # the tier is now full
    assert pending is not None
    pending.buffer[:] = last_payload
    scores = dict(conn.zrange(prefix + "z", 0, -1, withscores=True))
    expiry = dict(conn.zrange(prefix + "e", 0, -1, withscores=True))
    for name in damaged.split("+"):
        conn.delete(prefix + name)
        conn.rpush(prefix + name, "not a sorted set")
    # The commit checks its indexes before writing anything: it answers "wrongtype", the
    # indexes are repaired, the commit runs again.
    kept = t.complete_store(pending, True)
    t.refresh_usage(["t0"])
    assert t.remote_counters.errors == {} and not t.breaker_open()
    assert t.remote_counters.ledger_repairs == 1
    assert kept is (damaged != "p")  # a lost p drops the reservation: its deadline was only there
    dropped = {"z": 0, "p": 1, "e": 0, "t:t0": 0, "z+t:t0": 3}[damaged]
    assert t.remote_counters.evicted == ({"corrupt": dropped} if dropped else {})
    if kept:
        assert load_bytes(t, last.key) == last_payload
        name = last.key.hex()
        assert conn.zscore(prefix + "z", name) == conn.zscore(prefix + "t:t0", name) is not None
    committed = [meta for meta, _ in objects] + [expiring[0]]
    for meta in committed:
        name = meta.key.hex()
        if damaged == "z+t:t0":  # no score was left anywhere: those entries went, bytes too
            assert conn.exists(t.meta_key(meta.key)) == 0
            continue
        assert conn.zscore(prefix + "z", name) == scores[name.encode()]
        assert conn.zscore(prefix + "t:t0", name) == scores[name.encode()]
        assert conn.zscore(prefix + "e", name) == expiry.get(name.encode())
        assert load_bytes(t, meta.key) is not None
    _ledger_is_consistent(t)
    assert store(t, *_valued(10, 100.0))  # admissions and evictions work again
    assert t.remote_counters.errors == {} and t.remote_counters.ledger_repairs == 1
    _ledger_is_consistent(t)


def test_a_removal_through_a_wrong_typed_tenant_set_keeps_the_usage_exact(
    full_tier: RemoteTier,
) -> None:
    """Before scripts checked their indexes first, this removal failed after deleting the
    entry and before fixing the usage figures: ``used`` stayed 4 KiB too high for good."""
    t = full_tier
    conn, prefix = _conn(t), t._prefix
    objects = _full(t, 3)
    conn.delete(prefix + "t:t0")
    conn.rpush(prefix + "t:t0", "not a sorted set")
    assert t.remove(objects[0][0].key)
    assert t.remote_counters.ledger_repairs == 1 and t.remote_counters.errors == {}
    info = _ledger_is_consistent(t)
    assert set(info) == {meta.key.hex() for meta, _ in objects[1:]}
    t.refresh_usage(["t0"])
    assert t.used_bytes == 2 * OBJ == t.tenant_bytes("t0")


def test_a_wrong_typed_set_of_a_tenant_with_no_entries_is_found_and_rebuilt(
    full_tier: RemoteTier,
) -> None:
    t = full_tier
    conn, prefix = _conn(t), t._prefix
    _full(t, 2)
    conn.rpush(prefix + "t:newcomer", "not a sorted set")  # no entry, no usage figure names it
    meta, payload = make_object(9, tenant="newcomer")
    assert store(t, meta, payload)
    assert t.remote_counters.ledger_repairs == 1 and t.remote_counters.errors == {}
    assert conn.type(prefix + "t:newcomer") == b"zset"
    assert load_bytes(t, meta.key) == payload
    _ledger_is_consistent(t)


def test_a_wrong_typed_ledger_is_rebuilt_from_the_objects_on_the_server(
    full_tier: RemoteTier,
) -> None:
    """``info`` itself of the wrong type: the entries (sizes, tenants, parents) are lost.
    The repair clears every index and the writer accounts for the objects on the server again
    from their metas, parents first; a meta that is garbage has its bytes deleted. Before,
    every script failed with ``WRONGTYPE`` and the tier refused every store for good."""
    t = full_tier
    conn, prefix = _conn(t), t._prefix
    root, root_payload = _valued(1, 1.0)
    leaf = KVObjectMeta(**{**_valued(2, 5.0)[0].__dict__, "parent": root.key, "position": 1})
    other, other_payload = make_object(3, tenant="t1")
    for meta, payload in ((root, root_payload), (leaf, _valued(2, 5.0)[1]), (other, other_payload)):
        assert store(t, meta, payload)
    torn, hashed = make_object(4)[0], make_object(5)[0]
    conn.set(t.meta_key(torn.key), b"garbage")  # bytes nobody can read: not adopted, deleted
    conn.set(t.data_key(torn.key), b"x" * 16)
    conn.hset(t.meta_key(hashed.key), "not", "a meta")  # nor a meta key of another type
    conn.delete(prefix + "info")
    conn.set(prefix + "info", "not a hash")
    new, new_payload = _valued(10, 100.0)
    assert store(t, new, new_payload)  # repaired, rebuilt, then stored
    assert t.remote_counters.ledger_repairs == 1 and t.remote_counters.errors == {}
    info = _ledger_is_consistent(t)
    assert set(info) == {m.key.hex() for m in (root, leaf, other, new)}
    assert all(rec["st"] == "C" for rec in info.values())
    assert info[leaf.key.hex()]["p"] == root.key.hex()
    assert conn.zscore(prefix + "z", root.key.hex()) >= conn.zscore(prefix + "z", leaf.key.hex())
    assert conn.exists(t.meta_key(torn.key), t.data_key(torn.key), t.meta_key(hashed.key)) == 0
    assert load_bytes(t, other.key) == other_payload and load_bytes(t, root.key) == root_payload
    t.refresh_usage(["t0", "t1"])
    assert t.used_bytes == 4 * OBJ and t.tenant_bytes("t1") == OBJ
    assert t.remove(leaf.key) and t.remove(root.key)  # the adopted entries are whole
    _ledger_is_consistent(t)


def test_a_tenant_deletion_through_a_wrong_typed_ledger_finds_every_object(
    full_tier: RemoteTier,
) -> None:
    t = full_tier
    conn, prefix = _conn(t), t._prefix
    mine = [make_object(i, tenant="t1") for i in range(2)]
    for meta, payload in mine:
        assert store(t, meta, payload)
    conn.delete(prefix + "info")
    conn.rpush(prefix + "info", "not a hash")
    refs = t.objects_of("t1")  # the survey's HSCAN met the wrong type: repaired, asked again
    assert {ref.key for ref in refs} == {meta.key for meta, _ in mine}
    assert t.remote_counters.ledger_repairs == 1
    _ledger_is_consistent(t)


@pytest.mark.parametrize("lost", ["usage", "whole_ledger"])
def test_a_lost_ledger_version_never_goes_back(full_tier: RemoteTier, lost: str) -> None:
    """Objects' generations are ledger versions, and a removal deletes bytes only up to its
    own version. A ledger whose usage figures (with the version) or all of whose keys were lost
    (a failover, an outside ``DEL``) must not count from 1 again: bytes stored before would
    then outrank every later removal and stay on the server for good."""
    t = full_tier
    conn, prefix = _conn(t), t._prefix
    for seed in range(2, 6):  # the ledger's version moves on
        assert store(t, *make_object(seed)) and t.remove(make_object(seed)[0].key)
    meta, payload = make_object(1)
    assert store(t, meta, payload)
    doomed = [prefix + "u"] if lost == "usage" else list(conn.scan_iter(match=prefix + "*"))
    conn.delete(*doomed)
    if lost == "whole_ledger":
        assert store(t, meta, payload)  # the entry went with the ledger: stored again
    assert t.remove(meta.key)
    assert conn.exists(t.meta_key(meta.key), t.data_key(meta.key)) == 0
    t.refresh_usage(["t0"])
    assert t.used_bytes == 0
    _ledger_is_consistent(t)
