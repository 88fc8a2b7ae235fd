"""What the router reads of each worker: its identity (``/kv/info``) and its KV dump.

A worker is a ``kvstrata serve`` process started with an events endpoint. The router talks
to it over HTTP or HTTPS (``/kv/info``, ``/kv/dump``, ``/health``, the OpenAI endpoints) and
listens to its ZMQ event stream. ``/kv/info`` and ``/kv/dump`` are read with the router's own
fleet key (``api_key``: ``Authorization: Bearer``); HTTPS is verified with ``worker_tls``.
Everything here validates what the worker sends: a worker that answers garbage is treated
as unreachable, never trusted. What the router learns from its answers is
``fleet.workers.WorkerState``.
"""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvstrata.errors import InvalidInput
from kvstrata.events.curve import CurveKeyError, decode_public_key
from kvstrata.events.schema import EventDecodeError, KVEvent, decode_batch
from kvstrata.fleet.engine_load import ScrapedLoad
from kvstrata.identity.keys import FingerprintDigest
from kvstrata.index.model import Medium, parse_medium
from kvstrata.router.placement import ComputePlace
from kvstrata.runtime.transfer_config import TRANSPORTS
from kvstrata.transfer.layout import KVLayout

NEXT_SEQ_HEADER = "X-Kvstrata-Next-Seq"
EPOCH_HEADER = "X-Kvstrata-Epoch"


class WorkerProtocolError(InvalidInput):
    """A worker's ``/kv/info`` or ``/kv/dump`` answer is not what the protocol says."""


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """A decode worker's transfer listener (``/kv/info`` ``transfer``): where a prefill worker
    streams KV to, and the pool layout it is priced with."""

    host: str
    port: int
    layout: KVLayout
    transport: str = "tcp"

    @classmethod
    def from_json(cls, body: Any) -> TransferTarget:
        layout = KVLayout(**body["layout"])
        port = int(body["port"])
        transport = str(body.get("transport", "tcp"))  # older workers: tcp only
        if layout.problem() is not None or not 0 < port < 65536 or transport not in TRANSPORTS:
            raise ValueError(f"bad transfer entry {body!r:.200}")
        return cls(str(body["host"]), port, layout, transport)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    base_url: str
    epoch: int
    model: str
    fingerprint: FingerprintDigest
    block_size: int
    events_endpoint: str
    replay_endpoint: str | None
    next_seq: int
    secret_digest: str | None = None  # None: the worker does not say how it salts tenants
    tiers: tuple[str, ...] = ()  # the media it holds KV in (empty: it does not say)
    fetch_s_per_block: tuple[float | None, float | None, float | None, float | None] = (
        None,
        None,
        None,
        None,
    )
    """Measured seconds to bring one block from each medium (``Medium`` order; None: not
    measured yet), from the worker's store: the router prices fetches with these."""
    curve_public_key: bytes | None = None
    """The event sockets' CURVE server key (None: plaintext sockets)."""
    lower_events_endpoint: str | None = None
    """A second stream into the same worker slot: the kvstrata connector's events (host,
    disk, remote) beside vLLM's own (device)."""
    lower_replay_endpoint: str | None = None
    lower_curve_public_key: bytes | None = None
    """The connector stream's CURVE server key (None: plaintext), for its sockets as
    ``curve_public_key`` is for the main stream's."""
    scraped: ScrapedLoad | None = None
    """The engine's own load figures when it reports them (None: the router's count only)."""
    transfer: TransferTarget | None = None
    """A decode worker's transfer listener (None: it receives no KV transfers)."""
    compute: ComputePlace | None = None
    """Where the worker computes (``router.placement``; None: it does not say)."""
    step_tokens: int | None = None
    """Tokens one engine step computes (its scheduler's ``max_num_batched_tokens``): how many
    queued prompts the router packs into one step (``router.queue``). None: not reported."""

    def __post_init__(self) -> None:
        check_step_tokens(self.step_tokens)  # a budget built in code obeys the wire's bounds

    @property
    def reaches_shared_tier(self) -> bool:
        """Does the worker have the shared (remote) tier? (Unknown: assume it does.)"""
        return not self.tiers or Medium.REMOTE in {parse_medium(t) for t in self.tiers}

    @classmethod
    def from_json(cls, base_url: str, body: Any) -> WorkerInfo:
        try:
            fingerprint = bytes.fromhex(body["fingerprint"])
            info = cls(
                worker_id=str(body["worker_id"]),
                base_url=base_url,
                epoch=int(body["epoch"]),
                model=str(body["model"]),
                fingerprint=FingerprintDigest(fingerprint),
                block_size=int(body["block_size"]),
                events_endpoint=str(body["events_endpoint"]),
                replay_endpoint=(
                    None if body.get("replay_endpoint") is None else str(body["replay_endpoint"])
                ),
                next_seq=int(body.get("next_seq", 0)),
                secret_digest=(
                    None if body.get("secret_digest") is None else str(body["secret_digest"])
                ),
                tiers=tuple(str(t) for t in body.get("tiers", ())),
                fetch_s_per_block=_fetch_figures(body.get("fetch_s_per_block") or {}),
                curve_public_key=(
                    None
                    if body.get("curve_public_key") is None
                    else decode_public_key(str(body["curve_public_key"]))
                ),
                transfer=(
                    None
                    if body.get("transfer") is None
                    else TransferTarget.from_json(body["transfer"])
                ),
                compute=(
                    None if body.get("compute") is None else ComputePlace.from_json(body["compute"])
                ),
                step_tokens=check_step_tokens(body.get("step_tokens")),
            )
        except (
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            OverflowError,
            CurveKeyError,
            InvalidInput,
        ) as exc:
            raise WorkerProtocolError(f"bad /kv/info from {base_url}: {exc!r}") from exc
        if len(fingerprint) != 32 or info.block_size <= 0 or not info.events_endpoint:
            raise WorkerProtocolError(f"bad /kv/info from {base_url}: {body!r:.200}")
        return info


