"""The OpenAI-compatible HTTP app over one ``ReferenceEngine``.

``create_app`` builds a FastAPI app with ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics`` and the worker's KV state (``/kv/info``, ``/kv/dump``,
see ``kv_state``; with an engine that publishes KV events, the lifespan also runs its replay
thread and idle flush). The app's lifespan starts the engine's step loop (continuous
batching: every request joins the running batch at the next step) and stops it. The event loop
tokenises, queues the generation and follows its tokens; it never waits on a step. A client
that disconnects, streaming or not, cancels its request at the next step. A full queue is a
429 with ``Retry-After``. Errors are answered in OpenAI's shape: bad input is a 400, an unknown
model a 404, and anything unexpected inside the engine a 500 after which the next request is
served normally. Each generation's ``RequestRecord`` is logged as one JSON line on the
``kvstrata.serve`` logger: ids and counts, never text.

Access (``serve.auth.HttpAuth``): a completion runs for the principal of its API key, in its
tenant's namespace (``X-Kvstrata-Tenant`` or ``kvstrata_tenant`` may only narrow it); the
guard runs before the body is parsed. ``/metrics`` needs an observer key (open on a
single-tenant server); ``/admin/*`` and ``/kv/*`` say their own (``admin``, ``kv_state``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.generation import Generation
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import ApiError, ContextTooLong, InvalidInput, QueueFull
from kvstrata.runtime import tokenization
from kvstrata.runtime.config import ServeLimits
from kvstrata.runtime.placement import PLACED_AT_HEADER, parse_placed_at
from kvstrata.security import OBSERVE, Authenticator, Principal, Role
from kvstrata.serve import protocol, responses
from kvstrata.serve.admin import ADMIN_TIERS, register_admin
from kvstrata.serve.auth import REQUEST_ID_HEADER, HttpAuth, request_id_of
from kvstrata.serve.deletion import DELETE_PATH, register_deletion
from kvstrata.serve.disagg import PREFILL_PATH, Disaggregation, register_disagg
from kvstrata.serve.kv_state import KV_PREFIX, KvStateRuntime, register_kv_state
from kvstrata.serve.limits import DEFAULT_LIMITS, BodyLimits, output_budget
from kvstrata.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from kvstrata.serve.streaming import Outcome, TextAssembler, follow
from kvstrata.serve.timing import (
    COMPUTE_HEADER,
    MATCHED_HEADER,
    TIMING_REQUEST_HEADER,
    timing_comment,
)
from kvstrata.telemetry import KvMetrics

logger = logging.getLogger("kvstrata.serve")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = frozenset({COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics", DELETE_PATH})
KV_ENDPOINTS = frozenset(
    {KV_PREFIX + "/info", KV_PREFIX + "/dump", KV_PREFIX + "/debug/drop-events", PREFILL_PATH}
)
PREFILL_HEADER = "X-Kvstrata-Prefill-S"
"""Engine-measured seconds from admission to first token of a non-streamed answer (wall
time: shared steps count in full; the router learns from ``timing.COMPUTE_HEADER``)."""
TTFT_HEADER = "X-Kvstrata-Ttft-S"
_DISCONNECT_POLL_S = 0.2
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    engine: ReferenceEngine,
    *,
    model_name: str,
    metrics: KvMetrics,
    auth: HttpAuth | None = None,
    debug_endpoints: bool = False,
    limits: ServeLimits = DEFAULT_LIMITS,
    disagg: Disaggregation | None = None,
) -> FastAPI:
    """Build the app; ``metrics`` must be the engine's own, so ``/metrics`` shows its figures.

    ``auth``: who may do what (None: single-tenant, nothing privileged);
    ``debug_endpoints`` adds ``POST /kv/debug/drop-events`` (event gap injection for tests);
    ``limits`` bounds request bodies and output lengths (``serve.limits``);
    ``disagg``: this worker's disaggregated-prefill roles (``serve.disagg``): ``/kv/prefill``,
    ``kvstrata_transfer`` waits, the transfer listener (started and stopped with the app).
    """
    if metrics is not engine.metrics:
        raise InvalidInput("metrics must be the KvMetrics object the engine records into")
    guard = auth if auth is not None else HttpAuth(Authenticator())
    service = _Service(engine, model_name, limits, disagg)
    receiver = disagg.receiver if disagg is not None else None
    kv_runtime = KvStateRuntime(engine.events, engine) if engine.events is not None else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start_loop()
        if kv_runtime is not None:
            kv_runtime.start()
        if receiver is not None:
            receiver.start()
        try:
            yield
        finally:
            if receiver is not None:
                await asyncio.to_thread(receiver.close)
            if kv_runtime is not None:
                await kv_runtime.close()
            await asyncio.to_thread(engine.stop_loop)

    app = FastAPI(title="kvstrata", lifespan=lifespan)
    app.add_middleware(BodyLimits, limits=limits)  # inside the counter: it counts 408s and 413s
    app.add_middleware(_RequestCounter, metrics=metrics)
    app.exception_handler(ApiError)(protocol.api_error_handler)
    app.exception_handler(RequestValidationError)(protocol.validation_error_handler)
    app.exception_handler(StarletteHTTPException)(protocol.http_error_handler)
    register_admin(app, engine.bridge.store if engine.bridge is not None else None, guard)
    register_deletion(app, engine, guard)
    register_kv_state(
        app,
        engine,
        model_name=model_name,
        auth=guard,
        debug_endpoints=debug_endpoints,
        transfer_info=receiver.info if receiver is not None else None,
    )
    if disagg is not None:
        register_disagg(app, disagg, guard)

    def caller(request: Request) -> None:
        """A route dependency: runs before the body is validated, so a caller without a key
        learns nothing from the body's error messages."""
        request.state.kvstrata_principal = guard.check(request, {Role.TENANT}, "run completions")

    def tenant_of(request: Request, body: SamplingRequest) -> str:
        principal: Principal = request.state.kvstrata_principal
        return guard.namespace(request, principal, body.kvstrata_tenant)

    @app.post(COMPLETIONS, response_model=None, dependencies=[Depends(caller)])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await service.completions(request, body, tenant_of(request, body))

    @app.post(CHAT, response_model=None, dependencies=[Depends(caller)])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await service.chat(request, body, tenant_of(request, body))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return responses.models_body(model_name, engine.max_model_len, service.created)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        guard.check(request, OBSERVE, "read /metrics", open_single_tenant=True)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Service:
    """Turns parsed requests into queued generations and their tokens into responses."""

    def __init__(
        self,
        engine: ReferenceEngine,
        model_name: str,
        limits: ServeLimits,
        disagg: Disaggregation | None,
    ) -> None:
        self.engine = engine
        self.disagg = disagg
        self.limits = limits
        self.model_name = model_name
        self.created = int(time.time())
        self.vocab_size = int(engine.model.config.vocab_size)
        self._token_bytes = tokenization.max_token_bytes(engine.tokenizer)

    async def completions(self, request: Request, body: CompletionRequest, tenant: str) -> Response:
        self._check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            token_ids = [int(t) for t in prompt]
            if max(token_ids) >= self.vocab_size:
                raise ApiError(400, f"token ids must be < {self.vocab_size}", param="prompt")

            def encode() -> list[int]:
                return token_ids
        else:
            text = prompt if isinstance(prompt, str) else str(prompt[0])
            self._refuse_if_it_cannot_fit([text], "prompt")

            def encode() -> list[int]:
                return self.engine.encode_prompt(text)

        return await self._serve(request, COMPLETIONS, body, tenant, encode, "prompt")

    async def chat(self, request: Request, body: ChatCompletionRequest, tenant: str) -> Response:
        self._check_model(body)
        messages = body.template_messages()
        self._refuse_if_it_cannot_fit([str(m.get("content", "")) for m in messages], "messages")

        def encode() -> list[int]:
            return self.engine.encode_chat(messages)

        return await self._serve(request, CHAT, body, tenant, encode, "messages")

    def _refuse_if_it_cannot_fit(self, texts: list[str], param: str) -> None:
        """A 400 before tokenizing text far too long for the context window (megabytes of it
        would hold a tokenizer thread for seconds)."""
        tokenization.refuse_if_it_cannot_fit(
            texts, self.engine.max_model_len, self._token_bytes, param
        )

    def _check_model(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )

    async def _serve(
        self,
        request: Request,
        endpoint: str,
        body: SamplingRequest,
        tenant: str,
        encode: Callable[[], list[int]],
        prompt_param: str,
    ) -> Response:
        # The request id (a client's X-Request-Id, or new) names the request in logs and
        # audit; the generation's own id adds a suffix, so it is unique even when a client
        # repeats its id (the engine keys prefetches by it).
        correlation = request_id_of(request)
        request_id = f"{correlation}.{uuid.uuid4().hex[:8]}"
        engine = self.engine
        wait = body.kvstrata_transfer
        if wait is not None and self.disagg is not None:
            await self.disagg.await_transfer(wait, tenant)  # then generate: a hit or local
        try:
            # off the event loop (the tokenizer releases the GIL): a long prompt stalled every
            # other request, health probes included, for seconds
            prompt_ids = await asyncio.to_thread(encode)
            generation = engine.generate(
                prompt_ids,
                self._params(body, len(prompt_ids)),
                tenant=tenant,
                request_id=request_id,
                placed_at=parse_placed_at(request.headers.get(PLACED_AT_HEADER)),
            )
            if wait is not None and self.disagg is not None:  # the transfer's blocks: held
                self.disagg.release_at_first_token(wait, generation)  # until its lookup
        except Exception as exc:
            if wait is not None and self.disagg is not None:  # no request: release them now
                self.disagg.release_at_first_token(wait, None)
            return protocol.error_response(_as_api_error(exc, prompt_param, request_id))
        _log_at_end(endpoint, body.stream, generation)
        assembler = TextAssembler(engine.decode, body.stop_strings())
        outcome: list[Outcome] = []
        deltas = follow(generation, assembler, outcome)
        if body.stream:
            comment = None
            if request.headers.get(TIMING_REQUEST_HEADER) == "1":
                comment = functools.partial(_timing_of, generation)
            chunks = self._chunks(
                endpoint, request_id, deltas, outcome, body.include_usage(), comment
            )
            headers = {**_SSE_HEADERS, REQUEST_ID_HEADER: correlation}
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        watcher = asyncio.create_task(_cancel_when_gone(request, generation))
        try:
            async for _delta in deltas:
                pass
        except Exception as exc:
            return protocol.error_response(_as_api_error(exc, prompt_param, request_id))
        finally:
            watcher.cancel()
            await deltas.aclose()
        if not outcome or outcome[0].finish_reason == "abort":  # the client is gone: 499,
            return Response(status_code=499)  # counted as such (nobody reads it)
        record = generation.record
        timing = {
            PREFILL_HEADER: f"{record.prefill_s:.6f}",
            TTFT_HEADER: f"{record.ttft_s:.6f}",
            MATCHED_HEADER: str(record.matched_tokens),
            REQUEST_ID_HEADER: correlation,
        }
        if record.prefill_compute_s > 0:
            timing[COMPUTE_HEADER] = f"{record.prefill_compute_s:.6f}"
        return JSONResponse(self._final_body(endpoint, request_id, outcome[0]), headers=timing)

    def _params(self, body: SamplingRequest, prompt_tokens: int) -> SamplingParams:
        max_tokens = output_budget(
            body,
            prompt_tokens=prompt_tokens,
            max_model_len=self.engine.max_model_len,
            limit=self.limits.max_tokens,
        )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(0, body.top_k),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )

    def _final_body(self, endpoint: str, request_id: str, outcome: Outcome) -> dict[str, Any]:
        usage = _usage(outcome)
        if endpoint == CHAT:
            return responses.chat_body(
                request_id, self.model_name, outcome.text, outcome.finish_reason, usage
            )
        return responses.completion_body(
            request_id, self.model_name, outcome.text, outcome.finish_reason, usage
        )

    async def _chunks(
        self,
        endpoint: str,
        request_id: str,
        deltas: AsyncGenerator[str, None],
        outcome: list[Outcome],
        include_usage: bool,
        timing: Callable[[], str] | None = None,
    ) -> AsyncIterator[str]:
        """SSE lines: deltas, a final chunk with the finish reason, optional usage, [DONE];
        with ``timing``, its comment in front of the first delta (``serve.timing``)."""
        model = self.model_name
        chat = endpoint == CHAT

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                return _sse(responses.chat_chunk(request_id, model, delta, finish))
            body = responses.completion_body(
                request_id, model, text or "", finish, None, chunk=True
            )
            return _sse(body)

        try:
            if chat:
                yield _sse(
                    responses.chat_chunk(request_id, model, {"role": "assistant", "content": ""})
                )
            try:
                async for text in deltas:
                    if timing is not None:
                        yield timing() + chunk(text)
                        timing = None
                    else:
                        yield chunk(text)
            except Exception as exc:
                error = _as_api_error(exc, "messages" if chat else "prompt", request_id)
                yield _sse(error.body())
            else:
                if outcome:
                    yield chunk(None, outcome[0].finish_reason)
                    if include_usage:
                        yield _sse(self._usage_chunk(chat, request_id, outcome[0]))
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()

    def _usage_chunk(self, chat: bool, request_id: str, outcome: Outcome) -> dict[str, Any]:
        usage = _usage(outcome)
        if chat:
            return responses.chat_chunk(request_id, self.model_name, None, usage_body=usage)
        body = responses.completion_body(request_id, self.model_name, "", None, usage, chunk=True)
        body["choices"] = []
        return body


