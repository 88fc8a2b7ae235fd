"""A vLLM OpenAI server as a fleet worker (``kvstrata router --engine vllm``).

vLLM serves no ``/kv/info`` or ``/kv/dump``, so :class:`VllmSource` builds both:

- **Identity.** The worker id, the event endpoints and the connector stream's CURVE key
  (``lower_curve``) come from the command line (or from ``kvstrata up``, which chose the
  ports: :class:`VllmWorker`); the model from ``/v1/models``.
  The index's fingerprint only seeds the router's own hashes (recomputed from event tokens,
  the index never compares it with an engine's), so it is a digest of the served model name
  and block size: equal for every server of one model.
- **Epoch.** ``process_start_time_seconds`` of vLLM's ``/metrics`` (prometheus_client's process
  collector, in milliseconds): a restarted server is a new incarnation. vLLM's own batches
  carry no epoch; the connector's batches carry the connector's (new per process) — either
  change drops the worker's old entries.
- **Load.** ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
  ``vllm:kv_cache_usage_perc`` (summed over engines) → :class:`ScrapedLoad`, read every
  health round and folded into the TTFT estimate (``WorkerState.load``).
- **State.** No dump: the snapshot is empty at sequence 0, so the first live batch (seq > 0)
  is a gap that vLLM's replay socket fills from its buffer (``buffer_steps``, 10,000 steps by
  default) — the whole history of a server younger than that. Older history that the buffer
  lost leaves the worker's entries incomplete (routing misses, never wrong answers: vLLM
  checks its own hashes).
- **Step budget.** vLLM does not report its ``max_num_batched_tokens`` either: a worker is
  taken to run its OpenAI server's default on CPU, 2,048 tokens (``VLLM_STEP_TOKENS``),
  unless ``step_tokens=N`` in ``--worker`` says otherwise (``up --engine vllm`` passes the
  servers' own). The router packs queued prompts by it.
- **Tenants.** vLLM's ``cache_salt`` goes, untagged, into block 0's ``extra_keys`` of its
  ``BlockStored`` events (``vllm/distributed/kv_events.py``): :func:`salted_batch` turns it
  into the connector's tenant (``tenant_for_salt``), so both streams and the front door (which
  maps a request's ``cache_salt`` the same way) agree on the namespace.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from msgspec.structs import replace

from kvstrata.events.curve import CurveKeyError, decode_public_key, load_public_key
from kvstrata.events.schema import BlockStored, KVEvent, KVEventBatch
from kvstrata.fleet.engine_load import ScrapedLoad
from kvstrata.fleet.worker_info import (
    MAX_STEP_TOKENS,
    WorkerDump,
    WorkerInfo,
    WorkerProtocolError,
    check_step_tokens,
)
from kvstrata.identity import DEFAULT_TENANT, FingerprintDigest, secret_digest
from kvstrata.identity.salts import salt_tenant
from kvstrata.telemetry.prom_text import samples

_LOAD_METRICS = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_START = "process_start_time_seconds"
VLLM_STEP_TOKENS = 2048
"""vLLM's default ``max_num_batched_tokens`` for its OpenAI server on CPU at world size 1
(``vllm/engine/arg_utils.py``, ``EngineArgs.get_batch_defaults``, in the vLLM this project
installs); other platforms and versions differ (some GPUs get 8,192): give ``step_tokens``
then."""


@dataclass(frozen=True, slots=True)
class VllmWorker:
    """Where one vLLM server and its two event streams are."""

    worker_id: str
    base_url: str
    events_endpoint: str
    replay_endpoint: str | None
    lower_events_endpoint: str | None = None
    lower_replay_endpoint: str | None = None
    block_size: int = 32
    lower_curve_public_key: bytes | None = None
    """The connector stream's CURVE server key (its ``events.curve_secret_file``'s public
    half; None: plaintext, loopback only — ``fleet.curve_keys``)."""
    step_tokens: int = VLLM_STEP_TOKENS
    """The server's ``max_num_batched_tokens`` (vLLM does not report it): its OpenAI server's
    default unless ``step_tokens=N`` says otherwise."""

    def __post_init__(self) -> None:
        check_step_tokens(self.step_tokens)

    @classmethod
    def parse(cls, text: str, position: int, block_size: int) -> VllmWorker:
        """``URL,events=tcp://…[,replay=tcp://…][,lower=tcp://…][,lower_replay=tcp://…]
        [,lower_curve=KEY][,step_tokens=N][,id=NAME]`` (``--worker`` of ``kvstrata router
        --engine vllm``); ``KEY``: the connector's public key in z85 text, or its ``zmq.auth``
        certificate file; ``N``: the server's ``--max-num-batched-tokens`` if it was set."""
        url, *pairs = text.split(",")
        fields: dict[str, str] = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or name not in _PARTS:
                raise ValueError(f"--worker {text!r}: unknown part {pair!r}")
            fields[name] = value
        if "events" not in fields:
            raise ValueError(f"--worker {text!r}: events=tcp://HOST:PORT is required for vLLM")
        key = None
        if "lower_curve" in fields:
            if "lower" not in fields:
                raise ValueError(f"--worker {text!r}: lower_curve names the key of lower=")
            try:
                key = _server_key(fields["lower_curve"])
            except CurveKeyError as exc:
                raise ValueError(f"--worker {text!r}: lower_curve: {exc}") from exc
        try:
            step_tokens = int(fields.get("step_tokens", VLLM_STEP_TOKENS))
            check_step_tokens(step_tokens)
        except ValueError:
            raise ValueError(
                f"--worker {text!r}: step_tokens must be an integer in [1, {MAX_STEP_TOKENS}]"
            ) from None
        return cls(
            worker_id=fields.get("id", f"v{position}"),
            base_url=url.rstrip("/"),
            events_endpoint=fields["events"],
            replay_endpoint=fields.get("replay"),
            lower_events_endpoint=fields.get("lower"),
            lower_replay_endpoint=fields.get("lower_replay"),
            block_size=block_size,
            lower_curve_public_key=key,
            step_tokens=step_tokens,
        )


