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

Objects created after the deletion pass every check: deletion removes data, not a prompt. A
tombstone that is not a finite number (garbage, a wrong-typed key) covers every object of its key
(``TOMB_LUA``), and a deletion replaces it; no script fails on it.

``survey`` finds a tenant's objects for a deletion: the ledger's entries of that tenant
(``HSCAN``: pending reservations included, with parents) plus every meta key (``SCAN`` of each
primary), whose metas are read in pipelined batches for the tenant's keys and for objects the
ledger does not know (bytes whose entry was lost): key, parent, creation time. Names the tier
did not write (a ``ns:{backup}:m``, a ledger field that is no key hex) are skipped and counted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta
from kvstrata.objects.tombstone import ObjectRef, Tombstone
from kvstrata.tiers.remote_client import RemoteClient, RemoteUnavailable
from kvstrata.tiers.remote_format import (
    data_key,
    decode_meta,
    gen_key,
    key_of_hex,
    key_of_meta,
    meta_key,
    meta_pattern,
)

# A tombstone is a number (deleted_at). One that cannot be read — garbage, NaN, a key of another
# type — still marks a deletion whose time is unknown, so it covers every object of its key
# (``buried``): refusing a cache entry costs a recompute, resurrecting deleted data is what a
# tombstone exists to prevent. It goes with its server TTL or when a deletion replaces it.
# ``TOMB_LUA`` is that rule for the scripts (the object slot's ``WRITE``, the ledger's
# ``RESERVE``); ``buried`` is the same rule for readers.
TOMB_LUA = r"""
local function finite(x)
  return type(x) == 'number' and x == x and x ~= math.huge and x ~= -math.huge
end
-- deleted_at of a tombstone read with redis.pcall('GET'): nil when absent (false), or when
-- it is garbage (a string that is no finite number, an error reply of a wrong-typed key).
local function deleted_at(raw)
  if type(raw) ~= 'string' then return nil end
  local x = tonumber(raw)
  if finite(x) then return x end
  return nil
end
-- Does the tombstone `raw` (read with redis.pcall('GET')) cover an object created at
-- `created`? Absent: no. Otherwise yes, unless both are finite and created > deleted_at.
local function covers(raw, created)
  if raw == false then return false end
  local deleted = deleted_at(raw)
  return not (deleted and finite(created) and created > deleted)
end
"""

# Reads the generation key of an object (``remote_format``): its commit's ledger version, or
# nil when it is absent or garbage, ``inf`` included (garbage never protects bytes). Needs
# ``TOMB_LUA``'s ``finite``.
GEN_LUA = r"""
local function generation(key)
  local raw = redis.pcall('GET', key)
  if type(raw) ~= 'string' then return nil end
  local x = tonumber(raw)
  if finite(x) then return x end
  return nil
end
"""

# KEYS: meta, data, tombstone, generation.  ARGV: payload, meta bytes, ttl ms ("" for none),
# created_at, generation (the ledger version of this store's commit).
# 1: written, or the whole object of a later commit of the same key is there already (it
# stands: the same key names the same content, and the generation never goes back); 0: a
# tombstone covers the object (nothing written): one at or after its creation, or one that
# cannot be read (see ``TOMB_LUA``), never a script error.
WRITE = (
    TOMB_LUA
    + GEN_LUA
    + r"""
if covers(redis.pcall('GET', KEYS[3]), tonumber(ARGV[4])) then return 0 end
local there = generation(KEYS[4])
if there and there > tonumber(ARGV[5]) and redis.call('EXISTS', KEYS[1], KEYS[2]) == 2 then
  return 1
end
if ARGV[3] == '' then
  redis.call('SET', KEYS[2], ARGV[1])
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[4], ARGV[5])
else
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3])
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  redis.call('SET', KEYS[4], ARGV[5], 'PX', ARGV[3])
end
return 1
"""
)

# KEYS: meta, data, generation.  ARGV: the ledger version at which the entry left (a removal,
# an eviction), or "" for any generation.  Deletes the object's keys unless their generation
# is later: a store of the same key committed after the entry left wrote them, and its own
# entry accounts for them. Returns the keys deleted.
DROP_OBJECT = (
    TOMB_LUA
    + GEN_LUA
    + r"""
local there = generation(KEYS[3])
if ARGV[1] ~= '' and there and there > tonumber(ARGV[1]) then return 0 end
return redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
"""
)

# KEYS: meta, data, tombstone, generation.  ARGV: deleted_at, ttl ms.  Returns how many of meta
# and payload were deleted (a deletion removes every generation).
# A later deletion extends the tombstone; one that cannot be read is replaced. A deleted_at
# that is no finite number (the caller checks) leaves the tombstone as it is.
ERASE_OBJECT = (
    TOMB_LUA
    + r"""
local old, deleted = deleted_at(redis.pcall('GET', KEYS[3])), tonumber(ARGV[1])
if finite(deleted) and (not old or deleted > old) then
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
end
redis.call('DEL', KEYS[4])
return redis.call('DEL', KEYS[1], KEYS[2])
"""
)


def tomb_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:t"


def ttl_ms(mark: Tombstone, now: float) -> int:
    return max(1, int((mark.expires_at - now) * 1000))


