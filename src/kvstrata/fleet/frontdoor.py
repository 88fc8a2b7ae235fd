"""The fleet's front door: one OpenAI-compatible endpoint that routes each request to a worker.

Per request: validate the body with the same models a worker uses (a malformed request is a
400 here and never reaches a worker), tokenize it exactly as the worker will (same tokenizer
files, same chat template), hash its full blocks in the tenant's namespace, ask the router,
and proxy the request unchanged to the chosen worker. A worker that cannot be reached is
marked unhealthy at once (no more traffic; the next health round drops its index entries or
re-attaches it) and the request goes to the next best worker (safe: nothing was returned to
the client yet). Workers answer everything else themselves, including their own exactness
guarantees: the router only decides *where*, never *what*.

Access: the front door loads the same keys file as its workers (its own ``HttpAuth``) and
authenticates each client as a worker would: the tenant that hashes and routes a request is
its key's, narrowed only as the key allows. The client's ``Authorization`` header and the
narrowed ``X-Kvstrata-Tenant`` go to the worker unchanged, and the worker authenticates
them again (defence in depth: a worker reachable around the front door is no weaker). The
router's own calls (``/kv/info``, ``/kv/dump``) carry its fleet key (``FleetConfig.api_key``).
``/debug/route`` needs an observer key and answers only in the caller's own namespaces;
``/metrics`` and ``/fleet/workers`` need one too (open when single-tenant). The request id
(a client's valid ``X-Request-Id`` or a new one) goes to the worker, so both audit trails
name the same request.

Health: a background task polls each worker's ``/kv/info``. An unreachable worker is
detached (entries dropped, no traffic); a reachable one with a new epoch (restarted) is
re-attached from its dump; a recovered one is attached again.

Concurrency: handlers run on the server's event loop and touch fleet state only through
:class:`~kvstrata.fleet.fleet.Fleet` methods (each a short critical section under the fleet
lock, no I/O), holding nothing but immutable values across an ``await``: the
:class:`~kvstrata.fleet.fleet.Reservation` of a routed request and
:class:`~kvstrata.fleet.fleet.WorkerView` snapshots. Routing (which hashes the prompt) runs
in a thread; HTTP to workers never runs under the lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kvstrata.errors import ApiError, NoWorkerAvailable
from kvstrata.fleet import disagg_proxy
from kvstrata.fleet.answers import chained, head_timing, stream_head, usage_in_sse, usage_of
from kvstrata.fleet.deletion import register_deletion
from kvstrata.fleet.failover import (
    ClientGone,
    WorkerDeaths,
    WorkerGone,
    client_left,
    re_route,
    unless_client_left,
    unless_dead,
    until_dead,
)
from kvstrata.fleet.fleet import Fleet, Reservation
from kvstrata.fleet.vllm_workers import tenant_of_body
from kvstrata.fleet.worker_info import worker_tls
from kvstrata.identity import DEFAULT_TENANT
from kvstrata.runtime.placement import PLACED_AT_HEADER, placed_at_header
from kvstrata.security import OBSERVE, Authenticator, Principal, Role
from kvstrata.serve.auth import REQUEST_ID_HEADER, TENANT_HEADER, HttpAuth, request_id_of
from kvstrata.serve.deletion_protocol import TOKEN_ID_LIMIT
from kvstrata.serve.limits import BodyLimits
from kvstrata.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    api_error_handler,
    check_forwardable,
    error_response,
    invalid_request,
    parse_json,
)
from kvstrata.serve.timing import (
    COMPUTE_HEADER,
    MATCHED_HEADER,
    TIMING_REQUEST_HEADER,
    from_headers,
)

_log = logging.getLogger(__name__)
_MODELS_TIMEOUT_S = 5.0
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
WORKER_HEADER = "X-Kvstrata-Worker"
PREDICTED_HEADER = "X-Kvstrata-Predicted-Ttft-S"  # the router's TTFT prediction for it


def _parse(endpoint: str | None, raw: bytes) -> tuple[SamplingRequest, dict[str, Any]]:
    """The body of ``endpoint``'s request (None: a chat if it has a ``messages`` key, else a
    completion — ``/debug/route`` takes either)."""
    payload = parse_json(raw)
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object")
    payload.pop("kvstrata_transfer", None)  # the router's to set (disaggregation), never a client's
    chat = endpoint == CHAT or (endpoint is None and "messages" in payload)
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        body = model.model_validate(payload)
    except ValidationError as exc:  # answered as a worker would (same message, param, code)
        raise invalid_request(list(exc.errors()), in_body=False) from exc
    check_forwardable(raw, payload)  # sent on whole: its other fields must encode too
    return body, payload


def _tokens(fleet: Fleet, endpoint: str, body: SamplingRequest) -> list[int]:
    """The ids the worker will see; ``ApiError`` 400 where the worker answers one too (text
    far too long, a conversation the chat template refuses or no chat template at all)."""
    tokenizer = fleet.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = body.template_messages()
        tokenizer.refuse_if_it_cannot_fit([str(m.get("content", "")) for m in messages], "messages")
        return tokenizer.encode_chat(messages)
    assert isinstance(body, CompletionRequest)
    prompt = body.prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < TOKEN_ID_LIMIT for t in ids):  # no tokenizer makes these; the
            raise ApiError(400, "token ids must be in [0, 2**32)", param="prompt")  # worker
        return ids  # checks its own vocabulary
    text = prompt if isinstance(prompt, str) else str(prompt[0])
    tokenizer.refuse_if_it_cannot_fit([text], "prompt")
    return tokenizer.encode_prompt(text)


def _engine_tenant(fleet: Fleet, principal: Principal, tenant: str, payload: dict[str, Any]) -> str:
    """The namespace the worker will key the request in (``tenant``: the one the caller's key
    allows). A vLLM worker (and its kvstrata connector) knows only ``cache_salt``. With keys,
    the front door sets it from the key's namespace, folding in any salt the client sent, so
    no tenant can share another's KV by sending its salt, or the default namespace by sending
    none. Without keys (one tenant), the client's salt is its tenant, else the default one."""
    if fleet.config.engine != "vllm":
        return tenant
    if not principal.open_namespaces:
        sent = payload.get("cache_salt")
        payload["cache_salt"] = json.dumps(
            ["kvstrata-namespace", tenant, sent if isinstance(sent, str) else None]
        )
    return tenant_of_body(payload) or DEFAULT_TENANT


