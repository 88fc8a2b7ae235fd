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

Wire format (msgpack): request ``[tenant, [key bytes…], presence, req_id]`` (``LookupQuery``),
reply ``found`` (int). ``presence``: how many leading blocks the store holds, without the
break-even test (the P/D consumer's "have the producer's blocks arrived?" probe, uncounted);
``req_id``: the vLLM request, so a canary tier serves exactly its share of requests.

Who may ask: the ipc socket lives in a directory of this user's own, mode 0700
(``private_dir``), so no other user can connect to it. With ``lookup_curve_secret_file``
(``[connector]``; a ``zmq.auth`` secret certificate both connector sides load) the REP side is
also a CURVE server that admits only that certificate's key, and the REQ side its client:
possession of the file is the credential (scheduler and worker are one deployment on one host,
so they share it, as they share the worker configuration).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

from kvstrata.connectors.vllm_plan import Lookup as Lookup
from kvstrata.errors import InvalidInput
from kvstrata.events.curve import KeyPair, ZapGuard
from kvstrata.identity import BlockKey

logger = logging.getLogger("kvstrata.connectors.vllm")


class LookupQuery(msgspec.Struct, array_like=True, frozen=True):
    tenant: str
    keys: list[bytes]
    presence: bool = False
    req_id: str | None = None


_LOCAL: dict[str, Lookup] = {}
_LOCAL_LOCK = threading.Lock()


def private_dir(base: Path | None = None) -> Path:
    """This user's lookup socket directory (created 0700; refused when it belongs to another
    user, tightened when it is ours but open to others)."""
    path = Path(base or tempfile.gettempdir()) / f"kvstrata-lookup-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise InvalidInput(f"{path} is not a directory of this user: refusing to use it")
        if info.st_mode & 0o077:
            path.chmod(0o700)
    except OSError as exc:
        raise InvalidInput(f"cannot prepare the lookup socket directory {path}: {exc}") from exc
    return path


def endpoint_for(engine_id: str, base: Path | None = None) -> str:
    safe = "".join(ch for ch in engine_id if ch.isalnum() or ch in "-_")[:64]
    return f"ipc://{private_dir(base) / f'{safe}.ipc'}"


def register_local(engine_id: str, lookup: Lookup) -> None:
    with _LOCAL_LOCK:
        _LOCAL[engine_id] = lookup


def unregister_local(engine_id: str) -> None:
    with _LOCAL_LOCK:
        _LOCAL.pop(engine_id, None)


def local_lookup(engine_id: str) -> Lookup | None:
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


class LookupServer:
    """Answers lookups from another process; one thread, started and stopped explicitly."""

    def __init__(self, endpoint: str, lookup: Lookup, *, curve: KeyPair | None = None) -> None:
        self.endpoint = endpoint
        self.lookup = lookup
        self.curve = curve
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._zap: ZapGuard | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> LookupServer:
        if self.curve is not None:  # a context of its own: one ZAP handler per context
            self._context = zmq.Context()
            self._zap = ZapGuard(self._context, [self.curve.public_key]).start()
        self._thread = threading.Thread(target=self._serve, name="kvstrata-lookup", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _serve(self) -> None:
        context = self._context or zmq.Context.instance()
        socket = context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            socket.curve_server = True
            socket.curve_secretkey = self.curve.secret_key
            socket.curve_publickey = self.curve.public_key
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
        decoder = msgspec.msgpack.Decoder(LookupQuery)
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()  # all of it: REP answers only whole messages
                try:
                    if len(frames) != 1:
                        raise ValueError(f"{len(frames)} frames, expected 1")
                    query = decoder.decode(frames[0])
                    keys = [BlockKey(k) for k in query.keys]
                    found = self.lookup(query.tenant, keys, query.presence, query.req_id)
                except (msgspec.DecodeError, ValueError):
                    logger.warning("kvstrata: malformed lookup request ignored (a miss)")
                    found = 0
                except Exception:  # the store failed: a miss, and the server keeps serving
                    logger.exception("kvstrata: a lookup failed (a miss)")
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
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._context is not None:
            self._context.term()
            self._context = None


class LookupClient:
    """The scheduler's view: the in-process worker if there is one, else the worker's socket."""

    def __init__(
        self,
        engine_id: str,
        *,
        timeout_ms: int = 2000,
        curve: KeyPair | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint or endpoint_for(engine_id)
        self.timeout_ms = timeout_ms
        self.curve = curve
        self._socket: zmq.Socket[bytes] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self.timeouts = 0

    def __call__(
        self,
        tenant: str,
        keys: Sequence[BlockKey],
        presence: bool = False,
        req_id: str | None = None,
    ) -> int:
        if not keys:
            return 0
        local = local_lookup(self.engine_id)
        if local is not None:
            return local(tenant, keys, presence, req_id)
        query = LookupQuery(tenant, [bytes(k) for k in keys], presence, req_id)
        return self._remote(query)

    def _remote(self, query: LookupQuery) -> int:
        if self._socket is None:
            context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            socket = context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                self.curve.client_of(self.curve.public_key).apply(socket)
            socket.connect(self.endpoint)
            self._socket = socket
        socket = self._socket
        socket.send(self._encoder.encode(query))
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
