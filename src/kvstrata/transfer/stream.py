"""Layer-wise KV transfer with digests: a sender fed as layers are computed, a receiver that
commits only what verified whole.

``TransferSender`` is fed one layer at a time (``send_layer(layer, blocks)``: that layer's
bytes for every block of the request, as soon as the layer's KV exists) and sends, per run of
consecutive blocks (up to ``DEFAULT_RUN_BYTES``), a RUN frame followed by the run's bytes as a
frame of their own, gathered from the caller's buffers without a copy; then ``finish()`` sends
COMPLETE with each block's whole-payload digest (``objects.payload_digest`` of the layers in
order: the sender hashes incrementally, never re-reading the payload). Wire format:
``frames`` (LAYER and LAYERS frames, whose slices carry digests of their own, are accepted
too).

``TransferReceiver.receive(conn, metas)`` places layer slices straight into PENDING objects of
a destination tier (``prepare_store``: the host tier's slot is writable in place) at offset
``layer × layer_bytes`` — a RUN's bytes go from the socket into the slots
(``Connection.recv_frame_into``), with no buffer between —, feeds each block's running hash
while the slice is in cache (checks a LAYER/LAYERS slice's own digest too), and at COMPLETE
checks that every layer of every block came and each block's digest; only then does it give
each slot its final meta (the announced digest) and ``complete_store(ok)``. Any other end — a
digest mismatch, a missing layer, a malformed or foreign frame, the sender's CANCEL,
``cancel()`` here, the deadline, or the sender gone — aborts every pending object
(``complete_store(fail)``): nothing half-written is ever visible. A non-identity conversion
(``convert``: source blocks → target blocks, run after verification) stages source blocks in
memory instead and stores the converted ones.

Each transfer is counted once (``TransferMetrics``: path, outcome, bytes, seconds) and audited
(``Action.TRANSFER``: outcome, object ids, counts — never tokens).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import xxhash

from kvstrata.errors import InvalidInput
from kvstrata.identity import BlockKey
from kvstrata.objects import KVObjectMeta, payload_digest, payload_hasher
from kvstrata.security.audit import NULL_AUDIT, Action, AuditLog
from kvstrata.telemetry.transfer_metrics import TransferMetrics
from kvstrata.tiers.base import StoreSlot, TierError
from kvstrata.transfer import frames
from kvstrata.transfer.transport import (
    Buffer,
    Connection,
    FrameError,
    PeerLost,
    TransportTimeout,
)

_T = TypeVar("_T")
Converter = Callable[[Sequence[bytes]], Sequence[Buffer]]


@dataclass(frozen=True)
class Conversion:
    """How a transfer in the sender's layout becomes this receiver's blocks: ``convert`` maps
    the verified source blocks to target payloads; the sender must announce exactly
    ``source_blocks`` blocks of ``source_block_bytes`` each (what the handshake agreed), so
    nothing it claims in BEGIN sizes the receiver's staging."""

    convert: Converter
    source_blocks: int
    source_block_bytes: int


DEFAULT_RUN_BYTES = 512 * 1024
"""A RUN's bytes at most: one layer of many blocks per frame, not one per block — per-frame
costs (headers, a syscall, a Python round) dominated small slices — and no more than stays in
the receiving core's L2 cache until its slices are hashed (measured on a 2 MiB-L2 Xeon,
SmolLM2's 24 KiB slices, stack ÷ raw socket: 4 MiB runs 0.52, 2 MiB 0.48, 1 MiB 0.77,
512 KiB 0.84–0.89, 256 KiB 0.71, 128 KiB 0.62; ``docs/disaggregation.md``)."""
MAX_RUN_SLICES = 512
"""Slices per RUN at most: its bytes go out as one gathered send (IOV_MAX is 1024)."""


