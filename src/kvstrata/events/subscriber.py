"""Gap-aware subscriber for the KV event plane (wire protocol in :mod:`.publisher`).

Why it exists: an index built from events is only as right as the stream is complete. The
subscriber checks every sequence number; on a gap it asks the publisher's replay socket for
the missing batches before delivering anything newer, so consumers see batches in order. If
replay cannot cover the gap (no replay socket, timeout, or the batches were already evicted
from the publisher's buffer) it reports ``resync_needed`` instead of guessing.

Bad input never raises here: malformed frames, undecodable payloads and unknown events are
counted in :class:`EventPlaneStats` and skipped. An undecodable payload, or a malformed event
other than a store (it may have been a removal), also flags ``resync_needed``; an unknown
event type or trailing fields past the known ones (a newer producer) do not.

With ``curve`` (a :class:`~kvstrata.events.curve.CurveClient`: the publisher's public key and
this subscriber's own key pair) the SUB socket and every replay DEALER are CURVE clients.

A replay request waits for its answer (up to ``replay_timeout_s``) inside ``poll`` unless
``background_replay``: then ``poll`` sends the request and returns; each later ``poll`` reads
what has arrived on the request's DEALER (waiting at most its own ``timeout_ms``) and reads no
further live frames until the answer or the timeout is in, then settles the gap exactly as the
waiting path does. A consumer that serves many streams from one thread (the router's event
plane) sets it, so a worker whose replay socket does not answer delays no other worker's
events. Either way the DEALER belongs to the polling thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Self

import zmq

from kvstrata.events.curve import CurveClient
from kvstrata.events.publisher import END_SEQ
from kvstrata.events.schema import (
    EventDecodeError,
    KVEventBatch,
    UnknownEventError,
    decode_batch,
)

_SEQ_BYTES: Final = 8
_STORES_ONLY: Final = frozenset({"BlockStored"})
"""Event types whose loss cannot leave stale state behind (a missed store is a miss)."""


@dataclass(slots=True)
class _Replay:
    """One replay request, on a DEALER of its own (closed when settled, so a late answer to a
    timed-out request can never be mistaken for the answer to the next one)."""

    dealer: zmq.Socket[bytes]
    deadline: float
    replies: list[tuple[int, bytes]] = field(default_factory=list)
    answered: bool = False
    """The end marker came: ``replies`` is all the publisher holds from the start seq."""


@dataclass(slots=True)
class _PendingGap:
    """A live frame past a gap, held until its replay (``background_replay``) settles."""

    seq: int
    payload: bytes
    replay: _Replay


@dataclass
class EventPlaneStats:
    """Counters a consumer owns and exports; nothing global."""

    batches: int = 0
    events: int = 0
    malformed_messages: int = 0
    malformed_events: int = 0
    unknown_events: int = 0
    duplicates: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    resyncs_needed: int = 0
    untrusted_batches: int = 0
    history_truncated: int = 0
    """Rebuilds from the replay history (``resume_from(…, history=True)``) whose oldest
    batches the publisher's buffer no longer held: that part stays unknown, no resync."""


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """A decoded batch with its sequence number; ``replayed`` if it came over the replay socket."""

    seq: int
    batch: KVEventBatch
    replayed: bool = False


@dataclass
class PollResult:
    """What one ``poll`` delivered, in sequence order, and whether the stream lost data.

    ``resync_needed`` means a gap could not be filled by replay: the consumer must rebuild the
    publisher's state another way (a full dump) before trusting its index again.
    """

    batches: list[ReceivedBatch] = field(default_factory=list)
    resync_needed: bool = False


