"""NIXL transport: frame bodies written by UCX into the peer's registered memory.

Each connection is a TCP control channel (``tcp.TcpConnection``) plus one NIXL agent per side.
At setup both sides register a receive ring of ``slots`` × ``slot_bytes`` bytes of DRAM and a
send staging buffer of one slot, and exchange over the control channel their agent metadata
and the ring's address. ``send_frame`` copies the parts into the staging buffer, posts a NIXL
``WRITE`` into a free slot of the peer's ring, waits for the transfer state ``DONE`` (the
completion notification: the bytes are in the peer's memory), then sends a small control
message ``D slot length``. ``recv_frame`` takes that message, copies the slot out and returns
the slot with ``A slot`` (credit-based flow control: a sender without credit waits for an ack).

UCX is confined to loopback by the caller's environment (``UCX_NET_DEVICES=lo``); this module
reads no environment. ``nixl`` is imported lazily: ``available()`` says whether it can be.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstrata.transfer.tcp import TcpConnection, TcpListener, TcpTransport
from kvstrata.transfer.transport import (
    Address,
    Buffer,
    FrameError,
    PeerLost,
    TransportError,
    TransportTimeout,
    copy_into,
    frame_length,
)

_HELLO = struct.Struct(">QII")  # ring address, slots, slot bytes; then the agent metadata
_DATA = struct.Struct(">cII")  # b"D", slot, length
_ACK = struct.Struct(">cI")  # b"A", slot
_names = itertools.count()


def available() -> str | None:
    """None when NIXL imports, else the reason it does not."""
    try:
        importlib.import_module("nixl._api")
    except ImportError as exc:  # the optional extra is not installed
        return f"nixl not importable: {exc}"
    return None


class NixlConnection:
    path = "nixl"

    def __init__(
        self, control: TcpConnection, *, slots: int, slot_bytes: int, timeout_s: float | None
    ) -> None:
        api: Any = importlib.import_module("nixl._api")  # untyped optional extra

        self._control = control
        self.max_frame = slot_bytes
        self._slot_bytes = slot_bytes
        name = f"kvstrata-{os.getpid()}-{next(_names)}"
        try:
            self._agent: Any = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
            self._ring = np.zeros(slots * slot_bytes, dtype=np.uint8)
            self._stage = np.zeros(slot_bytes, dtype=np.uint8)
            self._regs = [
                self._agent.register_memory([(a.ctypes.data, a.nbytes, 0, "")], "DRAM")
                for a in (self._ring, self._stage)
            ]
        except Exception as exc:  # nixl raises its own (pybind) error types
            raise TransportError(f"NIXL setup failed: {exc}") from exc
        hello = _HELLO.pack(self._ring.ctypes.data, slots, slot_bytes)
        control.send_frame(hello, self._agent.get_agent_metadata(), timeout_s=timeout_s)
        peer = bytes(control.recv_frame(timeout_s=timeout_s))
        if len(peer) < _HELLO.size:
            raise FrameError("NIXL hello too short")
        self._peer_ring, peer_slots, peer_slot_bytes = _HELLO.unpack_from(peer)
        if peer_slot_bytes != slot_bytes or peer_slots <= 0:
            raise FrameError(f"peer ring of {peer_slots}×{peer_slot_bytes} does not match")
        try:
            self._peer = self._agent.add_remote_agent(peer[_HELLO.size :])
        except Exception as exc:
            raise TransportError(f"NIXL peer metadata refused: {exc}") from exc
        self._free = deque(range(peer_slots))
        self._pending: deque[bytes] = deque()  # data messages read while waiting for an ack
        self._closed = False
        self._ack_timeout_s = 5.0

    def send_frame(self, *parts: Buffer, timeout_s: float | None = None) -> None:
        length = frame_length(parts)
        if length > self.max_frame:
            raise FrameError(f"frame of {length} bytes over the slot size {self.max_frame}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._free:
            self._take_control(_left(deadline))
        slot = self._free.popleft()
        offset = 0
        for part in parts:
            view = np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8)
            self._stage[offset : offset + view.size] = view
            offset += view.size
        if length:
            self._write(slot, length, deadline)
        self._control.send_frame(_DATA.pack(b"D", slot, length), timeout_s=_left(deadline))

    def _write(self, slot: int, length: int, deadline: float | None) -> None:
        agent = self._agent
        try:
            local = agent.get_xfer_descs([(self._stage.ctypes.data, length, 0)], "DRAM")
            remote_addr = self._peer_ring + slot * self._slot_bytes
            remote = agent.get_xfer_descs([(remote_addr, length, 0)], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, self._peer)
        except Exception as exc:
            raise TransportError(f"NIXL transfer setup failed: {exc}") from exc
        try:
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if deadline is not None and time.monotonic() > deadline:
                    raise TransportTimeout("NIXL write did not complete in time")
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise PeerLost("NIXL write failed (peer gone?)")
        finally:
            agent.release_xfer_handle(handle)

    def _take_control(self, timeout_s: float | None) -> None:
        message = bytes(self._control.recv_frame(timeout_s=timeout_s))
        if len(message) == _ACK.size and message[:1] == b"A":
            self._free.append(_ACK.unpack(message)[1])
        elif len(message) == _DATA.size and message[:1] == b"D":
            self._pending.append(message)
        else:
            raise FrameError("malformed NIXL control message")

    def recv_frame(self, *, timeout_s: float | None = None) -> Buffer:
        body = bytearray()
        self._receive(timeout_s, lambda data: body.extend(data))
        return body

    def recv_frame_into(
        self, buffers: Sequence[memoryview], *, timeout_s: float | None = None
    ) -> None:
        self._receive(timeout_s, lambda data: copy_into(data, buffers))

    def _receive(self, timeout_s: float | None, take: Callable[[memoryview], None]) -> None:
        """The next frame's bytes in the ring, handed to ``take`` before the slot is acked."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending:
            self._take_control(_left(deadline))
        _, slot, length = _DATA.unpack(self._pending.popleft())
        if slot * self._slot_bytes >= self._ring.size or length > self._slot_bytes:
            raise FrameError(f"NIXL control names slot {slot} / {length} bytes out of range")
        start = slot * self._slot_bytes
        take(memoryview(self._ring[start : start + length].data).cast("B"))
        # The frame arrived whole even if the ack cannot leave; the next receive reports it.
        with contextlib.suppress(PeerLost):
            self._control.send_frame(_ACK.pack(b"A", slot), timeout_s=self._ack_timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._agent.remove_remote_agent(self._peer)
            for reg in self._regs:
                self._agent.deregister_memory(reg)
        except Exception:  # best effort: the peer may be gone already
            pass
        self._control.close()


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeout("deadline passed")
    return left


class NixlListener:
    def __init__(self, control: TcpListener, *, slots: int, slot_bytes: int) -> None:
        self._control = control
        self._slots = slots
        self._slot_bytes = slot_bytes

    @property
    def address(self) -> Address:
        return self._control.address

    def accept(self, *, timeout_s: float | None = None) -> NixlConnection:
        control = self._control.accept(timeout_s=timeout_s)
        return _setup(control, self._slots, self._slot_bytes, timeout_s)

    def close(self) -> None:
        self._control.close()


def _setup(
    control: TcpConnection, slots: int, slot_bytes: int, timeout_s: float | None
) -> NixlConnection:
    try:
        return NixlConnection(control, slots=slots, slot_bytes=slot_bytes, timeout_s=timeout_s)
    except BaseException:
        control.close()
        raise


class NixlTransport:
    """``slot_bytes`` is the largest frame; ``slots`` frames may be in flight unacknowledged."""

    name = "nixl"

    def __init__(self, *, slots: int = 8, slot_bytes: int = 4 * 1024 * 1024) -> None:
        reason = available()
        if reason is not None:
            raise TransportError(reason)
        self._tcp = TcpTransport(max_frame=max(slot_bytes, 1 << 16))
        self.slots = slots
        self.slot_bytes = slot_bytes

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> NixlListener:
        return NixlListener(
            self._tcp.listen(host, port), slots=self.slots, slot_bytes=self.slot_bytes
        )

    def connect(self, address: Address, *, timeout_s: float | None = None) -> NixlConnection:
        control = self._tcp.connect(address, timeout_s=timeout_s)
        return _setup(control, self.slots, self.slot_bytes, timeout_s)
