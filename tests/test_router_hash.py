"""Router hashes: the vectorised numpy path against a slow pure-Python model of the same math."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.errors import IdentityError
from kvstrata.identity.keys import FingerprintDigest, TenantNamespace, namespace_root
from kvstrata.identity.router_hash import (
    GAMMA,
    MASK64,
    P,
    RouterHasher,
    router_seed,
)

_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _ref_mix(value: int) -> int:
    z = value & MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def reference_hashes(seed: int, block_size: int, tokens: list[int]) -> list[int]:
    """The module docstring's math, one block and one token at a time, in Python ints."""
    s = _ref_mix(seed + GAMMA * block_size)
    multipliers = [_ref_mix(s + GAMMA * (c + 1)) | 1 for c in range(block_size)]
    state, out = s, []
    for j in range(len(tokens) // block_size):
        linear = sum(tokens[j * block_size + c] * multipliers[c] for c in range(block_size))
        content = _ref_mix(linear)
        state = (state * P + content) & MASK64
        out.append(_ref_mix(state))
    return out


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151_936) for _ in range(n)]


def test_deterministic_across_instances_and_input_types() -> None:
    tokens = _tokens(1000)
    expected = RouterHasher(7, 16).hashes(tokens)
    assert expected.dtype == np.uint64
    assert len(expected) == 62  # 1000 // 16: the partial block has no hash
    again = RouterHasher(7, 16)
    assert np.array_equal(again.hashes(tokens), expected)
    assert np.array_equal(again.hashes(tokens), expected)  # scratch reuse changes nothing
    assert np.array_equal(again.hashes(tuple(tokens)), expected)
    assert np.array_equal(again.hashes(np.array(tokens, dtype=np.int64)), expected)
    assert np.array_equal(again.hashes(np.array(tokens, dtype=np.uint32)), expected)
    numpy_scalars: list[Any] = [np.int64(t) for t in tokens]
    assert np.array_equal(again.hashes(numpy_scalars), expected)


def test_matches_reference_on_long_input_across_chunks_and_table_growth() -> None:
    hasher = RouterHasher(123_456_789, 4)
    short = _tokens(40, seed=1)
    assert hasher.hashes(short).tolist() == reference_hashes(123_456_789, 4, short)
    long = _tokens(40_000, seed=2)  # 10k blocks: several scratch chunks, grown power tables
    assert hasher.hashes(long).tolist() == reference_hashes(123_456_789, 4, long)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, MASK64),
    block_size=st.integers(1, 9),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
)
def test_property_matches_reference(seed: int, block_size: int, tokens: list[int]) -> None:
    assert RouterHasher(seed, block_size).hashes(tokens).tolist() == reference_hashes(
        seed, block_size, tokens
    )