class ZmqEventSubscriber:
    """Receives, orders and decodes one publisher's batches; single-threaded, no background I/O.

    ``expected_seq`` is the first sequence number the consumer needs (vLLM starts at 0); a
    later first arrival is a gap. ``None`` accepts whatever arrives first (a consumer that
    will resync anyway). ``bind=True`` is for real vLLM, which connects to a ``tcp://host:port``
    endpoint rather than binding it.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        bind: bool = False,
        expected_seq: int | None = 0,
        replay_timeout_s: float = 1.0,
        max_batches_per_poll: int = 1024,
        stats: EventPlaneStats | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve: CurveClient | None = None,
        background_replay: bool = False,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._bind = bind
        self._expected = expected_seq
        self._replay_timeout_s = replay_timeout_s
        self._max_batches = max_batches_per_poll
        self.stats = stats if stats is not None else EventPlaneStats()
        self._context = context
        self._curve = curve
        self._sub: zmq.Socket[bytes] | None = None
        self._untrusted_next: int | None = None
        """The number after the last live frame dropped as untrusted (see ``_fill_gap``)."""
        self._history = False
        """Rebuilding from the replay history until the first accepted batch (``resume_from``)."""
        self._background = background_replay
        self._pending: _PendingGap | None = None

    @property
    def endpoint(self) -> str:
        """The live endpoint (resolved to the real port after ``start`` when binding ``:*``)."""
        return self._endpoint

    @property
    def expected_seq(self) -> int | None:
        return self._expected

    def resume_from(self, seq: int, *, history: bool = False) -> None:
        """Expect ``seq`` next: after a full dump taken at ``seq``, older batches are duplicates.

        ``history``: there is no dump, the replay history *is* the state (vLLM, from seq 0), so
        batches before the oldest one the publisher's buffer still holds are gone for good and
        asking again cannot help: the first gap fill takes what the buffer holds and counts
        ``history_truncated`` instead of flagging a resync (which would only rewind here again).
        """
        if seq < 0:
            raise ValueError("sequence numbers are non-negative")
        self._expected = seq
        self._untrusted_next = None
        self._history = history
        self._drop_pending()  # a gap relative to the old position: the dump supersedes it

    def start(self) -> Self:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if self._bind:
            if self._endpoint.startswith("tcp://") and self._endpoint.endswith(":*"):
                port = sub.bind_to_random_port(self._endpoint[:-2])
                self._endpoint = f"{self._endpoint[:-2]}:{port}"
            else:
                sub.bind(self._endpoint)
        else:
            sub.connect(self._endpoint)
        self._sub = sub
        return self

    def close(self) -> None:
        self._drop_pending()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def poll(self, timeout_ms: int = 0) -> PollResult:
        """Wait up to ``timeout_ms`` for traffic, then take what is queued (bounded per call)."""
        sub = self._sub
        if sub is None:
            raise RuntimeError("subscriber is not started")
        result = PollResult()
        pending = self._pending
        if pending is not None:
            if not self._read_replay(pending.replay, timeout_ms):
                return result  # the live frames wait in the socket, in order
            self._pending = None
            self._settle_gap(pending.seq, pending.payload, self._settled(pending.replay), result)
            timeout_ms = 0  # deliver what the replay brought without waiting for more
        if not sub.poll(timeout_ms):
            return result
        handled = 0
        while handled < self._max_batches and self._pending is None and sub.poll(0):
            self._handle_live(sub.recv_multipart(), result)
            handled += 1
        return result

    def _handle_live(self, frames: list[bytes], result: PollResult) -> None:
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            self.stats.malformed_messages += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self._expected is not None and seq < self._expected:
            self.stats.duplicates += 1
            return
        if self._expected is not None and seq > self._expected:
            if seq != self._untrusted_next:
                if self._replay_endpoint is None:
                    self._settle_gap(seq, payload, None, result)  # nobody to ask
                    return
                gap = _PendingGap(seq, payload, self._open_replay(self._replay_endpoint))
                if self._background:
                    self._pending = gap  # settled by a later poll
                    return
                self._read_replay(gap.replay, int(self._replay_timeout_s * 1000) + 1)
                self._settle_gap(seq, payload, self._settled(gap.replay), result)
                return
            # it follows the frame just dropped: a real stream whose publisher's replay does
            # not hold what it sends (a zero-length buffer); replay cannot help
            self._skip_to(seq, result)
        self._accept(seq, payload, result, replayed=False)

    def _settle_gap(
        self,
        seq: int,
        payload: bytes,
        replies: list[tuple[int, bytes]] | None,
        result: PollResult,
    ) -> None:
        """The live frame ``seq`` after a gap, once its replay is answered (or timed out)."""
        if not self._fill_gap(seq, replies, result):
            self.stats.untrusted_batches += 1  # its publisher never sent that number
            self._untrusted_next = seq + 1
            return
        assert self._expected is not None  # _fill_gap moved it to at least ``seq``'s gap
        if seq < self._expected:
            self.stats.duplicates += 1  # replay already delivered it
            return
        self._accept(seq, payload, result, replayed=False)

    def _accept(
        self,
        seq: int,
        payload: bytes,
        result: PollResult,
        *,
        replayed: bool,
        rebuilding: bool = False,
    ) -> None:
        """Advance past ``seq`` even if its payload is bad: replaying it would not fix it.

        A payload that does not decode, or a malformed event that is (or may be) a removal,
        may have dropped blocks the consumer's state still claims: that flags a resync (the
        dump, not this batch, is then the truth). Not while ``rebuilding`` from the replay
        history (``resume_from(…, history=True)``): the resync would rebuild from the same
        history and meet the same batch again. A malformed ``BlockStored`` only leaves a block
        unknown (a routing miss), and an event of a type this version does not know (a newer
        producer) is only counted."""
        self._expected = seq + 1
        self._untrusted_next = None
        self._history = False
        try:
            decoded = decode_batch(payload)
        except EventDecodeError:
            self.stats.malformed_messages += 1
            if not rebuilding:
                self._lost(result)
            return
        lossy = False
        for error in decoded.skipped:
            if isinstance(error, UnknownEventError):
                self.stats.unknown_events += 1
            else:
                self.stats.malformed_events += 1
                lossy = lossy or error.tag not in _STORES_ONLY
        if lossy and not rebuilding:
            self._lost(result)
        self.stats.batches += 1
        self.stats.events += len(decoded.batch.events)
        if replayed:
            self.stats.replayed_batches += 1
        result.batches.append(ReceivedBatch(seq=seq, batch=decoded.batch, replayed=replayed))

    def _fill_gap(
        self, live_seq: int, replies: list[tuple[int, bytes]] | None, result: PollResult
    ) -> bool:
        """Deliver the replay of ``[expected, live_seq)``; flag a resync for whatever it cannot
        cover (``replies`` None: unanswered), except in history mode, where what it cannot
        cover before the first batch delivered is lost history (``history_truncated``).

        A hole *after* the first batch delivered is not an eviction (a buffer evicts its oldest
        first) but a reply lost on the way: a resync, in history mode too.

        False when the publisher's replay answered and holds nothing at or past ``live_seq``:
        it has not sent that number (a publisher buffers a batch before sending it), so the
        live frame is forged or corrupt and the caller drops it. ``_expected`` does not move to
        it: were it to, every real batch after it would be dropped as a duplicate until a
        resync. What the replay did hold is delivered. A publisher that keeps no replay buffer
        looks the same for one frame; its next frame (``live_seq + 1``) is then trusted."""
        assert self._expected is not None
        history = self._history
        trusted = replies is None or any(seq >= live_seq for seq, _ in replies)
        if trusted:
            self.stats.gaps += 1
            self.stats.missed_batches += live_seq - self._expected
        evicted = lost = False
        delivered = 0
        for seq, payload in replies or []:
            if seq >= live_seq:
                break
            if seq < self._expected:
                continue
            if seq > self._expected:  # before the first: the oldest were evicted; later: lost
                lost = lost or delivered > 0
                evicted = True
            self._accept(seq, payload, result, replayed=True, rebuilding=history)
            delivered += 1
        if trusted and self._expected < live_seq:
            lost = lost or delivered > 0  # a buffer holding live_seq holds all after the first
            evicted = True
            self._expected = live_seq
        if lost or (evicted and not history):
            self._lost(result)
        elif evicted:
            # In history mode nothing before the gap is known (the state was just emptied),
            # so an unanswered replay, or no replay socket at all, loses only history: a
            # resync would empty the state and meet the same gap again, for ever.
            self.stats.history_truncated += 1
        return trusted

    def _lost(self, result: PollResult) -> None:
        self.stats.resyncs_needed += 1
        result.resync_needed = True

    def _skip_to(self, live_seq: int, result: PollResult) -> None:
        """Give up on ``[expected, live_seq)`` without asking: flag a resync (in history mode,
        count lost history: see ``_fill_gap``)."""
        assert self._expected is not None
        self.stats.gaps += 1
        self.stats.missed_batches += live_seq - self._expected
        self._expected = live_seq
        if self._history:
            self.stats.history_truncated += 1
        else:
            self._lost(result)

    def _open_replay(self, endpoint: str) -> _Replay:
        """Ask the ROUTER for the batches from the one expected next; read by ``_read_replay``."""
        assert self._expected is not None
        start_seq = self._expected
        self.stats.replay_requests += 1
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's buffer
        replay = _Replay(dealer, time.monotonic() + self._replay_timeout_s)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart((b"", start_seq.to_bytes(_SEQ_BYTES, "big")))
        except BaseException:
            dealer.close(linger=0)
            raise
        return replay

    def _read_replay(self, replay: _Replay, wait_ms: int) -> bool:
        """Read the replay's frames that arrive within ``wait_ms`` (never past its deadline);
        True once it is settled: the end marker came, or the deadline passed."""
        until = min(replay.deadline, time.monotonic() + wait_ms / 1000)
        while not replay.answered:
            remaining_ms = max(0, int((until - time.monotonic()) * 1000))
            if not replay.dealer.poll(remaining_ms):
                return time.monotonic() >= replay.deadline
            frames = replay.dealer.recv_multipart()
            if len(frames) == 4:  # vLLM's replies carry the topic: ["", topic, seq, data]
                frames = [frames[0], frames[2], frames[3]]
            if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
                self.stats.malformed_messages += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                replay.answered = True
            else:
                replay.replies.append((seq, frames[2]))
        return True

    @staticmethod
    def _settled(replay: _Replay) -> list[tuple[int, bytes]] | None:
        replay.dealer.close(linger=0)
        return replay.replies if replay.answered else None

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.replay.dealer.close(linger=0)
            self._pending = None

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        socket = (self._context or zmq.Context.instance()).socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(socket)
        return socket
