"""The transfer stack alone on loopback, measured the way ``transfer.tcp.raw_socket_gbps`` is.

``bench disagg``'s ``transfer_gbps`` divides each ``/kv/prefill`` reply's bytes by its
seconds, and those seconds span the whole layer-wise prefill: on a compute-bound model it is
the prefill's pace, not the link's. This probe takes the compute out: one sender thread streams
``blocks`` × ``layers`` slices of already computed KV through ``TransferSender`` (a LAYER frame
per slice with its xxh3-128 digest, COMPLETE with each block's digest) over a ``TcpTransport``
connection; the receiver (``TransferReceiver`` into a real ``HostTier``, this process, as
``raw_socket_gbps``'s drain thread is) writes them into PENDING slots, checks every digest and
commits. Bytes are the KV payload; seconds run from the first frame to the committed result.
``stack_vs_raw`` against ``raw_socket_gbps`` of the same size in the same call is the share of
the socket's throughput the stack keeps (issue 14's goal: ≥ 0.7).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, Representation
from kvstrata.tiers.host import HostTier
from kvstrata.transfer.stream import TransferReceiver, TransferSender
from kvstrata.transfer.tcp import raw_socket_gbps
from kvstrata.transfer.transport import TransportError, make_transport


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


def transfer_stack_gbps(
    *, blocks: int, layers: int, layer_bytes: int, transport_name: str = "tcp"
) -> LinkProbe:
    """Stream ``blocks`` × ``layers`` slices through the stack once (module docstring) over
    ``transport_name`` (``tcp``; ``nixl``: UCX confined by the caller's environment)."""
    block_bytes = layers * layer_bytes
    slices = [os.urandom(layer_bytes) for _ in range(blocks)]  # one layer, reused per layer
    transport = make_transport(transport_name)
    with HostTier(blocks * block_bytes, block_bytes, pin_memory=False) as tier:
        receiver = TransferReceiver(tier)
        listener = transport.listen()
        sent = threading.Event()

        def send() -> None:
            conn = transport.connect(listener.address, timeout_s=10)
            try:
                sender = TransferSender(
                    conn, "link-probe", blocks=blocks, layers=layers, layer_bytes=layer_bytes
                )
                for layer in range(layers):
                    sender.send_layer(layer, slices)
                sender.finish()
                sent.set()
            finally:
                conn.close()

        with ThreadPoolExecutor(1) as pool:
            conn = None
            try:
                future = pool.submit(send)
                conn = listener.accept(timeout_s=10)
                start = time.perf_counter()
                result = receiver.receive(
                    conn, _metas(blocks, block_bytes), timeout_s=300, request_id="link-probe"
                )
                seconds = time.perf_counter() - start
                future.result()
            finally:
                if conn is not None:
                    conn.close()
                listener.close()
        if not result.ok or not sent.is_set():
            raise TransportError(f"link probe ended {result.outcome}: {result.detail}")
    payload = blocks * block_bytes
    raw = raw_socket_gbps(payload)
    return LinkProbe(payload / seconds / 1e9, raw, payload, seconds)