MAX_STEP_TOKENS = 1 << 24
"""Above any engine's step budget: a larger ``step_tokens`` is garbage."""


def check_step_tokens(value: Any) -> int | None:
    """A step budget (``/kv/info``'s ``step_tokens``, a vLLM worker's ``step_tokens=``): absent
    or null, or an integer in [1, ``MAX_STEP_TOKENS``] (ValueError otherwise: a ``/kv/info``
    answer holding one is rejected whole, as for any other bad field)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_STEP_TOKENS:
        raise ValueError(f"step_tokens must be an integer in [1, {MAX_STEP_TOKENS}]: {value!r}")
    return value


def _fetch_figures(
    body: dict[str, Any],
) -> tuple[float | None, float | None, float | None, float | None]:
    """``{tier name: seconds per block | null}`` → per ``Medium``; unknown names, negative or
    non-finite figures are left out (a garbage figure must not steer the router)."""
    figures: list[float | None] = [None, None, None, None]
    for name, value in body.items():
        medium = parse_medium(str(name))
        if medium is None or value is None:
            continue
        seconds = float(value)
        if math.isfinite(seconds) and seconds >= 0:
            figures[medium] = seconds
    return (figures[0], figures[1], figures[2], figures[3])


@dataclass(frozen=True, slots=True)
class WorkerDump:
    epoch: int
    next_seq: int
    events: list[KVEvent]
    ts: float
    history_by_replay: bool = False
    """No snapshot: the stream's replay history from ``next_seq`` is the state (vLLM), so
    what its buffer has evicted stays unknown rather than asking for this dump again."""


def bearer(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header presenting ``api_key`` (none without one)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def worker_tls(ca_file: Path | None) -> ssl.SSLContext | bool:
    """How the router's HTTP clients verify workers' HTTPS: this CA bundle, else the system
    CAs (``True``)."""
    return True if ca_file is None else ssl.create_default_context(cafile=str(ca_file))


def fetch_info(client: httpx.Client, base_url: str, api_key: str | None = None) -> WorkerInfo:
    response = client.get(f"{base_url}/kv/info", headers=bearer(api_key))
    response.raise_for_status()
    try:
        body = response.json()
    except (ValueError, RecursionError) as exc:
        raise WorkerProtocolError(f"bad /kv/info from {base_url}: not JSON") from exc
    return WorkerInfo.from_json(base_url, body)


def fetch_dump(client: httpx.Client, base_url: str, api_key: str | None = None) -> WorkerDump:
    """The worker's full resident state as events, and the live seq it corresponds to."""
    response = client.get(f"{base_url}/kv/dump", headers=bearer(api_key))
    response.raise_for_status()
    try:
        next_seq = int(response.headers[NEXT_SEQ_HEADER])
        epoch = int(response.headers[EPOCH_HEADER])
        decoded = decode_batch(response.content)
    except (KeyError, ValueError, EventDecodeError) as exc:
        raise WorkerProtocolError(f"bad /kv/dump from {base_url}: {exc!r}") from exc
    return WorkerDump(epoch, next_seq, list(decoded.batch.events), decoded.batch.ts)
