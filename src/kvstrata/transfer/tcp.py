"""The built-in transport: length-prefixed frames over plain TCP sockets (no dependency).

A frame is a 4-byte big-endian body length and the body. Receiving is resumable: a timeout in
the middle of a frame keeps what arrived, so a caller may poll with short timeouts (to notice a
cancellation) without losing the stream's framing. ``raw_socket_gbps`` measures this machine's
plain loopback socket throughput, the physical peer that transfer benchmarks report beside
their own figure.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Final

from kvstrata.transfer.transport import (
    DEFAULT_MAX_FRAME,
    Address,
    Buffer,
    FrameError,
    PeerLost,
    TransportError,
    TransportTimeout,
    frame_length,
)

_LENGTH = struct.Struct(">I")
_IOV_MAX = 1024
_FIRST_ALLOCATION: Final = 1 << 20
"""``recv_frame``'s buffer starts at most this large and doubles as a frame's bytes arrive:
what a peer makes the receiver hold is what it sent, not what its 4-byte header announced."""
GREETING: Final = b"kvstrata-transfer/1\n"
"""What a listener sends on every accepted connection before anything else, and what
``connect`` waits for before it sends a byte (``transport`` module docstring): a worker told
to connect somewhere that is not a transfer listener writes nothing there."""


class TcpConnection:
    path = "tcp"

    def __init__(self, sock: socket.socket, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self.max_frame = max_frame
        self._header = bytearray(_LENGTH.size)
        self._header_got = 0
        self._buffer = bytearray()  # reused for every frame (grown to the largest one)
        self._want: int | None = None  # the length of the frame being received
        self._body_got = 0
        self._scatter: list[memoryview] | None = None  # recv_frame_into's buffers, in progress
        self._scatter_at = 0
        self._broken: str | None = None
        self._closed = False

    def send_frame(self, *parts: Buffer, timeout_s: float | None = None) -> None:
        if self._broken is not None:
            raise FrameError(f"connection unusable: {self._broken}")
        views = [_byte_view(part) for part in parts]
        length = sum(view.nbytes for view in views)
        if length > self.max_frame:
            raise FrameError(f"frame of {length} bytes over the limit of {self.max_frame}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = [memoryview(_LENGTH.pack(length)), *(view for view in views if view.nbytes)]
        left = _LENGTH.size + length
        try:
            while True:  # one sendmsg per frame (gathered), resumed after a partial send
                self._sock.settimeout(_remaining(deadline))
                sent = self._sock.sendmsg(pending)
                left -= sent
                if not left:
                    break
                done = 0  # a partial send: drop what went out, resume mid-buffer
                while sent >= pending[done].nbytes:
                    sent -= pending[done].nbytes
                    done += 1
                pending = pending[done:]
                pending[0] = pending[0][sent:]
        except TimeoutError as exc:
            self._broken = "send timed out mid-frame"
            raise TransportTimeout(f"sending a {length}-byte frame timed out") from exc
        except OSError as exc:
            raise PeerLost(f"peer gone while sending: {exc}") from exc

    def recv_frame(self, *, timeout_s: float | None = None) -> Buffer:
        deadline = self._usable(timeout_s)
        try:
            length = self._length(deadline)
            if self._want is None:
                self._want, self._body_got = length, 0
                if len(self._buffer) < min(length, _FIRST_ALLOCATION):
                    self._buffer = bytearray(min(length, _FIRST_ALLOCATION))
            while self._body_got < self._want:
                if self._body_got == len(self._buffer):  # full: double (a held frame keeps
                    grown = bytearray(min(self._want, 2 * len(self._buffer)))  # the old one)
                    grown[: self._body_got] = memoryview(self._buffer)[: self._body_got]
                    self._buffer = grown
                end = min(len(self._buffer), self._want)
                view = memoryview(self._buffer)[self._body_got : end]
                self._body_got += self._recv_into(view, deadline, mid=True)
        except TimeoutError as exc:
            raise TransportTimeout("no whole frame arrived in time") from exc
        except OSError as exc:
            raise PeerLost(f"peer gone: {exc}") from exc
        body = memoryview(self._buffer)[: self._want]
        self._want = None
        self._header_got = 0
        return body

    def recv_frame_into(
        self, buffers: Sequence[memoryview], *, timeout_s: float | None = None
    ) -> None:
        """The next frame scattered by the kernel straight into ``buffers`` (``recvmsg_into``,
        at most ``_IOV_MAX`` buffers a call): no copy through a buffer of ours."""
        deadline = self._usable(timeout_s)
        try:
            length = self._length(deadline)
            if self._scatter is None:
                want = frame_length(buffers)
                if length != want:
                    self._broken = f"frame of {length} bytes where {want} were expected"
                    raise FrameError(self._broken)
                self._scatter = [b for b in buffers if b.nbytes]
                self._scatter_at = 0
            views, at = self._scatter, self._scatter_at
            while at < len(views):
                self._sock.settimeout(_remaining(deadline))
                got = self._sock.recvmsg_into(views[at : at + _IOV_MAX])[0]
                if got == 0:
                    raise PeerLost("peer closed the connection mid-frame")
                while at < len(views) and got >= views[at].nbytes:
                    got -= views[at].nbytes
                    at += 1
                if got:
                    views[at] = views[at][got:]
                self._scatter_at = at
        except TimeoutError as exc:
            raise TransportTimeout("no whole frame arrived in time") from exc
        except OSError as exc:
            raise PeerLost(f"peer gone: {exc}") from exc
        self._scatter = None
        self._header_got = 0

    def _usable(self, timeout_s: float | None) -> float | None:
        """The deadline of a receive, once the connection is known usable."""
        if self._broken is not None:
            raise FrameError(f"connection unusable: {self._broken}")
        return None if timeout_s is None else time.monotonic() + timeout_s

    def _length(self, deadline: float | None) -> int:
        """The current frame's length (its header read first, resumably), within the limit."""
        while self._header_got < len(self._header):
            view = memoryview(self._header)[self._header_got :]
            self._header_got += self._recv_into(view, deadline, mid=self._header_got > 0)
        (length,) = _LENGTH.unpack(self._header)
        if length > self.max_frame:
            self._broken = f"announced frame of {length} bytes"
            raise FrameError(f"frame of {length} bytes over the limit {self.max_frame}")
        return int(length)

    def _recv_into(self, view: memoryview, deadline: float | None, *, mid: bool) -> int:
        self._sock.settimeout(_remaining(deadline))
        got = self._sock.recv_into(view)
        if got == 0:
            raise PeerLost("peer closed the connection" + (" mid-frame" if mid else ""))
        return got

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()


