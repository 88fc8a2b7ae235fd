"""The decode worker's side of a prefill → decode transfer: a TCP listener that receives KV
into the worker's store (issue 14; the contract is ``docs/disaggregation.md``).

``DecodeTransfers.start()`` listens on ``host:port`` (``transfer.tcp``) and serves every
connection on its own thread:

1. an intro frame (``transfer.intro``: request id, tenant, prompt token ids, a MAC under the
   deployment's tenant secret) — a wrong MAC is refused ``tenant_forbidden``;
2. the handshake: the ``TransferOffer`` is answered by ``answer_offer`` with this worker's
   ``ReceiverCapabilities`` (its model digest and pool layout, valid tenant names, TCP, write,
   never lossy); a refusal is sent, counted and audited with its reason;
3. ``TransferReceiver`` writes the blocks into PENDING objects of the store's first level
   through the store's own two-phase path (``transfer.ingress.StoreIngress``) under keys this
   worker computes from the intro's tokens (its fingerprint, the offer's tenant) — never the
   sender's keys — and commits only after every layer and digest verified. A plan that is not
   the identity runs as the receiver's ``convert`` hook (``transfer.convert``).

Each transfer's end (``TransferStatus``) is kept by request id for a bounded time so a decode
request (``/v1/completions`` with ``kvstrata_transfer``) can ``wait`` for it, whichever of the
two arrives first. A committed transfer's blocks are held against eviction
(``TieredStore.hold_prefix``) until its decode request calls ``release`` — at its first token,
when the engine's own lookup holds what it loads — or for ``hold_s`` at most (a decode
request that never comes): between the commit and that lookup, other requests' saves into a
full tier could otherwise evict the received chain's leaves, the blocks its request needs.
The hold is a reservation (``reserve=True``): past the store's cap on held objects
(``store.state.HOLD_SHARE`` of a level) the rest of a chain is not protected. The store's
lock is never held across I/O: reservations and commits are the store's short locked
sections, bytes are written outside them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict

import torch

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.transfer_io import pool_layout
from kvstrata.errors import ConfigError
from kvstrata.identity import ModelFingerprint
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.blocks import BlockInfo, block_tokens
from kvstrata.security.audit import NULL_AUDIT, Action, AuditLog
from kvstrata.security.keys import valid_namespace
from kvstrata.serve.transfer_status import TransferStatus, TransferWaiter
from kvstrata.store.levels import Located, RequestScope
from kvstrata.telemetry.transfer_metrics import TransferMetrics
from kvstrata.transfer.convert import convert_blocks, torch_dtype
from kvstrata.transfer.handshake import (
    MAX_MESSAGE_BYTES,
    AcceptWithConversion,
    HandshakeError,
    ReceiverCapabilities,
    Refuse,
    TransferAnswer,
    TransferOffer,
    Transport,
    answer_offer,
    decode_offer,
    encode,
    refuse,
)
from kvstrata.transfer.ingress import StoreIngress
from kvstrata.transfer.intro import TransferIntro, decode_intro, intro_authentic
from kvstrata.transfer.layout import ConversionPlan, RefuseReason, plan_conversion
from kvstrata.transfer.stream import Conversion, Converter, TransferReceiver
from kvstrata.transfer.transport import (
    Buffer,
    Connection,
    Listener,
    TransportError,
    make_transport,
)

logger = logging.getLogger("kvstrata.serve.transfer")

_HANDSHAKE_TIMEOUT_S = 10.0
_KEEP_S = 300.0  # how long a finished transfer's status waits for its decode request
HOLD_S = 30.0
"""How long a committed transfer's blocks are held for a decode request that has not released
them (far longer than a request waits for admission on a worker that keeps up)."""
_MAX_TRACKED = 4096
MAX_CONNECTIONS = 64
"""Transfer connections served at once; one beyond is closed at accept (each holds a thread
and, until its handshake ends, up to a frame's worth of bytes its peer sent)."""


class DecodeTransfers:
    """Receives transfers into ``engine``'s store (module docstring); ``start``/``close``."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: str = "tcp",
        metrics: TransferMetrics | None = None,
        audit: AuditLog = NULL_AUDIT,
        receive_timeout_s: float = 60.0,
        tenant_secret: bytes = b"",
        hold_s: float = HOLD_S,
    ) -> None:
        if not tenant_secret:
            raise ConfigError(
                "a transfer listener needs the deployment's tenant secret: without one, anyone"
                " who reaches its port can write KV for any tenant",
                key="tenant_secret_file",
            )
        if engine.bridge is None or not engine.bridge.store.levels:
            raise ConfigError("a decode worker needs a store tier to receive transfers into")
        if not isinstance(engine.fingerprint, ModelFingerprint):
            raise ConfigError(f"reuse is disabled ({engine.fingerprint.reason}): no transfers")
        self.engine = engine
        self.host, self.port = host, port
        self.transport_name = transport
        self._transport = make_transport(transport)  # NIXL missing: TransportError, at start-up
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.audit = audit
        self.receive_timeout_s = receive_timeout_s
        self.hold_s = hold_s
        self.tenant_secret = tenant_secret
        self.layout = pool_layout(engine.pool.config)
        self.model_digest = engine.fingerprint.model_digest()
        self.capabilities = ReceiverCapabilities(
            model_digest=self.model_digest,
            layout=self.layout,
            tenant_allowed=valid_namespace,
            transports=(Transport(transport),),
            allow_lossy=False,
        )
        self._store = engine.bridge.store
        self._ingress = StoreIngress(self._store)
        self._lock = threading.Lock()
        self._waiters: OrderedDict[str, TransferWaiter] = OrderedDict()
        self._holding: dict[str, TransferWaiter] = {}  # the waiters whose blocks are held
        self._active = 0
        self._receiving: set[TransferReceiver] = set()  # cancelled by close()
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> DecodeTransfers:
        self._listener = self._transport.listen(self.host, self.port)
        self.host, self.port = self._listener.address
        self._thread = threading.Thread(target=self._accept_loop, name="kv-transfers", daemon=True)
        self._thread.start()
        return self

    def close(self, wait_s: float = 5.0) -> None:
        """Stop accepting, cancel the transfers in flight (their pending objects are aborted,
        their waiters told ``cancelled``) and wait up to ``wait_s`` for every connection to
        end, so that nothing is written to the store after this returns (one stuck in a
        handshake ends at its timeout and writes nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            receiving = list(self._receiving)
        for receiver in receiving:
            receiver.cancel()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._receiving:
                    break
            time.sleep(0.02)
        self._release_held(until=math.inf)

    def info(self) -> dict[str, object]:
        """What ``GET /kv/info`` advertises under ``"transfer"``."""
        with self._lock:
            active = self._active
        return {
            "host": self.host,
            "port": self.port,
            "transport": self.transport_name,
            "layout": asdict(self.layout),
            "model_digest": self.model_digest.hex(),
            "active": active,
        }

    # ---- waiting (any thread) ----------------------------------------------------------------
    def wait(self, request_id: str, timeout_s: float) -> TransferStatus | None:
        """The transfer's end, or None when it did not end within ``timeout_s``."""
        waiter = self._waiter(request_id)
        if not waiter.done.wait(timeout=max(0.0, timeout_s)):
            return None
        return waiter.status

    async def wait_async(self, request_id: str, timeout_s: float) -> TransferStatus | None:
        """``wait`` for the event loop: no thread is held while the transfer runs."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TransferStatus] = loop.create_future()

        def resolve(status: TransferStatus) -> None:
            if not future.done():
                future.set_result(status)

        def notify(status: TransferStatus) -> None:  # on the receiving thread
            loop.call_soon_threadsafe(resolve, status)

        waiter = self._waiter(request_id)
        with self._lock:
            status = waiter.status
            if status is None:
                waiter.callbacks.append(notify)
        if status is not None:
            return status
        try:
            return await asyncio.wait_for(future, timeout=max(0.0, timeout_s))
        except TimeoutError:
            return None
        finally:
            with self._lock:
                if notify in waiter.callbacks:
                    waiter.callbacks.remove(notify)

    def _begin(self, request_id: str) -> TransferWaiter:
        """A transfer began (before its answer goes out): the waiter its end will set. A
        decode request's wait that came first shares it; one another transfer under the same
        id owns (ended or not) is replaced, so a later ``wait`` waits for this one."""
        with self._lock:
            waiter = self._waiters.get(request_id)
            if waiter is None or waiter.owned or waiter.status is not None:
                waiter = self._waiters[request_id] = TransferWaiter(time.monotonic())
                self._waiters.move_to_end(request_id)
            waiter.owned = True
        return waiter

    def _waiter(self, request_id: str) -> TransferWaiter:
        now = time.monotonic()
        dropped: list[Located] = []
        with self._lock:
            waiter = self._waiters.get(request_id)
            if waiter is None:
                waiter = self._waiters[request_id] = TransferWaiter(now)
            while self._waiters and (
                len(self._waiters) > _MAX_TRACKED
                or next(iter(self._waiters.values())).created < now - _KEEP_S
            ):
                request, _ = self._waiters.popitem(last=False)
                dropped += self._unhold(request)
        self._store.release(dropped)
        return waiter

    # ---- holds on received blocks (module docstring) -----------------------------------------
    def release(self, request_id: str) -> None:
        """The decode request of transfer ``request_id`` has its blocks (or gave up): end
        their hold. Idempotent; unknown ids are ignored."""
        with self._lock:
            held = self._unhold(request_id)
        self._store.release(held)

    def _release_held(self, *, until: float) -> None:
        """End every hold that lasts until before ``until`` (monotonic seconds)."""
        held: list[Located] = []
        with self._lock:
            for request_id, waiter in list(self._holding.items()):
                if waiter.held_until <= until:
                    held += self._unhold(request_id)
        self._store.release(held)

    def _unhold(self, request_id: str) -> list[Located]:
        """Under the lock: take the blocks held for ``request_id`` (the caller releases them,
        unlocked) from the waiter that holds them, whether or not it is still tracked."""
        waiter = self._holding.pop(request_id, None)
        if waiter is None:
            return []
        held, waiter.held = waiter.held, []
        return held

    def _finish(
        self,
        status: TransferStatus,
        held: Sequence[Located] = (),
        waiter: TransferWaiter | None = None,
    ) -> None:
        waiter = waiter if waiter is not None else self._waiter(status.request_id)
        with self._lock:
            waiter.status = status
            unheld = self._unhold(status.request_id)  # a repeated id: never leak a hold
            if held and not self._stop.is_set():  # else close() may have released all
                waiter.held, waiter.held_until = list(held), time.monotonic() + self.hold_s
                self._holding[status.request_id] = waiter
            else:
                unheld += held
            callbacks = list(waiter.callbacks)
        self._store.release(unheld)
        waiter.done.set()
        for callback in callbacks:
            callback(status)

    # ---- connections -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            self._release_held(until=time.monotonic())
            try:
                conn = self._listener.accept(timeout_s=0.2)
            except TransportError:
                continue
            with self._lock:
                full = self._active >= MAX_CONNECTIONS
                self._active += 0 if full else 1
            if full:
                logger.warning("transfer: %d connections open, one more closed", MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        """One connection, counted in ``_active`` from its accept to its end."""
        started: list[tuple[str, TransferWaiter]] = []  # the request id, once the intro named it
        try:
            self._serve_one(conn, started)
        except Exception as exc:  # a connection's failure is its own, never the worker's
            logger.exception("transfer connection failed")
            if started:
                (request_id, waiter), detail = started[0], str(exc)
                self._finish(
                    TransferStatus(request_id, "failed", 0, 0, 0.0, detail=detail), (), waiter
                )
        finally:
            with self._lock:
                self._active -= 1
            conn.close()

    def _serve_one(self, conn: Connection, started: list[tuple[str, TransferWaiter]]) -> None:
        start = time.monotonic()
        try:
            intro = decode_intro(bytes(conn.recv_frame(timeout_s=_HANDSHAKE_TIMEOUT_S)))
            raw_offer = bytes(conn.recv_frame(timeout_s=_HANDSHAKE_TIMEOUT_S))
        except HandshakeError as error:
            conn.send_frame(encode(refuse(error.reason, error.detail)))
            return  # no request id we can trust: nobody waits on it
        if not intro_authentic(intro, self.tenant_secret):
            # Not our fleet's sender: its request id is not trusted either, so no status is
            # recorded under it (a peer could otherwise cancel others' transfers or flood
            # the status table); counted and audited all the same.
            detail = "intro MAC does not verify"
            conn.send_frame(encode(refuse(RefuseReason.TENANT_FORBIDDEN, detail)))
            self._refused(intro, conn, RefuseReason.TENANT_FORBIDDEN.value, 0.0, record=False)
            return
        waiter = self._begin(intro.request_id)
        started.append((intro.request_id, waiter))
        answer = answer_offer(raw_offer, self.capabilities, max_bytes=MAX_MESSAGE_BYTES)
        offer: TransferOffer | None = None
        plan: ConversionPlan | None = None
        if not isinstance(answer, Refuse):
            offer = decode_offer(raw_offer, max_bytes=MAX_MESSAGE_BYTES)
            answer, plan = self._check(intro, offer, answer)
        conn.send_frame(encode(answer))
        if isinstance(answer, Refuse) or offer is None or plan is None:
            reason = answer.reason.value if isinstance(answer, Refuse) else "malformed"
            self._refused(intro, conn, reason, time.monotonic() - start, waiter=waiter)
            return
        if self._stop.is_set():  # closing: take nothing more into the store
            self._refused(intro, conn, "closing", time.monotonic() - start, waiter=waiter)
            return
        metas = self._metas(intro, offer, plan)
        receiver = TransferReceiver(
            self._ingress,
            metrics=self.metrics,
            audit=self.audit,
            convert=None if plan.identity else self._conversion(plan, len(offer.blocks)),
        )
        with self._lock:
            self._receiving.add(receiver)
        try:
            if self._stop.is_set():  # close() came since the check above
                receiver.cancel()
            result = receiver.receive(
                conn, metas, timeout_s=self.receive_timeout_s, request_id=intro.request_id
            )
        finally:
            with self._lock:
                self._receiving.discard(receiver)
        held: list[Located] = []
        if result.ok:  # held for its decode request until it releases them (or hold_s)
            scope = RequestScope(intro.tenant, self.engine.model_id, intro.request_id)
            held = self._store.hold_prefix(result.committed, scope, reserve=True)
        status = TransferStatus(
            intro.request_id,
            result.outcome,
            len(result.committed),
            result.payload_bytes,
            time.monotonic() - start,
            detail=result.detail,
        )
        self._finish(status, held, waiter)

    def _check(
        self,
        intro: TransferIntro,
        offer: TransferOffer,
        answer: TransferAnswer,
    ) -> tuple[TransferAnswer, ConversionPlan | None]:
        """What the pure negotiation cannot know (the intro's MAC was checked already): its
        agreement with the offer, the tokens covering the blocks, one source rank per connection."""
        if offer.request_id != intro.request_id or offer.tenant != intro.tenant:
            return refuse(RefuseReason.MALFORMED, "offer and intro disagree"), None
        source = offer.layout.layout()
        if len(offer.blocks) * source.block_size > len(intro.prompt_token_ids):
            return refuse(RefuseReason.MALFORMED, "more blocks than the prompt fills"), None
        # Block i is filed under this worker's key of prompt block i, as a full block: an
        # offer must name exactly that (a partial or shifted block would be served as a hit).
        if any(e.index != i or e.tokens != source.block_size for i, e in enumerate(offer.blocks)):
            detail = "blocks must be the prompt's full blocks 0, 1, … in order"
            return refuse(RefuseReason.MALFORMED, detail), None
        plan = plan_conversion(source, self.layout)
        if not isinstance(plan, ConversionPlan):  # negotiate accepted: cannot happen
            return refuse(plan.reason, plan.detail), None
        if source.tp_size != 1 or len(plan.source_ranks) != 1:
            detail = "one connection carries one TP rank: multi-rank senders are not wired"
            return refuse(RefuseReason.INVALID_LAYOUT, detail), None
        if isinstance(answer, AcceptWithConversion) or plan.identity:
            return answer, plan
        return refuse(RefuseReason.PLAN_MISMATCH, "no plan"), None

    def _metas(
        self, intro: TransferIntro, offer: TransferOffer, plan: ConversionPlan
    ) -> list[KVObjectMeta]:
        """Provisional metas of the blocks this worker will hold, under its own keys."""
        tokens = list(intro.prompt_token_ids)
        engine = self.engine
        assert engine.bridge is not None
        size = self.layout.block_size
        count = len(offer.blocks) * plan.source.block_size // size
        keys = engine.call(lambda: engine.block_keys(tokens, intro.tenant)).result()[:count]
        metas = []
        for i, key in enumerate(keys):
            info = BlockInfo(intro.tenant, i * size, block_tokens(tokens, i, size))
            parent = keys[i - 1] if i else None
            metas.append(engine.bridge.bridge.make_meta(key, parent, info, memoryview(b"")))
        return metas

    def _conversion(self, plan: ConversionPlan, source_blocks: int) -> Conversion:
        return Conversion(self._converter(plan), source_blocks, plan.source.block_bytes())

    def _converter(self, plan: ConversionPlan) -> Converter:
        source_shape = plan.source.block_shape()
        source_dtype = torch_dtype(plan.source.dtype)

        def convert(sources: Sequence[bytes]) -> Sequence[Buffer]:
            joined = bytearray(b"".join(sources))
            tensor = torch.frombuffer(joined, dtype=source_dtype).reshape(-1, *source_shape)
            converted = convert_blocks(plan, {plan.source.tp_rank: tensor})
            blocks = converted.blocks.contiguous()
            flat = blocks.view(torch.uint8).reshape(blocks.shape[0], -1)
            return [memoryview(flat[i].numpy().tobytes()) for i in range(blocks.shape[0])]

        return convert

    def _refused(
        self,
        intro: TransferIntro,
        conn: Connection,
        reason: str,
        seconds: float,
        *,
        record: bool = True,
        waiter: TransferWaiter | None = None,
    ) -> None:
        path = getattr(conn, "path", "tcp")
        self.metrics.observe(path, "refused", 0, seconds)
        self.audit.record(
            Action.TRANSFER,
            f"refused_{reason}",
            tenant=intro.tenant,
            request_id=intro.request_id,
            tier=self._ingress.name,
        )
        if record:
            status = TransferStatus(intro.request_id, "refused", 0, 0, seconds, reason)
            self._finish(status, (), waiter)
