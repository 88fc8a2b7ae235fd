"""Connections to a Redis/Valkey deployment (one node or a cluster) and a circuit breaker.

``RemoteConfig`` is the remote tier's one configuration type. ``RemoteClient`` hides whether
the deployment is one node or a Redis Cluster: callers name Redis keys, and it groups them by
the node that serves their slot, runs one pipeline per node — in parallel threads, so a large
prefix costs about one round trip per shard rather than one per block — and maps every
client error to ``RemoteUnavailable`` after recording it in that node's breaker — except an
error *reply* (a script or data error, ``RemoteReplyError``): the node answered, so it is up.

Breaker (``CircuitBreaker``, one per node): after ``failures`` consecutive errors a node is
*open* — calls to it fail at once, without waiting for a timeout — for ``backoff_s``, which
doubles on every failed trial up to ``max_backoff_s``; after the backoff one trial call is let
through (*half-open*), and a success closes the breaker. So a dead server costs each request
at most one timeout, and the tier comes back by itself once the server answers again. Time is
passed in (``now``), so the breaker's logic is tested without sleeping.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

from kvstrata.errors import InvalidInput
from kvstrata.tiers.base import TierError

_CLIENT_ERRORS = (redis.RedisError, RedisClusterException, OSError)
"""What redis-py raises when a server or a cluster is unreachable, slow or inconsistent."""

_NODE_DOWN_REPLIES = (
    ClusterError,  # CLUSTERDOWN, MASTERDOWN
    AskError,  # MOVED / ASK the cluster client did not follow: stale topology
    TryAgainError,
    ReadOnlyError,  # a replica answered: failover under way
    OutOfMemoryError,
)
"""Error replies that say the node cannot serve now (counted by its breaker)."""


def node_failed(exc: BaseException) -> bool:
    """Does ``exc`` (one of ``_CLIENT_ERRORS``) mean the node is down or cannot serve — no
    connection, a timeout, a cluster or failover state, a server out of memory or busy? An
    error *reply* to a request (a script error, a wrong-typed key: ``ResponseError``) is the
    node answering: it must not count towards its breaker, or one bad value on a healthy
    server would take the tier offline for everyone."""
    if not isinstance(exc, redis.ResponseError) or isinstance(exc, _NODE_DOWN_REPLIES):
        return True
    return str(exc).startswith(("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"))


class RemoteUnavailable(TierError):
    """The remote server (or the node serving a slot) failed or its breaker is open."""


class RemoteReplyError(RemoteUnavailable):
    """The node answered a call with an error (a script or data error): the call failed — a
    miss or a refused store to its caller, like any ``RemoteUnavailable`` — but the node is
    up, so its breaker counts a success."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote tier lives and how patiently to talk to it.

    ``url`` is one node (``redis://127.0.0.1:6379/0``, ``rediss://`` for TLS); ``cluster``
    lists seed nodes (``host:port``) of a Redis Cluster instead. ``namespace`` prefixes every
    key, so several fleets (or tests) can share one deployment. Timeouts bound every call;
    ``retries`` are immediate re-tries of a failed connection before the breaker counts it (a
    timed-out call is never sent again: it may have run).
    """

    url: str | None = None
    cluster: tuple[str, ...] = ()
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    namespace: str = "kvstrata"
    timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    retries: int = 1
    breaker_failures: int = 3
    breaker_backoff_s: float = 0.5
    breaker_max_backoff_s: float = 10.0
    pending_timeout_s: float = 30.0
    expiry_grace_s: float = 60.0
    read_ahead_bytes: int = 256 << 20
    pipeline_bytes: int = 1 << 20
    socket_read_bytes: int = 1 << 20
    meta_cache_entries: int = 1 << 17

    def __post_init__(self) -> None:
        if (self.url is None) == (not self.cluster):
            raise InvalidInput("a remote tier needs exactly one of url or cluster seed nodes")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise InvalidInput("remote timeouts must be positive")
        if not self.namespace or any(c in self.namespace for c in "{}: "):
            raise InvalidInput(f"bad remote namespace {self.namespace!r}")

    @property
    def where(self) -> str:
        return self.url if self.url is not None else "cluster " + ",".join(self.cluster)


class CircuitBreaker:
    """Closed → open after ``failures`` consecutive errors → half-open after a backoff."""

    def __init__(self, failures: int, backoff_s: float, max_backoff_s: float) -> None:
        self._limit = max(1, failures)
        self._base = backoff_s
        self._max = max(backoff_s, max_backoff_s)
        self._lock = threading.Lock()
        self.consecutive = 0
        self.open_until: float | None = None
        self.backoff_s = backoff_s
        self.trips = 0
        self._trial = False

    def allow(self, now: float) -> bool:
        with self._lock:
            if self.open_until is None:
                return True
            if now < self.open_until or self._trial:
                return False
            self._trial = True  # half-open: exactly one caller tries
            return True

    def success(self) -> None:
        with self._lock:
            self.consecutive = 0
            self.open_until = None
            self.backoff_s = self._base
            self._trial = False

    def failure(self, now: float) -> None:
        with self._lock:
            self.consecutive += 1
            if self._trial:  # the half-open trial failed: back off longer
                self._trial = False
                self.backoff_s = min(self.backoff_s * 2, self._max)
                self.open_until = now + self.backoff_s
            elif self.open_until is None and self.consecutive >= self._limit:
                self.open_until = now + self.backoff_s
                self.trips += 1

    @property
    def is_open(self) -> bool:
        return self.open_until is not None


class RemoteClient:
    """One node or a cluster behind the same calls; errors become ``RemoteUnavailable``."""

    def __init__(
        self, config: RemoteConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Only a failed connection is tried again, never a timeout: a call that timed out may
        # still run on the server, and sending it again ran ledger scripts twice. A connection
        # error is mostly one before the command was sent (a stale pooled connection, a
        # refused connect); one after (the server closed it mid-reply) is safe too: a ledger
        # call that ran twice changes nothing more (owner tokens, generations:
        # ``remote_ledger``), but for a hit booked twice.
        retry = Retry(
            ExponentialBackoff(cap=0.05, base=0.005),
            config.retries,
            supported_errors=(redis.ConnectionError,),
        )
        common: dict[str, Any] = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "password": config.password,
            "socket_read_size": config.socket_read_bytes,
        }
        self.cluster: RedisCluster | None = None
        self.single: redis.Redis | None = None
        try:
            if config.url is not None:
                self.single = redis.Redis.from_url(config.url, retry=retry, **common)
                if config.tls and not config.url.startswith("rediss://"):
                    raise InvalidInput("tls = true needs a rediss:// url")
            else:
                seeds = [_node(seed) for seed in config.cluster]
                self.cluster = RedisCluster(
                    startup_nodes=seeds, ssl=config.tls, retry=retry, **common
                )
        except _CLIENT_ERRORS as exc:
            raise RemoteUnavailable(f"cannot reach {config.where}: {exc}") from exc
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstrata-remote")

    # ---- routing ----------------------------------------------------------------------------
    def node_of(self, key: str) -> str:
        if self.cluster is None:
            return "single"
        slot = self.cluster.keyslot(key)  # type: ignore[no-untyped-call]
        node = self.cluster.nodes_manager.get_node_from_slot(slot)
        return str(node.name)

    def connection(self, node: str) -> redis.Redis:
        if self.single is not None:
            return self.single
        assert self.cluster is not None
        found = self.cluster.get_node(node_name=node)  # type: ignore[no-untyped-call]
        if found is None or found.redis_connection is None:
            raise RemoteUnavailable(f"no connection to cluster node {node}")
        return found.redis_connection  # type: ignore[no-any-return]

    def breaker(self, node: str) -> CircuitBreaker:
        with self._lock:
            found = self._breakers.get(node)
            if found is None:
                c = self.config
                found = CircuitBreaker(
                    c.breaker_failures, c.breaker_backoff_s, c.breaker_max_backoff_s
                )
                self._breakers[node] = found
            return found

    def breakers(self) -> dict[str, CircuitBreaker]:
        with self._lock:
            return dict(self._breakers)

    # ---- calls ------------------------------------------------------------------------------
    def call(self, node: str, fn: Callable[[redis.Redis], Any]) -> Any:
        """Run ``fn`` on ``node``'s connection under its breaker."""
        if self._closed:
            raise RemoteUnavailable("remote tier is closed")
        breaker = self.breaker(node)
        if not breaker.allow(self._clock()):
            raise RemoteUnavailable(f"{node}: circuit open")
        try:
            result = fn(self.connection(node))
        except _CLIENT_ERRORS as exc:
            if not node_failed(exc):
                breaker.success()
                raise RemoteReplyError(f"{node}: {type(exc).__name__}: {exc}") from exc
            breaker.failure(self._clock())
            if self.cluster is not None:
                self._refresh_topology()
            raise RemoteUnavailable(f"{node}: {type(exc).__name__}: {exc}") from exc
        breaker.success()
        return result

    def pipelined(
        self,
        keys: Sequence[str],
        build: Callable[[Any, str], None],
        *,
        sizes: Mapping[str, int] | None = None,
    ) -> dict[str, Any | RemoteUnavailable]:
        """Pipelines per node, nodes in parallel: ``build(pipe, key)`` queues one command
        per key; returns each key's reply, or the ``RemoteUnavailable`` of its node.

        With ``sizes`` (the bytes each key's reply carries), a node's keys go in pipelines
        of at most ``pipeline_bytes`` each, one after the other: measured on loopback, one
        pipeline of many MiB-sized replies is 2-3x slower than the same GETs one by one
        (the client's reader re-buffers a reply it cannot consume yet), while small replies
        gain a lot from batching."""
        groups: dict[str, list[str]] = {}
        for key in keys:
            try:
                groups.setdefault(self.node_of(key), []).append(key)
            except _CLIENT_ERRORS as exc:
                return {k: RemoteUnavailable(str(exc)) for k in keys}

        limit = self.config.pipeline_bytes

        def batches(members: list[str]) -> list[list[str]]:
            if sizes is None:
                return [members]
            out: list[list[str]] = [[]]
            held = 0
            for key in members:
                size = sizes.get(key, limit)
                if out[-1] and held + size > limit:
                    out.append([])
                    held = 0
                out[-1].append(key)
                held += size
            return out

        def run(node: str, members: list[str]) -> list[Any]:
            def go(conn: redis.Redis) -> list[Any]:
                replies: list[Any] = []
                for batch in batches(members):
                    pipe = conn.pipeline(transaction=False)
                    for key in batch:
                        build(pipe, key)
                    replies += pipe.execute()
                return replies

            return list(self.call(node, go))

        out: dict[str, Any | RemoteUnavailable] = {}
        items = list(groups.items())
        if len(items) == 1:
            futures = None
            results = [self._guard(run, *items[0])]
        else:
            futures = [
                self._pool.submit(self._guard, run, node, members) for node, members in items
            ]
            results = [f.result() for f in futures]
        for (_, members), result in zip(items, results, strict=True):
            if isinstance(result, RemoteUnavailable):
                out.update((key, result) for key in members)
            else:
                out.update(zip(members, result, strict=True))
        return out

    @staticmethod
    def _guard(
        run: Callable[[str, list[str]], list[Any]], node: str, members: list[str]
    ) -> list[Any] | RemoteUnavailable:
        try:
            return run(node, members)
        except RemoteUnavailable as exc:
            return exc

    def nodes(self) -> list[str]:
        if self.cluster is None:
            return ["single"]
        return [str(n.name) for n in self.cluster.get_primaries()]  # type: ignore[no-untyped-call]

    def _refresh_topology(self) -> None:
        assert self.cluster is not None
        # On failure the next call tries again; the breaker bounds how often.
        with contextlib.suppress(*_CLIENT_ERRORS):
            self.cluster.nodes_manager.initialize()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in (self.single, self.cluster):
            if client is not None:
                with contextlib.suppress(redis.RedisError, OSError):
                    client.close()


def _node(seed: str) -> ClusterNode:
    host, _, port = seed.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidInput(f"cluster seed must be host:port, got {seed!r}")
    return ClusterNode(host, int(port))  # type: ignore[no-untyped-call]
