"""The intro frame before a transfer's handshake: bounded, strict decoding and its MAC."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.transfer.intro import (
    TransferIntro,
    decode_intro,
    encode_intro,
    intro_authentic,
    intro_mac,
)
from kvstrata.transfer.layout import RefuseReason
from kvstrata.transfer.messages import PROTOCOL_VERSION, HandshakeError

SECRET = b"deployment-secret"


def _intro(tokens: tuple[int, ...] = (1, 2, 3), secret: bytes = SECRET) -> TransferIntro:
    mac = intro_mac(secret, "r-1", "acme", tokens)
    return TransferIntro(PROTOCOL_VERSION, "r-1", tokens, "acme", mac)


def test_round_trip_and_mac() -> None:
    intro = _intro()
    decoded = decode_intro(encode_intro(intro))
    assert decoded == intro and intro_authentic(decoded, SECRET)
    assert not intro_authentic(decoded, b"another secret")
    moved = msgspec.structs.replace(intro, prompt_token_ids=(1, 2, 4))
    assert not intro_authentic(moved, SECRET)  # the MAC covers the tokens
    other_tenant = msgspec.structs.replace(intro, tenant="acmf")
    assert not intro_authentic(other_tenant, SECRET)


def test_bad_intros_are_one_handshake_error() -> None:
    raw = encode_intro(_intro())
    with pytest.raises(HandshakeError) as caught:
        decode_intro(raw, max_bytes=len(raw) - 1)
    assert caught.value.reason is RefuseReason.TOO_LARGE
    newer = encode_intro(msgspec.structs.replace(_intro(), version=PROTOCOL_VERSION + 1))
    with pytest.raises(HandshakeError) as caught:
        decode_intro(newer)
    assert caught.value.reason is RefuseReason.VERSION_UNSUPPORTED
    extra = msgspec.msgpack.encode({**msgspec.msgpack.decode(raw), "more": 1})
    for bad in (raw[:-3], extra, b"", msgspec.msgpack.encode({"type": "intro"})):
        with pytest.raises(HandshakeError) as caught:
            decode_intro(bad)
        assert caught.value.reason is RefuseReason.MALFORMED


@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash(raw: bytes) -> None:
    with contextlib.suppress(HandshakeError):  # anything else fails the test
        decode_intro(raw)
