"""The compatibility handshake: every answer and refusal, round trips, hostile bytes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.errors import InvalidInput
from kvstrata.transfer.handshake import (
    MAX_BLOCKS,
    PROTOCOL_VERSION,
    Accept,
    AcceptWithConversion,
    BlockEntry,
    HandshakeError,
    MemoryDescriptor,
    Operation,
    ReceiverCapabilities,
    Refuse,
    TransferAnswer,
    TransferOffer,
    Transport,
    WireLayout,
    answer_offer,
    check_answer,
    decode_answer,
    decode_offer,
    encode,
    negotiate,
    refuse,
)
from kvstrata.transfer.layout import ConversionPlan, KVLayout, RefuseReason, plan_conversion

MODEL = bytes(range(32))
LIMIT = 8 << 20
SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
TP2 = KVLayout(num_layers=4, num_kv_heads=4, head_dim=8, block_size=16, dtype="float32", tp_size=2)


def offer(layout: KVLayout = SMOL, **changes: Any) -> TransferOffer:
    base = TransferOffer(
        version=PROTOCOL_VERSION,
        model_digest=MODEL,
        layout=WireLayout.of(layout),
        request_id="req-1",
        tenant="acme",
        blocks=(BlockEntry(0, layout.block_size, b"\x01" * 32), BlockEntry(1, 3, b"\x02" * 32)),
        operations=(Operation.WRITE,),
        transports=(Transport.TCP, Transport.NIXL),
        descriptors=(MemoryDescriptor(region_id=7, offset=0, length=4096),),
    )
    return msgspec.structs.replace(base, **changes)


def receiver(layout: KVLayout = SMOL, **changes: Any) -> ReceiverCapabilities:
    return dataclasses.replace(
        ReceiverCapabilities(model_digest=MODEL, layout=layout, tenant_allowed={"acme"}),
        **changes,
    )


def roundtrip_offer(message: TransferOffer) -> TransferOffer:
    return decode_offer(encode(message), max_bytes=LIMIT)


def roundtrip_answer(message: TransferAnswer) -> TransferAnswer:
    return decode_answer(encode(message), max_bytes=LIMIT)


def as_map(message: TransferOffer) -> dict[str, Any]:
    raw = msgspec.msgpack.decode(encode(message))
    assert isinstance(raw, dict)
    return raw


def test_identical_layouts_accept_and_the_sender_agrees() -> None:
    sent = roundtrip_offer(offer())
    answer = roundtrip_answer(negotiate(sent, receiver()))
    assert answer == Accept(version=1, transport=Transport.TCP, operation=Operation.WRITE)
    plan = check_answer(sent, answer)
    assert isinstance(plan, ConversionPlan) and plan.identity


def test_the_receivers_preferred_transport_in_common_is_chosen() -> None:
    answer = negotiate(offer(), receiver(transports=(Transport.NIXL, Transport.TCP)))
    assert isinstance(answer, Accept) and answer.transport is Transport.NIXL


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (SMOL, dataclasses.replace(SMOL, block_size=32)),
        (SMOL, dataclasses.replace(SMOL, order="HTKLD")),
        (TP2, dataclasses.replace(TP2, tp_size=1)),
        (dataclasses.replace(TP2, tp_size=1), TP2.rank(1)),
    ],
    ids=["reblock", "reorder", "tp2to1", "tp1to2"],
)
def test_lossless_conversion_is_accepted_with_the_senders_own_plan(
    source: KVLayout, target: KVLayout
) -> None:
    sent = roundtrip_offer(offer(source))
    answer = roundtrip_answer(negotiate(sent, receiver(target)))
    assert isinstance(answer, AcceptWithConversion) and answer.lossless
    assert answer.target.layout() == target
    assert check_answer(sent, answer) == plan_conversion(source, target)


def test_a_lossy_plan_is_refused_unless_the_receiver_allows_lossy() -> None:
    bf16 = dataclasses.replace(SMOL, dtype="bfloat16")
    refused = negotiate(offer(), receiver(bf16))
    assert isinstance(refused, Refuse) and refused.reason is RefuseReason.LOSSY_NOT_ALLOWED
    assert "float32→bfloat16" in refused.detail
    answer = roundtrip_answer(negotiate(offer(), receiver(bf16, allow_lossy=True)))
    assert isinstance(answer, AcceptWithConversion) and not answer.lossless
    plan = check_answer(offer(), answer)
    assert isinstance(plan, ConversionPlan) and not plan.lossless


def _negotiated(sent: TransferOffer, capabilities: ReceiverCapabilities) -> RefuseReason:
    answer = roundtrip_answer(negotiate(sent, capabilities))
    assert isinstance(answer, Refuse), answer
    return answer.reason


def _decoded(raw: bytes, max_bytes: int = LIMIT) -> RefuseReason:
    with pytest.raises(HandshakeError) as caught:
        decode_offer(raw, max_bytes=max_bytes)
    answer = answer_offer(raw, receiver(), max_bytes=max_bytes)
    assert isinstance(answer, Refuse) and answer.reason is caught.value.reason
    return caught.value.reason


def _layout_field(**changes: Any) -> bytes:
    raw = as_map(offer())
    raw["layout"].update(changes)
    return msgspec.msgpack.encode(raw)


def _tampered_plan() -> RefuseReason:
    sent = offer()
    answer = negotiate(sent, receiver(dataclasses.replace(SMOL, block_size=32)))
    assert isinstance(answer, AcceptWithConversion)
    wrong = msgspec.structs.replace(
        answer, steps=(msgspec.structs.replace(answer.steps[0], target_block_size=64),)
    )
    with pytest.raises(HandshakeError) as caught:
        check_answer(sent, wrong)
    return caught.value.reason


OTHER_MODEL = bytes(32)
SCENARIOS: dict[RefuseReason, Callable[[], RefuseReason]] = {
    RefuseReason.SHAPE_MISMATCH: lambda: _negotiated(
        offer(), receiver(dataclasses.replace(SMOL, num_layers=24))
    ),
    RefuseReason.ORDER_UNKNOWN: lambda: _decoded(_layout_field(order="LKHTX")),
    RefuseReason.DTYPE_UNSUPPORTED: lambda: _decoded(_layout_field(dtype="int4")),
    RefuseReason.CODEC_UNSUPPORTED: lambda: _negotiated(
        offer(), receiver(dataclasses.replace(SMOL, codec_id="kivi"))
    ),
    RefuseReason.HEADS_NOT_DIVISIBLE: lambda: _decoded(_layout_field(tp_size=2)),
    RefuseReason.PIPELINE_MISMATCH: lambda: _negotiated(
        offer(), receiver(dataclasses.replace(SMOL, pp_size=2))
    ),
    RefuseReason.INVALID_LAYOUT: lambda: _decoded(_layout_field(tp_rank=1)),
    RefuseReason.MODEL_MISMATCH: lambda: _negotiated(offer(model_digest=OTHER_MODEL), receiver()),
    RefuseReason.VERSION_UNSUPPORTED: lambda: _decoded(
        msgspec.msgpack.encode({**as_map(offer()), "version": 2, "new_field": 1})
    ),
    RefuseReason.TENANT_FORBIDDEN: lambda: _negotiated(offer(tenant="mallory"), receiver()),
    RefuseReason.TRANSPORT_UNSUPPORTED: lambda: _negotiated(
        offer(transports=(Transport.NIXL,)), receiver()
    ),
    RefuseReason.OPERATION_UNSUPPORTED: lambda: _negotiated(
        offer(operations=(Operation.READ,)), receiver()
    ),
    RefuseReason.LOSSY_NOT_ALLOWED: lambda: _negotiated(
        offer(), receiver(dataclasses.replace(SMOL, dtype="float16"))
    ),
    RefuseReason.TOO_LARGE: lambda: _negotiated(offer(), receiver(max_blocks=1)),
    RefuseReason.MALFORMED: lambda: _decoded(b"\xc1"),
    RefuseReason.PLAN_MISMATCH: _tampered_plan,
}


def test_every_reason_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(RefuseReason)


@pytest.mark.parametrize("reason", list(SCENARIOS), ids=lambda r: r.value)
def test_each_refusal_reason(reason: RefuseReason) -> None:
    assert SCENARIOS[reason]() is reason


def test_reason_wire_strings_are_stable() -> None:
    assert {r.value for r in RefuseReason} >= {
        "model_mismatch",
        "version_unsupported",
        "tenant_forbidden",
        "transport_unsupported",
        "operation_unsupported",
        "malformed",
        "too_large",
        "lossy_not_allowed",
        "plan_mismatch",
    }
    raw = encode(refuse(RefuseReason.TENANT_FORBIDDEN, "x"))
    assert msgspec.msgpack.decode(raw) == {
        "type": "refuse",
        "version": 1,
        "reason": "tenant_forbidden",
        "detail": "x",
    }


def test_the_refusal_order_is_version_model_tenant_transport_operation_size() -> None:
    bad = offer(model_digest=OTHER_MODEL, tenant="mallory", transports=(Transport.NIXL,))
    assert _negotiated(bad, receiver(versions=frozenset({2}))) is RefuseReason.VERSION_UNSUPPORTED
    assert _negotiated(bad, receiver()) is RefuseReason.MODEL_MISMATCH
    assert _negotiated(offer(tenant="mallory"), receiver(max_blocks=0)) is (
        RefuseReason.TENANT_FORBIDDEN
    )


def test_a_tenant_predicate_is_honoured() -> None:
    allowed = receiver(tenant_allowed=lambda tenant: tenant.startswith("ac"))
    assert isinstance(negotiate(offer(), allowed), Accept)
    assert _negotiated(offer(tenant="zed"), allowed) is RefuseReason.TENANT_FORBIDDEN


def test_one_tenant_name_is_not_a_set_of_names() -> None:
    with pytest.raises(InvalidInput):
        receiver(tenant_allowed="acme-corp")


def test_oversized_input_is_refused_before_decoding() -> None:
    raw = encode(offer())
    assert _decoded(raw, max_bytes=len(raw) - 1) is RefuseReason.TOO_LARGE
    assert roundtrip_offer(offer()) == offer()
    with pytest.raises(HandshakeError) as caught:
        decode_answer(b"\x00" * 65, max_bytes=64)
    assert caught.value.reason is RefuseReason.TOO_LARGE


def _mutated(**changes: Any) -> bytes:
    return msgspec.msgpack.encode({**as_map(offer()), **changes})


KEY = b"\x03" * 32


@pytest.mark.parametrize(
    "raw",
    [
        _mutated(model_digest=b"\x00" * 31),
        _mutated(blocks=[[0, 16, b"\x00" * 33]]),
        _mutated(blocks=[[0, -1, KEY]]),
        _mutated(blocks=[[1, 16, KEY], [0, 16, KEY]]),  # not increasing
        _mutated(blocks=[[0, 17, KEY]]),  # more tokens than a block holds
        _mutated(blocks=[[0, 3, KEY], [1, 16, KEY]]),  # a partial block before the end
        _mutated(blocks=[[0, True, KEY]]),  # bool is not an int
        _mutated(descriptors=[{"region_id": 0, "offset": 2**64 - 1, "length": 2}]),
        _mutated(descriptors=[{"region_id": 0, "offset": 0, "length": 0}]),
        _mutated(transports=["tcp", "tcp"]),
        _mutated(transports=["carrier-pigeon"]),
        _mutated(operations=[]),
        _mutated(request_id=""),
        _mutated(tenant="t" * 257),
        _mutated(unexpected=1),
        _mutated(type="accept"),
        _mutated(layout=[1, 2, 3]),
        _layout_field(num_layers=-30),
        _layout_field(block_size=2**40),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"version": "1"}),
        b"\x91" * 100_000 + b"\x00",  # nested arrays, very deep
        b"",
    ],
)
def test_hostile_offers_are_malformed(raw: bytes) -> None:
    assert _decoded(raw) is RefuseReason.MALFORMED


def test_too_many_blocks_is_malformed_even_under_the_byte_limit() -> None:
    blocks = [[index, 16, KEY] for index in range(MAX_BLOCKS + 1)]
    assert _decoded(_mutated(blocks=blocks), max_bytes=64 << 20) is RefuseReason.MALFORMED


layouts = st.builds(
    lambda tp, bs, dtype, order: KVLayout(
        num_layers=4,
        num_kv_heads=8,
        head_dim=16,
        block_size=bs,
        dtype=dtype,
        order=order,
        tp_size=tp[0],
        tp_rank=tp[1],
    ),
    st.sampled_from([1, 2, 4, 8, 16]).flatmap(
        lambda t: st.tuples(st.just(t), st.integers(0, t - 1))
    ),
    st.sampled_from([8, 16, 32]),
    st.sampled_from(["float32", "bfloat16", "float16"]),
    st.permutations("LKHTD").map("".join),
)
offers = st.builds(
    lambda layout, count, tenant, rid, ops, transports, regions: offer(
        layout,
        tenant=tenant,
        request_id=rid,
        blocks=tuple(BlockEntry(i, layout.block_size, bytes([i % 256]) * 32) for i in range(count)),
        operations=tuple(ops),
        transports=tuple(transports),
        descriptors=tuple(MemoryDescriptor(r, o, n) for r, o, n in regions),
    ),
    layouts,
    st.integers(0, 40),
    st.text(max_size=40),
    st.text(min_size=1, max_size=40),
    st.lists(st.sampled_from(Operation), min_size=1, max_size=2, unique=True),
    st.lists(st.sampled_from(Transport), min_size=1, max_size=2, unique=True),
    st.lists(st.tuples(st.integers(0, 2**63), st.integers(0, 2**40), st.integers(1, 2**40))),
)


@given(offers, layouts, st.booleans())
@settings(max_examples=150, deadline=None)
def test_every_message_round_trips_and_the_sender_agrees(
    sent: TransferOffer, target: KVLayout, lossy: bool
) -> None:
    assert roundtrip_offer(sent) == sent
    answer = negotiate(sent, receiver(target, allow_lossy=lossy, tenant_allowed=lambda _: True))
    assert roundtrip_answer(answer) == answer
    outcome = check_answer(sent, roundtrip_answer(answer))
    if isinstance(answer, Refuse):
        assert outcome == answer
    else:
        assert isinstance(outcome, ConversionPlan)
        expected = plan_conversion(sent.layout.layout(), target)
        assert isinstance(expected, ConversionPlan) and outcome.steps == expected.steps
        assert isinstance(answer, Accept) == expected.identity


def _only_handshake_errors(raw: bytes) -> None:
    for decode in (decode_offer, decode_answer):
        with contextlib.suppress(HandshakeError):
            decode(raw, max_bytes=LIMIT)
    assert isinstance(answer_offer(raw, receiver(), max_bytes=LIMIT), Accept | Refuse)


@given(st.binary(max_size=512))
@settings(max_examples=300)
def test_random_bytes_raise_only_handshake_errors(raw: bytes) -> None:
    _only_handshake_errors(raw)


@given(offers, st.data())
@settings(max_examples=100, deadline=None)
def test_truncated_messages_are_malformed(sent: TransferOffer, data: st.DataObject) -> None:
    raw = encode(sent)
    cut = data.draw(st.integers(0, len(raw) - 1))
    assert _decoded(raw[:cut]) is RefuseReason.MALFORMED


hostile_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@given(st.data())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_hostile_field_values_raise_only_handshake_errors(data: st.DataObject) -> None:
    raw_offer = as_map(offer())
    field = data.draw(st.sampled_from([*raw_offer, "layout.order", "layout.tp_size", "blocks.0"]))
    value = data.draw(hostile_values)
    if field.startswith("layout."):
        raw_offer["layout"][field.split(".")[1]] = value
    elif field == "blocks.0":
        raw_offer["blocks"][0] = value
    else:
        raw_offer[field] = value
    _only_handshake_errors(msgspec.msgpack.encode(raw_offer))
    answer = msgspec.msgpack.decode(encode(negotiate(offer(), receiver())))
    answer[data.draw(st.sampled_from([*answer, "steps"]))] = value
    _only_handshake_errors(msgspec.msgpack.encode(answer))