def buried(meta: KVObjectMeta, raw_tomb: object) -> bool:
    """Does the object-slot tombstone read with ``meta`` cover it? None (no tombstone) does
    not; one created at or after ``meta``, or one that is not a finite number, does — the
    rule ``WRITE`` applies (see ``TOMB_LUA``). (A tombstone key of the wrong type reads as None
    in an ``MGET``: ``WRITE`` refuses new objects beside it, a reader cannot tell.)"""
    if raw_tomb is None:
        return False
    try:
        deleted_at = float(raw_tomb)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return not (math.isfinite(deleted_at) and meta.created_at > deleted_at)


@dataclass
class SurveyResult:
    """A tenant's objects, and how many names were skipped as not the tier's (a ledger field or
    a parent that is no key hex, a ``ns:{*}:m`` key that is no meta key)."""

    refs: list[ObjectRef]
    foreign: int = 0


def survey(client: RemoteClient, namespace: str, info_key: str, tenant: str) -> SurveyResult:
    """Every object of ``tenant`` on the server (see the module docstring). Names the tier did
    not write are skipped and counted, never fatal: one foreign key must not stop a deletion.
    I/O; raises ``RemoteUnavailable`` when a node does not answer."""
    ledger: dict[str, object] = client.call(
        client.node_of(info_key), lambda conn: dict(conn.hscan_iter(info_key, count=1000))
    )
    refs: dict[BlockKey, ObjectRef] = {}
    known: set[BlockKey] = set()
    foreign = 0
    for raw_key, raw in ledger.items():
        key = key_of_hex(_text(raw_key))
        if key is None:
            foreign += 1
            continue
        known.add(key)
        try:
            rec = json.loads(_text(raw))
        except ValueError:  # UnicodeDecodeError too: the ledger's next call drops the entry
            continue
        if isinstance(rec, dict) and rec.get("t") == tenant:
            parent_hex = rec.get("p") or ""
            parent = key_of_hex(parent_hex) if isinstance(parent_hex, str) else None
            if parent_hex and parent is None:
                foreign += 1
            refs[key] = ObjectRef(key, parent, tenant)
    named, skipped = meta_keys(client, namespace)
    foreign += skipped
    wanted = {name: key for name, key in named.items() if key in refs or key not in known}
    for key, meta in read_metas(client, wanted).items():
        if meta is not None and meta.tenant == tenant:
            refs[key] = ObjectRef(key, meta.parent, tenant, meta.created_at)
    return SurveyResult(list(refs.values()), foreign)


def read_metas(
    client: RemoteClient, names: dict[str, BlockKey]
) -> dict[BlockKey, KVObjectMeta | None]:
    """The meta under each name (None: garbage, torn, another key's, or a key of another
    type — an ``MGET`` reads that as absent, where a ``GET`` would fail the whole pipeline).
    Pipelined per shard; raises ``RemoteUnavailable`` when a shard fails."""
    out: dict[BlockKey, KVObjectMeta | None] = {}
    for name, reply in client.pipelined(list(names), lambda pipe, name: pipe.mget(name)).items():
        if isinstance(reply, RemoteUnavailable):
            raise reply
        raw, key = reply[0], names[name]
        out[key] = decode_meta(raw, key) if isinstance(raw, bytes) else None
    return out


def meta_keys(client: RemoteClient, namespace: str) -> tuple[dict[str, BlockKey], int]:
    """Every meta key on the server (a ``SCAN`` of each primary) by name, and how many names
    ``meta_pattern`` matched that are no meta key of the tier (``ns:{backup}:m``)."""
    pattern = meta_pattern(namespace)
    named: dict[str, BlockKey] = {}
    foreign = 0
    for node in client.nodes():
        found = client.call(node, lambda conn: list(conn.scan_iter(match=pattern, count=1000)))
        for raw in found:
            name = _text(raw)
            key = key_of_meta(namespace, name)
            if key is None:
                foreign += 1
            else:
                named[name] = key
    return named, foreign


@dataclass
class MetasOnServer:
    """Every object's meta on the server, the keys whose meta is garbage (torn, another key's,
    not a string), and how many names were no meta key of the tier."""

    metas: list[KVObjectMeta]
    garbage: list[BlockKey]
    foreign: int = 0


def metas_on_server(client: RemoteClient, namespace: str) -> MetasOnServer:
    """Every object's meta on the server (``MetasOnServer``). I/O; raises
    ``RemoteUnavailable`` when a node fails."""
    wanted, foreign = meta_keys(client, namespace)
    found = MetasOnServer([], [], foreign)
    for key, meta in read_metas(client, wanted).items():
        if meta is None:
            found.garbage.append(key)
        else:
            found.metas.append(meta)
    return found


def erase_objects(
    client: RemoteClient, namespace: str, marks: Sequence[Tombstone], now: float, script: object
) -> dict[BlockKey, int]:
    """Set the object-slot tombstones of ``marks`` and delete their objects (pipelined per
    shard); object keys deleted per key. Raises ``RemoteUnavailable`` when a shard fails."""
    by_name = {meta_key(namespace, m.key): m for m in marks}

    def build(pipe: object, name: str) -> None:
        mark = by_name[name]
        key = mark.key
        keys = [name, data_key(namespace, key), tomb_key(namespace, key), gen_key(namespace, key)]
        script(keys=keys, args=[repr(mark.deleted_at), ttl_ms(mark, now)], client=pipe)  # type: ignore[operator]

    replies = client.pipelined(list(by_name), build)
    out: dict[BlockKey, int] = {}
    for name, reply in replies.items():
        if isinstance(reply, RemoteUnavailable):
            raise reply
        out[by_name[name].key] = int(reply)
    return out


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