def _byte_view(part: Buffer) -> memoryview:
    """``part`` as a flat byte view (a byte view as given: the sender's slices already are)."""
    if isinstance(part, memoryview) and part.format == "B" and part.ndim == 1 and part.c_contiguous:
        return part
    return memoryview(part).cast("B")


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


class TcpListener:
    def __init__(self, host: str, port: int, *, max_frame: int) -> None:
        self._sock = socket.create_server((host, port))
        self.max_frame = max_frame

    @property
    def address(self) -> Address:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def accept(self, *, timeout_s: float | None = None) -> TcpConnection:
        self._sock.settimeout(timeout_s)
        try:
            sock, _ = self._sock.accept()
        except TimeoutError as exc:
            raise TransportTimeout("no peer connected in time") from exc
        except OSError as exc:
            raise TransportError(f"accept failed: {exc}") from exc
        try:
            sock.settimeout(_GREETING_SEND_TIMEOUT_S)
            sock.sendall(GREETING)
        except OSError as exc:  # a peer that left at once (a port scan): the next accept
            sock.close()
            raise TransportError(f"peer gone before the greeting: {exc}") from exc
        sock.settimeout(None)
        return TcpConnection(sock, max_frame=self.max_frame)

    def close(self) -> None:
        self._sock.close()


_GREETING_SEND_TIMEOUT_S: Final = 5.0


def _expect_greeting(sock: socket.socket, address: Address, timeout_s: float | None) -> None:
    """Read exactly ``GREETING`` from a fresh connection; ``TransportError`` otherwise, with no
    byte of what the peer sent in it."""
    got = bytearray()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(got) < len(GREETING):
            sock.settimeout(_remaining(deadline))
            chunk = sock.recv(len(GREETING) - len(got))
            if not chunk:
                break
            got += chunk
            if not GREETING.startswith(got):
                break
    except OSError:  # TimeoutError included: a service that waits for us to speak first
        pass
    if bytes(got) != GREETING:
        raise TransportError(f"{address} is not a kvstrata transfer listener")


class TcpTransport:
    name = "tcp"

    def __init__(self, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> TcpListener:
        return TcpListener(host, port, max_frame=self.max_frame)

    def connect(self, address: Address, *, timeout_s: float | None = None) -> TcpConnection:
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as exc:
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        try:
            _expect_greeting(sock, address, timeout_s)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return TcpConnection(sock, max_frame=self.max_frame)


def raw_socket_gbps(total_bytes: int, *, chunk_bytes: int = 4 * 1024 * 1024) -> float:
    """Plain loopback socket throughput (GB/s, 1e9) for ``total_bytes``: one sender thread,
    ``sendall`` of one reused buffer, the receiver ``recv_into`` a preallocated one."""
    server = socket.create_server(("127.0.0.1", 0))
    received = 0

    def drain() -> None:
        nonlocal received
        conn, _ = server.accept()
        buf = memoryview(bytearray(chunk_bytes))
        with conn:
            while received < total_bytes:
                got = conn.recv_into(buf)
                if got == 0:
                    return
                received += got

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    payload = memoryview(bytearray(chunk_bytes))
    with socket.create_connection(server.getsockname()[:2]) as sock:
        start = time.perf_counter()
        left = total_bytes
        while left > 0:
            piece = payload[: min(left, chunk_bytes)]
            sock.sendall(piece)
            left -= len(piece)
        thread.join()
        elapsed = time.perf_counter() - start
    server.close()
    if received != total_bytes:
        raise TransportError(f"raw socket probe received {received} of {total_bytes} bytes")
    return total_bytes / elapsed / 1e9
