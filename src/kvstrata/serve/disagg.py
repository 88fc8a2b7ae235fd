"""A worker's HTTP side of disaggregated prefill (issue 14; ``docs/disaggregation.md``).

- ``POST /kv/prefill`` (prefill worker): ``{request_id, prompt_token_ids, tenant, target:
  {host, port, transport}}`` (``transport``: ``tcp``, the default, or ``nixl``, as the decode
  worker's ``/kv/info`` advertises) → prefill here and stream the KV to the decode worker at
  ``target`` (``transfer_sender.prefill_and_send``) → ``{outcome, blocks, bytes, seconds,
  prefill_compute_s, matched_tokens, overlap, reason}`` (``seconds``: the whole call, transfer
  included; ``prefill_compute_s``: the prefill's own compute, what the router fits this
  worker's prefill model from, as ``serve.timing`` reports it for a completion). The caller
  needs a tenant key, as for completions; ``tenant`` may only narrow it.
  ``target`` must be one the worker's ``[transfer] allowed_targets`` admit (default loopback;
  ``runtime.transfer_config``), else 403 ``target_forbidden``: nothing is computed or sent.
- ``kvstrata_transfer: {request_id, timeout_s}`` on a completion (decode worker): the request
  waits until that transfer committed, failed or timed out (``Disaggregation.await_transfer``)
  and then generates normally: a hit on the received blocks when it committed, a local
  prefill otherwise — the answer is the same either way.

Every path is counted: ``kvstrata_disagg_requests_total{role, path, outcome}`` (role
``prefill``/``decode``, path ``transfer``/``local``), its bytes and seconds, and
``kvstrata_transfer_refusals_total{reason}``; each is audited (``Action.TRANSFER``). The
receiver's own ``TransferMetrics`` count the transfers themselves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Depends, FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import Field

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.generation import Generation
from kvstrata.errors import ApiError
from kvstrata.runtime.transfer_config import TransferConfig
from kvstrata.security import Principal, Role
from kvstrata.security.audit import NULL_AUDIT, Action, AuditLog
from kvstrata.serve.auth import HttpAuth
from kvstrata.serve.protocol import MAX_TENANT_CHARS, TRANSFER_ID_PATTERN, TransferWait, _Strict
from kvstrata.serve.transfer_receiver import DecodeTransfers
from kvstrata.serve.transfer_sender import SendOutcome, prefill_and_send

PREFILL_PATH = "/kv/prefill"
MAX_PREFILL_TOKENS = 1 << 17


class TransferTarget(_Strict):
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    transport: Literal["tcp", "nixl"] = "tcp"  # what the decode worker's listener speaks


class PrefillRequest(_Strict):
    request_id: str = Field(pattern=TRANSFER_ID_PATTERN)
    prompt_token_ids: list[int] = Field(min_length=1, max_length=MAX_PREFILL_TOKENS)
    tenant: str | None = Field(default=None, min_length=1, max_length=MAX_TENANT_CHARS)
    target: TransferTarget


class DisaggMetrics:
    """Counted per request on both roles (module docstring); bound to the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["role", "path", "outcome"]
        self.requests = Counter(
            "kvstrata_disagg_requests",
            "Disaggregated-prefill requests by role, path taken and outcome",
            labels,
            registry=registry,
        )
        self.bytes = Counter(
            "kvstrata_disagg_bytes",
            "KV payload bytes of disaggregated requests",
            labels,
            registry=registry,
        )
        self.seconds = Histogram(
            "kvstrata_disagg_seconds",
            "Transfer wait (decode) or prefill+send time (prefill) of disaggregated requests",
            labels,
            buckets=(0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )
        self.refusals = Counter(
            "kvstrata_transfer_refusals",
            "Refused transfer handshakes, by reason (either side)",
            ["reason"],
            registry=registry,
        )

    def observe(
        self, role: str, path: str, outcome: str, payload_bytes: int, seconds: float
    ) -> None:
        self.requests.labels(role, path, outcome).inc()
        self.bytes.labels(role, path, outcome).inc(payload_bytes)
        self.seconds.labels(role, path, outcome).observe(seconds)


@dataclass
class Disaggregation:
    """A worker's disaggregation roles: ``receiver`` (decode; None: this worker takes no
    transfers) and the prefill side's settings (``targets``: where it may send; ``layer_delay_s``:
    tests only)."""

    engine: ReferenceEngine
    metrics: DisaggMetrics
    receiver: DecodeTransfers | None = None
    targets: TransferConfig = field(default_factory=TransferConfig)
    tenant_secret: bytes = b""
    layer_delay_s: float = 0.0
    audit: AuditLog = NULL_AUDIT

    async def await_transfer(self, wait: TransferWait, tenant: str) -> str:
        """Wait for transfer ``wait.request_id``; returns the path the request then takes
        (``transfer`` when the blocks committed, else ``local``), counted and audited."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        status = None
        if self.receiver is not None:
            status = await self.receiver.wait_async(wait.request_id, wait.timeout_s)
        seconds = loop.time() - started
        if self.receiver is None:
            outcome = "no_receiver"
        elif status is None:
            outcome = "timeout"
        else:
            outcome = status.outcome if not status.reason else f"refused_{status.reason}"
        if status is not None and status.reason:
            self.metrics.refusals.labels(status.reason).inc()
        path = "transfer" if status is not None and status.committed else "local"
        payload = status.payload_bytes if status is not None else 0
        self.metrics.observe("decode", path, outcome, payload, seconds)
        self.audit.record(
            Action.TRANSFER,
            f"decode_{path}_{outcome}",
            tenant=tenant,
            request_id=wait.request_id,
            counts={"blocks": status.blocks if status is not None else 0, "bytes": payload},
        )
        return path

    def release_at_first_token(self, wait: TransferWait, generation: Generation | None) -> None:
        """End the hold on transfer ``wait``'s received blocks (``DecodeTransfers.release``)
        at the request's first token, or its end: its lookup has taken what it found (now,
        without a ``generation``: the request failed before the engine took it)."""
        receiver, released = self.receiver, [False]
        if receiver is None:
            return
        if generation is None:
            receiver.release(wait.request_id)
            return

        def release() -> None:  # on the engine thread, after each token: once is enough
            if not released[0]:
                released[0] = True
                receiver.release(wait.request_id)

        generation.subscribe(release)


def register_disagg(app: FastAPI, disagg: Disaggregation, guard: HttpAuth) -> None:
    """Add ``POST /kv/prefill`` (module docstring)."""
    engine = disagg.engine
    vocab = int(engine.model.config.vocab_size)

    def caller(request: Request) -> None:
        request.state.kvstrata_principal = guard.check(request, {Role.TENANT}, "run prefills")

    @app.post(PREFILL_PATH, dependencies=[Depends(caller)])
    async def prefill(request: Request, body: PrefillRequest) -> dict[str, object]:
        principal: Principal = request.state.kvstrata_principal
        tenant = guard.namespace(request, principal, body.tenant)
        tokens = [int(t) for t in body.prompt_token_ids]
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ApiError(400, f"token ids must lie in 0..{vocab - 1}", param="prompt_token_ids")
        if len(tokens) >= engine.max_model_len:
            raise ApiError(400, "the prompt is longer than the model's context", param="prompt")
        target = body.target
        if not disagg.targets.permits(target.host, target.port):
            disagg.metrics.refusals.labels("target_forbidden").inc()
            disagg.audit.record(
                Action.TRANSFER,
                "prefill_target_forbidden",
                tenant=tenant,
                request_id=body.request_id,
                counts={"port": target.port},
            )
            raise ApiError(
                403,
                f"transfer target {target.host}:{target.port} is not in this worker's "
                "[transfer] allowed_targets",
                param="target",
                code="target_forbidden",
            )
        result: SendOutcome = await asyncio.to_thread(
            prefill_and_send,
            engine,
            tokens,
            tenant,
            body.request_id,
            (body.target.host, body.target.port),
            tenant_secret=disagg.tenant_secret,
            layer_delay_s=disagg.layer_delay_s,
            transport=body.target.transport,
        )
        disagg.metrics.observe(
            "prefill", "transfer", result.outcome, result.payload_bytes, result.seconds
        )
        if result.outcome == "refused":
            disagg.metrics.refusals.labels(result.reason).inc()
        disagg.audit.record(
            Action.TRANSFER,
            f"prefill_{result.outcome}",
            tenant=tenant,
            request_id=body.request_id,
            counts={"blocks": result.blocks, "bytes": result.payload_bytes},
        )
        return {
            "outcome": result.outcome,
            "blocks": result.blocks,
            "bytes": result.payload_bytes,
            "seconds": result.seconds,
            "prefill_compute_s": result.compute_s,
            "matched_tokens": result.matched_tokens,
            "overlap": result.overlap,
            "reason": result.reason,
        }
