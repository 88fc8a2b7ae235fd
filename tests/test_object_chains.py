"""``kvstrata.objects.chains``: one meta per distinct block id, by the documented rules."""

from __future__ import annotations

import pytest

from kvstrata.errors import InvalidInput
from kvstrata.objects import Representation
from kvstrata.objects.chains import block_key, chain_metas

REPRESENTATION = Representation(dtype="float32", layout="test", block_size=4, shape=(4,))


def priced(tokens: int, position: int) -> float:
    return tokens * 1.0 + position * 0.001


def test_metas_are_built_once_per_id_with_parent_position_and_partial_last_block() -> None:
    built = chain_metas(
        [((1, 2, 3), 10), ((1, 2, 4, 5), 16)],  # 10 tokens: the last of 3 blocks holds 2
        block_tokens=4,
        block_bytes=64,
        representation=REPRESENTATION,
        recompute_s=priced,
    )
    k = {i: block_key(i) for i in (1, 2, 3, 4, 5)}
    assert built.chains == ((k[1], k[2], k[3]), (k[1], k[2], k[4], k[5]))
    assert built.keys == k and built.block_ids() == {v: i for i, v in k.items()}
    assert list(built.metas) == [k[1], k[2], k[3], k[4], k[5]]  # first-occurrence order
    parents = {i: built.metas[k[i]].parent for i in k}
    assert parents == {1: None, 2: k[1], 3: k[2], 4: k[2], 5: k[4]}
    assert [built.metas[k[i]].position for i in (1, 2, 3, 4, 5)] == [0, 4, 8, 8, 12]
    assert built.metas[k[3]].recompute_s == priced(2, 8)  # partial: its own 2 tokens
    assert built.metas[k[4]].recompute_s == priced(4, 8)
    assert built.metas[k[5]].recompute_s == priced(4, 12)
    meta = built.metas[k[1]]
    assert meta.size == 64 and meta.representation == REPRESENTATION and meta.digest == b""


def test_keys_are_16_signed_little_endian_bytes() -> None:
    assert block_key(1) == (1).to_bytes(16, "little")
    assert block_key(-1) == b"\xff" * 16
    assert len(block_key(2**100)) == 16


def test_a_block_past_the_prompt_end_is_rejected() -> None:
    with pytest.raises(InvalidInput):
        chain_metas(
            [((1, 2), 4)],
            block_tokens=4,
            block_bytes=1,
            representation=REPRESENTATION,
            recompute_s=priced,
        )
