"""What a router process's :class:`~kvstrata.fleet.fleet.Fleet` is configured with: policy,
consistency mode, health checking, its workers and their roles, and the keys it presents."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.fleet.disagg import DisaggSettings
from kvstrata.index.core import ConsistencyMode
from kvstrata.runtime.config import ServeLimits
from kvstrata.security.config import DEFAULT_TOMBSTONE_TTL_S


@dataclass
class FleetConfig:
    policy: str = "kvstrata"
    mode: ConsistencyMode = ConsistencyMode.EXACT
    health_interval_s: float = 0.5
    health_failures: int = 2
    health_timeout_s: float = 2.0
    """A health probe's bound (``/kv/info``): a worker that answers none of
    ``health_failures`` probes in a row is declared dead, and requests in flight there that
    have sent the client nothing yet are re-routed (``fleet.failover``). Measured on 2 cores
    with both workers saturated (six concurrent ~2k-token chats): 1,413 probes, median 3.8 ms,
    p99 12 ms, max 22 ms, so 2 s is ~90x the worst seen; a hung worker is declared dead
    in ~2 × (2 s + ``health_interval_s``) instead of ~2 × 10 s."""
    max_attempts: int = 3
    request_timeout_s: float = 600.0
    tenant_secret: bytes = b""
    worker_urls: list[str] = field(default_factory=list)
    curve_client_secret_file: Path | None = None
    """The router's CURVE certificate (secret): with it, the fleet subscribes to CURVE workers
    (whose public keys ``/kv/info`` advertises) and refuses plaintext ones; without it, it
    refuses CURVE workers. No silent downgrade either way."""
    tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S
    """How long the index refuses late events of deleted blocks (``security.tombstone_ttl_s``)."""
    api_key: str | None = field(default=None, repr=False)
    """The router's fleet key: presented to workers' ``/kv/info`` and ``/kv/dump``."""
    tls_ca_file: Path | None = None
    """The CA bundle that verifies workers' HTTPS (None: the system CAs)."""
    limits: ServeLimits = field(default_factory=ServeLimits)
    """The workers' ``[limits]`` (the same ``--config``): the front door refuses a body they
    would refuse before sending it on. With its own defaults, a body a worker configured
    smaller refused (413, closing before reading it) read as a dead worker, and the retry
    flagged the others too."""
    engine: str = "kvstrata"
    """``kvstrata`` (``kvstrata serve`` workers) or ``vllm`` (vLLM OpenAI servers: a request's
    ``cache_salt`` is its tenant, vLLM's events are read through ``source``)."""
    prefill_urls: frozenset[str] = frozenset()
    """Workers (also in ``worker_urls``) that only prefill for others: attached, indexed and
    watched like any worker, never a routing candidate (``docs/disaggregation.md``)."""
    disagg: DisaggSettings | None = None
    """How to choose local or remote prefill (None: no prefill workers)."""
