"""A plain TCP service for the tests that point a worker at something that is not ours."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class ForeignService:
    """Accepts one connection, sends ``banner``, records every byte it receives until the
    peer closes or ``linger_s`` passes without any."""

    address: tuple[str, int]
    received: bytearray = field(default_factory=bytearray)


@contextmanager
def foreign_service(banner: bytes, *, linger_s: float = 2.0) -> Iterator[ForeignService]:
    """Yields once listening; on exit waits for the connection to end (so ``received`` is
    complete) and closes the socket."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    service = ForeignService(server.getsockname()[:2])

    def serve() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.sendall(banner)
            conn.settimeout(linger_s)
            try:
                while chunk := conn.recv(4096):
                    service.received.extend(chunk)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield service
        thread.join(30)
    finally:
        server.close()
