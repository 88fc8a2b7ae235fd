"""The front door's side of a disaggregated request: ``POST /kv/prefill`` beside the completion.

After the router placed a request on a decode worker, :func:`prepare` asks the fleet for a
plan (``Fleet.plan_disagg``, counted in ``kvstrata_disagg_decisions_total{path, reason}``).
On ``disagg`` it starts the prefill worker's ``POST /kv/prefill`` (the prompt's token ids,
the decode worker's transfer address, the client's credential and namespace headers) and
returns the completion body with ``kvstrata_transfer`` added: the front door then sends it to
the decode worker at once and streams that answer back as for any request. A prefill worker
that refuses the connection within a moment is flagged unreachable and the request goes
local (counted ``reason="prefill_unreachable"``); one that fails later only costs the decode
worker its wait (``timeout_s``), after which it prefills locally: the answer is the same.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import httpx

from kvstrata.errors import InvalidInput
from kvstrata.fleet.disagg import DisaggPlan
from kvstrata.fleet.fleet import Fleet, Reservation
from kvstrata.serve.timing import PrefillTiming, checked

_log = logging.getLogger(__name__)
CONNECT_GRACE_S = 0.05
"""How long the completion waits to see whether the prefill worker refused the connection."""


def _count(fleet: Fleet, chosen: DisaggPlan, path: str | None = None) -> None:
    fleet.metrics.disagg_decisions.labels(path or chosen.path, chosen.reason).inc()


async def prepare(
    fleet: Fleet,
    client: httpx.AsyncClient,
    reservation: Reservation,
    tenant: str,
    tokens: list[int],
    payload: dict[str, Any],
    headers: httpx.Headers,
) -> tuple[dict[str, Any], DisaggPlan | None]:
    """The body to send to the decode worker, and the plan (None: not a disaggregated fleet)."""
    if fleet.config.disagg is None:
        return payload, None
    request_id = reservation.request_id
    try:
        chosen = await asyncio.to_thread(
            fleet.plan_disagg, reservation.worker_id, request_id, tenant, tokens, record=True
        )
    except InvalidInput as exc:  # a cost the planner cannot price: prefill here
        _log.warning("planning %s failed: %s", request_id, exc)
        chosen = DisaggPlan("local", "plan_failed")
    if chosen.path == "local":
        _count(fleet, chosen)
        return payload, chosen
    # One id per attempt: a client that retries under its own X-Request-Id (or two tenants
    # that pick the same one) never meets an earlier transfer's end or hold on the decode side.
    transfer_id = f"{request_id}-{uuid.uuid4().hex[:12]}-kv"
    body: dict[str, Any] = {
        "request_id": transfer_id,
        "prompt_token_ids": tokens,
        "target": {
            "host": chosen.target_host,
            "port": chosen.target_port,
            "transport": chosen.target_transport,
        },
    }
    if isinstance(payload.get("kvstrata_tenant"), str):
        body["tenant"] = payload["kvstrata_tenant"]
    task = asyncio.create_task(
        client.post(f"{chosen.prefill_url}/kv/prefill", json=body, headers=headers)
    )
    done, _ = await asyncio.wait({task}, timeout=CONNECT_GRACE_S)
    if done and task.exception() is not None:
        _log.warning("prefill worker %s failed: %r", chosen.prefill_worker_id, task.exception())
        fleet.finish_prefill(request_id, chosen, reachable=False)
        gone = DisaggPlan("local", "prefill_unreachable", chosen.choice, chosen.prefill_worker_id)
        _count(fleet, gone)
        return payload, gone
    _count(fleet, chosen)

    def ended(finished: asyncio.Task[httpx.Response]) -> None:
        error = None if finished.cancelled() else finished.exception()
        if error is not None:
            _log.warning("prefill worker %s failed: %r", chosen.prefill_worker_id, error)
        sent = None if error is not None or finished.cancelled() else _sent(finished)
        fleet.finish_prefill(
            request_id,
            chosen,
            reachable=not isinstance(error, httpx.TransportError),
            prompt_tokens=len(tokens),
            seconds=None if sent is None else sent[0],
            timing=None if sent is None else sent[1],
        )

    task.add_done_callback(ended)
    wait = {"request_id": transfer_id, "timeout_s": chosen.timeout_s}
    return {**payload, "kvstrata_transfer": wait}, chosen


def _sent(finished: asyncio.Task[httpx.Response]) -> tuple[float, PrefillTiming | None] | None:
    """A ``sent`` reply's whole seconds and the prefill compute it reports (None when it
    reports none, or figures out of range: ``serve.timing.checked``); None: not sent."""
    reply = finished.result()
    try:
        body = reply.json()
        if reply.status_code != 200 or body.get("outcome") != "sent":
            return None
        seconds = float(body["seconds"])
    except (ValueError, AttributeError, KeyError, TypeError):
        return None
    compute, matched = body.get("prefill_compute_s"), body.get("matched_tokens")
    timing = None
    if isinstance(compute, int | float) and isinstance(matched, int):
        timing = checked(float(compute), matched)
    return seconds, timing
