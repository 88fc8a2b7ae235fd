"""KV events of one worker: what every tier holds, as a sequenced stream plus on-demand dumps.

Why: a fleet index decides which worker holds which prefix from these events alone. So every
change of residency is announced, for every tier, with the block's tokens (the index computes
its own router hashes from ``token_ids``):

- device pool commit → ``BlockStored(medium="device")``; pool eviction → ``BlockRemoved
  (medium="device")``. ``pool.clear()`` evicts block by block, so a clear is reported as one
  ``BlockRemoved`` per block (never ``AllBlocksCleared``: blocks held by readers stay).
- a store level commits an object → ``BlockStored(medium=<level name>)`` (``"host"``,
  ``"disk"``); eviction, demotion, expiry, invalidation or deletion → ``BlockRemoved``.

Block hashes are ``event_block_hash(key)`` (low 64 bits of the BLAKE3 key, as vLLM does),
``parent_block_hash`` is the parent key's, ``namespace`` the tenant name. Pool events are
buffered; store changes are drained from the store's change feed (``store.take_events()``, the
store must be built with ``record_events=True``) at the start of every ``flush()``, and the
engine thread publishes them as one batch per engine step: ZMQ sockets stay on one thread.
Consecutive blocks of one chain are merged into one event, as vLLM does.

``snapshot()`` is the recovery path: under the store lock it drains and publishes, lists
every resident block as ``BlockStored`` events (parents first) and reads the next live sequence
number, so dump + live stream from ``next_seq`` = the worker's state. Objects whose meta has no
tokens (written by older versions) serve hits but are never announced; they are counted.

The events carry every tenant's token ids, so who may listen matters (``exposure_check``):
with ``curve_secret_file`` + ``curve_clients_dir`` both sockets are CURVE servers admitting
only the listed subscribers; without them an endpoint beyond loopback (or ipc) is refused at
start-up (``ConfigError`` naming the fix) and a loopback one is allowed with a warning.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import zmq

from kvstrata.errors import InvalidInput
from kvstrata.events import BlockRemoved, BlockStored, KVEvent, ZmqEventPublisher
from kvstrata.identity import BlockKey
from kvstrata.identity.keys import event_block_hash
from kvstrata.objects import KVObjectMeta
from kvstrata.runtime.blocks import BlockInfo, EvictedBlock, PoolView, ResidentBlock
from kvstrata.runtime.event_exposure import curve_server_of, exposure_check
from kvstrata.store.events import ObjectStored
from kvstrata.store.tiered import TieredStore

DEVICE_MEDIUM = "device"
T = TypeVar("T")


REPLAY_POLL_MS = 100
"""How long the replay thread waits for a request before checking whether to stop."""


def new_epoch() -> int:
    """A random 63-bit incarnation id: a restarted worker never reuses its predecessor's."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class KVEventsConfig:
    """Where a worker publishes (parsed once at the edge, e.g. ``kvstrata serve`` flags)."""

    endpoint: str
    replay_endpoint: str | None = None
    worker_id: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    curve_secret_file: Path | None = None
    """CURVE: this worker's secret key (a ``zmq.auth`` certificate file); with it the live
    and replay sockets are encrypted and accept only the clients in ``curve_clients_dir``."""
    curve_clients_dir: Path | None = None
    """CURVE: directory of the public certificates of the subscribers allowed in."""

    @property
    def curve(self) -> bool:
        return self.curve_secret_file is not None


@dataclass
class EmitterStats:
    """What the emitter did; exported by its owner."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    unannounced_without_tokens: int = 0  # stored blocks left out of events (no tokens known)


@dataclass(frozen=True)
class EventSnapshot:
    """Every resident block as ``BlockStored`` events, consistent with live seq ``next_seq``.

    ``skipped_without_tokens`` counts resident store objects that had to be left out.
    """

    next_seq: int
    epoch: int
    events: list[KVEvent]
    skipped_without_tokens: int = 0


@dataclass
class _Run:
    """A buffered event under construction: consecutive blocks of one chain merge into it."""

    stored: bool
    medium: str
    namespace: str | None
    hashes: list[int]
    parent: int | None = None
    tokens: list[int] = field(default_factory=list)

    def extend(self, stored: bool, medium: str, namespace: str | None, parent: int | None) -> bool:
        if (stored, medium, namespace) != (self.stored, self.medium, namespace):
            return False
        return not stored or parent == self.hashes[-1]

    def event(self, block_size: int) -> KVEvent:
        if not self.stored:
            return BlockRemoved(list(self.hashes), self.medium, namespace=self.namespace)
        return BlockStored(
            block_hashes=list(self.hashes),
            parent_block_hash=self.parent,
            token_ids=list(self.tokens),
            block_size=block_size,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
            namespace=self.namespace,
        )


class _Builder:
    """Appends blocks to a list of runs, merging a child into its parent's run."""

    def __init__(self) -> None:
        self.runs: list[_Run] = []

    def stored(
        self,
        medium: str,
        namespace: str,
        key: BlockKey,
        parent: BlockKey | None,
        tokens: Sequence[int],
    ) -> None:
        block_hash = event_block_hash(key)
        parent_hash = event_block_hash(parent) if parent is not None else None
        last = self.runs[-1] if self.runs else None
        if last is not None and last.extend(True, medium, namespace, parent_hash):
            last.hashes.append(block_hash)
            last.tokens.extend(tokens)
            return
        self.runs.append(_Run(True, medium, namespace, [block_hash], parent_hash, list(tokens)))

    def removed(self, medium: str, namespace: str | None, key: BlockKey) -> None:
        block_hash = event_block_hash(key)
        last = self.runs[-1] if self.runs else None
        if last is not None and last.extend(False, medium, namespace, None):
            last.hashes.append(block_hash)
            return
        self.runs.append(_Run(False, medium, namespace, [block_hash]))

    def events(self, block_size: int) -> list[KVEvent]:
        return [run.event(block_size) for run in self.runs]


