"""KV event wire format: round trips, vLLM-shaped payloads, and rejection of bad input."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvstrata.errors import InvalidInput
from kvstrata.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEvent,
    UnknownEventError,
    decode_batch,
    encode_batch,
    make_batch,
)

DIGEST = bytes(range(32))

EVENTS: list[KVEvent] = [
    BlockStored(
        block_hashes=[1, 2**64 - 1],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    ),
    BlockStored(
        block_hashes=[DIGEST],
        parent_block_hash=bytes(32),
        token_ids=[7] * 16,
        block_size=16,
        lora_id=3,
        medium="host",
        lora_name="adapter",
        extra_keys=[("cache_salt", "s")],
        group_idx=0,
        namespace="tenant-a",
    ),
    BlockRemoved(block_hashes=[1], medium="GPU"),
    BlockRemoved(block_hashes=[DIGEST], medium="disk", namespace="tenant-a"),
    AllBlocksCleared(),
]


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: KVEvent) -> None:
    batch = make_batch([event], ts=12.5, data_parallel_rank=0, worker_id="w1", epoch=7)
    decoded = decode_batch(encode_batch(batch))
    assert decoded.skipped == ()
    assert decoded.batch == batch


def test_layout_without_extensions_is_vllms() -> None:
    """Batch = [ts, [events], dp_rank]; events are maps tagged by "type"; defaults omitted."""
    raw = msgspec.msgpack.decode(encode_batch(make_batch([EVENTS[0], EVENTS[2]], ts=1.0)))
    assert raw == [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1, 2**64 - 1],
                "parent_block_hash": None,
                "token_ids": list(range(32)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        ],
    ]
    with_ext = msgspec.msgpack.decode(
        encode_batch(make_batch([], ts=1.0, data_parallel_rank=0, worker_id="w", epoch=2))
    )
    assert with_ext == [1.0, [], 0, "w", 2]


def test_hand_built_vllm_payload_decodes() -> None:
    """Exactly what vLLM's ZmqEventPublisher sends: int hashes, defaults omitted, dp rank 0."""
    payload = _pack(
        [
            1764441000.25,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [0x1234_5678_9ABC_DEF0, 42],
                    "parent_block_hash": None,
                    "token_ids": list(range(8)),
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "future_field": "ignored",
                },
                {"type": "BlockRemoved", "block_hashes": [42], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    decoded = decode_batch(payload)
    assert decoded.skipped == ()
    batch = decoded.batch
    assert batch.ts == 1764441000.25 and batch.data_parallel_rank == 0
    assert batch.worker_id is None and batch.epoch is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [0x1234_5678_9ABC_DEF0, 42] and stored.block_size == 4
    assert stored.extra_keys == [None, None] and stored.namespace is None
    assert removed == BlockRemoved(block_hashes=[42], medium="GPU")
    assert cleared == AllBlocksCleared()


def test_older_vllm_shapes_decode() -> None:
    """Older releases: tag-first arrays without medium/lora_name; newer: the batch as a map."""
    array_events = _pack([2.0, [["BlockStored", [5], 4, [1, 2], 2, None], ["BlockRemoved", [5]]]])
    stored, removed = decode_batch(array_events).batch.events
    assert stored == BlockStored([5], 4, [1, 2], 2, None, None, None)
    assert removed == BlockRemoved([5], None)
    map_batch = _pack(
        {"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}
    )
    batch = decode_batch(map_batch).batch
    assert batch.events == [AllBlocksCleared()] and batch.data_parallel_rank == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1 not msgpack",
        b"",
        _pack("a string"),
        _pack([1.0]),
        _pack(["ts", []]),
        _pack([1.0, {"not": "a list"}]),
        _pack([1.0, [], "rank"]),
        _pack({1: 2}),
    ],
)
def test_malformed_batch_raises_invalid_input(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)
    assert issubclass(EventDecodeError, InvalidInput)


@pytest.mark.parametrize(
    ("raw_event", "error"),
    [
        ({"type": "BlockTeleported", "block_hashes": [1]}, UnknownEventError),
        (["NoSuchEvent"], UnknownEventError),
        ({"block_hashes": [1]}, EventDecodeError),
        ({"type": 5}, EventDecodeError),
        ({"type": "BlockRemoved", "block_hashes": "nope", "medium": None}, EventDecodeError),
        ({"type": "BlockRemoved", "block_hashes": [-1], "medium": None}, EventDecodeError),
        ({"type": "BlockRemoved", "block_hashes": [b""], "medium": None}, EventDecodeError),
        ({"type": "BlockStored", "block_hashes": [1]}, EventDecodeError),
        ([], EventDecodeError),
        (3.5, EventDecodeError),
    ],
)
def test_bad_event_is_skipped_and_reported(raw_event: Any, error: type[Exception]) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
    decoded = decode_batch(_pack([1.0, [raw_event, good]]))
    assert decoded.batch.events == [BlockRemoved([9], "GPU")]
    (skipped,) = decoded.skipped
    assert type(skipped) is error


def test_trailing_fields_of_a_newer_producer_are_ignored() -> None:
    """vLLM's array events grow at the end; an event with fields past the ones this version
    knows decodes to them (as msgspec decodes array-like structs), instead of being
    skipped as malformed: skipping a removal for it made every batch a resync."""
    known = ["BlockRemoved", [1], "GPU", 0, "ns"]
    decoded = decode_batch(_pack([1.0, [[*known, "a new field", 7]]]))
    assert decoded.skipped == ()
    assert decoded.batch.events == [decode_batch(_pack([1.0, [known]])).batch.events[0]]


def test_a_malformed_event_names_its_type_when_readable() -> None:
    bad_store = {"type": "BlockStored", "block_hashes": [1]}
    bad_removal = {"type": "BlockRemoved", "block_hashes": [-1], "medium": None}
    decoded = decode_batch(_pack([1.0, [bad_store, bad_removal, {"block_hashes": [1]}]]))
    assert [error.tag for error in decoded.skipped] == ["BlockStored", "BlockRemoved", None]