def create_frontdoor_app(fleet: Fleet, auth: HttpAuth | None = None) -> FastAPI:
    """``auth``: the front door's guard (None: single-tenant, nothing privileged)."""
    guard = auth if auth is not None else HttpAuth(Authenticator())
    client: httpx.AsyncClient | None = None
    deaths: WorkerDeaths | None = None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        nonlocal client, deaths
        client = httpx.AsyncClient(  # no pool cap: httpx's 100 connections queued request
            timeout=fleet.config.request_timeout_s,  # 101 and, timed out, flagged its worker
            verify=worker_tls(fleet.config.tls_ca_file),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        deaths = WorkerDeaths(asyncio.get_running_loop())
        fleet.on_worker_dead(deaths.declare)
        health = asyncio.create_task(_health_loop(fleet))
        try:
            yield
        finally:
            health.cancel()
            await client.aclose()
            fleet.close()

    app = FastAPI(title="kvstrata router", lifespan=lifespan)
    # The workers' own body limits, here first: a body a worker refuses (413, closing before
    # it is read) would otherwise read as a dead worker, and the retry would flag them all.
    app.add_middleware(BodyLimits, limits=fleet.config.limits)
    register_deletion(app, fleet, guard)
    app.exception_handler(ApiError)(api_error_handler)

    async def handle(endpoint: str, request: Request) -> Response:
        assert client is not None and deaths is not None
        request_id = request_id_of(request)
        try:
            principal = guard.check(request, {Role.TENANT}, "run completions")
            body, payload = _parse(endpoint, await request.body())
            tenant = _engine_tenant(
                fleet, principal, guard.namespace(request, principal, body.kvstrata_tenant), payload
            )
            tokens = await asyncio.to_thread(_tokens, fleet, endpoint, body)
        except ApiError as exc:
            fleet.metrics.requests.labels(endpoint, str(exc.status)).inc()
            return error_response(exc)
        headers = _worker_headers(request, body, request_id)
        # unique in the fleet's in-flight table even when a client repeats its request id
        flight_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        forward = _Forward(
            fleet, client, deaths, endpoint, flight_id, tenant, tokens, body, payload, headers,
            request.is_disconnected,
        )  # fmt: skip
        response = await _forward(forward)
        fleet.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.post(COMPLETIONS, response_model=None)
    async def completions(request: Request) -> Response:
        return await handle(COMPLETIONS, request)

    @app.post(CHAT, response_model=None)
    async def chat(request: Request) -> Response:
        return await handle(CHAT, request)

    def observer(request: Request) -> Principal:
        return guard.check(request, OBSERVE, "explain routing")

    @app.post("/debug/route", response_model=None)
    async def debug_route(request: Request) -> Response:
        """Explain where a completion or chat body would go, without sending it — in the
        caller's own namespace only."""
        try:
            principal = observer(request)
            body, payload = _parse(None, await request.body())
            endpoint = CHAT if isinstance(body, ChatCompletionRequest) else COMPLETIONS
            tenant = _engine_tenant(
                fleet, principal, guard.namespace(request, principal, body.kvstrata_tenant), payload
            )
            tokens = await asyncio.to_thread(_tokens, fleet, endpoint, body)
            decision = fleet.route("debug", tenant, tokens, body.requested_max_tokens(), False)
        except ApiError as exc:
            return error_response(exc)
        except NoWorkerAvailable as exc:
            return error_response(ApiError(503, str(exc), type="server_error"))
        answer: dict[str, Any] = {"prompt_tokens": len(tokens), "decision": decision.to_dict()}
        if fleet.config.disagg is not None:
            chosen = await asyncio.to_thread(
                fleet.plan_disagg, decision.worker_id, "debug", tenant, tokens, record=False
            )
            answer["disagg"] = chosen.to_dict()
        return JSONResponse(answer)

    @app.get("/fleet/workers")
    async def workers(request: Request) -> dict[str, Any]:
        guard.check(request, OBSERVE, "list the workers", open_single_tenant=True)
        out = [
            {
                "worker_id": view.worker_id,
                "url": view.url,
                "healthy": view.healthy,
                "epoch": view.epoch,
                "inflight": view.inflight,
                "consistent": view.consistent,
                "blocks": dict(zip(("device", "host", "disk", "remote"), view.blocks, strict=True)),
                "prefill_samples": view.prefill_samples,
                "prefill_model": {
                    **view.prefill_model.terms(),
                    "spread": view.prefill_model.spread,
                },
                "serving_overhead_s": view.serving_overhead_s,
                "step_tokens": view.step_tokens,
                "decode_step_s": view.decode_step_s,
            }
            for view in fleet.worker_views()
        ]
        return {"mode": fleet.config.mode.value, "policy": fleet.config.policy, "workers": out}

    @app.get("/health")
    async def health() -> Response:
        healthy = sum(view.healthy for view in fleet.worker_views())
        status = 200 if healthy else 503
        return JSONResponse(
            {"status": "ok" if healthy else "no_workers", "workers": healthy}, status
        )

    @app.get("/v1/models")
    async def models() -> Response:
        """The first healthy worker that answers (one that died since the last health round
        is skipped, not a 500)."""
        assert client is not None
        for view in fleet.worker_views():
            if view.healthy:
                try:
                    upstream = await client.get(f"{view.url}/v1/models", timeout=_MODELS_TIMEOUT_S)
                except httpx.HTTPError as exc:
                    _log.warning("worker %s did not list its models: %r", view.worker_id, exc)
                    continue
                return Response(
                    upstream.content, upstream.status_code, media_type="application/json"
                )
        return error_response(ApiError(503, "no worker available", type="server_error"))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        guard.check(request, OBSERVE, "read /metrics", open_single_tenant=True)
        for view in fleet.worker_views():
            fleet.metrics.worker_inflight.labels(view.worker_id).set(view.inflight)
        return Response(generate_latest(fleet.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _health_loop(fleet: Fleet) -> None:
    while True:
        try:
            await asyncio.to_thread(fleet.check_health)
        except Exception:
            _log.exception("health round failed")
        await asyncio.sleep(fleet.config.health_interval_s)


@dataclass(frozen=True, slots=True)
class _Forward:
    """One client request on its way to a worker: what every attempt needs. ``headers``:
    what the worker needs of the client's (credential, namespace, request id). ``left``:
    whether the client disconnected."""

    fleet: Fleet
    client: httpx.AsyncClient
    deaths: WorkerDeaths
    endpoint: str
    request_id: str
    tenant: str
    tokens: list[int]
    body: SamplingRequest
    payload: dict[str, Any]
    headers: httpx.Headers
    left: Callable[[], Awaitable[bool]]


async def _forward(request: _Forward) -> Response:
    """Reserve and proxy; on a connection failure, flag the worker and try the next best; the
    same when the health round declares the worker dead before the client got anything
    (``failover``). A client that left abandons the wait on the worker
    (``unless_client_left``) and releases the reservation.

    Whatever ends an attempt — an answer, a retry, the client leaving, an exception nobody
    expected, a cancellation — the reservation is released (``Fleet.finish`` is idempotent):
    a leaked one made its worker look busy for good."""
    fleet, tokens = request.fleet, request.tokens
    max_tokens = request.body.requested_max_tokens()
    for _attempt in range(fleet.config.max_attempts):
        try:
            reservation = await asyncio.to_thread(
                fleet.reserve, request.request_id, request.tenant, tokens, max_tokens
            )
        except NoWorkerAvailable as exc:
            return error_response(ApiError(503, str(exc), type="server_error"))
        try:
            answer = await _try_worker(request, reservation)
        except BaseException:
            fleet.finish(reservation, time.time(), None, None)
            raise
        if answer is not None:
            return answer
    return error_response(ApiError(503, "no worker could take the request", type="server_error"))


async def _try_worker(request: _Forward, reservation: Reservation) -> Response | None:
    """One worker's try (``_forward``); None: it failed before the client got anything."""
    fleet, client, body, tokens, left = (
        request.fleet, request.client, request.body, request.tokens, request.left
    )  # fmt: skip
    request_id, decision, worker_id = (
        reservation.request_id,
        reservation.decision,
        reservation.worker_id,
    )
    fleet.metrics.decisions.labels(worker_id, decision.policy, decision.reason.split(":")[0]).inc()
    fleet.metrics.predicted_ttft.observe(decision.predicted_ttft_s)
    fleet.metrics.predicted_matched.labels(worker_id).inc(reservation.cached_tokens)
    fleet.metrics.prompt_tokens.labels(worker_id).inc(len(tokens))
    url = f"{reservation.base_url}{request.endpoint}"
    gone = request.deaths.event(worker_id)
    sent, _plan = await disagg_proxy.prepare(
        fleet, client, reservation, request.tenant, tokens, request.payload, request.headers
    )
    try:
        headers = request.headers.copy()  # when it was placed: the engine admits in order
        headers[PLACED_AT_HEADER] = placed_at = placed_at_header(reservation.started)
        upstream_request = client.build_request("POST", url, json=sent, headers=headers)
        sending = client.send(upstream_request, stream=True)
        upstream = await unless_dead(gone, unless_client_left(left, sending))
    except ClientGone:
        return client_left(fleet, reservation, request_id)
    except (httpx.TransportError, WorkerGone) as exc:
        re_route(fleet, reservation, "", exc, request_id)
        return None
    extra = {
        WORKER_HEADER: worker_id,
        PREDICTED_HEADER: f"{decision.predicted_ttft_s:.6f}",
        PLACED_AT_HEADER: placed_at,
    }
    if "retry-after" in upstream.headers:  # a worker's full queue (429): when to retry
        extra["Retry-After"] = upstream.headers["retry-after"]
    if body.stream and upstream.status_code == 200:
        chunks = until_dead(gone, upstream.aiter_raw())
        try:  # hold the client's headers until the first token: until then, a worker
            head, first_at = await unless_client_left(left, stream_head(chunks))  # that dies
        except ClientGone:  # costs the client nothing; a client gone stops the worker
            await upstream.aclose()
            return client_left(fleet, reservation, request_id)
        except (httpx.HTTPError, WorkerGone) as exc:
            await upstream.aclose()
            re_route(fleet, reservation, " before its first token", exc, request_id)
            return None
        head, timing = head_timing(head)
        if timing is not None:  # the worker's own figure (before the first token is marked)
            fleet.observe_prefill(reservation, timing.matched_tokens, timing.compute_s)
        relay = _relay(fleet, reservation, upstream, head, first_at, chunks)
        # started here, so its cleanup (finish the reservation, close the upstream) runs
        # even if the client left and Starlette never iterates the body
        primed = [chunk for chunk in [await anext(relay, None)] if chunk is not None]
        return StreamingResponse(
            chained(primed, relay),
            status_code=200,
            media_type="text/event-stream",
            headers=extra,
        )
    try:
        content = await unless_dead(gone, unless_client_left(left, upstream.aread()))
    except ClientGone:
        return client_left(fleet, reservation, request_id)
    except (httpx.HTTPError, WorkerGone) as exc:  # it failed after its headers: nothing
        re_route(fleet, reservation, " mid-answer", exc, request_id)  # was relayed yet
        return None
    finally:
        await upstream.aclose()
    now = time.time()
    _learn_prefill(fleet, reservation, upstream.headers)
    completion = usage_of(content)
    if completion is not None:
        fleet.metrics.matched.labels(worker_id).inc(completion[1])
    fleet.finish(reservation, now, None if completion is None else completion[0], None)
    return Response(
        content,
        upstream.status_code,
        media_type=upstream.headers.get("content-type", "application/json"),
        headers=extra,
    )


def _worker_headers(request: Request, body: SamplingRequest, request_id: str) -> httpx.Headers:
    """What the worker needs of the client's headers: its credential and namespace header,
    byte for byte (Starlette decodes headers as latin-1: encoded back the same way), and the
    request id; and the ask for the worker's timing comment (``serve.timing``). A
    ``kvstrata_tenant`` in the body travels in the forwarded body instead of a header: a body
    may hold any text, not all of it a valid header value (a non-ASCII name could not be
    encoded, a control character made the worker look unreachable)."""
    headers = {REQUEST_ID_HEADER: request_id, TIMING_REQUEST_HEADER: "1"}
    for name in ("authorization", TENANT_HEADER):
        value = request.headers.get(name)
        if value is not None and not (name == TENANT_HEADER and body.kvstrata_tenant is not None):
            headers[name] = value
    return httpx.Headers(headers, encoding="latin-1")


async def _relay(
    fleet: Fleet,
    reservation: Reservation,
    upstream: httpx.Response,
    head: list[bytes],
    first_at: float | None,
    rest: AsyncIterator[bytes],
) -> AsyncIterator[bytes]:
    """Relay ``head`` and then ``rest``; ``first_at``: when the head's first token came."""
    ttft: float | None = None
    completion: tuple[int, int] | None = None
    predicted = reservation.decision.predicted_ttft_s
    if first_at is not None:
        ttft = fleet.first_token(reservation, first_at)
        if ttft is not None:
            fleet.metrics.actual_ttft.observe(ttft)
            if predicted > 0:
                fleet.metrics.ttft_ratio.observe(ttft / predicted)
    try:
        async for chunk in chained(head, rest):
            if b'"usage"' in chunk:
                completion = usage_in_sse(chunk) or completion
            yield chunk
    finally:
        await upstream.aclose()
        if completion is not None:
            fleet.metrics.matched.labels(reservation.worker_id).inc(completion[1])
        fleet.finish(reservation, time.time(), None if completion is None else completion[0], ttft)


def _learn_prefill(fleet: Fleet, reservation: Reservation, headers: httpx.Headers) -> None:
    """Refit the worker's prefill model from its engine's report, if any (``serve.timing``)."""
    timing = from_headers(headers.get(COMPUTE_HEADER), headers.get(MATCHED_HEADER))
    if timing is not None:
        fleet.observe_prefill(reservation, timing.matched_tokens, timing.compute_s)
