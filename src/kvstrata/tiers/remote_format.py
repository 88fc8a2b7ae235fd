"""How one KV object is laid out in Redis/Valkey (apart from the tier's behaviour).

``ns`` is the namespace; the braces are a cluster hash tag, so an object's two keys live on
one slot (one ``MGET`` reads both, one ``MULTI`` writes both) and objects spread over shards::

    ns:{<key hex>}:m   u64 xxh3-64(meta JSON) little endian | meta JSON (``KVObjectMeta``)
    ns:{<key hex>}:d   the payload (``meta.size`` bytes; its xxh3-128 digest is in the meta)
    ns:{<key hex>}:g   the generation: the ledger version at which these bytes were committed

The meta checksum rejects garbage and torn metas, which the payload digest does not cover.
The generation lets a writer that removed or evicted an entry delete only the bytes of that
entry, never those of a store of the same key committed after it (``DROP_OBJECT``).
"""

from __future__ import annotations

import json
import re

import xxhash

from kvstrata.identity import BlockKey
from kvstrata.objects import MALFORMED_META, KVObjectMeta


def meta_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:m"


def data_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:d"


def gen_key(namespace: str, key: BlockKey) -> str:
    return f"{namespace}:{{{key.hex()}}}:g"


def meta_pattern(namespace: str) -> str:
    """``SCAN`` pattern of every object's meta key."""
    return f"{namespace}:{{*}}:m"


def key_of_meta(namespace: str, name: str) -> BlockKey | None:
    """The block key a meta key names (inverse of ``meta_key``), or None when ``name`` is not
    one: anything else that ``meta_pattern`` matches (``ns:{backup}:m``, a key another program
    put in the namespace) must be skipped, not trusted."""
    head, tail = f"{namespace}:{{", "}:m"
    if not (name.startswith(head) and name.endswith(tail)):
        return None
    return key_of_hex(name[len(head) : len(name) - len(tail)])


_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def key_of_hex(text: str) -> BlockKey | None:
    """The block key ``text`` spells in hex (as the ledger and key names hold it), or None when
    it spells none (empty, odd length, anything but hex digits)."""
    return BlockKey(bytes.fromhex(text)) if _HEX.fullmatch(text) else None


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
