"""The remote tier's tombstones and the deletion survey, on the server (apart from the tier).

A deletion leaves two server keys per deleted block, both holding ``deleted_at`` and expiring
with the tombstone (server TTL = what is left of ``tombstone_ttl_s``):

- ``{ns}:L:x:<key hex>`` in the ledger's hash slot (``remote_ledger``): ``RESERVE`` refuses to
  admit an object of that key created at or before ``deleted_at`` (status ``tombstoned``), so
  a *different* worker's late write-back never even gets room;
- ``ns:{<key hex>}:t`` in the object's slot (``remote_format``): the object write (``WRITE``,
  one script: check, then meta and payload) refuses such an object too, and readers (``MGET``
  of meta, payload and tombstone, one slot) treat a covered object as gone. ``ERASE_OBJECT``
  sets it and deletes the object's keys in one script, so a write that passed its reservation
  before the deletion either lands before the erase (and is erased) or after it (refused).

Objects created after the deletion pass every check: deletion removes data, not a prompt.

``survey`` finds a tenant's objects for a deletion: the ledger's entries of that tenant
(``HSCAN``: pending reservations included, with parents) plus every meta key (``SCAN`` of each
primary), whose metas are read in pipelined batches for the tenant's keys and for objects the
ledger does not know (bytes whose entry was lost): key, parent, creation time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.objects.tombstone import ObjectRef, Tombstone
from kvstrata.tiers.remote_client import RemoteClient, RemoteUnavailable
from kvstrata.tiers.remote_format import (
    data_key,
    decode_meta,
    key_of_meta,
    meta_key,
    meta_pattern,
)

# KEYS: meta, data, tombstone.  ARGV: payload, meta bytes, ttl ms ("" for none), created_at.
# 1: written; 0: a tombstone covers the object (nothing written).
WRITE = r"""
local tomb = redis.call('GET', KEYS[3])
if tomb and tonumber(ARGV[4]) <= tonumber(tomb) then return 0 end
if ARGV[3] == '' then
  redis.call('SET', KEYS[2], ARGV[1])
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
"""

# KEYS: meta, data, tombstone.  ARGV: deleted_at, ttl ms.  Returns the object keys deleted.
ERASE_OBJECT = r"""
local old = tonumber(redis.call('GET', KEYS[3]) or '-1')
if tonumber(ARGV[1]) > old then redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2]) end
return redis.call('DEL', KEYS[1], KEYS[2])
"""


def tomb_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:t"


def ttl_ms(mark: Tombstone, now: float) -> int:
    return max(1, int((mark.expires_at - now) * 1000))


def buried(meta: KVObjectMeta, raw_tomb: object) -> bool:
    """Does the object-slot tombstone read with ``meta`` cover it?"""
    if not isinstance(raw_tomb, bytes | str):
        return False
    try:
        deleted_at = float(raw_tomb)
    except ValueError:
        return False
    return meta.created_at <= deleted_at


def survey(client: RemoteClient, namespace: str, info_key: str, tenant: str) -> list[ObjectRef]:
    """Every object of ``tenant`` on the server (see the module docstring). I/O; raises
    ``RemoteUnavailable`` when a node does not answer."""
    ledger: dict[str, object] = client.call(
        client.node_of(info_key), lambda conn: dict(conn.hscan_iter(info_key, count=1000))
    )
    refs: dict[BlockKey, ObjectRef] = {}
    known: set[BlockKey] = set()
    for raw_key, raw in ledger.items():
        key = BlockKey(bytes.fromhex(_text(raw_key)))
        known.add(key)
        try:
            rec = json.loads(_text(raw))
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("t") == tenant:
            parent = str(rec.get("p") or "")
            refs[key] = ObjectRef(key, BlockKey(bytes.fromhex(parent)) if parent else None, tenant)
    pattern = meta_pattern(namespace)
    names: list[str] = []
    for node in client.nodes():
        found = client.call(node, lambda conn: list(conn.scan_iter(match=pattern, count=1000)))
        names += [_text(name) for name in found]
    wanted = {
        name: key
        for name in names
        if (key := key_of_meta(namespace, name)) in refs or key not in known
    }
    replies = client.pipelined(list(wanted), lambda pipe, name: pipe.get(name))
    for name, reply in replies.items():
        if isinstance(reply, RemoteUnavailable):
            raise reply
        key = wanted[name]
        meta = decode_meta(reply, key) if isinstance(reply, bytes) else None
        if meta is not None and meta.tenant == tenant:
            refs[key] = ObjectRef(key, meta.parent, tenant, meta.created_at)
    return list(refs.values())


def erase_objects(
    client: RemoteClient, namespace: str, marks: Sequence[Tombstone], now: float, script: object
) -> dict[BlockKey, int]:
    """Set the object-slot tombstones of ``marks`` and delete their objects (pipelined per
    shard); object keys deleted per key. Raises ``RemoteUnavailable`` when a shard fails."""
    by_name = {meta_key(namespace, m.key): m for m in marks}

    def build(pipe: object, name: str) -> None:
        mark = by_name[name]
        keys = [name, data_key(namespace, mark.key), tomb_key(namespace, mark.key)]
        script(keys=keys, args=[repr(mark.deleted_at), ttl_ms(mark, now)], client=pipe)  # type: ignore[operator]

    replies = client.pipelined(list(by_name), build)
    out: dict[BlockKey, int] = {}
    for name, reply in replies.items():
        if isinstance(reply, RemoteUnavailable):
            raise reply
        out[by_name[name].key] = int(reply)
    return out


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
