"""The remote tier's ledger under in-flight reservations, stalled writers, timeouts and bytes
no entry accounts for (a review's findings, each reproduced on a real valkey-server).

- An admission that cannot free enough room — PENDING bytes are not evictable — evicts nothing,
  for the capacity and for a tenant's quota; nor does it ever evict the new key's prefix.
- Ledger entries have owners: a writer that stalled past ``pending_timeout_s`` cannot drop the
  entry of the writer that took the key over; a reader that found corrupt bytes cannot drop a
  later store's reservation; bytes written beside another writer's reservation are deleted.
- A call that timed out is never sent again (it may have run), and a store that failed in an
  unknown state can be tried again at once; a failed write leaves no bytes without an entry.
- A read never serves bytes the ledger does not account for, and deletes them.

Every test runs against real ``valkey-server`` processes: the session's ``remote_server`` or
``remote_cluster`` in its own namespace, or (when it stalls the server) one of its own.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.valkey_server import ValkeyCluster, ValkeyServer
from kvstrata.store.value_policy import value_per_byte
from kvstrata.tiers.base import TierError
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from kvstrata.tiers.remote_ledger import COMMIT, LedgerReply
from kvstrata.tiers.remote_ledger_admit import RESERVE
from tier_helpers import OBJ, FakeClock, load_bytes, make_object, store


def _tier(config: RemoteConfig, objects: int, **kw: Any) -> RemoteTier:
    return RemoteTier(config, objects * OBJ, **kw)


def _object(seed: int, value: float, parent: BlockKey | None = None) -> tuple[KVObjectMeta, bytes]:
    meta, payload = make_object(seed)
    return replace(meta, recompute_s=value, parent=parent), payload


def _entry(tier: RemoteTier, key: BlockKey) -> dict[str, Any] | None:
    raw = tier.client.call(tier.ledger_node, lambda c: c.hget(tier._ledger_key, key.hex()))
    return None if raw is None else dict(json.loads(raw))


def _bytes_on_server(tier: RemoteTier, key: BlockKey) -> int:
    """How many of the object's meta and payload keys the server holds."""
    mkey, dkey = tier.meta_key(key), tier.data_key(key)
    return int(tier.client.call(tier.client.node_of(mkey), lambda c: c.exists(mkey, dkey)))


def _before(tier: RemoteTier, method: str, step: Callable[[], None]) -> None:
    """Run ``step`` once, right before ``tier`` next calls its ``method`` (then the method)."""
    original = getattr(tier, method)

    def hooked(*args: Any, **kw: Any) -> Any:
        setattr(tier, method, original)
        step()
        return original(*args, **kw)

    setattr(tier, method, hooked)


def _fail_next_delete(tier: RemoteTier) -> None:
    """``tier``'s next deletion of object keys fails, as if their shard did not answer."""
    original = tier._delete_objects

    def failing(*args: Any) -> bool:
        tier._delete_objects = original  # type: ignore[method-assign]
        return False

    tier._delete_objects = failing  # type: ignore[method-assign]


@pytest.fixture(params=["single", "cluster"])
def config(
    request: pytest.FixtureRequest, remote_server: ValkeyServer, remote_namespace: str
) -> RemoteConfig:
    if request.param == "single":
        return RemoteConfig(url=remote_server.url, namespace=remote_namespace)
    cluster: ValkeyCluster = request.getfixturevalue("remote_cluster")
    return RemoteConfig(cluster=cluster.seeds, namespace=remote_namespace)


@pytest.fixture
def single(remote_server: ValkeyServer, remote_namespace: str) -> RemoteConfig:
    return RemoteConfig(url=remote_server.url, namespace=remote_namespace)


# ------------------------------------------------------------------ admission evicts whole


