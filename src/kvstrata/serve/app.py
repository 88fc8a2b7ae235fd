"""The OpenAI-compatible HTTP app over one ``ReferenceEngine``.

``create_app`` builds a FastAPI app with ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics`` and the worker's KV state (``/kv/info``, ``/kv/dump``,
see ``kv_state``; with an engine that publishes KV events, the lifespan also runs its replay
thread and idle flush). Every engine call (tokenising, prefill,
decoding) runs on the single engine thread of an ``EngineWorker`` that the app's lifespan
starts and closes; the event loop never computes. Errors are answered in OpenAI's shape:
bad input is a 400, an unknown model a 404, and anything unexpected inside the engine a
500 after which the next request is served normally. Each generation's ``RequestRecord``
is logged as one JSON line on the ``kvstrata.serve`` logger: ids and counts, never text.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.engine.engine import ReferenceEngine
from kvstrata.engine.generation import Generation
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import ApiError, ContextTooLong, InvalidInput
from kvstrata.identity import DEFAULT_TENANT
from kvstrata.serve import protocol
from kvstrata.serve.admin import ADMIN_TIERS, register_admin
from kvstrata.serve.kv_state import KV_PREFIX, KvStateRuntime, register_kv_state
from kvstrata.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from kvstrata.serve.streaming import (
    DoneEvent,
    EngineWorker,
    ErrorEvent,
    Outcome,
    StreamEvent,
    TextAssembler,
    TextEvent,
    produce,
)
from kvstrata.telemetry import KvMetrics

logger = logging.getLogger("kvstrata.serve")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = frozenset({COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics"})
KV_ENDPOINTS = frozenset(
    {KV_PREFIX + "/info", KV_PREFIX + "/dump", KV_PREFIX + "/debug/drop-events"}
)
PREFILL_HEADER = "X-Kvstrata-Prefill-S"
"""Engine-measured prefill seconds of a non-streamed answer (the router learns from it)."""
TTFT_HEADER = "X-Kvstrata-Ttft-S"
MATCHED_HEADER = "X-Kvstrata-Matched-Tokens"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    engine: ReferenceEngine,
    *,
    model_name: str,
    metrics: KvMetrics,
    admin_token: str | None = None,
    debug_endpoints: bool = False,
) -> FastAPI:
    """Build the app; ``metrics`` must be the engine's own, so ``/metrics`` shows its figures.

    ``debug_endpoints`` adds ``POST /kv/debug/drop-events`` (event gap injection for tests).
    """
    if metrics is not engine.metrics:
        raise InvalidInput("metrics must be the KvMetrics object the engine records into")
    worker = EngineWorker()
    service = _Service(engine, model_name, worker)
    kv_runtime = KvStateRuntime(engine.events, worker) if engine.events is not None else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        if kv_runtime is not None:
            kv_runtime.start()
        try:
            yield
        finally:
            if kv_runtime is not None:
                await kv_runtime.close()
            worker.close()

    app = FastAPI(title="kvstrata", lifespan=lifespan)
    app.add_middleware(_RequestCounter, metrics=metrics)
    app.exception_handler(ApiError)(protocol.api_error_handler)
    app.exception_handler(RequestValidationError)(protocol.validation_error_handler)
    app.exception_handler(StarletteHTTPException)(protocol.http_error_handler)
    register_admin(app, engine.bridge.store if engine.bridge is not None else None, admin_token)
    register_kv_state(app, engine, worker, model_name=model_name, debug_endpoints=debug_endpoints)

    @app.post(COMPLETIONS, response_model=None)
    async def completions(
        body: CompletionRequest,
        x_kvstrata_tenant: str | None = Header(default=None),
    ) -> Response:
        return await service.completions(body, _tenant(body, x_kvstrata_tenant))

    @app.post(CHAT, response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        x_kvstrata_tenant: str | None = Header(default=None),
    ) -> Response:
        return await service.chat(body, _tenant(body, x_kvstrata_tenant))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return protocol.models_body(model_name, engine.max_model_len, service.created)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Service:
    """Turns parsed requests into engine work on the worker thread and into responses."""

    def __init__(self, engine: ReferenceEngine, model_name: str, worker: EngineWorker) -> None:
        self.engine = engine
        self.model_name = model_name
        self.worker = worker
        self.created = int(time.time())
        self.vocab_size = int(engine.model.config.vocab_size)

    async def completions(self, body: CompletionRequest, tenant: str) -> Response:
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

            def encode() -> list[int]:
                return self.engine.encode_prompt(text)

        return await self._serve(COMPLETIONS, body, tenant, encode, "prompt")

    async def chat(self, body: ChatCompletionRequest, tenant: str) -> Response:
        self._check_model(body)
        messages = body.template_messages()

        def encode() -> list[int]:
            return self.engine.encode_chat(messages)

        return await self._serve(CHAT, body, tenant, encode, "messages")

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
        endpoint: str,
        body: SamplingRequest,
        tenant: str,
        encode: Callable[[], list[int]],
        prompt_param: str,
    ) -> Response:
        request_id = uuid.uuid4().hex
        engine = self.engine

        def prepare() -> Generation:
            prompt_ids = encode()
            max_tokens = body.requested_max_tokens()
            if max_tokens is None:
                max_tokens = engine.max_model_len - len(prompt_ids)
                if max_tokens < 1:
                    raise ContextTooLong(
                        f"prompt of {len(prompt_ids)} tokens fills the context window of "
                        f"{engine.max_model_len} tokens"
                    )
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(0, body.top_k),
                seed=body.seed,
                ignore_eos=body.ignore_eos,
            )
            return engine.generate(prompt_ids, params, tenant=tenant, request_id=request_id)

        def on_end(generation: Generation) -> None:
            _log_record(endpoint, body.stream, generation)

        stops = body.stop_strings()
        try:
            if not body.stream:
                outcome = await self.worker.call(lambda: _run_once(prepare, engine, stops, on_end))
                record = outcome.generation.record
                timing = {
                    PREFILL_HEADER: f"{record.prefill_s:.6f}",
                    TTFT_HEADER: f"{record.ttft_s:.6f}",
                    MATCHED_HEADER: str(record.matched_tokens),
                }
                body_out = self._final_body(endpoint, request_id, outcome)
                return JSONResponse(body_out, headers=timing)
            events = self.worker.stream(prepare, engine.decode, stops, on_end)
            first = await anext(events)
        except Exception as exc:
            return protocol.error_response(_as_api_error(exc, prompt_param, request_id))
        if isinstance(first, ErrorEvent):
            await events.aclose()
            return protocol.error_response(_as_api_error(first.error, prompt_param, request_id))
        chunks = self._chunks(endpoint, request_id, first, events, body.include_usage())
        return StreamingResponse(chunks, media_type="text/event-stream", headers=_SSE_HEADERS)

    def _final_body(self, endpoint: str, request_id: str, outcome: Outcome) -> dict[str, Any]:
        usage = _usage(outcome.generation)
        if endpoint == CHAT:
            return protocol.chat_body(
                request_id, self.model_name, outcome.text, outcome.finish_reason, usage
            )
        return protocol.completion_body(
            request_id, self.model_name, outcome.text, outcome.finish_reason, usage
        )

    async def _chunks(
        self,
        endpoint: str,
        request_id: str,
        first: StreamEvent,
        events: AsyncGenerator[StreamEvent, None],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE lines: deltas, a final chunk with the finish reason, optional usage, [DONE]."""
        model = self.model_name
        chat = endpoint == CHAT

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                return _sse(protocol.chat_chunk(request_id, model, delta, finish))
            body = protocol.completion_body(request_id, model, text or "", finish, None, chunk=True)
            return _sse(body)

        try:
            if chat:
                yield _sse(
                    protocol.chat_chunk(request_id, model, {"role": "assistant", "content": ""})
                )
            event = first
            while True:
                if isinstance(event, TextEvent):
                    yield chunk(event.text)
                elif isinstance(event, DoneEvent):
                    yield chunk(None, event.outcome.finish_reason)
                    if include_usage:
                        yield _sse(self._usage_chunk(chat, request_id, event.outcome))
                    break
                else:
                    error = _as_api_error(event.error, "messages" if chat else "prompt", request_id)
                    yield _sse(error.body())
                    break
                event = await anext(events)
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    def _usage_chunk(self, chat: bool, request_id: str, outcome: Outcome) -> dict[str, Any]:
        usage = _usage(outcome.generation)
        if chat:
            return protocol.chat_chunk(request_id, self.model_name, None, usage_body=usage)
        body = protocol.completion_body(request_id, self.model_name, "", None, usage, chunk=True)
        body["choices"] = []
        return body


