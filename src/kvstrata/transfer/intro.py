"""The frame that opens a worker-to-worker transfer connection, before the handshake (pure).

``TransferIntro`` names the prompt a transfer is for: the decode worker computes its *own*
block keys from these token ids (its fingerprint, the offer's tenant), never trusting the
sender's keys for identity; a sender that lies about the tokens only stores KV under the keys
of the tokens it named. Wire: a msgpack map tagged ``"type": "intro"``, unknown fields refused,
bounded before parsing (``decode_intro`` raises only ``HandshakeError``).

``mac`` (``intro_mac``: keyed BLAKE2b-256 over the request id, tenant and token ids, keyed by
the deployment's tenant secret — the secret both workers need anyway for their keys to agree)
lets the receiver refuse a peer that does not hold the secret (``tenant_forbidden``) before
anything is written under a tenant's keys. Without a secret (a single-tenant deployment) the
MAC proves nothing; the transfer port then must stay on a trusted network.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Annotated, Final

import msgspec

from kvstrata.transfer.layout import RefuseReason
from kvstrata.transfer.messages import PROTOCOL_VERSION, HandshakeError, Name

MAX_PROMPT_TOKENS: Final = 1 << 20
MAX_INTRO_BYTES: Final = 8 * MAX_PROMPT_TOKENS

TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]


class TransferIntro(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="intro", tag_field="type"
):
    version: int
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    prompt_token_ids: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
    tenant: Name
    mac: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(TransferIntro)


def encode_intro(intro: TransferIntro) -> bytes:
    return _ENCODER.encode(intro)


def decode_intro(raw: bytes, *, max_bytes: int = MAX_INTRO_BYTES) -> TransferIntro:
    if len(raw) > max_bytes:
        raise HandshakeError(RefuseReason.TOO_LARGE, f"intro of {len(raw)} bytes")
    try:
        intro = _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise HandshakeError(RefuseReason.MALFORMED, f"intro: {exc}") from exc
    if intro.version != PROTOCOL_VERSION:
        raise HandshakeError(RefuseReason.VERSION_UNSUPPORTED, f"intro version {intro.version}")
    return intro


def intro_mac(secret: bytes, request_id: str, tenant: str, token_ids: Sequence[int]) -> bytes:
    """The intro's MAC (module docstring); ``secret`` is the deployment's tenant secret."""
    key = hashlib.blake2b(b"kvstrata.transfer.intro.v1\0" + secret, digest_size=32).digest()
    mac = hashlib.blake2b(key=key, digest_size=32)
    for text in (request_id, tenant):
        data = text.encode()
        mac.update(struct.pack("<I", len(data)) + data)
    mac.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    return mac.digest()


def intro_authentic(intro: TransferIntro, secret: bytes) -> bool:
    expected = intro_mac(secret, intro.request_id, intro.tenant, intro.prompt_token_ids)
    return hmac.compare_digest(expected, intro.mac)
