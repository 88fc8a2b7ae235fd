"""The wire format of a layer-wise KV transfer (pure: encoding and decoding, no I/O).

Every frame starts with ``b"KX"``, a version byte (1), a kind byte and the request id (u16
length + UTF-8, at most ``MAX_REQUEST_ID`` bytes); integers are big-endian:

    BEGIN     u32 blocks, u32 layers, u32 layer_bytes (one layer of one block)
    LAYER     u32 block, u32 layer, 16-byte xxh3-128 digest of the payload, payload (the rest)
    LAYERS    u32 first block, u32 count, u32 layer, count 16-byte digests (one per block's
              slice), payload: count slices of ``layer_bytes``, block ``first`` first
    RUN       u32 first block, u32 count, u32 layer; the payload (count slices of
              ``layer_bytes``, block ``first`` first) is the *next* transport frame, alone, so
              the receiver can place it straight into its PENDING objects
              (``Connection.recv_frame_into``); its bytes are checked by the per-block digests
              of COMPLETE, before anything commits
    COMPLETE  u32 blocks, then that many 16-byte digests of each block's whole payload
    CANCEL    nothing more

``decode`` accepts exactly these shapes and raises ``MalformedFrame`` (a clear message) for
anything else — truncated, trailing bytes, unknown kind or version, out-of-range counts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from kvstrata.errors import InvalidInput

MAGIC = b"KX"
VERSION = 1
DIGEST_BYTES = 16
MAX_REQUEST_ID = 256
MAX_BLOCKS = 1 << 20
MAX_LAYERS = 4096

_PREFIX = struct.Struct(">2sBBH")
_BEGIN = struct.Struct(">III")
_LAYER = struct.Struct(">II16s")
_LAYERS = struct.Struct(">III")
_RUN = struct.Struct(">III")
_COUNT = struct.Struct(">I")


class MalformedFrame(InvalidInput):
    """A frame that is not one of the transfer's shapes."""


class Kind(IntEnum):
    BEGIN = 1
    LAYER = 2
    COMPLETE = 3
    CANCEL = 4
    LAYERS = 5
    RUN = 6


@dataclass(frozen=True)
class Begin:
    request_id: str
    blocks: int
    layers: int
    layer_bytes: int


@dataclass(frozen=True)
class Layer:
    request_id: str
    block: int
    layer: int
    digest: bytes
    payload: memoryview


@dataclass(frozen=True)
class Layers:
    """One layer of a run of consecutive blocks: what a sender ships per frame, so a frame
    carries up to megabytes instead of one block's slice (a few KB on small models)."""

    request_id: str
    first: int
    layer: int
    digests: tuple[bytes, ...]
    payload: memoryview

    def slice(self, index: int) -> memoryview:
        size = len(self.payload) // len(self.digests)
        return self.payload[index * size : (index + 1) * size]


@dataclass(frozen=True)
class Run:
    """One layer of ``count`` consecutive blocks whose bytes come as the next frame."""

    request_id: str
    first: int
    count: int
    layer: int


@dataclass(frozen=True)
class Complete:
    request_id: str
    digests: tuple[bytes, ...]


@dataclass(frozen=True)
class Cancel:
    request_id: str


Frame = Begin | Layer | Layers | Run | Complete | Cancel


def _prefix(kind: Kind, request_id: str) -> bytes:
    rid = request_id.encode("utf-8")
    if len(rid) > MAX_REQUEST_ID:
        raise InvalidInput(f"request id of {len(rid)} bytes over {MAX_REQUEST_ID}")
    return _PREFIX.pack(MAGIC, VERSION, kind, len(rid)) + rid


def encode_begin(request_id: str, blocks: int, layers: int, layer_bytes: int) -> bytes:
    return _prefix(Kind.BEGIN, request_id) + _BEGIN.pack(blocks, layers, layer_bytes)


def layer_header(request_id: str, block: int, layer: int, digest: bytes) -> bytes:
    """The LAYER frame without its payload (sent as a second part: no copy of the payload)."""
    return _prefix(Kind.LAYER, request_id) + _LAYER.pack(block, layer, digest)


def layers_header(request_id: str, first: int, layer: int, digests: list[bytes]) -> bytes:
    """The LAYERS frame without its payload (the slices follow as further parts)."""
    head = _prefix(Kind.LAYERS, request_id) + _LAYERS.pack(first, len(digests), layer)
    return head + b"".join(digests)


