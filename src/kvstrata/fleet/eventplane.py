"""The router's event loop: one subscriber per worker, applied in order to the global index.

Attach protocol (also how a restarted router rebuilds its index from the workers):

1. connect a SUB socket to the worker's live endpoint (nothing is read yet);
2. take the worker's dump (``/kv/dump``: every resident block, and the live sequence number
   ``S`` it corresponds to) and replace the worker's entries with it;
3. expect ``S`` next: older batches that were queued meanwhile are duplicates of the dump,
   and a later one is a gap that the replay socket fills.

Attaching a worker already read at the same sockets (the health round, after a restart at
fixed endpoints) keeps its stream (``_reattach``): the new epoch's dump may be in already
(its first batch made the stream resync), or one is fetched, never two.

A gap that replay cannot fill marks the worker inconsistent at once (its entries stop counting
in lookups: when unsure, recompute) and is repaired by a new dump. No dump is fetched on the
loop's thread: an attach's (after the subscription's settle time) and a resync's each run on a
daemon thread of their own, so neither a slow worker nor shutdown waits on another. A worker
whose stream waits for its dump is not read meanwhile (its frames wait in the SUB socket; any
lost to its high-water mark are a gap once the dump is in); the other workers' events flow.
``attach`` returns when the dump is applied. Gap replays run in the background too
(``ZmqEventSubscriber(background_replay=True)``): a worker whose replay socket does not answer
holds only its own stream, for up to ``replay_timeout_s``. A resync's dump that fails is
retried with backoff (0.5 s doubling to 30 s, counted in ``resyncs["dump_failed"]``) until it
succeeds or the worker is detached; the worker matches nothing until then.

A vLLM worker has no snapshot: its "dump" is empty at seq 0 (``WorkerDump.history_by_replay``)
and the replay buffer brings the history; its connector stream (``lower``) likewise starts at
0. What a buffer has already evicted stays unknown (counted in the subscriber's
``history_truncated``) instead of asking for the same empty dump again, which would rewind to 0
and find the same buffer: a resync loop that kept a long-running vLLM worker matching nothing.
A main-stream resync replaces every medium's entries, so the lower subscriber is rewound to 0
as well and its next batch replays that history.

Ownership: the loop's own thread owns the subscribers, their ZMQ sockets and their
``EventPlaneStats`` (plain counters, read by the metrics collector as they are); other threads
only enqueue commands and wait on their futures, and a dump thread only calls the worker
source (with the shared HTTP client) and fills a future the loop reads. The index
and the ``resyncs`` counts belong to the fleet lock passed in: this thread takes it to apply a
batch or a dump or to count a resync (bookkeeping only; receiving and ``/kv/dump`` happen
outside it), so never wait on a command while holding that lock.

CURVE: a worker that advertises a public key in ``/kv/info`` is subscribed to as a CURVE
client with the router's key pair (``curve_keys``), and so is a connector stream with its own
key (``WorkerInfo.lower_curve_public_key``); the fleet refuses the mismatched cases (a CURVE
stream without router keys, a plaintext one with them, a plaintext connector stream beyond
loopback, which its connector never publishes: ``fleet.curve_keys``) before it gets here.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import httpx
from msgspec.structs import replace

from kvstrata.events.curve import CurveClient, KeyPair
from kvstrata.events.schema import KVEventBatch
from kvstrata.events.subscriber import EventPlaneStats, PollResult, ZmqEventSubscriber
from kvstrata.fleet.source import KvstrataSource, WorkerSource
from kvstrata.fleet.worker_info import WorkerDump, WorkerInfo, WorkerProtocolError
from kvstrata.index.core import GlobalIndex

_log = logging.getLogger(__name__)
_DUMP_RETRY_S = 0.5
_DUMP_RETRY_MAX_S = 30.0
_DUMP_RETRY_DOUBLINGS = 6
_APPLY_CHUNK = 256
"""Batches applied per hold of the fleet lock (routing waits at most that long)."""


@dataclass
class _Stream:
    info: WorkerInfo
    subscriber: ZmqEventSubscriber
    lower: ZmqEventSubscriber | None = None
    """The connector's stream of a vLLM worker (``WorkerInfo.lower_events_endpoint``)."""
    dump: Future[WorkerDump] | None = None
    """A dump on its way (the stream is not read until it is in)."""
    attaching: Future[object] | None = None
    """The ``attach`` command waiting for the first dump (failed if that dump fails)."""
    dump_failures: int = 0
    """Failed resync dumps in a row (the retry's backoff)."""
    closed: threading.Event = field(default_factory=threading.Event)
    """Set when the stream closes: its dump thread gives up instead of asking a gone worker."""

    def close(self) -> None:
        self.closed.set()
        self.subscriber.close()
        if self.lower is not None:
            self.lower.close()
        if self.attaching is not None and not self.attaching.done():
            self.attaching.set_exception(
                WorkerProtocolError(f"{self.info.worker_id} was detached before its dump was in")
            )


