"""The version-1 block key spec: golden vectors, a from-spec recomputation, and its invariants."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from blake3 import blake3

from kvstrata.errors import IdentityError
from kvstrata.identity.keys import (
    AdapterExtra,
    BlockExtras,
    FingerprintDigest,
    MultimodalExtra,
    NamespaceRoot,
    TenantNamespace,
    chain_keys,
    content_hash,
    namespace_root,
)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "block_keys_v1.json").read_text())
FP = FingerprintDigest(bytes(range(32)))


def _root(tenant: str = "acme", secret: bytes = b"s3cret") -> NamespaceRoot:
    return namespace_root(FP, TenantNamespace.for_tenant(tenant, secret))


def _extras(raw: list[dict[str, Any] | None] | None) -> list[BlockExtras | None] | None:
    if raw is None:
        return None
    out: list[BlockExtras | None] = []
    for entry in raw:
        if entry is None:
            out.append(None)
            continue
        adapter = entry["adapter"]
        out.append(
            BlockExtras(
                multimodal=tuple(
                    MultimodalExtra(m["offset"], bytes.fromhex(m["mm_hash"]))
                    for m in entry["multimodal"]
                ),
                adapter=None
                if adapter is None
                else AdapterExtra(adapter["name"], bytes.fromhex(adapter["weight_digest"])),
            )
        )
    return out


def _vector(name: str) -> dict[str, Any]:
    return next(v for v in GOLDEN["vectors"] if v["name"] == name)


def test_golden_namespace_root() -> None:
    namespace = TenantNamespace.for_tenant(GOLDEN["tenant"], bytes.fromhex(GOLDEN["secret_hex"]))
    assert namespace.salt.hex() == GOLDEN["tenant_salt"]
    fp = FingerprintDigest(bytes.fromhex(GOLDEN["fingerprint_digest"]))
    assert namespace_root(fp, namespace).hex() == GOLDEN["root"]


@pytest.mark.parametrize("vector", GOLDEN["vectors"], ids=lambda v: v["name"])
def test_golden_vectors(vector: dict[str, Any]) -> None:
    root = NamespaceRoot(bytes.fromhex(GOLDEN["root"]))
    size = vector["block_size"]
    keys = chain_keys(root, vector["tokens"], size, _extras(vector["extras"]))
    assert [k.hex() for k in keys] == vector["keys"]
    blocks = [vector["tokens"][i * size : (i + 1) * size] for i in range(len(keys))]
    assert [content_hash(b).hex() for b in blocks] == vector["content_hashes"]


def test_golden_vector_recomputed_from_the_spec_text() -> None:
    """Recompute one vector with blake3 alone, following the keys.py docstring byte by byte."""

    def u32(value: int) -> bytes:
        return struct.pack("<I", value)

    secret, name = b"s3cret", b"acme"
    # The tenant salt derivation lives in TenantNamespace.for_tenant (not in the spec table).
    salt = blake3(b"kvstrata.tenant.v1\x00" + u32(len(secret)) + secret + name).digest()
    root = blake3(b"kvstrata.root.v1\x00" + bytes(range(32)) + u32(len(salt)) + salt).digest()
    assert root.hex() == GOLDEN["root"]

    vector = _vector("multimodal_and_adapter_bs4")
    tokens, n = vector["tokens"], 4
    mm_a, mm_b, lora = bytes([0xAA]) * 32, bytes(range(100, 132)), bytes(range(32, 64))

    def mm_entry(offset: int, digest: bytes) -> bytes:
        return b"\x01" + u32(offset) + digest

    lora_entry = b"\x02" + u32(len(b"sql-lora")) + b"sql-lora" + lora
    extras = [
        [mm_entry(1, mm_a)],
        [],
        [mm_entry(3, mm_b), mm_entry(0, mm_a), lora_entry],
    ]
    parent, expected = root, []
    for i, entries in enumerate(extras):
        block = b"".join(u32(t) for t in tokens[i * n : (i + 1) * n])
        tail = u32(len(entries)) + b"".join(sorted(entries))
        parent = blake3(b"kvstrata.block.v1\x00" + parent + u32(n) + block + tail).digest()
        expected.append(parent.hex())
    assert expected == vector["keys"]

    first_block = b"".join(u32(t) for t in tokens[:n])
    content = blake3(b"kvstrata.content.v1\x00" + u32(n) + first_block).digest()
    assert content.hex() == vector["content_hashes"][0]


def test_only_full_blocks_get_keys() -> None:
    root = _root()
    assert chain_keys(root, list(range(3)), 4) == []
    assert len(chain_keys(root, list(range(11)), 4)) == 2
    assert chain_keys(root, list(range(11)), 4) == chain_keys(root, list(range(8)), 4)
    assert chain_keys(root, [], 4) == []


def test_keys_are_a_prefix_chain() -> None:
    root = _root()
    tokens = list(range(100, 132))
    keys = chain_keys(root, tokens, 4)
    assert chain_keys(root, tokens[:12], 4) == keys[:3]
    assert chain_keys(keys[2], tokens[12:], 4) == keys[3:]
    changed = [*tokens[:13], 999_999, *tokens[14:]]
    other = chain_keys(root, changed, 4)
    assert other[:3] == keys[:3]
    assert all(a != b for a, b in zip(other[3:], keys[3:], strict=True))


def test_numpy_and_list_tokens_agree() -> None:
    root = _root()
    tokens = list(range(50, 82))
    expected = chain_keys(root, tokens, 16)
    assert chain_keys(root, np.array(tokens, dtype=np.int64), 16) == expected
    assert chain_keys(root, np.array(tokens, dtype=np.uint32), 16) == expected


def test_different_tenant_or_secret_gives_different_keys() -> None:
    tokens = list(range(32))
    acme = chain_keys(_root("acme"), tokens, 16)
    globex = chain_keys(_root("globex"), tokens, 16)
    other_secret = chain_keys(_root("acme", b"other"), tokens, 16)
    assert not set(acme) & set(globex)
    assert not set(acme) & set(other_secret)


def test_extras_are_order_insensitive_but_content_sensitive() -> None:
    root = _root()
    tokens = list(range(8))
    mm_a = MultimodalExtra(0, bytes([1]) * 32)
    mm_b = MultimodalExtra(2, bytes([2]) * 32)
    lora = AdapterExtra("a", bytes([3]) * 32)

    def key(extras: BlockExtras | None) -> bytes:
        return chain_keys(root, tokens, 8, [extras])[0]

    assert key(BlockExtras((mm_a, mm_b), lora)) == key(BlockExtras((mm_b, mm_a), lora))
    base = key(BlockExtras((mm_a, mm_b), lora))
    variants = [
        BlockExtras((mm_a,), lora),
        BlockExtras((mm_a, MultimodalExtra(3, bytes([2]) * 32)), lora),
        BlockExtras((mm_a, MultimodalExtra(2, bytes([9]) * 32)), lora),
        BlockExtras((mm_a, mm_b), AdapterExtra("b", bytes([3]) * 32)),
        BlockExtras((mm_a, mm_b), AdapterExtra("a", bytes([4]) * 32)),
        BlockExtras((mm_a, mm_b), None),
    ]
    keys = {key(v) for v in variants} | {base, key(None)}
    assert len(keys) == len(variants) + 2
    assert key(None) == key(BlockExtras())


def test_extras_must_cover_every_full_block() -> None:
    with pytest.raises(IdentityError):
        chain_keys(_root(), list(range(8)), 4, [None])


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [0, 0, 0, 2**32]])
def test_token_ids_out_of_range_raise(bad: list[int]) -> None:
    with pytest.raises(IdentityError):
        chain_keys(_root(), bad, 4)
    with pytest.raises(IdentityError):
        content_hash(bad)


def test_bad_lengths_raise() -> None:
    with pytest.raises(IdentityError):
        chain_keys(NamespaceRoot(b"short"), [1, 2], 1)
    with pytest.raises(IdentityError):
        chain_keys(_root(), [1, 2], 0)
    with pytest.raises(IdentityError):
        namespace_root(FingerprintDigest(b"x" * 31), TenantNamespace.for_tenant("acme"))
    with pytest.raises(IdentityError):
        BlockExtras((MultimodalExtra(0, b"x" * 31),)).encode()
    with pytest.raises(IdentityError):
        TenantNamespace.for_tenant("")


def test_content_hash_is_position_free_and_not_a_chained_key() -> None:
    root = _root()
    block = [7, 8, 9, 10]
    tokens = [*block, 1, 2, 3, 4, *block]
    keys = chain_keys(root, tokens, 4)
    assert keys[0] != keys[2]  # same tokens, different prefix
    assert content_hash(tokens[0:4]) == content_hash(tokens[8:12])
    assert bytes(content_hash(block)) not in {bytes(k) for k in keys}
    assert content_hash(block) != content_hash([7, 8, 9, 11])
