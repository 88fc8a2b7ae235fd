"""What a worker accepts from one request: its body (size, time to arrive) and its output length.

``BodyLimits`` is ASGI middleware in front of every route. It answers before the app sees the
request when the body is too large or too slow, so no handler ever parses a partial body:

- a ``Content-Length`` above ``ServeLimits.max_body_bytes`` is a 413 before the app sees it;
- a body without one (chunked) is counted as it arrives and is a 413 as soon as it passes
  the limit;
- a body that has not fully arrived ``body_timeout_s`` after the request's headers is a 408.

Both errors carry OpenAI's error shape and ``Connection: close``: the connection carries no
further request. Before a 413 the rest of the body is read and discarded (at most
``DRAIN_MAX_BYTES`` / ``DRAIN_MAX_S``), so the close does not reset the connection before the
client has read the answer. A complete body is buffered
(at most ``max_body_bytes``, which FastAPI would buffer anyway to parse it) and replayed to
the app as one message; later ``receive`` calls (a streaming response listening for the
client going away) go to the server as before.

``output_budget`` is the one rule for a request's ``max_tokens``: an explicit value above
``ServeLimits.max_tokens`` is a 400 (as vLLM words it: "max_tokens must be at most N"), and a
request without one gets its endpoint's default capped by the limit and by the room its prompt
leaves in the context window.
"""

from __future__ import annotations

import asyncio
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.errors import ApiError, ContextTooLong
from kvstrata.runtime.config import ServeLimits
from kvstrata.runtime.config_schema import MIB
from kvstrata.serve.protocol import SamplingRequest, error_response

DEFAULT_LIMITS: Final = ServeLimits()


def output_budget(
    body: SamplingRequest, *, prompt_tokens: int, max_model_len: int, limit: int
) -> int:
    """The ``max_tokens`` a request runs with.

    An explicit value above ``limit`` raises ``ApiError`` (400); one that does not fit the
    context window is left to the engine, which raises ``ContextTooLong``. Without one, the
    endpoint's default (16 for completions, none for chat) is capped by ``limit`` and by the
    room the prompt leaves in the context window; a prompt that leaves no room raises
    ``ContextTooLong``.
    """
    param = body.explicit_max_tokens_param()
    asked = body.requested_max_tokens()
    if param is not None and asked is not None:
        if asked > limit:
            raise ApiError(
                400, f"{param} must be at most {limit}", code="invalid_value", param=param
            )
        return asked
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ContextTooLong(
            f"prompt of {prompt_tokens} tokens fills the context window of {max_model_len} tokens"
        )
    return min(room, limit) if asked is None else min(asked, room, limit)


class BodyLimits:
    """ASGI middleware: bound the size of every request body and the time it takes to arrive."""

    def __init__(self, app: ASGIApp, limits: ServeLimits = DEFAULT_LIMITS) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is None:
            await _refuse(scope, receive, send, ApiError(400, "invalid Content-Length header"))
            return
        if declared > self.limits.max_body_bytes:
            await _refuse(scope, receive, send, self._too_large(), drain=True)
            return
        chunks: list[bytes] = []
        received = 0
        refusal: ApiError | None = None
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left before its body arrived: nobody to answer
                    chunk = bytes(message.get("body", b""))
                    received += len(chunk)
                    if received > self.limits.max_body_bytes:
                        refusal = self._too_large()
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            refusal = ApiError(
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                code="request_timeout",
            )
        if refusal is not None:
            await _refuse(scope, receive, send, refusal, drain=refusal.status == 413)
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> ApiError:
        limit_mib = self.limits.max_body_bytes / MIB
        return ApiError(
            413,
            f"the request body is larger than this server's limit of {limit_mib:g} MiB",
            code="request_too_large",
        )


def _content_length(scope: Scope) -> int | None:
    """The declared body length (0 when none is declared); None when it is malformed."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isascii() and text.isdigit() else None  # not "²"
    return 0


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the buffered body over once, then defers to the server."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


DRAIN_MAX_BYTES: Final = 16 * MIB
DRAIN_MAX_S: Final = 2.0
DRAIN_IDLE_S: Final = 0.25


async def _refuse(
    scope: Scope, receive: Receive, send: Send, error: ApiError, *, drain: bool = False
) -> None:
    """Answer ``error`` and close the connection.

    ``drain`` (a body too large): first read and discard what is still coming, up to
    ``DRAIN_MAX_BYTES`` or ``DRAIN_MAX_S``, or until it pauses for ``DRAIN_IDLE_S``. A socket
    closed with unread bytes in its receive buffer is *reset*, and the reset can destroy the
    answer before the client reads it: the client (or a router forwarding to this worker) then
    sees a dropped connection instead of the 413. (Draining after the answer is not possible:
    once it is sent, the server reports every later ``receive`` as a disconnect.)"""
    if drain:
        drained = 0
        deadline = asyncio.get_running_loop().time() + DRAIN_MAX_S
        try:
            while drained <= DRAIN_MAX_BYTES:
                # Stops at a pause too: a client that declared a body it does not send (or
                # waits for a 100-continue) gets its answer at once.
                async with asyncio.timeout_at(
                    min(deadline, asyncio.get_running_loop().time() + DRAIN_IDLE_S)
                ):
                    message = await receive()
                if message["type"] != "http.request":
                    return  # the client left: nobody to answer
                drained += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except TimeoutError:
            pass
    response = error_response(error)
    response.headers["connection"] = "close"
    await response(scope, receive, send)