class PendingSink(Protocol):
    """Where a receiver writes: the two-phase store of a ``Tier`` (every tier is one), or a
    ``TieredStore`` level through ``transfer.ingress.StoreIngress``."""

    @property
    def name(self) -> str: ...

    def prepare_store(self, meta: KVObjectMeta) -> StoreSlot | None: ...

    def complete_store(self, slot: StoreSlot, success: bool) -> bool: ...


class TransferSender:
    """Sends one request's KV, layer by layer, over one connection (one thread drives it)."""

    def __init__(
        self,
        conn: Connection,
        request_id: str,
        *,
        blocks: int,
        layers: int,
        layer_bytes: int,
        timeout_s: float | None = 30.0,
        run_bytes: int = DEFAULT_RUN_BYTES,
    ) -> None:
        self.conn = conn
        self.request_id = request_id
        self.blocks, self.layers, self.layer_bytes = blocks, layers, layer_bytes
        self.timeout_s = timeout_s
        self.run_bytes = run_bytes
        self._hashers = [payload_hasher() for _ in range(blocks)]
        self._next_layer = 0
        self._begun = False

    def begin(self) -> None:
        frame = frames.encode_begin(self.request_id, self.blocks, self.layers, self.layer_bytes)
        self.conn.send_frame(frame, timeout_s=self.timeout_s)
        self._begun = True

    def send_layer(self, layer: int, blocks: Sequence[Buffer]) -> None:
        """``blocks[i]``: layer ``layer`` of block ``i`` (``layer_bytes`` each); layers in order.

        Sent as LAYERS frames of consecutive blocks, each at most ``run_bytes`` (and the
        connection's ``max_frame``; at most ``MAX_RUN_SLICES`` slices: one gathered send)."""
        if not self._begun:
            self.begin()
        if layer != self._next_layer or len(blocks) != self.blocks:
            raise InvalidInput(
                f"expected layer {self._next_layer} of {self.blocks} blocks, "
                f"got layer {layer} of {len(blocks)}"
            )
        views = [memoryview(data).cast("B") for data in blocks]
        for index, view in enumerate(views):
            if view.nbytes != self.layer_bytes:
                raise InvalidInput(f"block {index}: {view.nbytes} bytes, not {self.layer_bytes}")
        per_frame = self._run_slices()
        hashers = self._hashers
        for first in range(0, len(views), per_frame):
            run = views[first : first + per_frame]
            self.conn.send_frame(
                frames.encode_run(self.request_id, first, len(run), layer),
                timeout_s=self.timeout_s,
            )
            self.conn.send_frame(*run, timeout_s=self.timeout_s)
            for index, view in enumerate(run, start=first):  # while the receiver places it
                hashers[index].update(view)
        self._next_layer += 1

    def _run_slices(self) -> int:
        """Slices per RUN: as many as ``run_bytes`` and the frame limit allow; one slice larger
        than ``run_bytes`` (large blocks) goes alone, within the frame limit."""
        if self.layer_bytes > self.conn.max_frame:
            raise InvalidInput(
                f"a {self.layer_bytes}-byte layer slice is over {self.conn.max_frame} per frame"
            )
        limit = min(self.run_bytes, self.conn.max_frame)
        return max(1, min(self.blocks, MAX_RUN_SLICES, limit // self.layer_bytes))

    def finish(self) -> list[bytes]:
        """Send COMPLETE; returns the per-block digests it announced."""
        if self._next_layer != self.layers:
            raise InvalidInput(f"finish after {self._next_layer} of {self.layers} layers")
        digests = [h.digest() for h in self._hashers]
        self.conn.send_frame(
            frames.encode_complete(self.request_id, digests), timeout_s=self.timeout_s
        )
        return digests

    def cancel(self) -> None:
        self.conn.send_frame(frames.encode_cancel(self.request_id), timeout_s=self.timeout_s)


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    outcome: str  # one of telemetry.transfer_metrics.OUTCOMES
    committed: tuple[BlockKey, ...]
    payload_bytes: int
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "committed"


class _End(Exception):  # control flow inside receive, never escapes
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


class TransferReceiver:
    """Receives one transfer at a time into ``tier``; ``cancel()`` may come from any thread."""

    def __init__(
        self,
        tier: PendingSink,
        *,
        metrics: TransferMetrics | None = None,
        audit: AuditLog = NULL_AUDIT,
        convert: Conversion | None = None,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.audit = audit
        self.convert = convert
        self.poll_s = poll_s
        self._clock = clock
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def receive(
        self,
        conn: Connection,
        metas: Sequence[KVObjectMeta],
        *,
        timeout_s: float,
        request_id: str | None = None,
    ) -> TransferResult:
        """Receive one request's blocks as ``metas`` (provisional digests) → the outcome.

        A ``cancel()`` that came before this call cancels this transfer; the flag clears when
        it ends."""
        session = _Session(self, conn, metas, request_id)
        start = self._clock()
        try:
            session.run(start + timeout_s)
            outcome, detail = "committed", ""
        except _End as end:
            outcome, detail = end.outcome, end.detail
        finally:
            if session.pending:
                session.abort()
            self._cancelled.clear()
        seconds = self._clock() - start
        self.metrics.observe(conn.path, outcome, session.payload_bytes, seconds)
        keys = session.committed if outcome == "committed" else [m.key for m in metas]
        self.audit.record(
            Action.TRANSFER,
            outcome,
            tenant=metas[0].tenant if metas else None,
            request_id=session.request_id,
            tier=self.tier.name,
            keys=keys,
            counts={"blocks": len(metas), "bytes": session.payload_bytes},
        )
        return TransferResult(
            session.request_id or "",
            outcome,
            tuple(session.committed),
            session.payload_bytes,
            seconds,
            detail,
        )


class _Session:
    """One transfer's state: pending slots (or staged source blocks), layers seen, digests."""

    def __init__(
        self,
        owner: TransferReceiver,
        conn: Connection,
        metas: Sequence[KVObjectMeta],
        request_id: str | None,
    ) -> None:
        self.owner, self.conn, self.metas = owner, conn, list(metas)
        self.request_id = request_id
        self.pending: list[StoreSlot] = []
        self.staged: list[bytearray] = []
        self.places: list[memoryview] = []  # per source block: where its bytes go (a byte view)
        self.seen: list[bytearray] = []  # per layer: 1 where that block's slice came
        self.hashers: list[xxhash.xxh3_128] = []  # per block: its layers hashed as they came
        self.hashed: list[int] = []  # per block: layers fed to its hasher (in order only)
        self.committed: list[BlockKey] = []
        self.payload_bytes = 0
        self.begin: frames.Begin | None = None

    def run(self, deadline: float) -> None:
        while True:
            frame = self._next(deadline)
            if self.request_id is None:
                self.request_id = frame.request_id
            if frame.request_id != self.request_id:
                raise _End("refused", "frame of another request")
            if isinstance(frame, frames.Cancel):
                raise _End("cancelled", "sender cancelled")
            if isinstance(frame, frames.Begin):
                self._on_begin(frame)
            elif self.begin is None:
                raise _End("refused", "first frame is not BEGIN")
            elif isinstance(frame, frames.Run):
                self._on_run(self.begin, frame.first, frame.count, frame.layer, None, deadline)
            elif isinstance(frame, frames.Layers):
                digests = frame.digests
                self._on_run(self.begin, frame.first, len(digests), frame.layer, frame, deadline)
            elif isinstance(frame, frames.Layer):
                self._on_run(self.begin, frame.block, 1, frame.layer, frame, deadline)
            else:
                self._on_complete(self.begin, frame)
                return

    def _next(self, deadline: float) -> frames.Frame:
        raw = self._poll(deadline, lambda left: self.conn.recv_frame(timeout_s=left))
        try:
            return frames.decode(raw)
        except frames.MalformedFrame as exc:
            raise _End("refused", str(exc)) from exc

    def _poll(self, deadline: float, receive: Callable[[float], _T]) -> _T:
        """``receive(timeout)`` in short rounds (it resumes where a timeout left it) until it
        returns, the deadline passes or ``cancel()`` comes; transport errors end the session."""
        owner = self.owner
        while True:
            if owner._cancelled.is_set():
                raise _End("cancelled", "receiver cancelled")
            left = deadline - owner._clock()
            if left <= 0:
                raise _End("timeout", "deadline passed before COMPLETE")
            try:
                return receive(min(left, owner.poll_s))
            except TransportTimeout:
                continue
            except PeerLost as exc:
                raise _End("peer_lost", str(exc)) from exc
            except FrameError as exc:
                raise _End("refused", str(exc)) from exc

    def _on_begin(self, begin: frames.Begin) -> None:
        if self.begin is not None:
            raise _End("refused", "second BEGIN")
        source_size = begin.layers * begin.layer_bytes
        conversion = self.owner.convert
        if conversion is None:
            if begin.blocks != len(self.metas):
                raise _End("refused", f"{begin.blocks} blocks announced, {len(self.metas)} asked")
            if any(m.size != source_size for m in self.metas):
                raise _End("refused", f"block of {source_size} bytes does not match the metas")
        elif (begin.blocks, source_size) != (
            conversion.source_blocks,
            conversion.source_block_bytes,
        ):
            raise _End(
                "refused",
                f"{begin.blocks} blocks of {source_size} bytes announced, the handshake agreed "
                f"{conversion.source_blocks} of {conversion.source_block_bytes}",
            )
        self.begin = begin
        self.seen = [bytearray(begin.blocks) for _ in range(begin.layers)]
        self.hashers = [payload_hasher() for _ in range(begin.blocks)]
        self.hashed = [0] * begin.blocks
        if self.owner.convert is not None:
            self.staged = [bytearray(source_size) for _ in range(begin.blocks)]
            self.places = [memoryview(b) for b in self.staged]
            return
        for meta in self.metas:
            slot = self._prepare(meta)
            self.pending.append(slot)
        self.places = [memoryview(slot.buffer).cast("B") for slot in self.pending]

    def _prepare(self, meta: KVObjectMeta) -> StoreSlot:
        try:
            slot = self.owner.tier.prepare_store(meta)
        except (TierError, InvalidInput) as exc:
            raise _End("refused", f"tier refused: {exc}") from exc
        if slot is None:
            raise _End("refused", "no room in the tier (or the object exists)")
        return slot

    def _on_run(
        self,
        begin: frames.Begin,
        first: int,
        count: int,
        layer: int,
        inline: frames.Layers | frames.Layer | None,
        deadline: float,
    ) -> None:
        """One layer of blocks ``first`` … ``first + count - 1``: a RUN (``inline`` None: its
        bytes are the next frame, received straight into the slots) or a LAYERS/LAYER frame
        (slices inline, each checked against its own digest, then copied). Checks once per
        run; per slice only the placement and the block's running hash, fed while the slice is
        in cache so that COMPLETE need not read the payload again."""
        size = begin.layer_bytes
        if not (first >= 0 and first + count <= begin.blocks and 0 <= layer < begin.layers):
            raise _End("refused", f"blocks {first}+{count} layer {layer} out of range")
        seen = self.seen[layer]
        if any(seen[first : first + count]):
            raise _End("refused", f"layer {layer} of a block in {first}+{count} sent twice")
        start, end = layer * size, (layer + 1) * size
        places = [target[start:end] for target in self.places[first : first + count]]
        if inline is None:
            self._poll(deadline, lambda left: self.conn.recv_frame_into(places, timeout_s=left))
            pieces = places
        else:
            payload = inline.payload
            if len(payload) != count * size:
                raise _End("refused", f"layer payload of {len(payload)} bytes for {count} blocks")
            digests = inline.digests if isinstance(inline, frames.Layers) else (inline.digest,)
            pieces = [payload[i * size : (i + 1) * size] for i in range(count)]
            for index, (piece, digest) in enumerate(zip(pieces, digests, strict=True)):
                if payload_digest(piece) != digest:
                    raise _End("digest_mismatch", f"block {first + index} layer {layer}")
                places[index][:] = piece
            pieces = places  # the running hashes read what landed, where it lies
        self.payload_bytes += count * size
        hashers, hashed = self.hashers, self.hashed
        for block, piece in enumerate(pieces, start=first):
            if hashed[block] == layer:  # in layer order: the running hash stays valid
                hashers[block].update(piece)
                hashed[block] = layer + 1
        seen[first : first + count] = b"\x01" * count

    def _on_complete(self, begin: frames.Begin, frame: frames.Complete) -> None:
        if len(frame.digests) != begin.blocks:
            raise _End("refused", f"COMPLETE names {len(frame.digests)} of {begin.blocks} blocks")
        for layer, blocks in enumerate(self.seen):
            if not all(blocks):
                raise _End("refused", f"block {blocks.index(0)} missing layer {layer}")
        sources: Sequence[Buffer] = self.staged or [s.buffer for s in self.pending]
        for block, (data, digest) in enumerate(zip(sources, frame.digests, strict=True)):
            if self.hashed[block] == begin.layers:
                got = self.hashers[block].digest()
            else:  # layers came out of order: hash the assembled payload
                got = payload_digest(data)
            if got != digest:
                raise _End("digest_mismatch", f"block {block} whole-payload digest")
        # Every digest above is of the bytes where they lie, after their last write: the tier
        # takes it (``StoreSlot.written_digest``) instead of reading every byte again.
        digests = self._store_converted() if self.staged else list(frame.digests)
        self._commit_all(digests)

    def _store_converted(self) -> list[bytes]:
        conversion = self.owner.convert
        assert conversion is not None
        try:
            targets = conversion.convert([bytes(b) for b in self.staged])
        except Exception as exc:  # the sender's bytes in a shape the converter cannot take
            raise _End("refused", f"conversion failed: {exc}"[:300]) from exc
        if len(targets) != len(self.metas):
            raise _End("refused", f"conversion gave {len(targets)} of {len(self.metas)} blocks")
        for meta, data in zip(self.metas, targets, strict=True):
            if memoryview(data).nbytes != meta.size:
                raise _End("refused", f"converted block of {memoryview(data).nbytes} bytes")
            slot = self._prepare(meta)
            self.pending.append(slot)
            slot.buffer[:] = memoryview(data).cast("B")
        return [payload_digest(slot.buffer) for slot in self.pending]

    def _commit_all(self, digests: list[bytes]) -> None:
        """Commit parents first. A commit the tier refuses ends the transfer there: what
        committed before it stays (each block verified, and a prefix of a chain is a valid
        cache entry), the rest is aborted. Nothing is taken back: a key the sink held before
        the transfer committed "again" without a write, and removing it would delete a block
        this transfer never wrote."""
        for slot, digest in zip(self.pending, digests, strict=True):
            slot.meta = replace(slot.meta, digest=digest)
            slot.written_digest = digest  # verified over the slot's bytes (``_on_complete``)
        while self.pending:
            slot = self.pending[0]
            try:
                ok = self.owner.tier.complete_store(slot, True)
            except TierError as exc:
                self.pending.pop(0)
                raise _End("refused", f"tier failed at commit: {exc}") from exc
            self.pending.pop(0)
            if not ok:
                raise _End("digest_mismatch", "tier rejected a verified block at commit")
            self.committed.append(slot.meta.key)

    def abort(self) -> None:
        for slot in self.pending:
            try:
                self.owner.tier.complete_store(slot, False)
            except TierError:  # already finished by the tier: nothing of it is visible
                continue
        self.pending.clear()
