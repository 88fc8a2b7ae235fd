"""Where the remote benchmarks run: a server the user names, or a ``valkey-server`` started here.

Every remote bench works in a namespace of its own (``bench_namespace``) and deletes its keys
when it is done (``delete_namespace``), so pointing one at a shared server leaves nothing
behind; a server started here is simply stopped.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import redis

from kvstrata.runtime.config import TierSpec, remote_tier
from kvstrata.runtime.valkey_server import ValkeyServer
from kvstrata.tiers.remote_client import RemoteConfig


def bench_namespace(bench: str) -> str:
    """A namespace no other run uses (valid for ``RemoteConfig``: no ``{}: ``)."""
    return f"bench-{bench}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remote_tier_spec(url: str, namespace: str, capacity_bytes: int) -> TierSpec:
    """A write-through remote tier on ``url`` for a bench (patient timeouts: a loaded bench
    machine must not turn slow replies into misses)."""
    return remote_tier(RemoteConfig(url=url, namespace=namespace, timeout_s=10.0), capacity_bytes)


@contextlib.contextmanager
def remote_target(url: str | None) -> Iterator[str]:
    """``url`` as is, or the URL of a local ``valkey-server`` that lives for the block."""
    if url is not None:
        yield url
        return
    server = ValkeyServer().start()
    try:
        yield server.url
    finally:
        server.stop()


def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key of a remote tier's ``namespace`` (objects and ledger); the count."""
    deleted = 0
    with redis.Redis.from_url(url, socket_timeout=30.0) as conn:
        for pattern in (f"{namespace}:*", f"{{{namespace}}}:*"):
            batch: list[bytes] = []
            for name in conn.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    deleted += int(conn.delete(*batch))
                    batch = []
            if batch:
                deleted += int(conn.delete(*batch))
    return deleted
