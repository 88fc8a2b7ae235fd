"""The handshake's messages on the wire (pure: no torch, no I/O); see ``handshake.py``.

Wire format: msgpack maps (field names as here, defaults omitted), each message tagged by
``"type"`` (``offer``, ``accept``, ``accept_with_conversion``, ``refuse``) and carrying
``version``; block entries and head sources are arrays. Unknown fields are refused: a new
field is a new protocol version. Types and bounds (32-byte digests and keys, non-negative
sizes, list lengths) are checked while parsing; semantics in ``handshake.validate_offer``.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Final, TypeAlias

import msgspec

from kvstrata.errors import InvalidInput
from kvstrata.transfer.layout import ConversionStep, HeadSource, KVLayout, RefuseReason, StepKind

PROTOCOL_VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 4 << 20
"""A sensible ``max_bytes``: an offer of ``MAX_BLOCKS`` blocks is about 2.5 MiB."""
MAX_BLOCKS: Final = 1 << 16
MAX_DESCRIPTORS: Final = 1 << 12
MAX_STEPS: Final = 8
MAX_HEAD_PIECES: Final = 1 << 10
MAX_NAME: Final = 256
MAX_DETAIL: Final = 1024
MAX_DIM: Final = 1 << 20
"""Bound on every layout size (layers, heads, head dim, block size, TP/PP sizes)."""

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
Digest32 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Order = Annotated[str, msgspec.Meta(max_length=8)]
Detail = Annotated[str, msgspec.Meta(max_length=MAX_DETAIL)]


class HandshakeError(InvalidInput):
    """A handshake message that cannot be taken: ``reason`` is what a ``Refuse`` would say."""

    def __init__(self, reason: RefuseReason, detail: str) -> None:
        self.reason = reason
        self.detail = detail[:MAX_DETAIL]
        super().__init__(f"{reason.value}: {self.detail}")


class Operation(Enum):
    """One-sided operations a transport may run: the sender writes, or the receiver reads."""

    WRITE = "write"
    READ = "read"


class Transport(Enum):
    TCP = "tcp"
    NIXL = "nixl"
    SHARED_TIER = "shared_tier"
    """No wire between the two: the sender stores, the receiver reads a tier both reach (the
    vLLM connector's producer/consumer roles, ``connectors/vllm_pd.py``)."""


class _Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every wire struct: immutable, strict about unknown fields."""


class WireLayout(_Wire, frozen=True):
    """``KVLayout`` on the wire, every field explicit (no defaults: the spec is this list)."""

    num_layers: Positive
    num_kv_heads: Positive
    head_dim: Positive
    block_size: Positive
    dtype: Name
    order: Order
    codec_id: Name
    codec_version: Count
    tp_size: Positive
    tp_rank: Count
    pp_size: Positive
    pp_stage: Count

    @classmethod
    def of(cls, layout: KVLayout) -> WireLayout:
        return cls(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            dtype=layout.dtype,
            order=layout.order,
            codec_id=layout.codec_id,
            codec_version=layout.codec_version,
            tp_size=layout.tp_size,
            tp_rank=layout.tp_rank,
            pp_size=layout.pp_size,
            pp_stage=layout.pp_stage,
        )

    def layout(self) -> KVLayout:
        return KVLayout(**msgspec.structs.asdict(self))


class BlockEntry(_Wire, frozen=True, array_like=True):
    """``[index, tokens, key]``: the sender's block ``index`` holds ``tokens`` tokens under the
    sender's chained ``key`` (the receiver maps each to its own key)."""

    index: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
    tokens: Positive
    key: Digest32


class MemoryDescriptor(_Wire, frozen=True):
    """A registered memory region a one-sided transport (NIXL) reads or writes."""

    region_id: U64
    offset: U64
    length: Annotated[int, msgspec.Meta(ge=1)]


class TransferOffer(_Wire, frozen=True, tag="offer", tag_field="type"):
    version: int
    model_digest: Digest32
    layout: WireLayout
    request_id: Name
    tenant: Name
    blocks: Annotated[tuple[BlockEntry, ...], msgspec.Meta(max_length=MAX_BLOCKS)]
    operations: Annotated[tuple[Operation, ...], msgspec.Meta(min_length=1, max_length=4)]
    transports: Annotated[tuple[Transport, ...], msgspec.Meta(min_length=1, max_length=4)]
    descriptors: Annotated[
        tuple[MemoryDescriptor, ...], msgspec.Meta(max_length=MAX_DESCRIPTORS)
    ] = ()


class WireHeadSource(_Wire, frozen=True, array_like=True):
    """``HeadSource`` on the wire: ``[source_rank, source_start, target_start, count]``."""

    source_rank: Count
    source_start: Count
    target_start: Count
    count: Positive


class WireStep(_Wire, frozen=True):
    """``ConversionStep`` on the wire; fields a kind does not use are omitted."""

    kind: StepKind
    source_order: Order = ""
    target_order: Order = ""
    heads: Annotated[tuple[WireHeadSource, ...], msgspec.Meta(max_length=MAX_HEAD_PIECES)] = ()
    source_block_size: Count = 0
    target_block_size: Count = 0
    source_dtype: Name = ""
    target_dtype: Name = ""

    @classmethod
    def of(cls, step: ConversionStep) -> WireStep:
        return cls(
            kind=step.kind,
            source_order=step.source_order,
            target_order=step.target_order,
            heads=tuple(
                WireHeadSource(h.source_rank, h.source_start, h.target_start, h.count)
                for h in step.heads
            ),
            source_block_size=step.source_block_size,
            target_block_size=step.target_block_size,
            source_dtype=step.source_dtype,
            target_dtype=step.target_dtype,
        )

    def step(self) -> ConversionStep:
        return ConversionStep(
            kind=self.kind,
            source_order=self.source_order,
            target_order=self.target_order,
            heads=tuple(
                HeadSource(h.source_rank, h.source_start, h.target_start, h.count)
                for h in self.heads
            ),
            source_block_size=self.source_block_size,
            target_block_size=self.target_block_size,
            source_dtype=self.source_dtype,
            target_dtype=self.target_dtype,
        )


class Accept(_Wire, frozen=True, tag="accept", tag_field="type"):
    version: int
    transport: Transport
    operation: Operation


class AcceptWithConversion(_Wire, frozen=True, tag="accept_with_conversion", tag_field="type"):
    version: int
    transport: Transport
    operation: Operation
    target: WireLayout  # the receiving rank's layout: the plan's target
    steps: Annotated[tuple[WireStep, ...], msgspec.Meta(min_length=1, max_length=MAX_STEPS)]
    lossless: bool


class Refuse(_Wire, frozen=True, tag="refuse", tag_field="type"):
    version: int
    reason: RefuseReason
    detail: Detail = ""


TransferAnswer: TypeAlias = Accept | AcceptWithConversion | Refuse
HandshakeMessage: TypeAlias = TransferOffer | TransferAnswer


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(message: HandshakeMessage) -> bytes:
    return _ENCODER.encode(message)
