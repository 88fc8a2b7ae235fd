"""``POST /admin/delete`` on a worker: remove a tenant's or a prompt's KV from every tier.

The body is one selector (``serve.deletion_protocol``). The caller needs an admin key
(``ADMINISTER``). A prompt (text, chat or token ids) is tokenized as generation tokenizes it
and keyed in the tenant's namespace (``engine.block_keys``); the engine deletes those keys
and their descendants — or every object of the tenant, or those older than N seconds — from
the device pool and every store level (``engine.delete``, on the engine thread), leaving
tombstones. Then, still on the engine thread, the worker's KV events are flushed, so the
``BlockRemoved`` batch is published, and the answer names the live sequence number the stream
continues from (``events_next_seq``, with ``events_epoch``): a router's index refuses any
earlier ``BlockStored`` of a deleted key (``index.tombstones``).

Answer::

    {"removed": {tier: n}, "deleted_keys": n, "pending": n, "unreachable": [tier, ...],
     "keys": [hex, ...],
     "events_next_seq": S, "events_epoch": E, "worker_id": W}

``unreachable`` names tiers whose medium failed (their replicas may remain: not confirmed).
``keys`` (block keys in hex: object ids, never tokens) tell the router which entries go when
the worker chose them (``older_than``). One audit line (``delete``; reason = the selector
kind; tenant, key id, request id, counts per tier and the keys) records it; never the prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.errors import ApiError
from kvstrata.identity import BlockKey
from kvstrata.security import ADMINISTER, Action, AuditLog
from kvstrata.serve.auth import REQUEST_ID_HEADER, HttpAuth, request_id_of
from kvstrata.serve.deletion_protocol import (
    DELETE_PATH,
    DeleteRequest,
    SelectorKind,
    parse_delete_body,
)
from kvstrata.serve.protocol import error_response
from kvstrata.store.deletion import DeleteReport, DeleteSelector


@dataclass(frozen=True)
class _Outcome:
    report: DeleteReport
    next_seq: int | None
    epoch: int | None
    worker_id: str | None


def register_deletion(
    app: FastAPI, engine: ReferenceEngine, auth: HttpAuth, audit: AuditLog | None = None
) -> None:
    """Add ``POST /admin/delete`` to a worker's app (``audit``: the guard's by default)."""
    audit = auth.audit if audit is None else audit
    vocab_size = int(engine.model.config.vocab_size)

    def tokens_of(body: DeleteRequest) -> tuple[list[int], int]:
        """The prompt's token ids and the first that depends on its content (a chat's
        template-only head is kept: ``deletion_protocol``)."""
        if body.prompt is not None:
            return engine.encode_prompt(body.prompt), 0
        if body.messages is not None:
            return engine.chat_content_start(body.template_messages())
        assert body.prompt_token_ids is not None
        if body.prompt_token_ids and max(body.prompt_token_ids) >= vocab_size:
            raise ApiError(400, f"token ids must be < {vocab_size}", param="prompt_token_ids")
        return body.prompt_token_ids, body.content_from or 0

    def selector_of(body: DeleteRequest) -> DeleteSelector | None:
        """None: nothing can match (a prompt shorter than one block, or no reuse at all)."""
        if not body.by_prompt:
            return DeleteSelector(
                tenant=body.tenant, all=bool(body.all), older_than_s=body.older_than_s
            )
        tokens, start = tokens_of(body)
        keys = engine.block_keys(tokens, body.tenant)  # on the loop, as serving does
        keys = keys[start // engine.config.block_size :]  # chained: the rest go with these
        return DeleteSelector(tenant=body.tenant, keys=tuple(keys)) if keys else None

    def run(selector: DeleteSelector | None) -> _Outcome:
        """On the engine thread: delete, then publish the removals and read the stream's seq."""
        empty = DeleteReport(removed={}, keys=[])
        report = empty if selector is None else engine.delete(selector)
        emitter = engine.events
        if emitter is None:
            return _Outcome(report, None, None, None)
        emitter.flush()
        return _Outcome(report, emitter.publisher.next_seq, emitter.epoch, emitter.worker_id)

    @app.post(DELETE_PATH, response_model=None)
    async def delete(request: Request) -> Response:
        request_id = request_id_of(request)
        try:
            principal = auth.check(request, ADMINISTER, "delete cached KV", request_id=request_id)
            body = parse_delete_body(await request.body())
            selector = await asyncio.to_thread(selector_of, body)  # tokenizes: off the loop
        except ApiError as exc:
            return error_response(exc)
        outcome = await asyncio.wrap_future(engine.call(lambda: run(selector)))
        report = outcome.report
        audit.record(
            Action.DELETE,
            body.kind.value,
            tenant=body.tenant,
            key_id=principal.key_id,
            request_id=request_id,
            plane=f"http POST {DELETE_PATH}",
            keys=[bytes(key) for key in report.keys],
            counts={**report.removed, "pending": report.pending},
        )
        return JSONResponse(answer_body(report, outcome), headers={REQUEST_ID_HEADER: request_id})


def answer_body(report: DeleteReport, outcome: _Outcome) -> dict[str, Any]:
    return {
        "removed": dict(report.removed),
        "deleted_keys": len(report.keys),
        "pending": report.pending,
        "unreachable": list(report.unreachable),
        "keys": [_hex(key) for key in report.keys],
        "events_next_seq": outcome.next_seq,
        "events_epoch": outcome.epoch,
        "worker_id": outcome.worker_id,
    }


def _hex(key: BlockKey) -> str:
    return bytes(key).hex()


__all__ = ["DELETE_PATH", "SelectorKind", "register_deletion"]