def layers_overhead(request_id: str, count: int) -> int:
    """Bytes of a LAYERS frame besides its payload."""
    return _PREFIX.size + len(request_id.encode("utf-8")) + _LAYERS.size + count * DIGEST_BYTES


def encode_run(request_id: str, first: int, count: int, layer: int) -> bytes:
    return _prefix(Kind.RUN, request_id) + _RUN.pack(first, count, layer)


def encode_complete(request_id: str, digests: list[bytes]) -> bytes:
    return _prefix(Kind.COMPLETE, request_id) + _COUNT.pack(len(digests)) + b"".join(digests)


def encode_cancel(request_id: str) -> bytes:
    return _prefix(Kind.CANCEL, request_id)


def decode(frame: bytes | bytearray | memoryview) -> Frame:
    view = memoryview(frame).cast("B")
    if len(view) < _PREFIX.size:
        raise MalformedFrame(f"frame of {len(view)} bytes is shorter than a header")
    magic, version, kind, rid_len = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise MalformedFrame(f"not a version-{VERSION} transfer frame")
    if rid_len > MAX_REQUEST_ID or len(view) < _PREFIX.size + rid_len:
        raise MalformedFrame("request id truncated or too long")
    try:
        request_id = bytes(view[_PREFIX.size : _PREFIX.size + rid_len]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedFrame("request id is not UTF-8") from exc
    body = view[_PREFIX.size + rid_len :]
    if kind == Kind.BEGIN:
        _exact(body, _BEGIN.size, "BEGIN")
        blocks, layers, layer_bytes = _BEGIN.unpack(body)
        if not (0 < blocks <= MAX_BLOCKS and 0 < layers <= MAX_LAYERS and layer_bytes > 0):
            raise MalformedFrame(f"BEGIN counts out of range: {blocks}, {layers}, {layer_bytes}")
        return Begin(request_id, blocks, layers, layer_bytes)
    if kind == Kind.LAYER:
        if len(body) < _LAYER.size:
            raise MalformedFrame("LAYER header truncated")
        block, layer, digest = _LAYER.unpack_from(body)
        return Layer(request_id, block, layer, digest, body[_LAYER.size :])
    if kind == Kind.LAYERS:
        if len(body) < _LAYERS.size:
            raise MalformedFrame("LAYERS header truncated")
        first, count, layer = _LAYERS.unpack_from(body)
        digests_end = _LAYERS.size + count * DIGEST_BYTES
        if not 0 < count <= MAX_BLOCKS or len(body) < digests_end:
            raise MalformedFrame(f"LAYERS of {count} blocks truncated or out of range")
        payload = body[digests_end:]
        if len(payload) % count:
            raise MalformedFrame(f"LAYERS payload of {len(payload)} bytes for {count} blocks")
        digests = body[_LAYERS.size : digests_end]
        return Layers(
            request_id,
            first,
            layer,
            tuple(bytes(digests[i : i + DIGEST_BYTES]) for i in range(0, len(digests), 16)),
            payload,
        )
    if kind == Kind.RUN:
        _exact(body, _RUN.size, "RUN")
        first, count, layer = _RUN.unpack(body)
        if not 0 < count <= MAX_BLOCKS:
            raise MalformedFrame(f"RUN of {count} blocks out of range")
        return Run(request_id, first, count, layer)
    if kind == Kind.COMPLETE:
        if len(body) < _COUNT.size:
            raise MalformedFrame("COMPLETE header truncated")
        (count,) = _COUNT.unpack_from(body)
        _exact(body, _COUNT.size + count * DIGEST_BYTES, "COMPLETE")
        digests = body[_COUNT.size :]
        return Complete(
            request_id,
            tuple(bytes(digests[i : i + DIGEST_BYTES]) for i in range(0, len(digests), 16)),
        )
    if kind == Kind.CANCEL:
        _exact(body, 0, "CANCEL")
        return Cancel(request_id)
    raise MalformedFrame(f"unknown frame kind {kind}")


def _exact(body: memoryview, size: int, what: str) -> None:
    if len(body) != size:
        raise MalformedFrame(f"{what} body of {len(body)} bytes, expected {size}")