class KVEventEmitter:
    """Turns pool and store changes into KV events and publishes them on the engine thread.

    Lifecycle: build (``from_config`` or with a publisher), ``start()`` (binds the sockets),
    hand it to the engine (which calls ``attach``), ``close()`` after the engine is closed.
    Implements ``PoolListener``; drains the store's change feed.

    ``start_replay()`` starts the one thread that answers replay requests (it touches only the
    publisher's ROUTER socket and its locked buffer); ``stop_replay()`` and ``close()`` stop and
    join it before the sockets close. Every owner of an emitter — ``kvstrata serve`` and the
    vLLM connector — uses this thread, so a subscriber can fill a gap from either.
    """

    def __init__(self, publisher: ZmqEventPublisher, *, block_size: int) -> None:
        if publisher.epoch is None:
            raise ValueError("the publisher needs an epoch (see new_epoch)")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.publisher = publisher
        self.block_size = block_size
        self.stats = EmitterStats()
        self._lock = threading.Lock()
        self._buffer = _Builder()
        self._pool: PoolView | None = None
        self._attached = False
        self._store: TieredStore | None = None
        self._started = False
        self._replay_stop = threading.Event()
        self._replay_thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: KVEventsConfig, *, block_size: int) -> KVEventEmitter:
        """An emitter with a fresh epoch; ``start()`` binds its sockets. Reads the CURVE keys
        and refuses exposed plaintext endpoints (``exposure_check``)."""
        exposure_check(config)
        publisher = ZmqEventPublisher(
            config.endpoint,
            config.replay_endpoint,
            topic=config.topic,
            buffer_steps=config.buffer_steps,
            worker_id=config.worker_id,
            epoch=new_epoch(),
            curve=curve_server_of(config),
        )
        return cls(publisher, block_size=block_size)

    @property
    def epoch(self) -> int:
        epoch = self.publisher.epoch
        assert epoch is not None
        return epoch

    @property
    def worker_id(self) -> str | None:
        return self.publisher.worker_id

    @property
    def pending(self) -> bool:
        """Events wait for the next ``flush`` (any thread). Only ``flush`` drains the store's
        feed, on the publishing thread: two drainers could append their halves out of order."""
        with self._lock:
            if self._buffer.runs:
                return True
        return self._store is not None and self._store.has_events()

    def start(self) -> KVEventEmitter:
        """Bind the live (and replay) sockets; a bad or busy endpoint is an ``InvalidInput``."""
        try:
            self.publisher.start()
        except zmq.ZMQError as exc:
            self.publisher.close()
            endpoints = f"{self.publisher.endpoint!r}, {self.publisher.replay_endpoint!r}"
            raise InvalidInput(f"cannot bind the KV event endpoints {endpoints}: {exc}") from exc
        self._started = True
        return self

    def start_replay(self) -> KVEventEmitter:
        """Answer replay requests on a thread (no-op without a replay endpoint or if running)."""
        if not self._started:
            raise RuntimeError("start() the emitter before its replay thread")
        if self.publisher.replay_endpoint is None or self.serving_replay:
            return self
        self._replay_stop.clear()
        self._replay_thread = threading.Thread(
            target=self._serve_replay, name="kvstrata-kv-replay", daemon=True
        )
        self._replay_thread.start()
        return self

    def stop_replay(self) -> None:
        if self._replay_thread is not None:
            self._replay_stop.set()
            self._replay_thread.join()
            self._replay_thread = None

    def _serve_replay(self) -> None:
        while not self._replay_stop.is_set():
            try:
                self.publisher.serve_replay(timeout_ms=REPLAY_POLL_MS)
            except zmq.ZMQError:
                if self._replay_stop.is_set():
                    return
                raise

    @property
    def serving_replay(self) -> bool:
        return self._replay_thread is not None and self._replay_thread.is_alive()

    def close(self) -> None:
        """Stop the replay thread, close the sockets; later ``flush`` calls discard (nobody
        can hear them any more)."""
        self._started = False
        self.stop_replay()
        self.publisher.close()

    def attach(self, pool: PoolView | None, store: TieredStore | None) -> None:
        """Listen to ``pool`` and ``store`` (``runtime.wiring.wire`` calls this once, before
        any request; an engine whose device pool publishes its own events passes None)."""
        if self._attached:
            raise ValueError("this emitter is already attached to an engine")
        self._attached = True
        self._pool = pool
        self._store = store
        if pool is not None:
            pool.subscribe(self)
        if store is not None:
            self._attach_store(store)

    def _attach_store(self, store: TieredStore) -> None:
        """Drain ``store``'s change feed from now on (what it recovered is not re-announced:
        ``snapshot`` lists it)."""
        if not store.records_events:
            raise ValueError("the store must be built with record_events=True")
        self._store = store
        store.take_events()

    # ---- PoolListener (engine thread) ---------------------------------------------------------
    def block_committed(self, block: ResidentBlock) -> None:
        info = block.info
        if not isinstance(info, BlockInfo) or info.tokens is None:
            self.stats.unannounced_without_tokens += 1
            return
        with self._lock:
            buffer = self._buffer
            buffer.stored(DEVICE_MEDIUM, info.tenant, block.key, block.parent_key, info.tokens)
            self.stats.blocks_stored += 1

    def block_evicted(self, block: EvictedBlock) -> None:
        info = block.info
        tenant = info.tenant if isinstance(info, BlockInfo) else None
        with self._lock:
            self._buffer.removed(DEVICE_MEDIUM, tenant, block.key)
            self.stats.blocks_removed += 1

    # ---- the store's change feed (drained on the engine thread) --------------------------------
    def _drain_store(self) -> None:
        if self._store is None:
            return
        events = self._store.take_events()
        with self._lock:
            for event in events:
                if isinstance(event, ObjectStored):
                    meta = event.meta
                    if meta.tokens is None:
                        self.stats.unannounced_without_tokens += 1
                        continue
                    self._buffer.stored(event.tier, meta.tenant, meta.key, meta.parent, meta.tokens)
                    self.stats.blocks_stored += 1
                else:
                    self._buffer.removed(event.tier, event.tenant, event.key)
                    self.stats.blocks_removed += 1

    # ---- publishing (engine thread) -----------------------------------------------------------
    def flush(self) -> int | None:
        """Publish what is buffered as one batch; its seq, or None when nothing was buffered."""
        self._drain_store()
        with self._lock:
            if not self._buffer.runs:
                return None
            buffered, self._buffer = self._buffer, _Builder()
        if not self._started:
            return None
        events = buffered.events(self.block_size)
        seq = self.publisher.publish(events)
        self.stats.batches += 1
        self.stats.events += len(events)
        return seq

    def snapshot(self) -> EventSnapshot:
        """Every block resident now, with the live seq the stream continues from (engine thread).

        Holding the store lock, nothing can change a tier or reach the buffer in between, and
        the pool only changes on this (the engine) thread: every batch before ``next_seq`` is
        reflected in the dump, every later one describes a later change.
        """
        store = self._store
        guard: AbstractContextManager[object] = (
            store.exclusive() if store is not None else nullcontext()
        )
        builder = _Builder()
        skipped = 0
        with guard:
            self.flush()
            if self._pool is not None:
                skipped += self._dump_pool(self._pool, builder)
            if store is not None:
                for name, metas in store.resident():
                    skipped += self._dump_level(name, metas, builder)
            next_seq = self.publisher.next_seq
        return EventSnapshot(next_seq, self.epoch, builder.events(self.block_size), skipped)

    def _dump_pool(self, pool: PoolView, builder: _Builder) -> int:
        skipped = 0
        blocks = pool.committed_blocks()
        for block in _chain_order(blocks, lambda b: b.key, lambda b: b.parent_key):
            info = block.info
            if not isinstance(info, BlockInfo) or info.tokens is None:
                skipped += 1
                continue
            builder.stored(DEVICE_MEDIUM, info.tenant, block.key, block.parent_key, info.tokens)
        return skipped

    @staticmethod
    def _dump_level(name: str, metas: list[KVObjectMeta], builder: _Builder) -> int:
        skipped = 0
        for meta in _chain_order(metas, lambda m: m.key, lambda m: m.parent):
            if meta.tokens is None:
                skipped += 1
                continue
            builder.stored(name, meta.tenant, meta.key, meta.parent, meta.tokens)
        return skipped


def _chain_order(
    items: Iterable[T],
    key_of: Callable[[T], BlockKey],
    parent_of: Callable[[T], BlockKey | None],
) -> Iterator[T]:
    """Depth first over the chains: every item after its parent (when present), and a child
    right after its parent where possible, so chains merge into few events."""
    by_key = {key_of(item): item for item in items}
    children: dict[BlockKey, list[T]] = {}
    roots: list[T] = []
    for item in by_key.values():
        parent = parent_of(item)
        if parent is not None and parent in by_key:
            children.setdefault(parent, []).append(item)
        else:
            roots.append(item)
    stack = list(reversed(roots))
    while stack:
        item = stack.pop()
        yield item
        stack.extend(reversed(children.get(key_of(item), [])))