def _same_sockets(old: WorkerInfo, new: WorkerInfo) -> bool:
    """Whether a stream subscribed for ``old`` reads ``new``'s events (its sockets and key)."""
    return (
        old.events_endpoint,
        old.replay_endpoint,
        old.lower_events_endpoint,
        old.lower_replay_endpoint,
        old.curve_public_key,
        old.lower_curve_public_key,
    ) == (
        new.events_endpoint,
        new.replay_endpoint,
        new.lower_events_endpoint,
        new.lower_replay_endpoint,
        new.curve_public_key,
        new.lower_curve_public_key,
    )


def _copy_outcome(source: Future[object], target: Future[object]) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())


def _without_epoch(batch: KVEventBatch) -> KVEventBatch:
    """A lower stream shares its worker's slot with the main stream, whose epoch rules: the
    connector's own epoch would otherwise read as a restart and drop the device entries."""
    return batch if batch.epoch is None else replace(batch, epoch=None)


class EventPlane:
    """Owns the subscribers; ``attach``/``detach`` may be called from any thread."""

    def __init__(
        self,
        index: GlobalIndex,
        lock: threading.Lock,
        *,
        subscribe_settle_s: float = 0.2,
        replay_timeout_s: float = 1.0,
        on_resync: Callable[[str, str], None] | None = None,
        curve_keys: KeyPair | None = None,
        api_key: str | None = None,
        verify: ssl.SSLContext | bool = True,
        source: WorkerSource | None = None,
        transform: Callable[[KVEventBatch], KVEventBatch] | None = None,
    ) -> None:
        self.index = index
        self.lock = lock
        """The fleet lock: the owner of ``index``."""
        self.stats = EventPlaneStats()
        self.resyncs: dict[str, int] = {}
        self._settle_s = subscribe_settle_s
        self._replay_timeout_s = replay_timeout_s
        self._on_resync = on_resync
        self._curve_keys = curve_keys
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.Queue[tuple[str, object, Future[object]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api_key = api_key
        """The router's fleet key, presented to read a worker's ``/kv/dump``."""
        self._http = httpx.Client(timeout=30.0, verify=verify)
        self._source: WorkerSource = source or KvstrataSource()
        self._transform = transform
        """Applied to every main-stream batch (vLLM: ``cache_salt`` → tenant namespace)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstrata-events", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._http.close()

    # ------------------------------------------------------------------ commands
    def attach(self, info: WorkerInfo, timeout_s: float = 30.0) -> None:
        """Subscribe to a worker and load its dump; replaces any previous stream for it.

        A worker whose dump is not in after ``timeout_s`` is detached (``TimeoutError``): no
        stream is left behind that the caller does not know of."""
        try:
            self._submit("attach", info).result(timeout=timeout_s)
        except TimeoutError:
            self._submit("detach", info.worker_id)
            raise

    def detach(self, worker_id: str, timeout_s: float = 10.0) -> None:
        """Close the worker's stream and drop its index entries (dead or drained worker)."""
        self._submit("detach", worker_id).result(timeout=timeout_s)

    def attached(self) -> list[str]:
        return list(self._streams)  # a copy-on-write snapshot: safe from any thread

    def _submit(self, kind: str, arg: object) -> Future[object]:
        future: Future[object] = Future()
        if self._thread is None:
            raise RuntimeError("event plane is not started")
        self._commands.put((kind, arg, future))
        return future

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            busy = False
            for worker_id, stream in self._streams.items():
                if stream.dump is not None:
                    if stream.dump.done():
                        try:
                            self._finish_dump(worker_id, stream, stream.dump)
                        except Exception:  # never let one worker's dump stop the loop
                            _log.exception("applying the dump of %s failed", worker_id)
                        busy = True
                    continue
                try:
                    busy |= self._poll(worker_id, stream)
                except Exception:  # never let one worker's stream stop the loop
                    _log.exception("event stream of %s failed; resyncing", worker_id)
                    self._resync(worker_id, stream, "error")
            if not busy:
                time.sleep(0.005)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "attach":
                    assert isinstance(arg, WorkerInfo)
                    self._attach(arg, future)  # resolved when its dump is in
                else:
                    assert isinstance(arg, str)
                    self._detach(arg)
                    future.set_result(None)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)

    def _attach(self, info: WorkerInfo, done: Future[object]) -> None:
        current = self._streams.get(info.worker_id)
        if current is not None and _same_sockets(current.info, info):
            self._reattach(info, current, done)
            return
        self._detach(info.worker_id)
        curve = self._client_of(info.worker_id, info.curve_public_key)
        lower_curve = self._client_of(info.worker_id, info.lower_curve_public_key)
        subscriber = ZmqEventSubscriber(
            info.events_endpoint,
            info.replay_endpoint,
            expected_seq=None,
            replay_timeout_s=self._replay_timeout_s,
            stats=self.stats,
            background_replay=True,
            curve=curve,
        ).start()
        lower = None
        if info.lower_events_endpoint is not None:
            # No dump of its own: from seq 0, so its replay socket brings the history.
            lower = ZmqEventSubscriber(
                info.lower_events_endpoint,
                info.lower_replay_endpoint,
                expected_seq=0,
                replay_timeout_s=self._replay_timeout_s,
                stats=self.stats,
                background_replay=True,
                curve=lower_curve,
            ).start()
        stream = _Stream(info, subscriber, lower, attaching=done)
        # the settle time lets the subscription reach the publisher before the dump is taken
        stream.dump = self._fetch_dump(stream, delay_s=self._settle_s)
        self._streams = {**self._streams, info.worker_id: stream}

    def _client_of(self, worker_id: str, server_key: bytes | None) -> CurveClient | None:
        """The router's CURVE client of a stream whose server key is ``server_key``."""
        if server_key is None:
            return None
        if self._curve_keys is None:
            raise WorkerProtocolError(f"worker {worker_id} needs CURVE keys")
        return self._curve_keys.client_of(server_key)

    def _reattach(self, info: WorkerInfo, stream: _Stream, done: Future[object]) -> None:
        """Attach a worker this plane already reads at the same sockets (a restart at fixed
        endpoints, seen by the health round): the stream stays. Its own epoch resync may have
        brought the new epoch's dump already (done), or be on its way (done with it; one held
        back by a failed dump's backoff is asked for now); otherwise the old epoch's entries
        stop counting and one dump replaces them. Before, the stream was torn down and a
        second dump fetched, and the worker matched nothing in between."""
        worker_id = info.worker_id
        stream.info = info
        if stream.attaching is not None:  # an earlier attach still waits: finish with it
            stream.attaching.add_done_callback(lambda first: _copy_outcome(first, done))
            return
        if stream.dump is None:
            with self.lock:
                in_step = self.index.epoch(worker_id) == info.epoch
                in_step = in_step and self.index.is_consistent(worker_id)
                if not in_step:
                    self.index.mark_inconsistent(worker_id)
            if in_step:
                done.set_result(None)
                return
            stream.dump = self._fetch_dump(stream)
        elif stream.dump_failures:  # a resync dump held back by its retry's backoff: ask now
            stream.dump_failures = 0
            stream.dump = self._fetch_dump(stream)
        stream.attaching = done

    def _detach(self, worker_id: str) -> None:
        stream = self._streams.get(worker_id)
        if stream is not None:
            self._streams = {k: v for k, v in self._streams.items() if k != worker_id}
            stream.close()
        with self.lock:
            self.index.remove_worker(worker_id)

    def _apply_dump(self, worker_id: str, stream: _Stream, dump: WorkerDump) -> None:
        if dump.next_seq < 0:
            raise WorkerProtocolError(f"dump of {worker_id}: negative next_seq {dump.next_seq}")
        with self.lock:
            self.index.replace_worker(
                worker_id, dump.epoch, dump.events, ts=dump.ts, next_seq=dump.next_seq
            )
        stream.subscriber.resume_from(dump.next_seq, history=dump.history_by_replay)
        if stream.lower is not None:  # the dump dropped its entries: replay brings them back
            stream.lower.resume_from(0, history=True)

    def _poll(self, worker_id: str, stream: _Stream) -> bool:
        busy = self._apply(worker_id, stream, stream.subscriber.poll(0), self._transform)
        if stream.dump is not None:
            # a resync is on its way: its dump replaces every medium's entries, so connector
            # batches read now would be lost; they wait in their socket until it is in
            return busy
        if stream.lower is not None:
            busy |= self._apply(worker_id, stream, stream.lower.poll(0), _without_epoch, lower=True)
        return busy

    def _apply(
        self,
        worker_id: str,
        stream: _Stream,
        result: PollResult,
        transform: Callable[[KVEventBatch], KVEventBatch] | None,
        *,
        lower: bool = False,
    ) -> bool:
        """A gap replay cannot fill resyncs the worker from its dump — except on a lower
        stream, which has no dump of its own: what its replay buffer no longer holds stays
        unknown (routing misses, never wrong KV), counted in ``resyncs["lower_lost"]``, and
        the device entries are kept."""
        if result.resync_needed and not lower:
            # Inconsistent before the batches go in (the lock is released between chunks): a
            # deletion in between must not take the worker for one whose stream is intact.
            with self.lock:
                self.index.mark_inconsistent(worker_id)
        epoch_changed = False
        batches = result.batches
        for start in range(0, len(batches), _APPLY_CHUNK):  # a replay can bring thousands
            with self.lock:
                before = self.index.epoch(worker_id)
                for received in batches[start : start + _APPLY_CHUNK]:
                    batch = received.batch if transform is None else transform(received.batch)
                    self.index.apply_batch(worker_id, batch, seq=received.seq, second_stream=lower)
                epoch_changed |= self.index.epoch(worker_id) != before and before is not None
        if epoch_changed and not lower:
            # A batch of an epoch never seen reads as a restart and retires the live epoch;
            # the worker's dump says which is live (a stray or forged epoch must not wedge
            # the slot: later batches of the real epoch would all be refused as stale).
            self._resync(worker_id, stream, "epoch")
            return True
        if result.resync_needed and lower:
            self._count("lower_lost")
            _log.warning(
                "lost connector events of %s (replay could not fill the gap): lower tiers "
                "partly unknown",
                worker_id,
            )
        elif result.resync_needed:
            self._resync(worker_id, stream, "gap")
        return bool(result.batches) or result.resync_needed

    def _count(self, reason: str) -> None:
        """Under the fleet lock: the metrics collector reads ``resyncs`` holding it."""
        with self.lock:
            self.resyncs[reason] = self.resyncs.get(reason, 0) + 1

    def _resync(self, worker_id: str, stream: _Stream, reason: str) -> None:
        with self.lock:
            self.index.mark_inconsistent(worker_id)
        self._count(reason)
        if self._on_resync is not None:
            self._on_resync(worker_id, reason)
        if stream.dump is None and not self._stop.is_set():
            stream.dump = self._fetch_dump(stream)

    def _fetch_dump(self, stream: _Stream, *, delay_s: float = 0.0) -> Future[WorkerDump]:
        """The worker's dump, fetched after ``delay_s`` on a daemon thread of its own (at most
        one per worker: its stream is not read, so it cannot resync again, until it is in)."""
        future: Future[WorkerDump] = Future()
        worker_id, closed = stream.info.worker_id, stream.closed

        def fetch() -> None:
            try:
                if closed.wait(delay_s) or self._stop.is_set():
                    raise RuntimeError(f"the stream of {worker_id} closed")
                # the info of now: a re-attach may have brought a new epoch meanwhile
                future.set_result(self._source.dump(self._http, stream.info, self._api_key))
            except BaseException as exc:  # the loop reads it from the future
                future.set_exception(exc)

        name = f"kvstrata-dump-{worker_id}"
        threading.Thread(target=fetch, name=name, daemon=True).start()
        return future

    def _finish_dump(self, worker_id: str, stream: _Stream, dump: Future[WorkerDump]) -> None:
        stream.dump = None
        try:
            self._apply_dump(worker_id, stream, dump.result())
        except Exception as exc:  # any failure: a dump must never stop the loop
            if stream.attaching is not None:  # an attach fails as a whole, as it always did
                attaching, stream.attaching = stream.attaching, None
                self._detach(worker_id)
                attaching.set_exception(exc)
                return
            stream.dump_failures += 1
            self._count("dump_failed")
            doublings = min(stream.dump_failures - 1, _DUMP_RETRY_DOUBLINGS)
            delay = min(_DUMP_RETRY_MAX_S, _DUMP_RETRY_S * 2**doublings)
            _log.warning("resync of %s failed (%s); retrying in %.1f s", worker_id, exc, delay)
            with self.lock:  # a dump that failed half-way must not read as consistent
                self.index.mark_inconsistent(worker_id)
            if not self._stop.is_set():
                stream.dump = self._fetch_dump(stream, delay_s=delay)
            return
        stream.dump_failures = 0
        if stream.attaching is not None:
            attaching, stream.attaching = stream.attaching, None
            attaching.set_result(None)
