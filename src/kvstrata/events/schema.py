"""KV cache events on the wire: vLLM's format, plus kvstrata's optional fields.

Why vLLM's format: a router that speaks it can index real vLLM engines and kvstrata workers
alike. The layout follows ``vllm/distributed/kv_events.py``:

- A batch is a msgpack array ``[ts, [events], data_parallel_rank]`` (vLLM's ``EventBatch``,
  ``array_like``, defaults omitted). kvstrata appends ``worker_id`` and ``epoch`` as trailing
  elements; msgspec-based vLLM consumers ignore extra trailing elements.
- An event is a msgpack map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``), fields named as in vLLM, defaults omitted. kvstrata adds the optional
  ``namespace`` (tenant) key, which vLLM's decoders ignore as an unknown key.
- ``medium`` carries the tier name (vLLM uses ``"GPU"``/``"CPU"``).

Decoding is deliberately lenient about *shape* and strict about *types*: it accepts the batch
as an array or a map, events as maps or as tag-first arrays (older vLLM releases), missing
legacy keys (``lora_name``, ``medium``), and block hashes as ints (vLLM's default: the low 64
bits of the digest) or bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). Anything else raises
an :class:`EventDecodeError` so that a consumer can count it and move on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgspec

from kvstrata.errors import InvalidInput

BlockHash: TypeAlias = int | bytes
"""vLLM's external block hash: an unsigned 64-bit int by default, the raw digest otherwise."""


class EventDecodeError(InvalidInput):
    """A payload or one of its events could not be decoded; the consumer counts and skips it.

    ``tag``: the event's type when it was readable (a consumer may treat a malformed removal
    differently from a malformed store); None for a payload, or an event of no readable type.
    """

    def __init__(self, message: str, *, tag: str | None = None) -> None:
        super().__init__(message)
        self.tag = tag


class UnknownEventError(EventDecodeError):
    """An event carries a ``type`` tag this version does not know (a newer producer)."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True, frozen=True):
    """Base of every KV cache event; ``tag=True`` puts ``"type": <class name>`` in the map."""


class BlockStored(KVCacheEvent, frozen=True):
    """Blocks became resident in ``medium``; ``token_ids`` concatenates every block's tokens.

    Field order and names follow vLLM. ``lora_id``, ``medium`` and ``lora_name`` have no
    default so they are always encoded, as vLLM does (its decoders require them).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    namespace: str | None = None
    """kvstrata: tenant namespace id; a router never matches another tenant's blocks."""