def test_a_reservation_that_cannot_fit_beside_pending_ones_evicts_nothing(
    single: RemoteConfig,
) -> None:
    t = _tier(single, 10)
    try:
        objects = [make_object(i) for i in range(1, 7)]
        for meta, payload in objects:
            assert store(t, meta, payload)
        slots = [t.prepare_store(make_object(100 + i)[0]) for i in range(3)]  # in flight
        big = make_object(999, size=8 * OBJ)[0]  # fits the tier, not beside 3 pending
        assert t.prepare_store(big) is None
        assert t.remote_counters.refused == {"no_room": 1}
        assert t.remote_counters.evicted == {}
        assert all(load_bytes(t, meta.key) == payload for meta, payload in objects)
        for slot in slots:
            assert slot is not None
            t.complete_store(slot, False)
        assert t.prepare_store(big) is not None  # the reservations went: now it evicts
        assert t.remote_counters.evicted == {"value": 4}
    finally:
        t.close()


def test_a_quota_that_cannot_be_met_beside_pending_ones_evicts_nothing(
    single: RemoteConfig,
) -> None:
    t = _tier(single, 100, quota_of=lambda tenant: 10 * OBJ)
    try:
        objects = [make_object(i) for i in range(1, 7)]
        for meta, payload in objects:
            assert store(t, meta, payload)
        slots = [t.prepare_store(make_object(100 + i)[0]) for i in range(3)]
        assert all(slot is not None for slot in slots)
        assert t.prepare_store(make_object(999, size=8 * OBJ)[0]) is None
        assert t.remote_counters.refused == {"quota": 1}
        assert t.remote_counters.evicted == {}
        assert all(load_bytes(t, meta.key) == payload for meta, payload in objects)
    finally:
        t.close()


def test_an_admission_never_evicts_the_new_keys_prefix(single: RemoteConfig) -> None:
    t = _tier(single, 2, value_of=value_per_byte)
    try:
        root, other = _object(1, 1.0), _object(2, 10.0)
        child = _object(3, 1.0, parent=root[0].key)
        for meta, payload in (root, other):
            assert store(t, meta, payload)
        assert store(t, *child)  # the root scores lowest, but the child would be an orphan
        assert [key for key, _ in t.take_evicted()] == [other[0].key]
        assert load_bytes(t, root[0].key) == root[1]
        assert load_bytes(t, child[0].key) == child[1]
    finally:
        t.close()


def test_a_chain_is_kept_whole_or_the_new_leaf_is_refused(single: RemoteConfig) -> None:
    t = _tier(single, 3, value_of=value_per_byte)
    try:
        root = _object(1, 1.0)
        mid = _object(2, 1.0, parent=root[0].key)
        other = _object(3, 10.0)
        for meta, payload in (root, mid, other):
            assert store(t, meta, payload)
        leaf = _object(4, 1.0, parent=mid[0].key)
        assert store(t, *leaf)  # mid, then the root score lowest: both are its prefix
        assert [key for key, _ in t.take_evicted()] == [other[0].key]
        for meta, payload in (root, mid, leaf):
            assert load_bytes(t, meta.key) == payload
        second = _object(5, 1.0, parent=leaf[0].key)
        assert t.prepare_store(second[0]) is None  # only its own prefix could make room
        assert t.remote_counters.refused == {"no_room": 1}
        assert t.take_evicted() == []
    finally:
        t.close()


# ------------------------------------------------------------------ owned ledger entries


def test_a_stalled_writers_abort_leaves_the_new_owners_entry(single: RemoteConfig) -> None:
    clock = FakeClock()
    a, b, c = (_tier(single, 64, clock=clock) for _ in range(3))
    try:
        meta, payload = make_object(7)
        slot = a.prepare_store(meta)  # a reserves, then stalls past pending_timeout_s
        assert slot is not None
        clock.now += single.pending_timeout_s + 1
        assert store(b, meta, payload)  # b's admission sweeps a's stale entry and stores it
        a.complete_store(slot, False)  # a gives up: it must not drop b's entry
        entry = _entry(b, meta.key)
        assert entry is not None and entry["st"] == "C"
        b.refresh_usage()
        assert b.used_bytes == OBJ and b.object_count == 1
        for seed in range(100, 164):  # b's object is evicted like any other
            assert store(c, *make_object(seed))
        assert load_bytes(c, meta.key) is None and _bytes_on_server(c, meta.key) == 0
    finally:
        for t in (a, b, c):
            t.close()