def test_prefix_property() -> None:
    hasher = RouterHasher(99, 16)
    tokens = _tokens(16 * 50 + 5)
    full = hasher.hashes(tokens)
    for n_tokens in (0, 15, 16, 17, 160, 16 * 50):
        prefix = hasher.hashes(tokens[:n_tokens])
        assert np.array_equal(prefix, full[: n_tokens // 16])


@pytest.mark.parametrize("block", [0, 3, 19])
def test_change_in_block_changes_it_and_every_later_hash_only(block: int) -> None:
    hasher = RouterHasher(5, 8)
    tokens = _tokens(8 * 20)
    base = hasher.hashes(tokens)
    for position in (0, 7):
        changed = list(tokens)
        changed[block * 8 + position] ^= 1
        other = hasher.hashes(changed)
        assert np.array_equal(other[:block], base[:block])
        assert np.all(other[block:] != base[block:])


def test_swapping_tokens_within_a_block_changes_the_hash() -> None:
    hasher = RouterHasher(5, 4)
    assert hasher.hashes([1, 2, 3, 4])[0] != hasher.hashes([2, 1, 3, 4])[0]


def test_different_seeds_and_block_sizes_differ() -> None:
    tokens = _tokens(16 * 64)
    a = RouterHasher(1, 16).hashes(tokens)
    b = RouterHasher(2, 16).hashes(tokens)
    assert not set(a.tolist()) & set(b.tolist())
    c = RouterHasher(1, 8).hashes(tokens)
    assert not set(a.tolist()) & set(c.tolist())


def test_seed_from_namespace_root() -> None:
    fp = FingerprintDigest(bytes(range(32)))
    root_a = namespace_root(fp, TenantNamespace.for_tenant("acme", b"k"))
    root_b = namespace_root(fp, TenantNamespace.for_tenant("globex", b"k"))
    assert router_seed(root_a) == int.from_bytes(root_a[:8], "little")
    assert router_seed(root_a) != router_seed(root_b)
    tokens = _tokens(64)
    assert np.array_equal(
        RouterHasher.for_root(root_a, 16).hashes(tokens),
        RouterHasher(router_seed(root_a), 16).hashes(tokens),
    )
    with pytest.raises(IdentityError):
        router_seed(b"short")  # type: ignore[arg-type]


def test_no_collisions_across_200k_random_blocks() -> None:
    hasher = RouterHasher(2024, 16)
    tokens = _tokens(16 * 200_000, seed=3)
    chained = hasher.hashes(tokens)
    assert len(np.unique(chained)) == len(chained) == 200_000
    content = hasher.block_content_hashes(tokens)
    assert len(np.unique(content)) == 200_000


def test_no_collisions_across_200k_nearly_identical_blocks() -> None:
    """Low-entropy input: blocks that differ from each other in one or two token ids."""
    hasher = RouterHasher(2024, 16)
    blocks = np.zeros((200_000, 16), dtype=np.uint32)
    ids = np.arange(200_000, dtype=np.uint32)
    blocks[ids, ids % 16] = ids // 16 + 1
    blocks[ids, (ids + 5) % 16] += 1
    content = hasher.block_content_hashes(blocks.reshape(-1))
    assert len(np.unique(content)) == 200_000


def test_empty_and_partial_inputs() -> None:
    hasher = RouterHasher(0, 16)
    assert hasher.hashes([]).shape == (0,)
    assert hasher.hashes(list(range(15))).shape == (0,)
    assert hasher.hashes(np.zeros(0, dtype=np.int64)).shape == (0,)


def test_invalid_input_raises() -> None:
    with pytest.raises(IdentityError):
        RouterHasher(0, 0)
    with pytest.raises(IdentityError):
        RouterHasher(-1, 16)
    with pytest.raises(IdentityError):
        RouterHasher(2**64, 16)
    hasher = RouterHasher(0, 2)
    for bad in ([-1, 2], [2**32, 1], np.array([-1, 2]), np.array([1.0, 2.0])):
        with pytest.raises(IdentityError):
            hasher.hashes(bad)
    with pytest.raises(IdentityError):
        hasher.hashes(np.zeros((2, 2), dtype=np.uint32))


@given(
    seed=st.integers(0, MASK64),
    split=st.integers(0, 6),
    n_blocks=st.integers(0, 8),
    block_size=st.sampled_from([1, 4, 16]),
)
@settings(max_examples=60, deadline=None)
def test_extend_from_parent_equals_whole_chain(
    seed: int, split: int, n_blocks: int, block_size: int
) -> None:
    from kvstrata.identity.router_hash import mix64, unmix64

    tokens = _tokens(n_blocks * block_size, seed=seed % 1000)
    hasher = RouterHasher(seed, block_size)
    whole = [int(h) for h in hasher.hashes(tokens)]
    split = min(split, n_blocks)
    parent = whole[split - 1] if split else None
    tail = [int(h) for h in hasher.extend(parent, tokens[split * block_size :])]
    assert tail == whole[split:]
    assert unmix64(mix64(seed)) == seed


def test_extend_from_a_wrong_parent_changes_every_hash() -> None:
    hasher = RouterHasher(3, 16)
    tokens = _tokens(64)
    whole = hasher.hashes(tokens)
    other = hasher.extend(int(whole[0]) ^ 1, tokens[16:])
    assert not set(int(h) for h in other) & set(int(h) for h in whole)


def test_hashers_share_their_power_tables() -> None:
    """An index keeps a hasher per namespace (thousands: clients name sub-namespaces), so a
    hasher must not hold tables sized by its longest request: they were ~190 KiB each for a
    128k-token request, 768 MiB over 4,096 namespaces."""
    import tracemalloc

    tokens = np.arange(131_072, dtype=np.uint32)
    RouterHasher(1, 16).hashes(tokens)  # the shared tables grow once, before measuring
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        hashers = [RouterHasher(seed, 16) for seed in range(50)]
        for hasher in hashers:
            hasher.hashes(tokens)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 50 * 8 * 1024, held  # multipliers and small state only: < 8 KiB a hasher
