"""The transfer stack alone on loopback, against a raw socket measured the same way.

``bench disagg``'s ``prefill_send_gbps`` divides each ``/kv/prefill`` reply's bytes by its
seconds, and those seconds span the whole layer-wise prefill: on a compute-bound model it is
the prefill's pace, not the link's. This probe takes the compute out. As in a disaggregated
fleet, sender and receiver are two processes: a child process (spawned, so it shares no
interpreter lock and no copy-on-write memory with the receiver) streams ``blocks`` × ``layers``
slices of already computed KV through ``TransferSender`` (RUN frames, each run's bytes
gathered from the slices, COMPLETE with each block's digest); this process receives with
``TransferReceiver`` into a real ``HostTier`` — the bytes scattered from the socket into the
PENDING slots, every block digest checked, then committed.

The peer is the same pair of processes without the stack (``raw_link_gbps``): the child
``sendall``s the same number of bytes from one reused buffer, this process ``recv_into`` a
preallocated one. Both are timed in this process from ``accept`` to the last byte (the stack:
to the committed result), the child having prepared its bytes before it connects.
``stack_vs_raw`` is the share of the raw socket's throughput the stack keeps (issue 14's
goal: ≥ 0.7).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation
from kvstrata.tiers.host import HostTier
from kvstrata.transfer.stream import TransferReceiver, TransferSender
from kvstrata.transfer.transport import Address, TransportError, make_transport

_CHUNK = 4 * 1024 * 1024
_ACCEPT_TIMEOUT_S = 60.0  # a spawned child imports kvstrata before it connects


@dataclass(frozen=True)
class LinkProbe:
    stack_gbps: float
    raw_socket_gbps: float
    payload_bytes: int
    seconds: float

    @property
    def stack_vs_raw(self) -> float:
        return self.stack_gbps / self.raw_socket_gbps if self.raw_socket_gbps > 0 else 0.0


def _metas(blocks: int, block_bytes: int) -> list[KVObjectMeta]:
    representation = Representation("bfloat16", "kvstrata.block.v1", 16, (block_bytes,))
    return [
        KVObjectMeta(
            key=BlockKey(i.to_bytes(4, "big") * 8),
            parent=BlockKey((i - 1).to_bytes(4, "big") * 8) if i else None,
            tenant="bench",
            representation=representation,
            size=block_bytes,
            digest=bytes(16),
            created_at=0.0,
            position=16 * i,
        )
        for i in range(blocks)
    ]


def _send_stack(
    address: Address, transport_name: str, blocks: int, layers: int, layer_bytes: int
) -> None:
    """The child's part of the stack probe (module docstring)."""
    slices = [os.urandom(layer_bytes) for _ in range(blocks)]  # one layer, reused per layer
    conn = make_transport(transport_name).connect(address, timeout_s=_ACCEPT_TIMEOUT_S)
    try:
        sender = TransferSender(
            conn, "link-probe", blocks=blocks, layers=layers, layer_bytes=layer_bytes
        )
        for layer in range(layers):
            sender.send_layer(layer, slices)
        sender.finish()
        # COMPLETE is in the kernel's buffer; closing now could reset the connection before
        # the receiver read it (NIXL: before its ack): wait for the receiver to close first.
        conn.recv_frame(timeout_s=_ACCEPT_TIMEOUT_S)
    except TransportError:
        pass
    finally:
        conn.close()


def _send_raw(address: Address, total_bytes: int) -> None:
    """The child's part of the raw probe."""
    payload = memoryview(bytearray(_CHUNK))
    with socket.create_connection(address, timeout=_ACCEPT_TIMEOUT_S) as sock:
        sock.settimeout(None)
        left = total_bytes
        while left > 0:
            piece = payload[: min(left, _CHUNK)]
            sock.sendall(piece)
            left -= len(piece)
        sock.recv(1)  # until the receiver closes


def _child(target: Callable[..., None], *args: object) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def raw_link_gbps(total_bytes: int) -> float:
    """Loopback TCP throughput (GB/s, 1e9) from a child process into this one (module
    docstring): the physical peer of ``transfer_stack_gbps``."""
    server = socket.create_server(("127.0.0.1", 0))
    child = _child(_send_raw, server.getsockname()[:2], total_bytes)
    try:
        server.settimeout(_ACCEPT_TIMEOUT_S)
        conn, _ = server.accept()
        buffer = memoryview(bytearray(_CHUNK))
        received = 0
        with conn:
            conn.settimeout(None)
            start = time.perf_counter()
            while received < total_bytes:
                got = conn.recv_into(buffer)
                if got == 0:
                    break
                received += got
            elapsed = time.perf_counter() - start
    finally:
        server.close()
        child.join(timeout=30)
    if received != total_bytes:
        raise TransportError(f"raw link probe received {received} of {total_bytes} bytes")
    return total_bytes / elapsed / 1e9


def transfer_stack_gbps(
    *, blocks: int, layers: int, layer_bytes: int, transport_name: str = "tcp"
) -> LinkProbe:
    """Stream ``blocks`` × ``layers`` slices through the stack once (module docstring) over
    ``transport_name`` (``tcp``; ``nixl``: UCX confined by the caller's environment), then
    the raw peer of the same size."""
    block_bytes = layers * layer_bytes
    transport = make_transport(transport_name)
    with HostTier(blocks * block_bytes, block_bytes, pin_memory=False) as tier:
        receiver = TransferReceiver(tier)
        listener = transport.listen()
        child = _child(_send_stack, listener.address, transport_name, blocks, layers, layer_bytes)
        try:
            conn = listener.accept(timeout_s=_ACCEPT_TIMEOUT_S)
            try:
                start = time.perf_counter()
                result = receiver.receive(
                    conn, _metas(blocks, block_bytes), timeout_s=300, request_id="link-probe"
                )
                seconds = time.perf_counter() - start
            finally:
                conn.close()
        finally:
            listener.close()
            child.join(timeout=30)
        if not result.ok:
            raise TransportError(f"link probe ended {result.outcome}: {result.detail}")
    payload = blocks * block_bytes
    raw = raw_link_gbps(payload)
    return LinkProbe(payload / seconds / 1e9, raw, payload, seconds)
