"""The sending side of the transfer contract tests, run as a separate process (a script).

It connects to ``--port`` over ``--transport`` and streams ``--blocks`` × ``--layers`` layer
slices of deterministic bytes (``payload``), misbehaving as ``--mode`` says:

- ``full``: every layer, then COMPLETE; ``corrupt``: one RUN's bytes flipped after the
  sender hashed them; ``bad_complete``: a wrong whole-block digest in COMPLETE;
- ``cancel``: half the layers, then CANCEL; ``stall``: half the layers, then nothing (the
  receiver times out or is cancelled); ``half``: half the layers, prints ``HALF`` and waits to
  be SIGKILLed; ``skip``: all but one RUN (and its bytes), then COMPLETE.

After its part it waits until the receiver closes (or 30 s), so the receiver sees EOF only
when the test kills it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
from collections.abc import Sequence

from kvstrata.transfer import frames
from kvstrata.transfer.stream import TransferSender
from kvstrata.transfer.transport import Buffer, Connection, PeerLost, TransportError


def payload(seed: int, block: int, layer: int, size: int) -> bytes:
    return random.Random(seed * 1_000_003 + block * 4099 + layer).randbytes(size)


class _Tamper:
    """A connection that spoils one frame of the kind the mode names."""

    def __init__(self, inner: Connection, mode: str) -> None:
        self.inner, self.mode = inner, mode
        self.path, self.max_frame = inner.path, inner.max_frame
        self.runs = 0
        self.payload_next = False  # the frame after a RUN is that run's bytes
        self.skipping = False

    def send_frame(self, *parts: Buffer, timeout_s: float | None = None) -> None:
        if self.payload_next:
            self.payload_next = False
            if self.mode == "corrupt" and self.runs == 2:
                spoilt = bytearray(parts[0])
                spoilt[0] ^= 0xFF
                parts = (spoilt, *parts[1:])
            if self.skipping:
                return
        else:
            kind = bytes(memoryview(parts[0])[3:4])[0]
            self.skipping = False
            if kind == frames.Kind.RUN:  # the sender ships a RUN, then its bytes
                self.runs += 1
                self.payload_next = True
                if self.mode == "skip" and self.runs == 3:
                    self.skipping = True
                    return
            if kind == frames.Kind.COMPLETE and self.mode == "bad_complete":
                spoilt = bytearray(parts[0])
                spoilt[-1] ^= 0xFF
                parts = (bytes(spoilt),)
        self.inner.send_frame(*parts, timeout_s=timeout_s)

    def recv_frame(self, *, timeout_s: float | None = None) -> Buffer:
        return self.inner.recv_frame(timeout_s=timeout_s)

    def recv_frame_into(
        self, buffers: Sequence[memoryview], *, timeout_s: float | None = None
    ) -> None:
        self.inner.recv_frame_into(buffers, timeout_s=timeout_s)

    def close(self) -> None:
        self.inner.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["tcp", "nixl"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="full")
    parser.add_argument("--request-id", default="req-1")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layer-bytes", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.transport == "nixl":
        from kvstrata.transfer.nixl_transport import NixlTransport

        transport: object = NixlTransport(slots=4, slot_bytes=1 << 20)
    else:
        from kvstrata.transfer.tcp import TcpTransport

        transport = TcpTransport()
    conn = transport.connect(("127.0.0.1", args.port), timeout_s=30)  # type: ignore[attr-defined]
    sender = TransferSender(
        _Tamper(conn, args.mode),
        args.request_id,
        blocks=args.blocks,
        layers=args.layers,
        layer_bytes=args.layer_bytes,
    )
    half = args.layers // 2 if args.mode in ("cancel", "stall", "half") else args.layers
    for layer in range(half):
        sender.send_layer(
            layer, [payload(args.seed, b, layer, args.layer_bytes) for b in range(args.blocks)]
        )
    if args.mode == "cancel":
        sender.cancel()
    elif args.mode == "half":
        print("HALF", flush=True)
        threading.Event().wait(60)
    elif args.mode != "stall":
        sender.finish()
    try:
        while True:
            conn.recv_frame(timeout_s=30)
    except (PeerLost, TransportError):
        pass
    conn.close()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # skip UCX's seconds-long teardown at interpreter exit: nothing is pending