def test_a_late_write_beside_another_writers_reservation_is_deleted(
    single: RemoteConfig,
) -> None:
    """``b`` commits; ``a``'s admissions evict the entry and ``c`` reserves the key before
    ``b``'s write arrives. ``c``'s pending entry does not account for ``b``'s bytes: ``b``
    deletes them, and once ``c`` gives up nothing of the key is left."""
    a, b, c = _tier(single, 2), _tier(single, 64), _tier(single, 64)
    try:
        meta, payload = make_object(1)
        slot = b.prepare_store(meta)
        assert slot is not None
        slot.buffer[:] = payload
        later: list[Any] = []

        def evict_and_reserve() -> None:
            for seed in (2, 3):  # a holds two objects: the second admission evicts b's
                assert store(a, *make_object(seed))
            assert _entry(a, meta.key) is None
            later.append(c.prepare_store(meta))

        _before(b, "_write_object", evict_and_reserve)
        assert not b.complete_store(slot, True)
        assert b.remote_counters.refused == {"evicted_in_flight": 1}
        assert later[0] is not None
        c.complete_store(later[0], False)
        assert _entry(c, meta.key) is None
        assert _bytes_on_server(c, meta.key) == 0
    finally:
        for t in (a, b, c):
            t.close()


def test_a_reader_invalidating_corrupt_bytes_keeps_a_later_reservation(
    single: RemoteConfig,
) -> None:
    a, reader, w = (_tier(single, 64) for _ in range(3))
    try:
        meta, payload = make_object(1)
        assert store(a, meta, payload)
        data = a.data_key(meta.key)
        a.client.call("single", lambda c: c.setrange(data, 100, bytes([payload[100] ^ 0xFF])))
        later: list[Any] = []

        def remove_and_reserve() -> None:  # between the reader's read and its invalidation
            assert a.remove(meta.key)
            later.append(w.prepare_store(meta))

        _before(reader, "_invalidate", remove_and_reserve)
        assert load_bytes(reader, meta.key) is None
        assert reader.counters.invalidated == 1
        assert later[0] is not None
        later[0].buffer[:] = payload
        assert w.complete_store(later[0], True)  # its reservation was not the reader's to drop
        assert load_bytes(reader, meta.key) == payload
    finally:
        for t in (a, reader, w):
            t.close()


def test_a_resent_reservation_or_commit_changes_nothing(single: RemoteConfig) -> None:
    from kvstrata.tiers.remote_ledger import commit_generation
    from kvstrata.tiers.remote_ledger_admit import new_owner, reserve_args

    t = _tier(single, 64)
    try:
        meta, _ = make_object(1)
        owner, other = new_owner(), new_owner()
        args = reserve_args(
            t._prefix, meta, value=0.0, quota=None, capacity=64 * OBJ, now=1000.0,
            pending_timeout_s=30.0, owner=owner,
        )  # fmt: skip
        assert args is not None
        assert [t._script("reserve", args).status for _ in range(2)] == ["ok", "ok"]
        assert t._script("reserve", [*args[:-1], other]).status == "exists"
        commit = [t._prefix, meta.key.hex(), "1000.0"]
        assert t._script("commit", [*commit, other]).status == "gone"
        first, again = (t._script("commit", [*commit, owner]) for _ in range(2))
        assert first.status == again.status == "ok"
        assert commit_generation(first) == commit_generation(again)
        release = [t._prefix, "1000.0", meta.key.hex()]
        assert t._script("release", [*release, other, ""]).extra == [0]  # not its owner
        assert t._script("release", [*release, owner, "P"]).extra == [0]  # committed now
        t.refresh_usage()
        assert t.used_bytes == OBJ and t.object_count == 1
        assert t._script("release", [*release, owner, ""]).extra == [1]
        t.refresh_usage()
        assert t.used_bytes == 0
    finally:
        t.close()


