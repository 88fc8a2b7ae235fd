"""How one KV object is laid out in Redis/Valkey (apart from the tier's behaviour).

``ns`` is the namespace; the braces are a cluster hash tag, so an object's two keys live on
one slot (one ``MGET`` reads both, one ``MULTI`` writes both) and objects spread over shards::

    ns:{<key hex>}:m   u64 xxh3-64(meta JSON) little endian | meta JSON (``KVObjectMeta``)
    ns:{<key hex>}:d   the payload (``meta.size`` bytes; its xxh3-128 digest is in the meta)

The meta checksum rejects garbage and torn metas, which the payload digest does not cover.
"""

from __future__ import annotations

import json

import xxhash

from kvstrata.identity import BlockKey
from kvstrata.objects import MALFORMED_META, KVObjectMeta


def meta_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:m"


def data_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:d"


def meta_pattern(namespace: str) -> str:
    """``SCAN`` pattern of every object's meta key."""
    return f"{namespace}:{{*}}:m"


def key_of_meta(namespace: str, name: str) -> BlockKey:
    """The block key a meta key names (inverse of ``meta_key``)."""
    return BlockKey(bytes.fromhex(name[len(namespace) + 2 : -3]))


def encode_meta(meta: KVObjectMeta) -> bytes:
    body = json.dumps(meta.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body


def decode_meta(raw: bytes, key: BlockKey) -> KVObjectMeta | None:
    """The meta stored for ``key``, or None when it is garbage, torn or another key's."""
    if len(raw) < 9 or xxhash.xxh3_64_intdigest(raw[8:]).to_bytes(8, "little") != raw[:8]:
        return None
    try:
        meta = KVObjectMeta.from_dict(json.loads(raw[8:]))
    except MALFORMED_META:
        return None
    return meta if meta.key == key else None
