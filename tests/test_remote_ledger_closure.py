"""The shared ledger keeps prefixes closed after hits and deep commits, not only at a child's
commit: a parent always outscores its children, so eviction takes leaves and never a prefix
whose blocks are still resident (``bench eviction --remote-writers`` found ~89% of evictions
orphaning children on the Mooncake trace while only the direct parent was lifted on commit).

Scripted scenarios on a real valkey-server; each one fails with the parent-only lift.
"""

from __future__ import annotations

from dataclasses import replace

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.store.value_policy import value_per_byte
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_client import RemoteConfig
from tier_helpers import OBJ, load_bytes, make_object, store


def _object(seed: int, value: float, parent: BlockKey | None = None) -> tuple[KVObjectMeta, bytes]:
    meta, payload = make_object(seed)
    return replace(meta, recompute_s=value, parent=parent), payload


def _tier(server: ValkeyServer, namespace: str, objects: int) -> RemoteTier:
    config = RemoteConfig(url=server.url, namespace=namespace)
    return RemoteTier(config, objects * OBJ, value_of=value_per_byte)


def test_a_hit_on_a_child_lifts_its_prefix(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    tier = _tier(remote_server, remote_namespace, 3)
    try:
        root = _object(1, 1.0)
        child = _object(2, 5.0, parent=root[0].key)
        other = _object(3, 8.0)
        for meta, payload in (root, child, other):
            assert store(tier, meta, payload)
        for _ in range(2):  # child: 3 uses × 5 = 15 > other's 8 > the root's lift at commit
            assert load_bytes(tier, child[0].key) == child[1]
        tier.flush_touches()
        assert store(tier, *_object(4, 100.0))
        assert [key for key, _ in tier.take_evicted()] == [other[0].key]
        assert load_bytes(tier, root[0].key) == root[1]
    finally:
        tier.close()


def test_a_grandchilds_commit_lifts_the_whole_chain(
    remote_server: ValkeyServer, remote_namespace: str
) -> None:
    tier = _tier(remote_server, remote_namespace, 4)
    try:
        root = _object(11, 1.0)
        child = _object(12, 2.0, parent=root[0].key)
        grandchild = _object(13, 10.0, parent=child[0].key)
        other = _object(14, 5.0)
        for meta, payload in (root, child, grandchild, other):
            assert store(tier, meta, payload)
        assert store(tier, *_object(15, 100.0))
        assert [key for key, _ in tier.take_evicted()] == [other[0].key]
        assert store(tier, *_object(16, 100.0))  # now the chain goes, leaf first
        assert [key for key, _ in tier.take_evicted()] == [grandchild[0].key]
    finally:
        tier.close()