# ------------------------------------------------------------------ bytes no entry accounts for


def test_unaccounted_bytes_are_never_served_and_a_read_deletes_them(
    config: RemoteConfig,
) -> None:
    writer, reader = _tier(config, 2), _tier(config, 64)
    try:
        objects = [make_object(i) for i in range(1, 4)]
        lost, kept = objects[0], objects[1]
        for meta, payload in objects[:2]:
            assert store(writer, meta, payload)
        _fail_next_delete(writer)  # the victim's bytes stay on the server, its entry goes
        assert store(writer, *objects[2])
        assert [key for key, _ in writer.take_evicted()] == [lost[0].key]
        assert _bytes_on_server(reader, lost[0].key) == 2
        reader.read_ahead([lost[0].key, kept[0].key])
        assert load_bytes(reader, kept[0].key) == kept[1]  # read ahead and served
        assert load_bytes(reader, lost[0].key) is None
        assert _bytes_on_server(reader, lost[0].key) == 0
        assert reader.remote_counters.evicted == {"unaccounted": 1}
        assert store(reader, *lost)  # a new store of the key is served
        assert load_bytes(reader, lost[0].key) == lost[1]
    finally:
        writer.close()
        reader.close()


def test_bytes_beside_a_pending_reservation_are_dropped_and_its_store_served(
    single: RemoteConfig,
) -> None:
    writer, reader, w = _tier(single, 1), _tier(single, 64), _tier(single, 64)
    try:
        (meta, payload), other = make_object(1), make_object(2)
        assert store(writer, meta, payload)
        _fail_next_delete(writer)
        assert store(writer, *other)  # evicts meta; its bytes stay
        slot = w.prepare_store(meta)  # a new store of the key, not committed yet
        assert slot is not None
        assert load_bytes(reader, meta.key) is None
        assert _bytes_on_server(reader, meta.key) == 0
        slot.buffer[:] = payload
        assert w.complete_store(slot, True)
        assert load_bytes(reader, meta.key) == payload
    finally:
        for t in (writer, reader, w):
            t.close()


# ------------------------------------------------------------------ timeouts are not re-sent


@pytest.fixture(scope="module")
def own_server() -> Iterator[ValkeyServer]:
    """A server of these tests alone: they stall it (``DEBUG SLEEP``)."""
    server = ValkeyServer(extra=("--enable-debug-command", "yes")).start()
    yield server
    server.stop()


STALL_S = 2.0  # the tier's timeout (0.5 s) + the probe's (0.15 s) + slack for a loaded box


@contextlib.contextmanager
def _stalled(server: ValkeyServer, seconds: float) -> Iterator[None]:
    """The server sleeps for ``seconds``: every other call waits meanwhile (and runs after
    it, also one whose caller timed out). Returns once it is over."""
    staller = redis.Redis.from_url(server.url, socket_timeout=seconds + 10)
    busy = threading.Thread(target=staller.execute_command, args=("DEBUG", "SLEEP", seconds))
    # A probe unanswered for 0.15 s: the server sleeps (a loaded box can delay a healthy reply
    # that long only rarely; the stalls below leave the tier's 0.5 s timeout a second of slack
    # after it).
    probe = redis.Redis.from_url(server.url, socket_timeout=0.15, retry=Retry(NoBackoff(), 0))
    busy.start()
    try:
        deadline = time.monotonic() + 5.0
        while True:  # until a ping goes unanswered: the server sleeps
            assert time.monotonic() < deadline, "the server never stalled"
            try:
                probe.ping()
            except redis.TimeoutError:
                break
        yield
    finally:
        busy.join()
        probe.close()
        staller.close()


def _stall_during(
    tier: RemoteTier, method: str, server: ValkeyServer, seconds: float, name: str | None = None
) -> None:
    """``tier``'s next call of ``method`` (of script ``name``) meets a stalled server."""
    original = getattr(tier, method)

    def hooked(*args: Any) -> Any:
        if name is not None and args[0] != name:
            return original(*args)
        setattr(tier, method, original)
        with _stalled(server, seconds):
            return original(*args)

    setattr(tier, method, hooked)