def _timing_of(generation: Generation) -> str:
    """The timing comment of a streamed answer, or nothing where the figure is unknown."""
    record = generation.record
    if record.prefill_compute_s <= 0:
        return ""
    return timing_comment(record.prefill_compute_s, record.matched_tokens)


async def _cancel_when_gone(request: Request, generation: Generation) -> None:
    """Cancel a non-streaming generation whose client disconnected."""
    while not generation.done:
        if await request.is_disconnected():
            generation.close()
            return
        await asyncio.sleep(_DISCONNECT_POLL_S)


def _log_at_end(endpoint: str, stream: bool, generation: Generation) -> None:
    """Log the request's record once it ends in any way (on the engine thread)."""
    logged = False

    def listener() -> None:
        nonlocal logged
        if generation.done and not logged:
            logged = True
            _log_record(endpoint, stream, generation)

    generation.subscribe(listener)


def _usage(outcome: Outcome) -> dict[str, Any]:
    return responses.usage(
        prompt_tokens=len(outcome.generation.prompt_ids),
        completion_tokens=outcome.completion_tokens,
        cached_tokens=outcome.generation.record.matched_tokens,
    )


def _log_record(endpoint: str, stream: bool, generation: Generation) -> None:
    line = {"event": "request", "endpoint": endpoint, "stream": stream}
    line.update(generation.record.to_dict())
    logger.info(json.dumps(line, sort_keys=True))


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _as_api_error(exc: BaseException, prompt_param: str, request_id: str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextTooLong):
        return ApiError(400, str(exc), code="context_length_exceeded", param=prompt_param)
    if isinstance(exc, InvalidInput):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, QueueFull):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return ApiError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": retry},
        )
    logger.error(
        "engine failure on request %s", request_id, exc_info=(type(exc), exc, exc.__traceback__)
    )
    return ApiError(
        500,
        f"the engine failed while serving request {request_id}; see the server log",
        type="server_error",
        code="internal_error",
    )


class _RequestCounter:
    """ASGI middleware: count finished requests by endpoint and response status."""

    def __init__(self, app: ASGIApp, metrics: KvMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "other"
            if path.startswith(ADMIN_TIERS):
                endpoint = ADMIN_TIERS
            elif path.startswith(KV_PREFIX + "/"):
                endpoint = path if path in KV_ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


__all__ = ["create_app"]
