"""The prefill → decode compatibility handshake (pure: no torch, no I/O).

Before any KV byte moves, the sender (prefill side) sends a ``TransferOffer`` and the receiver
(decode side) answers with one ``TransferAnswer``:

- ``Accept``: the sender's blocks are the receiver's blocks byte for byte;
- ``AcceptWithConversion``: the receiver will convert, and says how (the plan's steps, so the
  sender can check them against its own ``plan_conversion`` — ``check_answer``);
- ``Refuse``: a reason from the closed ``RefuseReason`` list (stable wire strings) + a detail.

Where vLLM's compatibility hash says only yes or no, the answer says *what* differs and whether
it converts: the offer carries the model digest (``ModelFingerprint.model_digest``: the model
without its KV representation) and the full ``KVLayout``, so "another model" and "the same
model at another block size / TP size / dtype" are different answers.

The messages and their wire format are in ``messages.py`` (re-exported here). Decoding
(``decode_offer`` / ``decode_answer``) refuses input over ``max_bytes`` before parsing, reads
the version first (a newer peer gets ``version_unsupported``, not ``malformed``), then checks
types and bounds while parsing and the semantics after it; every failure is one
``HandshakeError`` carrying a ``RefuseReason``. ``answer_offer`` composes decode and
``negotiate`` for the thin I/O layer: it never raises on what a peer sent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec

from kvstrata.errors import InvalidInput
from kvstrata.transfer.layout import (
    ConversionPlan,
    KVLayout,
    RefuseReason,
    StepKind,
    plan_conversion,
)
from kvstrata.transfer.messages import (
    MAX_BLOCKS,
    MAX_DETAIL,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Accept,
    AcceptWithConversion,
    BlockEntry,
    HandshakeError,
    HandshakeMessage,
    MemoryDescriptor,
    Operation,
    Refuse,
    TransferAnswer,
    TransferOffer,
    Transport,
    WireLayout,
    WireStep,
    encode,
)

__all__ = [
    "MAX_BLOCKS",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Accept",
    "AcceptWithConversion",
    "BlockEntry",
    "HandshakeError",
    "HandshakeMessage",
    "MemoryDescriptor",
    "Operation",
    "ReceiverCapabilities",
    "Refuse",
    "TransferAnswer",
    "TransferOffer",
    "Transport",
    "WireLayout",
    "WireStep",
    "answer_offer",
    "check_answer",
    "decode_answer",
    "decode_offer",
    "encode",
    "negotiate",
    "refusal_for",
    "refuse",
    "validate_offer",
]

_U64_MAX: Final = (1 << 64) - 1


class _Envelope(msgspec.Struct):
    """What every version shares: read first, so a newer peer is told the version is the
    problem (unknown fields are skipped here, refused in the real decode)."""

    version: int


_M = TypeVar("_M")


def refuse(reason: RefuseReason, detail: str) -> Refuse:
    return Refuse(version=PROTOCOL_VERSION, reason=reason, detail=detail[:MAX_DETAIL])


def refusal_for(error: HandshakeError) -> Refuse:
    return refuse(error.reason, error.detail)


def _decode(raw: bytes, kind: type[_M] | object, *, max_bytes: int) -> _M:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise HandshakeError(RefuseReason.MALFORMED, f"not bytes: {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise HandshakeError(RefuseReason.TOO_LARGE, f"{len(raw)} bytes > {max_bytes}")
    try:
        envelope = msgspec.msgpack.decode(raw, type=_Envelope)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise HandshakeError(RefuseReason.MALFORMED, f"no versioned message: {exc}") from exc
    if envelope.version != PROTOCOL_VERSION:
        raise HandshakeError(
            RefuseReason.VERSION_UNSUPPORTED,
            f"version {envelope.version}; this side speaks {PROTOCOL_VERSION}",
        )
    try:
        decoded: _M = msgspec.msgpack.decode(raw, type=kind)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise HandshakeError(RefuseReason.MALFORMED, str(exc)) from exc
    return decoded


def validate_offer(offer: TransferOffer) -> None:
    """What types cannot say: a valid layout, canonical block mapping, regions inside 64 bits.

    Raises:
        HandshakeError: the first problem found.
    """
    layout = offer.layout.layout()
    problem = layout.problem()
    if problem is not None:
        raise HandshakeError(problem.reason, problem.detail)
    if not offer.request_id:
        raise HandshakeError(RefuseReason.MALFORMED, "empty request id")
    previous = -1
    for position, block in enumerate(offer.blocks):
        if block.index <= previous:
            raise HandshakeError(RefuseReason.MALFORMED, "block indices not strictly increasing")
        previous = block.index
        if block.tokens > layout.block_size:
            raise HandshakeError(
                RefuseReason.MALFORMED,
                f"block {block.index}: {block.tokens} tokens > block size {layout.block_size}",
            )
        if block.tokens < layout.block_size and position != len(offer.blocks) - 1:
            raise HandshakeError(RefuseReason.MALFORMED, f"partial block {block.index} not last")
    for descriptor in offer.descriptors:
        if descriptor.offset + descriptor.length > _U64_MAX + 1:
            raise HandshakeError(RefuseReason.MALFORMED, "memory region past 2**64")
    for name, values in (("operations", offer.operations), ("transports", offer.transports)):
        if len(set(values)) != len(values):
            raise HandshakeError(RefuseReason.MALFORMED, f"duplicate {name}")


def decode_offer(raw: bytes, *, max_bytes: int) -> TransferOffer:
    """Parse and validate an offer. Raises ``HandshakeError`` — and nothing else — on bad input."""
    offer: TransferOffer = _decode(raw, TransferOffer, max_bytes=max_bytes)
    validate_offer(offer)
    return offer


def decode_answer(raw: bytes, *, max_bytes: int) -> TransferAnswer:
    """Parse and validate an answer. Raises ``HandshakeError`` — and nothing else — on bad
    input. Whether the plan is the right one is ``check_answer``'s question."""
    answer: TransferAnswer = _decode(raw, TransferAnswer, max_bytes=max_bytes)
    if isinstance(answer, AcceptWithConversion):
        problem = answer.target.layout().problem()
        if problem is not None:
            raise HandshakeError(problem.reason, problem.detail)
    return answer


