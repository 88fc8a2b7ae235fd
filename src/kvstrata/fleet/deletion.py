"""``POST /admin/delete`` at the front door: delete on every worker, then in the index.

The body is a worker's (``serve.deletion_protocol``). The front door authenticates the caller
(``ADMINISTER``), tokenizes a prompt or chat once (as workers do) and sends every worker —
healthy or not: a deletion must reach every replica — ``{"tenant", "prompt_token_ids"}`` (or
the ``all`` / ``older_than_s`` body as it came), with the caller's ``Authorization`` and the
request id, all at once. Then it applies the index side (``Fleet.apply_deletion``): the
tenant's namespace, or the prompt's router hashes and their descendants, plus every key the
workers report, leave every worker slot and the shared tier, tombstoned at each worker's
``events_next_seq`` so that a late or replayed event cannot bring them back. A worker whose
stream the index has already applied past that position keeps its entries (they reflect the
deletion, and whatever it stored again since), unless its answer left replicas for later
(``pending``, an unreachable tier): ``GlobalIndex.delete``'s ``unsettled``.

Answer: ``status`` ``ok`` (every worker confirmed; HTTP 200), ``partial`` (some did not:
unreachable, refused, or a tier whose medium failed there) or
``failed`` (none did; both HTTP 502, since replicas may remain: run it again), the per-tier
sums, distinct deleted keys, and one entry per worker (its counts, or why it failed). One
audit line (``delete``, component ``router``) with the counts and the keys; never the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvstrata.errors import ApiError
from kvstrata.fleet.fleet import Fleet
from kvstrata.fleet.worker_info import worker_tls
from kvstrata.identity import BlockKey
from kvstrata.identity.keys import event_block_hash
from kvstrata.index.tombstones import StreamPosition
from kvstrata.security import ADMINISTER, Action, AuditLog
from kvstrata.serve.auth import REQUEST_ID_HEADER, HttpAuth, request_id_of
from kvstrata.serve.deletion_protocol import (
    DELETE_PATH,
    DeleteRequest,
    parse_delete_body,
)
from kvstrata.serve.protocol import error_response

_KEY_BYTES = 32


@dataclass
class WorkerOutcome:
    """One worker's answer to the fan-out (``error`` set when it did not confirm)."""

    worker_id: str | None
    url: str
    removed: dict[str, int] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    pending: int = 0
    unreachable: list[str] = field(default_factory=list)
    """Tiers whose medium failed on the worker: its deletion is not confirmed."""
    position: StreamPosition | None = None
    error: dict[str, Any] | None = None

    @property
    def confirmed(self) -> bool:
        return self.error is None and not self.unreachable

    @property
    def settled(self) -> bool:
        """Its stream at ``position`` shows the whole deletion: nothing left for later."""
        return self.confirmed and not self.pending

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "worker_id": self.worker_id,
            "url": self.url,
            "status": "ok" if self.confirmed else "failed",
            "removed": self.removed,
            "deleted_keys": len(self.keys),
            "pending": self.pending,
            "unreachable": self.unreachable,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def register_deletion(
    app: FastAPI, fleet: Fleet, auth: HttpAuth, audit: AuditLog | None = None
) -> None:
    """Add ``POST /admin/delete`` to the front door (``audit``: the guard's by default)."""
    audit = auth.audit if audit is None else audit

    @app.post(DELETE_PATH, response_model=None)
    async def delete(request: Request) -> Response:
        request_id = request_id_of(request)
        try:
            principal = auth.check(request, ADMINISTER, "delete cached KV", request_id=request_id)
            body = parse_delete_body(await request.body())
            prompt = await asyncio.to_thread(_tokens, fleet, body) if body.by_prompt else None
        except ApiError as exc:
            return error_response(exc)
        headers = {REQUEST_ID_HEADER: request_id}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        forwarded = _forwarded(body, prompt)
        verify = worker_tls(fleet.config.tls_ca_file)  # as every other client of the workers
        async with httpx.AsyncClient(
            timeout=fleet.config.request_timeout_s, verify=verify
        ) as client:
            outcomes = await asyncio.gather(
                *(
                    _ask(client, worker_id, url, forwarded, headers)
                    for worker_id, url in fleet.deletion_targets()
                )
            )
        answered = [o for o in outcomes if o.error is None]  # a failed tier still deleted some
        keys = sorted({key for o in answered for key in o.keys})
        positions = {
            o.worker_id: o.position
            for o in answered
            if o.worker_id is not None and o.position is not None
        }
        index = await asyncio.to_thread(
            fleet.apply_deletion,
            body.tenant,
            everything=bool(body.all),
            tokens=None if prompt is None else prompt[0],
            from_token=0 if prompt is None else prompt[1],
            engine_hashes=[event_block_hash(BlockKey(bytes.fromhex(k))) for k in keys],
            positions=positions,
            unsettled={o.worker_id for o in answered if o.worker_id is not None and not o.settled},
        )
        removed = _sums(o.removed for o in answered)
        pending = sum(o.pending for o in answered)
        failed = sum(not o.confirmed for o in outcomes)
        status = "ok" if not failed else ("partial" if failed < len(outcomes) else "failed")
        audit.record(
            Action.DELETE,
            body.kind.value,
            tenant=body.tenant,
            key_id=principal.key_id,
            request_id=request_id,
            plane=f"http POST {DELETE_PATH}",
            keys=keys,
            counts={**removed, "pending": pending, "failed_workers": failed},
        )
        answer = {
            "status": status,
            "tenant": body.tenant,
            "selector": body.kind.value,
            "removed": removed,
            "deleted_keys": len(keys),
            "pending": pending,
            "workers": [o.to_dict() for o in outcomes],
            "index": {
                "removed": 0 if index is None else index.removed,
                "tombstoned": 0 if index is None else index.tombstoned,
            },
        }
        return JSONResponse(
            answer, status_code=200 if not failed else 502, headers={REQUEST_ID_HEADER: request_id}
        )


