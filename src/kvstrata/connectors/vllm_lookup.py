"""How the scheduler side asks the worker's store which blocks it holds.

vLLM builds two connector instances from one config: the scheduler's and the worker's. With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both live in one process; in vLLM's default mode on CPU the
worker runs in a process of its own (the ``mp`` executor). The store (bytes and index) lives
with the worker, so:

- the worker registers itself in this module under the engine id (``register_local``); a
  scheduler in the same process calls it directly;
- the worker also serves lookups on a ZMQ REP socket at ``endpoint_for(engine_id)`` (an ipc
  path both sides derive from the same engine id), on a thread it starts explicitly
  (``LookupServer.start``); a scheduler in another process asks there (REQ, with a timeout:
  an unanswered lookup counts as a miss, never blocks scheduling for long).

Wire format (msgpack): request ``[tenant, [key bytes…]]``, reply ``found`` (int).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import zmq

from kvstrata.identity import BlockKey

logger = logging.getLogger("kvstrata.connectors.vllm")
LookupFn = Callable[[str, Sequence[BlockKey]], int]

_LOCAL: dict[str, LookupFn] = {}
_LOCAL_LOCK = threading.Lock()


def endpoint_for(engine_id: str) -> str:
    safe = "".join(ch for ch in engine_id if ch.isalnum() or ch in "-_")[:64]
    return f"ipc://{Path(tempfile.gettempdir()) / f'kvstrata-lookup-{safe}.ipc'}"


def register_local(engine_id: str, lookup: LookupFn) -> None:
    with _LOCAL_LOCK:
        _LOCAL[engine_id] = lookup


def unregister_local(engine_id: str) -> None:
    with _LOCAL_LOCK:
        _LOCAL.pop(engine_id, None)


def local_lookup(engine_id: str) -> LookupFn | None:
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


class LookupServer:
    """Answers lookups from another process; one thread, started and stopped explicitly."""

    def __init__(self, endpoint: str, lookup: LookupFn) -> None:
        self.endpoint = endpoint
        self.lookup = lookup
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> LookupServer:
        self._thread = threading.Thread(target=self._serve, name="kvstrata-lookup", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _serve(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        socket = context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            path = self.endpoint.removeprefix("ipc://")
            Path(path).unlink(missing_ok=True)
            socket.bind(self.endpoint)
        except (zmq.ZMQError, OSError) as exc:
            self._error = exc
            self._ready.set()
            socket.close()
            return
        self._ready.set()
        decoder = msgspec.msgpack.Decoder(tuple[str, list[bytes]])
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()  # all of it: REP answers only whole messages
                try:
                    if len(frames) != 1:
                        raise ValueError(f"{len(frames)} frames, expected 1")
                    tenant, keys = decoder.decode(frames[0])
                    found = self.lookup(tenant, [BlockKey(k) for k in keys])
                except (msgspec.DecodeError, ValueError):
                    logger.warning("kvstrata: malformed lookup request ignored (a miss)")
                    found = 0
                socket.send(encoder.encode(found))
        finally:
            socket.close()
            Path(self.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class LookupClient:
    """The scheduler's view: the in-process worker if there is one, else the worker's socket."""

    def __init__(self, engine_id: str, *, timeout_ms: int = 2000) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint_for(engine_id)
        self.timeout_ms = timeout_ms
        self._socket: zmq.Socket[bytes] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self.timeouts = 0

    def __call__(self, tenant: str, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        local = local_lookup(self.engine_id)
        if local is not None:
            return local(tenant, keys)
        return self._remote(tenant, keys)

    def _remote(self, tenant: str, keys: Sequence[BlockKey]) -> int:
        if self._socket is None:
            context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            socket = context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.endpoint)
            self._socket = socket
        socket = self._socket
        socket.send(self._encoder.encode((tenant, [bytes(k) for k in keys])))
        if not socket.poll(self.timeout_ms):
            # A REQ socket that got no reply is stuck: drop it, count a miss.
            self.timeouts += 1
            logger.warning("kvstrata: lookup timed out after %d ms (a miss)", self.timeout_ms)
            socket.close()
            self._socket = None
            return 0
        return int(msgspec.msgpack.decode(socket.recv(), type=int))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