@dataclass(frozen=True)
class ReceiverCapabilities:
    """What a decode worker takes. ``transports`` and ``operations`` are in preference order;
    ``tenant_allowed`` is a set of tenant names or a predicate over one."""

    model_digest: bytes
    layout: KVLayout
    tenant_allowed: Collection[str] | Callable[[str], bool]
    transports: tuple[Transport, ...] = (Transport.TCP,)
    operations: tuple[Operation, ...] = (Operation.WRITE,)
    versions: frozenset[int] = frozenset({PROTOCOL_VERSION})
    allow_lossy: bool = False
    max_blocks: int = MAX_BLOCKS

    def __post_init__(self) -> None:
        if isinstance(self.tenant_allowed, str):  # "acme" in "acme-corp" would be a hole
            raise InvalidInput("tenant_allowed is a set of names or a predicate, not one str")

    def allows_tenant(self, tenant: str) -> bool:
        allowed = self.tenant_allowed
        return bool(allowed(tenant)) if callable(allowed) else tenant in allowed


def negotiate(offer: TransferOffer, receiver: ReceiverCapabilities) -> TransferAnswer:
    """The receiver's decision, checked in a fixed order (the first failure is the reason):
    version, model, tenant, transport, operation, size, then the layout plan."""
    if offer.version not in receiver.versions:
        return refuse(RefuseReason.VERSION_UNSUPPORTED, f"version {offer.version}")
    if offer.model_digest != receiver.model_digest:
        return refuse(
            RefuseReason.MODEL_MISMATCH,
            f"model {offer.model_digest.hex()[:16]}… vs {receiver.model_digest.hex()[:16]}…",
        )
    if not receiver.allows_tenant(offer.tenant):
        return refuse(RefuseReason.TENANT_FORBIDDEN, f"tenant {offer.tenant!r}")
    transport = next((t for t in receiver.transports if t in offer.transports), None)
    if transport is None:
        offered = ",".join(t.value for t in offer.transports)
        return refuse(RefuseReason.TRANSPORT_UNSUPPORTED, f"offered {offered}")
    operation = next((o for o in receiver.operations if o in offer.operations), None)
    if operation is None:
        offered = ",".join(o.value for o in offer.operations)
        return refuse(RefuseReason.OPERATION_UNSUPPORTED, f"offered {offered}")
    if len(offer.blocks) > receiver.max_blocks:
        return refuse(RefuseReason.TOO_LARGE, f"{len(offer.blocks)} blocks > {receiver.max_blocks}")
    plan = plan_conversion(offer.layout.layout(), receiver.layout)
    if not isinstance(plan, ConversionPlan):
        return refuse(plan.reason, plan.detail)
    if plan.identity:
        return Accept(version=PROTOCOL_VERSION, transport=transport, operation=operation)
    if not plan.lossless and not receiver.allow_lossy:
        casts = [s for s in plan.steps if s.kind is StepKind.CAST]
        detail = ", ".join(f"{s.source_dtype}→{s.target_dtype}" for s in casts)
        return refuse(RefuseReason.LOSSY_NOT_ALLOWED, f"lossy cast {detail}")
    return AcceptWithConversion(
        version=PROTOCOL_VERSION,
        transport=transport,
        operation=operation,
        target=WireLayout.of(receiver.layout),
        steps=tuple(WireStep.of(step) for step in plan.steps),
        lossless=plan.lossless,
    )


def answer_offer(raw: bytes, receiver: ReceiverCapabilities, *, max_bytes: int) -> TransferAnswer:
    """Decode + negotiate for the receiver's I/O layer: bad input becomes a ``Refuse``."""
    try:
        offer = decode_offer(raw, max_bytes=max_bytes)
    except HandshakeError as error:
        return refusal_for(error)
    return negotiate(offer, receiver)


def check_answer(offer: TransferOffer, answer: TransferAnswer) -> ConversionPlan | Refuse:
    """The sender's check of an answer: the plan the receiver will run (empty for ``Accept``)
    — which must be the sender's own ``plan_conversion`` — or the receiver's ``Refuse``.

    Raises:
        HandshakeError: the answer picks a transport or operation not offered
            (``*_unsupported``) or announces a plan that is not the sender's (``plan_mismatch``).
    """
    if isinstance(answer, Refuse):
        return answer
    if answer.transport not in offer.transports:
        raise HandshakeError(RefuseReason.TRANSPORT_UNSUPPORTED, answer.transport.value)
    if answer.operation not in offer.operations:
        raise HandshakeError(RefuseReason.OPERATION_UNSUPPORTED, answer.operation.value)
    source = offer.layout.layout()
    if isinstance(answer, Accept):
        return ConversionPlan(source, source, ())
    own = plan_conversion(source, answer.target.layout())
    if not isinstance(own, ConversionPlan):
        raise HandshakeError(RefuseReason.PLAN_MISMATCH, f"sender has no plan: {own.detail}")
    if tuple(WireStep.of(step) for step in own.steps) != answer.steps:
        raise HandshakeError(RefuseReason.PLAN_MISMATCH, "steps differ from the sender's plan")
    if own.lossless != answer.lossless:
        raise HandshakeError(RefuseReason.PLAN_MISMATCH, "lossless flag differs")
    return own