class BlockRemoved(KVCacheEvent, frozen=True):
    """Blocks left ``medium`` (evicted or freed)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    namespace: str | None = None
    """kvstrata: tenant namespace id."""


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """Every block of the publisher is gone (prefix cache reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One engine step's events: ``[ts, [events], data_parallel_rank, worker_id, epoch]``.

    ``worker_id`` and ``epoch`` are kvstrata's: a new ``epoch`` (engine restart) tells the
    index to drop the worker's stale entries. Omitted when ``None``, so a batch without them is
    byte-identical to vLLM's.
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    worker_id: str | None = None
    epoch: int | None = None


_EVENT_TYPES: Final[dict[str, type[KVEvent]]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
# Keys older vLLM releases did not send; absent means None.
_LEGACY_NULLABLE: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": ("lora_id", "medium", "lora_name"),
    "BlockRemoved": ("medium",),
    "AllBlocksCleared": (),
}
_BATCH_FIELDS: Final = KVEventBatch.__struct_fields__
_ENCODER: Final = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """A decoded batch plus the events that were skipped (unknown or malformed) inside it."""

    batch: KVEventBatch
    skipped: tuple[EventDecodeError, ...] = ()


def make_batch(
    events: Sequence[KVEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    worker_id: str | None = None,
    epoch: int | None = None,
) -> KVEventBatch:
    """Build a batch stamped with wall-clock time unless ``ts`` is given (tests pin it)."""
    return KVEventBatch(
        ts=time.time() if ts is None else ts,
        events=list(events),
        data_parallel_rank=data_parallel_rank,
        worker_id=worker_id,
        epoch=epoch,
    )


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode a batch as msgpack in the layout described in the module docstring.

    msgspec writes every element of an ``array_like`` struct, ``None`` included, so trailing
    unset fields are trimmed by hand: without kvstrata's fields the bytes equal vLLM's.
    """
    values: list[object] = [getattr(batch, name) for name in _BATCH_FIELDS]
    while len(values) > 2 and values[-1] is None:
        values.pop()
    return _ENCODER.encode(values)


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one payload; a bad event is skipped and reported, a bad batch raises.

    Raises:
        EventDecodeError: the payload is not msgpack or not a batch of the expected shape.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    fields = _batch_fields(raw)
    raw_events = fields.get("events")
    if not isinstance(raw_events, list):
        raise EventDecodeError("batch field 'events' is not an array")
    events: list[KVEvent] = []
    skipped: list[EventDecodeError] = []
    for index, raw_event in enumerate(raw_events):
        try:
            events.append(decode_event(raw_event))
        except EventDecodeError as exc:
            skipped.append(type(exc)(f"event {index}: {exc}", tag=exc.tag))
    fields["events"] = []
    # array_like structs convert only from arrays: lay the named fields out in order.
    present = [index for index, name in enumerate(_BATCH_FIELDS) if name in fields]
    values = [fields.get(name) for name in _BATCH_FIELDS[: max(present) + 1]]
    try:
        shell = msgspec.convert(values, KVEventBatch)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"bad batch: {exc}") from exc
    return DecodedBatch(batch=msgspec.structs.replace(shell, events=events), skipped=tuple(skipped))


def decode_event(raw: object) -> KVEvent:
    """Turn one already msgpack-decoded event (map or tag-first array) into a typed event.

    Raises:
        UnknownEventError: the tag names no known event.
        EventDecodeError: the event is not a map/array or its fields have the wrong types.
    """
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = {key: value for key, value in raw.items() if key != "type"}
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = {}
    else:
        raise EventDecodeError(f"event is neither a map nor a tagged array: {raw!r:.80}")
    if not isinstance(tag, str):
        raise EventDecodeError(f"event tag is not a string: {tag!r:.80}")
    event_type = _EVENT_TYPES.get(tag)
    if event_type is None:
        raise UnknownEventError(f"unknown event type {tag!r:.80}")
    if isinstance(raw, list):
        # Trailing fields past the ones this version knows come from a newer producer that
        # appended them (vLLM's array events grow at the end): ignored, as msgspec ignores
        # them for array-like structs.
        names = event_type.__struct_fields__
        fields = dict(zip(names, raw[1:], strict=False))
    for name in _LEGACY_NULLABLE[tag]:
        fields.setdefault(name, None)
    try:
        event = msgspec.convert(fields, event_type)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"bad {tag}: {exc}", tag=tag) from exc
    try:
        _check_hashes(event)
    except EventDecodeError as exc:
        raise EventDecodeError(str(exc), tag=tag) from exc
    return event


def _batch_fields(raw: object) -> dict[str, Any]:
    """Name the batch's fields whether it came as vLLM's array or as a map."""
    if isinstance(raw, list):
        if len(raw) < 2:
            raise EventDecodeError(f"batch array has {len(raw)} elements, expected at least 2")
        return dict(zip(_BATCH_FIELDS, raw, strict=False))
    if isinstance(raw, dict) and all(isinstance(key, str) for key in raw):
        return {key: value for key, value in raw.items() if key in _BATCH_FIELDS}
    raise EventDecodeError(f"batch is neither an array nor a map: {raw!r:.80}")


def _check_hashes(event: KVEvent) -> None:
    """Reject hashes no vLLM hash function produces: negative ints or empty bytes."""
    if isinstance(event, AllBlocksCleared):
        return
    hashes: list[BlockHash] = list(event.block_hashes)
    if isinstance(event, BlockStored) and event.parent_block_hash is not None:
        hashes.append(event.parent_block_hash)
    for block_hash in hashes:
        if isinstance(block_hash, int) and not 0 <= block_hash < 2**64:
            raise EventDecodeError(f"int block hash out of uint64 range: {block_hash}")
        if isinstance(block_hash, bytes) and not block_hash:
            raise EventDecodeError("empty bytes block hash")
