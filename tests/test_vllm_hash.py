"""vLLM 0.32 block hashes, checked against the recipe recomputed here with hashlib/pickle/cbor2."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import cbor2
import numpy as np
import pytest

from kvstrata.errors import IdentityError
from kvstrata.identity.vllm_hash import (
    DEFAULT_NONE_HASH_SEED,
    PICKLE_PROTOCOL,
    to_event_extra_keys,
    vllm_block_extra_keys,
    vllm_block_hashes,
    vllm_event_int,
    vllm_none_hash,
)


def _sha_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def _sha_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _recipe(
    tokens: list[int], size: int, parent: bytes, extras: list[Any] | None = None, cbor: bool = False
) -> list[bytes]:
    fn = _sha_cbor if cbor else _sha_pickle
    out = []
    for i in range(len(tokens) // size):
        extra = extras[i] if extras is not None else None
        parent = fn((parent, tuple(tokens[i * size : (i + 1) * size]), extra))
        out.append(parent)
    return out


TOKENS = [(i * 104_729 + 7) % 151_936 for i in range(100)]


def test_pickle_protocol_is_what_vllm_uses() -> None:
    # vLLM pickles with HIGHEST_PROTOCOL; if Python ever raises it, vLLM's hashes change.
    assert pickle.HIGHEST_PROTOCOL == PICKLE_PROTOCOL == 5


def test_none_hash_default_and_seeded() -> None:
    assert DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert vllm_none_hash() == _sha_pickle("vllm-none-hash")
    assert vllm_none_hash().hex() == (
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    )
    # With PYTHONHASHSEED=0 in the engine's environment, vLLM hashes the string "0".
    assert vllm_none_hash(seed="0") == _sha_pickle("0")
    assert vllm_none_hash("sha256_cbor") == _sha_cbor("vllm-none-hash")
    assert vllm_none_hash("sha256_cbor", seed="42") == _sha_cbor("42")
    assert vllm_none_hash("sha256") != vllm_none_hash("sha256_cbor")


def test_block_hashes_match_the_recipe() -> None:
    hashes = vllm_block_hashes(TOKENS, 16)
    assert len(hashes) == 6  # 100 tokens: six full blocks, the partial block has no hash
    assert hashes == _recipe(TOKENS, 16, _sha_pickle("vllm-none-hash"))
    assert all(len(h) == 32 for h in hashes)


def test_block_0_parent_is_none_hash() -> None:
    first = vllm_block_hashes(TOKENS[:32], 32)[0]
    assert first == _sha_pickle((_sha_pickle("vllm-none-hash"), tuple(TOKENS[:32]), None))


def test_chaining_prefix_and_continuation() -> None:
    hashes = vllm_block_hashes(TOKENS, 8)
    assert vllm_block_hashes(TOKENS[:40], 8) == hashes[:5]
    assert vllm_block_hashes(TOKENS[24:], 8, none_hash=hashes[2]) == hashes[3:]
    changed = list(TOKENS)
    changed[30] += 1
    other = vllm_block_hashes(changed, 8)
    assert other[:3] == hashes[:3]
    assert all(a != b for a, b in zip(other[3:], hashes[3:], strict=True))


def test_explicit_none_hash() -> None:
    seeded = vllm_none_hash(seed="0")
    assert vllm_block_hashes(TOKENS, 16, none_hash=seeded) == _recipe(TOKENS, 16, seeded)
    assert vllm_block_hashes(TOKENS, 16, none_hash=seeded) != vllm_block_hashes(TOKENS, 16)


def test_numpy_tokens_hash_like_python_ints() -> None:
    # numpy scalars pickle differently; the hasher must convert them to Python ints.
    expected = vllm_block_hashes(TOKENS, 16)
    assert vllm_block_hashes(np.array(TOKENS, dtype=np.int64), 16) == expected
    assert vllm_block_hashes(np.array(TOKENS, dtype=np.uint32), 16) == expected
    assert vllm_block_hashes(tuple(TOKENS), 16) == expected


def test_cbor_variant() -> None:
    hashes = vllm_block_hashes(TOKENS, 16, hash_name="sha256_cbor")
    assert hashes == _recipe(TOKENS, 16, _sha_cbor("vllm-none-hash"), cbor=True)
    assert hashes != vllm_block_hashes(TOKENS, 16)


def test_extra_keys_builder_follows_vllm_order() -> None:
    keys0 = vllm_block_extra_keys(
        0,
        lora=("sql", "/adapters/sql"),
        mm=[("img-1", 3), ("img-2", -5)],
        cache_salt="salty",
        prompt_embeds_digest=b"\x01" * 32,
    )
    assert keys0 == (
        ("lora", "sql", "/adapters/sql"),
        ("mm", "img-1", 3),
        ("mm", "img-2", -5),
        ("cache_salt", "salty"),
        ("prompt_embeds", b"\x01" * 32),
    )
    # The cache salt only applies to block 0; no extras at all is None, never ().
    assert vllm_block_extra_keys(1, cache_salt="salty") is None
    assert vllm_block_extra_keys(1, lora=("sql", "/p"), cache_salt="salty") == (
        ("lora", "sql", "/p"),
    )


def test_extra_keys_enter_the_hash() -> None:
    salt = vllm_block_extra_keys(0, cache_salt="tenant-a")
    extras = [salt, None, (("mm", "img", 2),), None, None, None]
    hashes = vllm_block_hashes(TOKENS, 16, extra_keys_per_block=extras)
    assert hashes == _recipe(TOKENS, 16, _sha_pickle("vllm-none-hash"), extras)
    plain = vllm_block_hashes(TOKENS, 16)
    assert all(a != b for a, b in zip(hashes, plain, strict=True))  # salt changes the chain
    other_salt = [vllm_block_extra_keys(0, cache_salt="tenant-b"), *extras[1:]]
    assert vllm_block_hashes(TOKENS, 16, extra_keys_per_block=other_salt)[0] != hashes[0]
    cbor = vllm_block_hashes(TOKENS, 16, hash_name="sha256_cbor", extra_keys_per_block=extras)
    assert cbor == _recipe(TOKENS, 16, _sha_cbor("vllm-none-hash"), extras, cbor=True)


def test_empty_extra_keys_are_none() -> None:
    assert vllm_block_hashes(TOKENS, 16, extra_keys_per_block=[()] * 6) == vllm_block_hashes(
        TOKENS, 16
    )


def test_event_extra_keys_are_untagged() -> None:
    keys = vllm_block_extra_keys(
        0, lora=("sql", "/p"), mm=[("img", 4)], cache_salt="s", prompt_embeds_digest=b"d"
    )
    assert to_event_extra_keys(keys) == ("sql", ("img", 4), "s", b"d")
    assert to_event_extra_keys(None) is None


def test_event_int_is_low_64_bits_big_endian() -> None:
    digest = bytes(range(32))
    assert vllm_event_int(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert vllm_event_int(digest) == 0x18191A1B1C1D1E1F
    for h in vllm_block_hashes(TOKENS, 16):
        value = vllm_event_int(h)
        assert 0 <= value < 2**64
        assert value == int.from_bytes(h, "big") & (2**64 - 1)
        assert value.to_bytes(8, "big") == h[-8:]


def test_invalid_input_raises() -> None:
    with pytest.raises(IdentityError):
        vllm_block_hashes(TOKENS, 0)
    with pytest.raises(IdentityError):
        vllm_block_hashes(TOKENS, 16, hash_name="xxhash")  # type: ignore[arg-type]
    with pytest.raises(IdentityError):
        vllm_block_hashes(TOKENS, 16, none_hash=b"short")
    with pytest.raises(IdentityError):
        vllm_block_hashes(TOKENS, 16, extra_keys_per_block=[None])
    with pytest.raises(IdentityError):
        vllm_block_hashes(np.array(TOKENS, dtype=np.float32), 16)
    with pytest.raises(IdentityError):
        vllm_event_int(b"\x00" * 8)