def _tokens(fleet: Fleet, body: DeleteRequest) -> tuple[list[int], int]:
    """Token ids and the first that depends on the content (workers do the same)."""
    if body.prompt is not None:
        return fleet.tokenizer.encode_prompt(body.prompt), 0
    if body.messages is not None:
        return fleet.tokenizer.chat_content_start(body.template_messages())
    assert body.prompt_token_ids is not None
    return body.prompt_token_ids, body.content_from or 0


def _forwarded(body: DeleteRequest, prompt: tuple[list[int], int] | None) -> dict[str, Any]:
    if prompt is not None:
        tokens, start = prompt
        forwarded: dict[str, Any] = {"tenant": body.tenant, "prompt_token_ids": tokens}
        if start:
            forwarded["content_from"] = start
        return forwarded
    if body.all:
        return {"tenant": body.tenant, "all": True}
    return {"tenant": body.tenant, "older_than_s": body.older_than_s}


async def _ask(
    client: httpx.AsyncClient,
    worker_id: str | None,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
) -> WorkerOutcome:
    outcome = WorkerOutcome(worker_id, url)
    try:
        response = await client.post(f"{url}{DELETE_PATH}", json=body, headers=dict(headers))
    except httpx.HTTPError as exc:
        outcome.error = {"code": "unreachable", "message": type(exc).__name__}
        return outcome
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if response.status_code != 200 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        outcome.error = {"code": code or "refused", "http_status": response.status_code}
        return outcome
    try:
        _read_answer(outcome, answer)
    except (KeyError, TypeError, ValueError) as exc:
        outcome.error = {"code": "bad_answer", "message": str(exc)}
    return outcome


def _read_answer(outcome: WorkerOutcome, answer: Mapping[str, Any]) -> None:
    """A worker's delete answer, checked field by field (it is outside data here)."""
    removed = answer["removed"]
    if not isinstance(removed, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in removed.items()
    ):
        raise ValueError("removed must map tier names to counts")
    keys = answer["keys"]
    if not isinstance(keys, list) or not all(
        isinstance(k, str) and len(k) == 2 * _KEY_BYTES for k in keys
    ):
        raise ValueError("keys must be block keys in hex")
    for key in keys:
        bytes.fromhex(key)
    worker_id, next_seq, epoch = (
        answer["worker_id"],
        answer["events_next_seq"],
        answer["events_epoch"],
    )
    if worker_id is not None and not isinstance(worker_id, str):
        raise ValueError("worker_id must be a string")
    outcome.worker_id = worker_id or outcome.worker_id
    outcome.removed = {k: int(v) for k, v in removed.items()}
    outcome.keys = [k.lower() for k in keys]
    outcome.pending = int(answer.get("pending", 0))
    unreachable = answer.get("unreachable", [])
    if not isinstance(unreachable, list) or not all(isinstance(t, str) for t in unreachable):
        raise ValueError("unreachable must list tier names")
    outcome.unreachable = list(unreachable)
    if isinstance(next_seq, int) and (epoch is None or isinstance(epoch, int)):
        outcome.position = StreamPosition(epoch, next_seq)


def _sums(per_worker: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for removed in per_worker:
        for tier, count in removed.items():
            total[tier] = total.get(tier, 0) + count
    return total


__all__ = ["WorkerOutcome", "register_deletion"]