@pytest.fixture
def patient(own_server: ValkeyServer, remote_namespace: str) -> Iterator[RemoteTier]:
    config = RemoteConfig(
        url=own_server.url, namespace=remote_namespace, timeout_s=0.5, breaker_failures=100
    )
    t = _tier(config, 64)
    assert store(t, *make_object(50))  # scripts loaded
    yield t
    t.close()


def test_a_timed_out_commit_is_not_sent_again_and_the_key_stores_at_once(
    patient: RemoteTier, own_server: ValkeyServer
) -> None:
    meta, payload = make_object(2)
    slot = patient.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    _stall_during(patient, "_run_script", own_server, STALL_S, name="commit")
    with pytest.raises(TierError, match="committing"):
        patient.complete_store(slot, True)
    assert patient.remote_counters.refused == {}
    assert store(patient, meta, payload)  # the same store again: not held by a phantom
    assert load_bytes(patient, meta.key) == payload
    patient.refresh_usage()
    assert patient.used_bytes == 2 * OBJ and patient.object_count == 2


def test_a_timed_out_reservation_is_not_sent_again_and_the_key_stores_at_once(
    patient: RemoteTier, own_server: ValkeyServer
) -> None:
    meta, payload = make_object(3)
    _stall_during(patient, "_run_script", own_server, STALL_S, name="reserve")
    with pytest.raises(TierError):
        patient.prepare_store(meta)
    assert patient.remote_counters.refused == {}
    entry = _entry(patient, meta.key)
    assert entry is None or entry["st"] == "P"  # it runs once, after its caller gave up
    assert store(patient, meta, payload)  # the same reservation, taken up again
    assert load_bytes(patient, meta.key) == payload
    patient.refresh_usage()
    assert patient.used_bytes == 2 * OBJ and patient.object_count == 2


def test_a_timed_out_write_leaves_no_bytes_without_an_entry(
    patient: RemoteTier, own_server: ValkeyServer
) -> None:
    meta, payload = make_object(1)
    slot = patient.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload
    _stall_during(patient, "_write_object", own_server, STALL_S + 0.5)
    with pytest.raises(TierError, match="writing"):
        patient.complete_store(slot, True)
    entry = _entry(patient, meta.key)
    on_server = _bytes_on_server(patient, meta.key)
    assert on_server == 0 or (entry is not None and entry["st"] == "C")
    other = _tier(patient.config, 64)
    try:
        assert load_bytes(other, meta.key) in (None, payload)
        assert _bytes_on_server(other, meta.key) == 0 or _entry(other, meta.key) is not None
    finally:
        other.close()


def test_garbage_parent_links_in_a_cycle_do_not_hang_the_server(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    """Content-hash keys cannot form a cycle, but foreign or garbage entries can; a commit's
    lift up the chain used to loop for ever (the server answering BUSY to everyone)."""
    conn = redis.Redis.from_url(remote_server.url, socket_timeout=5)  # old code: a timeout
    prefix = f"{{{remote_namespace}}}:L:"
    info = prefix + "info"
    reserve, commit = conn.register_script(RESERVE), conn.register_script(COMMIT)

    def reserved(key: str, parent: str) -> bytes:
        args = [prefix, key, 10, "t", "1.0", -1, 10**9, "1.0", "31.0", -1, parent, "0.0", "aa"]
        return reserve(keys=[info], args=args)  # type: ignore[no-any-return]

    a, b = f"{1:016x}", f"{2:016x}"
    assert LedgerReply.parse(reserved(a, b)).status == "ok"
    assert LedgerReply.parse(commit(keys=[info], args=[prefix, a, "1.0", "aa"])).status == "ok"
    assert LedgerReply.parse(reserved(b, a)).status == "ok"
    assert LedgerReply.parse(commit(keys=[info], args=[prefix, b, "1.0", "aa"])).status == "ok"
    assert conn.ping()