def _run_once(
    prepare: Callable[[], Generation],
    engine: ReferenceEngine,
    stops: tuple[str, ...],
    on_end: Callable[[Generation], None],
) -> Outcome:
    """A whole non-streaming generation, on the engine thread."""
    generation = prepare()
    try:
        outcome = produce(generation, TextAssembler(engine.decode, stops), _drop, threading.Event())
    except Exception as exc:
        generation.record.error = type(exc).__name__
        on_end(generation)
        raise
    on_end(generation)
    return outcome


def _drop(_text: str) -> None:
    """Non-streaming requests read the assembled text at the end."""


def _usage(generation: Generation) -> dict[str, Any]:
    return protocol.usage(
        prompt_tokens=len(generation.prompt_ids),
        completion_tokens=len(generation.output_ids),
        cached_tokens=generation.record.matched_tokens,
    )


def _log_record(endpoint: str, stream: bool, generation: Generation) -> None:
    line = {"event": "request", "endpoint": endpoint, "stream": stream}
    line.update(generation.record.to_dict())
    logger.info(json.dumps(line, sort_keys=True))


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _tenant(body: SamplingRequest, header: str | None) -> str:
    """The tenant namespace: body extension or header (they must agree), else the default."""
    if header is not None and not 0 < len(header) <= protocol.MAX_TENANT_CHARS:
        raise ApiError(
            400,
            f"X-Kvstrata-Tenant must be 1..{protocol.MAX_TENANT_CHARS} characters",
            param="X-Kvstrata-Tenant",
        )
    if body.kvstrata_tenant is not None and header is not None and body.kvstrata_tenant != header:
        raise ApiError(
            400,
            "kvstrata_tenant conflicts with the X-Kvstrata-Tenant header",
            param="kvstrata_tenant",
        )
    return body.kvstrata_tenant or header or DEFAULT_TENANT


def _as_api_error(exc: BaseException, prompt_param: str, request_id: str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextTooLong):
        return ApiError(400, str(exc), code="context_length_exceeded", param=prompt_param)
    if isinstance(exc, InvalidInput):
        return ApiError(400, str(exc), code="invalid_value")
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