_PARTS = frozenset(
    {"events", "replay", "lower", "lower_replay", "lower_curve", "step_tokens", "id"}
)


def _server_key(value: str) -> bytes:
    """A public key in z85 text, or the ``zmq.auth`` certificate file holding it."""
    path = Path(value)
    return load_public_key(path) if path.is_file() else decode_public_key(value)


_MAX_METRIC = 1e12
"""Above any request count, usage fraction or Unix time in seconds a server reports."""


def parse_metrics(text: str) -> tuple[ScrapedLoad, float | None]:
    """vLLM's load figures (summed over label sets) and the process start time, if shown."""
    sums = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    started: float | None = None
    for name, _, number in samples(text):
        if not (math.isfinite(number) and 0 <= number < _MAX_METRIC):
            continue  # NaN, inf, negative or absurd: no figure rather than a wrong one
        if name in _LOAD_METRICS:
            sums[_LOAD_METRICS[name]] += number
        elif name == _START:
            started = number
    load = ScrapedLoad(int(sums["waiting"]), int(sums["running"]), sums["kv_usage"])
    return load, started


def router_fingerprint(model: str, block_size: int) -> FingerprintDigest:
    """The index's seed for a vLLM fleet (see the module docstring)."""
    data = f"kvstrata.vllm-router.v1\x00{model}\x00{block_size}".encode()
    return FingerprintDigest(hashlib.sha256(data).digest())


class VllmSource:
    """``WorkerSource`` for vLLM OpenAI servers (``kvstrata.fleet.source``)."""

    def __init__(self, workers: list[VllmWorker], *, tenant_secret: bytes = b"") -> None:
        """``tenant_secret``: what the servers' connectors salt tenants with. vLLM cannot say
        (no ``/kv/info``); whoever configured both (``kvstrata up``, the operator) vouches."""
        self._workers = {w.base_url: w for w in workers}
        self._secret_digest = secret_digest(tenant_secret)

    def info(self, http: httpx.Client, base_url: str, api_key: str | None) -> WorkerInfo:
        worker = self._workers.get(base_url)
        if worker is None:
            raise WorkerProtocolError(f"{base_url} is not a configured vLLM worker")
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        metrics = http.get(f"{base_url}/metrics", headers=headers)
        metrics.raise_for_status()
        models = http.get(f"{base_url}/v1/models", headers=headers)
        models.raise_for_status()
        load, started = parse_metrics(metrics.text)
        if started is None:
            raise WorkerProtocolError(f"{base_url}/metrics shows no {_START}: no epoch")
        try:
            model = str(models.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise WorkerProtocolError(f"bad /v1/models from {base_url}: {exc!r}") from exc
        return WorkerInfo(
            worker_id=worker.worker_id,
            base_url=base_url,
            epoch=int(started * 1000),
            model=model,
            fingerprint=router_fingerprint(model, worker.block_size),
            block_size=worker.block_size,
            events_endpoint=worker.events_endpoint,
            replay_endpoint=worker.replay_endpoint,
            next_seq=0,
            secret_digest=self._secret_digest,
            tiers=("device", "host", "disk") if worker.lower_events_endpoint else ("device",),
            lower_events_endpoint=worker.lower_events_endpoint,
            lower_replay_endpoint=worker.lower_replay_endpoint,
            lower_curve_public_key=worker.lower_curve_public_key,
            scraped=load,
            step_tokens=worker.step_tokens,
        )

    def dump(self, http: httpx.Client, info: WorkerInfo, api_key: str | None) -> WorkerDump:
        """Nothing at sequence 0: the replay socket brings the history (module docstring)."""
        return WorkerDump(
            epoch=info.epoch, next_seq=0, events=[], ts=time.time(), history_by_replay=True
        )


def _salted(event: KVEvent) -> KVEvent:
    if not isinstance(event, BlockStored) or event.namespace is not None:
        return event
    if event.parent_block_hash is not None or not event.extra_keys:
        return event
    first = event.extra_keys[0]
    salts = [item for item in first or () if isinstance(item, str)]
    if not salts:
        return event
    return replace(event, namespace=salt_tenant(salts[-1]))


def salted_batch(batch: KVEventBatch) -> KVEventBatch:
    """vLLM's batch with each salted chain's first event in its salt's tenant namespace.

    Only a chain's first block carries the salt; the index hashes a later event in its
    parent's namespace (``GlobalIndex``: an event without one takes its parent's)."""
    events = [_salted(e) for e in batch.events]
    if all(a is b for a, b in zip(events, batch.events, strict=True)):
        return batch
    return replace(batch, events=events)


def tenant_of_body(payload: dict[str, Any]) -> str | None:
    """The tenant a vLLM request's ``cache_salt`` names (None: no salt, caller decides)."""
    salt = payload.get("cache_salt")
    if isinstance(salt, str) and salt:
        return salt_tenant(salt)
    return None


__all__ = [
    "DEFAULT_TENANT",
    "VllmSource",
    "VllmWorker",
    "parse_metrics",
    "router_fingerprint",
    "salted_batch",
    "tenant_of_body",
]
