"""The remote tier when a removal or an eviction races a store of the same key.

The ledger and an object live on different slots, so a writer drops an entry (one script on
the ledger) and deletes its bytes (one on the object's slot) in two steps. Another writer can
store the key again in between. Its bytes must survive the first writer's delete: the ledger
accounts for them; and a writer whose write arrives after its entry was evicted and the key
stored again must not overwrite or orphan the later object. Each race is forced here by
running the other writers' whole calls inside one writer's step (its delete, its write),
against the real ``valkey-server`` of the ``remote_server`` fixture, each test in its own
namespace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_format import data_key, gen_key, meta_key
from kvstrata.tiers.remote_tombstones import DROP_OBJECT, WRITE, tomb_key
from tier_helpers import OBJ, load_bytes, make_object, remote_tier_on, store


@pytest.fixture
def writers(remote_server: ValkeyServer, remote_namespace: str) -> Iterator[list[RemoteTier]]:
    """Three writers of one namespace: ``a`` holds two objects, ``b`` and ``c`` hold 64."""
    tiers = [
        remote_tier_on(remote_server.url, remote_namespace, 2 * OBJ),
        remote_tier_on(remote_server.url, remote_namespace),
        remote_tier_on(remote_server.url, remote_namespace),
    ]
    yield tiers
    for tier in tiers:
        tier.close()


def _before(tier: RemoteTier, method: str, step: Callable[[], None]) -> list[bool]:
    """Run ``step`` once, right before ``tier`` next calls its ``method`` (then the method).
    Returns a list that holds True once it ran: a test asserts it, or a race that never
    happened would pass unseen."""
    original = getattr(tier, method)
    ran: list[bool] = []

    def hooked(*args: Any) -> Any:
        setattr(tier, method, original)
        step()
        ran.append(True)
        return original(*args)

    setattr(tier, method, hooked)
    return ran


def _before_delete(tier: RemoteTier, step: Callable[[], None]) -> list[bool]:
    """Run ``step`` right before ``tier`` deletes object keys (after its ledger call)."""
    return _before(tier, "_delete_objects", step)


def _loads(tier: RemoteTier, meta: KVObjectMeta) -> bytes | None:
    """What ``tier`` loads of ``meta`` after a probe of the server."""
    tier.probe([meta.key])
    return load_bytes(tier, meta.key)


def test_a_store_racing_a_removal_keeps_its_bytes(writers: list[RemoteTier]) -> None:
    a, b, c = writers
    meta, payload = make_object(1)
    assert store(a, meta, payload)
    raced = _before_delete(a, lambda: _stored(b, meta, payload))  # b stores it again meanwhile
    assert a.remove(meta.key) and raced
    assert b.meta(meta.key) == meta
    assert _loads(c, meta) == payload and _loads(b, meta) == payload
    c.refresh_usage(["t0"])
    assert c.used_bytes == OBJ and c.object_count == 1
    assert c.remove(meta.key) and c.used_bytes == 0
    assert _loads(b, meta) is None


def test_a_store_racing_an_eviction_keeps_its_bytes(writers: list[RemoteTier]) -> None:
    a, b, c = writers
    objects = [make_object(i) for i in range(3)]
    (m0, p0), (m1, p1), (m2, p2) = objects
    assert store(a, m0, p0) and store(a, m1, p1)
    # a's third object evicts one of the first two (equal value: the older goes); b stores
    # that victim again between a's ledger call and a's delete of the victim's bytes
    restored: list[KVObjectMeta] = []

    def restore() -> None:
        for meta, payload in objects[:2]:
            if not _in_ledger(b, meta):
                assert store(b, meta, payload)
                restored.append(meta)

    raced = _before_delete(a, restore)
    assert store(a, m2, p2) and raced
    assert [key for key, _ in a.take_evicted()] == [meta.key for meta in restored]
    assert _loads(c, restored[0]) == dict(objects)[restored[0]]
    c.refresh_usage(["t0"])
    assert c.used_bytes == 3 * OBJ and c.object_count == 3


def test_a_late_write_after_an_eviction_and_a_restore_leaves_nothing_unaccounted(
    writers: list[RemoteTier],
) -> None:
    """``b`` commits, then ``a``'s admissions evict the entry and ``c`` stores the key again,
    all before ``b``'s write arrives: ``b``'s write keeps ``c``'s later generation, and the one
    object left is ``c``'s entry's, removed whole."""
    a, b, c = writers
    meta, payload = make_object(1)
    slot = b.prepare_store(meta)
    assert slot is not None
    slot.buffer[:] = payload

    def evict_and_restore() -> None:
        for seed in (2, 3):  # a holds two objects: the second admission evicts the oldest
            assert store(a, *make_object(seed))
        assert not _in_ledger(a, meta)
        assert store(c, meta, payload)

    raced = _before(b, "_write_object", evict_and_restore)
    assert b.complete_store(slot, True) and raced  # the ledger holds the key (c's): stored
    assert _loads(b, meta) == payload and _loads(a, meta) == payload
    assert c.remove(meta.key)
    conn = c.client.single
    assert conn is not None
    assert conn.exists(c.meta_key(meta.key), c.data_key(meta.key)) == 0
    assert _loads(b, meta) is None


def _stored(tier: RemoteTier, meta: KVObjectMeta, payload: bytes) -> None:
    assert store(tier, meta, payload)


def _in_ledger(tier: RemoteTier, meta: KVObjectMeta) -> bool:
    """Whether the shared ledger holds ``meta`` (asked on the server, not the local view)."""
    conn = tier.client.single
    assert conn is not None
    return bool(conn.hexists(tier._ledger_key, meta.key.hex()))


# ------------------------------------------------------------------ the object-slot scripts


def _object_keys(ns: str, key: BlockKey) -> tuple[str, str, str, str]:
    return meta_key(ns, key), data_key(ns, key), tomb_key(ns, key), gen_key(ns, key)


def test_write_never_takes_a_generation_back_and_drop_spares_later_ones(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    conn = redis.Redis.from_url(remote_server.url)
    write, drop = conn.register_script(WRITE), conn.register_script(DROP_OBJECT)
    mkey, dkey, tkey, gkey = _object_keys(remote_namespace, BlockKey(b"\x07" * 32))
    try:
        assert write(keys=[mkey, dkey, tkey, gkey], args=[b"new", b"m", "", "1.0", "9"]) == 1
        # an older store's write arrives late: it reports written, and leaves the later bytes
        assert write(keys=[mkey, dkey, tkey, gkey], args=[b"old", b"m", "", "1.0", "5"]) == 1
        assert conn.mget(dkey, gkey) == [b"new", b"9"]
        assert drop(keys=[mkey, dkey, gkey], args=["8"]) == 0  # left at 8: generation 9 stays
        assert conn.exists(mkey, dkey, gkey) == 3
        assert drop(keys=[mkey, dkey, gkey], args=["9"]) == 3
        # bytes without a readable generation (written before generations, or garbage) go
        conn.set(mkey, b"m")
        conn.set(dkey, b"d")
        conn.set(gkey, b"not a number")
        assert drop(keys=[mkey, dkey, gkey], args=["1"]) == 3
        conn.set(mkey, b"m")
        conn.set(dkey, b"d")
        assert drop(keys=[mkey, dkey, gkey], args=["1"]) == 2
        conn.set(gkey, b"99")  # "": whatever the generation (a corrupt object)
        assert drop(keys=[mkey, dkey, gkey], args=[""]) == 1
    finally:
        conn.close()
