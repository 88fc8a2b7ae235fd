"""The transport seam of a KV transfer: framed, ordered, one peer per connection.

Primitives and their contracts (checked for every transport by ``tests/test_transfer_stream.py``):

- ``Transport.listen(host, port) -> Listener``: bind on loopback by default (``port=0``: any
  free port); ``Listener.address`` is what the peer passes to ``connect``.
- ``Listener.accept(timeout_s) -> Connection``: one peer; ``TransportTimeout`` if none came.
- ``Transport.connect(address, timeout_s) -> Connection``: returns only once the peer proved
  to be a transfer listener (TCP: the listener speaks first, a fixed greeting, before the
  connecting side sends anything; NIXL's control channel is that TCP connection). Anything
  else at the address — another service, a port nobody listens on — is a ``TransportError``
  that names no byte the peer sent: ``POST /kv/prefill`` names its target, so a worker must
  never write to, or report on, whatever a caller points it at.
- ``Connection.send_frame(*parts, timeout_s)``: one frame whose body is the parts concatenated
  (bytes or memoryviews of a memory region; a transport may send the region without copying it
  into a Python object). It returns once the frame is handed over — the transport's completion
  notification: TCP has it in the kernel's send buffer, NIXL has it written into the peer's
  registered memory (transfer state DONE). Frames arrive whole and in order, or not at all.
- ``Connection.recv_frame(timeout_s) -> bytes-like``: the next whole frame, valid until the
  next ``recv_frame`` on that connection (a transport may reuse its buffer). A timeout before
  the frame is complete raises ``TransportTimeout`` and leaves the connection usable (the next
  call resumes the same frame). The peer gone (EOF, reset) raises ``PeerLost``; a frame over
  ``max_frame`` bytes or a broken framing header raises ``FrameError`` (the connection is then
  unusable: close it).
- ``Connection.recv_frame_into(buffers, timeout_s)``: the next frame, written into
  ``buffers`` (writable, contiguous byte memoryviews: format ``B``) in order (TCP scatters it
  there straight from the socket; others may copy). Its length must equal their total, else
  ``FrameError`` (the connection is then unusable).
  Resumable like ``recv_frame``: after a ``TransportTimeout`` call it again with the same
  buffers.
- ``close()`` on either is idempotent.

Transport errors are ours (``TransportError`` and subclasses): socket and library errors are
mapped at the transport's edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstrata.errors import KvstrataError

Buffer = bytes | bytearray | memoryview
Address = tuple[str, int]

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
"""Frames above this are refused on both sides (a hostile length cannot make us allocate)."""


class TransportError(KvstrataError):
    """The transport failed (setup, I/O, library error)."""


class TransportTimeout(TransportError):
    """Nothing (or not a whole frame) arrived in time; the connection stays usable."""


class PeerLost(TransportError):
    """The peer went away (EOF, reset): no more frames will come."""


class FrameError(TransportError):
    """A frame broke the framing rules (oversized, bad header): the connection is unusable."""


class Connection(Protocol):
    path: str  # the metrics label of the transport: "tcp", "nixl"
    max_frame: int

    def send_frame(self, *parts: Buffer, timeout_s: float | None = None) -> None: ...

    def recv_frame(self, *, timeout_s: float | None = None) -> Buffer: ...

    def recv_frame_into(
        self, buffers: Sequence[memoryview], *, timeout_s: float | None = None
    ) -> None: ...

    def close(self) -> None: ...


class Listener(Protocol):
    @property
    def address(self) -> Address: ...

    def accept(self, *, timeout_s: float | None = None) -> Connection: ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> Listener: ...

    def connect(self, address: Address, *, timeout_s: float | None = None) -> Connection: ...


def frame_length(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(part).nbytes for part in parts)


def copy_into(body: Buffer, buffers: Sequence[memoryview]) -> None:
    """``recv_frame_into`` for a transport that receives whole frames: split ``body`` over
    ``buffers`` (``FrameError`` if the sizes differ)."""
    data = memoryview(body).cast("B")
    if data.nbytes != frame_length(buffers):
        raise FrameError(f"frame of {data.nbytes} bytes for {frame_length(buffers)} expected")
    offset = 0
    for buffer in buffers:
        size = buffer.nbytes
        buffer[:] = data[offset : offset + size]
        offset += size


TRANSPORT_NAMES: tuple[str, ...] = ("tcp", "nixl")


def make_transport(name: str) -> Transport:
    """The transport a ``[transfer] transport`` name selects; NIXL missing → ``TransportError``
    (with the reason it does not import)."""
    if name == "tcp":
        from kvstrata.transfer.tcp import TcpTransport

        return TcpTransport()
    if name == "nixl":
        from kvstrata.transfer.nixl_transport import NixlTransport

        return NixlTransport()
    raise TransportError(f"unknown transport {name!r} (known: {', '.join(TRANSPORT_NAMES)})")
